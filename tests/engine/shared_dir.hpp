// For the engine's multi-rank tests: this process's MPI rank, and a scratch directory every rank
// shares (made by rank 0, removed by it at the end).
#pragma once

#include <mpi.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <string>

namespace zest::test {

inline int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

class SharedDir {
 public:
  SharedDir() {
    char name[256] = {};
    if (rank() == 0) {
      std::strcpy(name, "/tmp/zest-engine-test-XXXXXX");
      if (!::mkdtemp(name)) name[0] = '\0';
    }
    MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = name;
  }
  ~SharedDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank() == 0) std::filesystem::remove_all(path_);
  }
  SharedDir(const SharedDir&) = delete;
  SharedDir& operator=(const SharedDir&) = delete;
  std::string path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace zest::test
