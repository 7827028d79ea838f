// What one rank of a multi-host run holds on its host: the program behind multihost_test.sh,
// using only zest's public API as a trainer would.
//
//   multihost_probe CONFIG PARAMS LAYERS STEPS
//
// Builds an Engine for zest::uniform_model(PARAMS, LAYERS) (the model `zest estimate --params
// PARAMS --layers LAYERS` sizes) with CONFIG, trains STEPS steps on synthetic gradients, and then,
// with every rank's engine alive, lists its NVMe offload directory (offload.optimizer.path; the
// swap files are removed when the engine goes). Rank 0 prints one line per rank, in rank order:
//
//   rank R local L/S pinned BYTES nvme BYTES files NAME:SIZE,NAME:SIZE across A/N sum W
//
// pinned is the device's pinned host memory peak (Device::pinned_stats), nvme EngineStats'
// nvme_bytes; L/S the rank's local rank and the ranks on its host (Runtime); A/N its rank and size
// in the communicator across hosts (Communicator::split_across_hosts), W the sum of the world ranks
// in it (an all-reduce over it).
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "zest/estimate.hpp"
#include "zest/zest.hpp"

namespace {

// One step with gradients that depend on the step and the rank, every rank the same shapes.
void step(zest::Engine& engine, int rank, int step_number) {
  const int groups = engine.group_count();
  for (int g = 0; g < groups; ++g) engine.acquire(g);
  for (int g = groups - 1; g >= 0; --g) {
    auto lease = engine.acquire(g);
    const auto tensor = static_cast<std::size_t>(g);  // uniform_model: one tensor per group
    auto* grad = lease.grad(tensor).as<float>();
    const std::size_t n = engine.spec(tensor).numel();
    for (std::size_t i = 0; i < n; ++i)
      grad[i] = 0.001f * static_cast<float>((i + static_cast<std::size_t>(rank + step_number)) % 17);
    engine.grads_ready(g);
  }
  engine.step();
}

std::string listing(const std::string& dir) {
  if (dir.empty()) return "-";
  std::vector<std::string> names;
  // Each engine keeps its swap file in a directory of its own there (zest-<host>-<pid>-<random>).
  for (const auto& own : std::filesystem::directory_iterator(dir))
    if (own.is_directory())
      for (const auto& entry : std::filesystem::directory_iterator(own.path()))
        names.push_back(entry.path().filename().string() + ":" + std::to_string(entry.file_size()));
  std::sort(names.begin(), names.end());
  std::string out;
  for (const std::string& name : names) out.append(out.empty() ? "" : ",").append(name);
  return out.empty() ? "-" : out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s CONFIG PARAMS LAYERS STEPS\n", argv[0]);
    return 2;
  }
  try {
    const zest::Config config = zest::load_config(argv[1]);
    const std::size_t params = std::strtoull(argv[2], nullptr, 10);
    const int layers = std::atoi(argv[3]);
    const int steps = std::atoi(argv[4]);
    zest::Runtime runtime(config);
    const int rank = runtime.rank();
    zest::Engine engine(config, runtime.device(), runtime.comm(), zest::uniform_model(params, layers));
    for (int s = 1; s <= steps; ++s) step(engine, rank, s);
    runtime.device().synchronize();
    MPI_Barrier(MPI_COMM_WORLD);  // every rank's swap file is there and written
    const zest::EngineStats stats = engine.stats();
    // Collective over the world's communicator, none of whose collectives is in flight now.
    const std::unique_ptr<zest::Communicator> across = runtime.comm().split_across_hosts();
    std::int64_t members[1] = {rank};
    across->all_reduce_host(members, zest::ReduceOp::sum);
    char line[1024];
    std::snprintf(line, sizeof line, "rank %d local %d/%d pinned %zu nvme %zu files %s across %d/%d sum %lld", rank,
                  runtime.local_rank(), runtime.local_size(), runtime.device().pinned_stats().peak, stats.nvme_bytes,
                  listing(config.offload.optimizer.paths.front()).c_str(), across->rank(), across->size(),
                  static_cast<long long>(members[0]));
    std::vector<char> all(rank == 0 ? sizeof line * static_cast<std::size_t>(runtime.world_size()) : 0);
    MPI_Gather(line, sizeof line, MPI_CHAR, all.data(), sizeof line, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (rank == 0)
      for (int r = 0; r < runtime.world_size(); ++r)
        std::printf("%s\n", all.data() + sizeof line * static_cast<std::size_t>(r));
    MPI_Barrier(MPI_COMM_WORLD);
    return 0;
  } catch (const zest::Error& error) {
    std::fprintf(stderr, "multihost_probe: %s\n", error.what());
    return 1;
  }
}
