#include "zest/communicator.hpp"

#include "zest/error.hpp"

namespace zest {

// The interface's default, for backends that cannot split (the world of one's, a program's own).
std::unique_ptr<Communicator> Communicator::split_by_host() {
  throw CommError("the " + backend_name() +
                  " communicator cannot make a communicator over one host; use the mpi or nccl backend, or "
                  "partition.secondary: none");
}

}  // namespace zest
