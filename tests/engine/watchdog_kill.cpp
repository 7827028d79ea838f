// A rank SIGKILLed in the middle of a step: the program behind watchdog_kill_test.sh, using only
// zest's public API as a trainer would.
//
//   watchdog_kill train DIR KILL_RANK   trains steps 1-2 of a stage-3 model, saves DIR, then in
//                                       step 3's backward KILL_RANK kills itself; every other rank
//                                       must get CommError from the engine (comm.timeout: 3s)
//                                       and prints it, with the seconds it took, then exits 3
//   watchdog_kill load DIR              loads DIR (step 2) and trains step 3 to the end
//
// A survivor ends with _Exit after the error: a rank is gone, so MPI_Finalize would wait for it.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "zest/zest.hpp"

namespace {

constexpr int kGroups = 4;
constexpr std::size_t kWidth = 64;

zest::Config config() {
  return zest::parse_config(
      "stage: 3\n"
      "device: {memory: 64MiB}\n"
      "comm: {timeout: 3s}\n"
      "buckets: {reduce: 16KiB, allgather: 16KiB}\n"
      "stage3: {prefetch: 16KiB, persistence_threshold: 0}\n");
}

std::vector<zest::ParamSpec> params() {
  std::vector<zest::ParamSpec> specs;
  for (int g = 0; g < kGroups; ++g) {
    // Appended, not operator+: GCC 12 at -O3 reports a false -Wrestrict on "w" + std::string.
    std::string name = "w";
    specs.push_back({name.append(std::to_string(g)), {kWidth, kWidth}, g});
  }
  return specs;
}

// One step with gradients that depend on the step and the rank; `kill_rank` dies in backward.
void step(zest::Engine& engine, int rank, int step_number, int kill_rank) {
  for (int g = 0; g < kGroups; ++g) engine.acquire(g);
  for (int g = kGroups - 1; g >= 0; --g) {
    auto lease = engine.acquire(g);
    auto* grad = lease.grad(static_cast<std::size_t>(g)).as<float>();
    for (std::size_t i = 0; i < kWidth * kWidth; ++i)
      grad[i] = 0.001f * static_cast<float>((i + static_cast<std::size_t>(rank + step_number)) % 17);
    // Half-way through backward, with the first bucket's reduction already issued.
    if (rank == kill_rank && g == kGroups / 2) raise(SIGKILL);
    engine.grads_ready(g);
  }
  engine.step();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s train DIR KILL_RANK | load DIR\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const std::string dir = argv[2];
  const zest::Config cfg = config();
  zest::Runtime runtime(cfg);
  const int rank = runtime.rank();
  zest::Engine engine(cfg, runtime.device(), runtime.comm(), params());
  if (mode == "train") {
    const int kill_rank = argc > 3 ? std::atoi(argv[3]) : -1;
    std::vector<float> values(kWidth * kWidth, 0.5f);
    for (std::size_t t = 0; t < engine.tensor_count(); ++t) engine.set_param(t, values);
    step(engine, rank, 1, -1);
    step(engine, rank, 2, -1);
    engine.save(dir);
    if (rank == 0) std::printf("saved step 2\n");
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    try {
      step(engine, rank, 3, kill_rank);
      runtime.device().synchronize();
    } catch (const zest::CommError& error) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("rank %d: CommError after %.1f s: %s\n", rank, seconds, error.what());
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::printf("rank %d: step 3 ended without an error\n", rank);
    return 1;
  }
  const zest::LoadResult loaded = engine.load(dir);
  step(engine, rank, 3, -1);
  if (rank == 0) std::printf("loaded step %lld, trained step 3\n", static_cast<long long>(loaded.steps));
  return loaded.steps == 2 ? 0 : 1;
}
