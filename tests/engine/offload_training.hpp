// For the offload tests (engine_offload_test, engine_update_ahead_test): train_engine on a cpu
// device under mpirun, with what the run leaves to compare, and the bit-for-bit comparison they
// make against the run without the offload (or without update_ahead).
#pragma once

#include <cstddef>
#include <cstring>
#include <vector>

#include "engine/reference_training.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/engine.hpp"

namespace zest::reference_training {

struct TrainedRun {
  std::vector<std::vector<float>> params;
  EngineStats stats;
  HostMemoryStats pinned;
};

inline TrainedRun train_on_cpu(const Options& o, int steps) {
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto comm = make_mpi_communicator(session, *device);
  TrainedRun run;
  run.params = train_engine(o, steps, *device, *comm, &run.stats);
  run.pinned = device->pinned_stats();
  return run;
}

// Bit for bit: every placement runs the same CPU Adam over the same elements.
inline bool identical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t t = 0; t < a.size(); ++t)
    if (a[t].size() != b[t].size() || std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace zest::reference_training
