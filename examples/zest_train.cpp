// zest-train: a character-level language model trained with zest for everything optimizer-side.
//
//   mpirun -np 4 zest-train --config configs/train-tiny.yaml [--steps N] [--load DIR] [--save DIR] [--trace FILE]
//
// --load DIR resumes from a checkpoint (any rank count and stage) at the step after the saved one;
// --steps N is the step to stop at; --save DIR writes a checkpoint when training stops; --trace FILE
// writes a Chrome trace of every rank's steps (a new file: an existing one is refused).
//
// The model computes in fp32 on the host (its own forward and backward, OpenBLAS for the matrix
// products); zest owns the parameters, gradients and optimizer states on the device, in the stage
// and precision the config chooses. Rank r trains on its slice of each step's global batch, and the
// batch is a function of (seed, step) alone, so the loss at step n is the same for any rank count,
// stage and offload mode.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "args/args.hpp"
#include "zest/trace.hpp"
#include "trainer.hpp"
#include "zest/zest.hpp"

namespace {

using namespace zest;

constexpr const char* kUsage = "usage: zest-train --config FILE [--steps N] [--load DIR] [--save DIR] [--trace FILE]\n";

int run(int argc, char** argv) {
  if (args::asks_for_help(argc - 1, argv + 1)) return args::print_usage(kUsage);
  std::string config_path;
  std::optional<int> steps_flag;
  std::string load_dir, save_dir, trace_path;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--config") config_path = args::path_of(argc, argv, i);
      // train.steps' range in the config (examples/train_config.cpp).
      else if (arg == "--steps")
        steps_flag = static_cast<int>(args::parse_integer(arg, args::value_of(argc, argv, i), 0, 1'000'000'000));
      else if (arg == "--save") save_dir = args::path_of(argc, argv, i);
      else if (arg == "--load") load_dir = args::path_of(argc, argv, i);
      else if (arg == "--trace") trace_path = args::path_of(argc, argv, i);
      else throw args::UsageError(std::string("unexpected argument '").append(arg).append("'"));
    }
    if (config_path.empty()) throw args::UsageError("--config FILE is required");
    args::check_distinct_outputs({{"--save", save_dir}, {"--trace", trace_path}});
  } catch (const args::UsageError& error) {
    std::fprintf(stderr, "zest-train: %s\n%s", error.what(), kUsage);
    return 2;
  }
  // Before any work: a --save path that a save would refuse fails now, not after the training.
  if (!save_dir.empty()) check_checkpoint_target(save_dir);

  const Config config = load_config(config_path, {"model", "train"});
  train::TrainConfig train = train::load_train_config(config_path);
  if (steps_flag) train.steps = *steps_flag;
  Runtime runtime(config);
  const bool leader = runtime.rank() == 0;
  // Refuses an existing file now, before any work (rank 0 creates it: not at parsing, where rank 0
  // could create it before another rank looks); records from here on.
  std::optional<TraceFile> trace_file;
  if (!trace_path.empty()) trace_file.emplace(trace_path, runtime.comm());
  const charlm::TextCorpus corpus = charlm::TextCorpus::load(train.text);
  // One BLAS thread per core this rank may use, so ranks sharing a host do not oversubscribe it.
  const int blas_threads = std::max<int>(1, static_cast<int>(runtime.cpus().size()));
  train::Trainer trainer(config, train, corpus, runtime.device(), runtime.comm(), blas_threads);
  Engine& engine = trainer.engine();
  if (leader)
    std::printf("zest-train: %zu parameters, stage %d, %s, %d rank(s), global batch %zu\n", engine.numel(),
                config.stage, std::string(dtype_name(config.precision.dtype)).c_str(), runtime.world_size(),
                train.global_batch);

  const auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  // 64-bit: a checkpoint's step count may pass what an int holds (it would wrap to a negative
  // step and train 2^31 steps); one at or past train.steps trains no more.
  std::int64_t first_step = 1;
  if (!load_dir.empty()) {
    const auto load_start = std::chrono::steady_clock::now();
    const LoadResult loaded = engine.load(load_dir);
    first_step = loaded.steps + 1;
    if (leader) {
      std::printf("zest-train: resumed from %s after step %lld (loaded in %.2f s)\n", load_dir.c_str(),
                  static_cast<long long>(loaded.steps), seconds_since(load_start));
      for (const std::string& change : loaded.config_changes) std::printf("zest-train: note: %s\n", change.c_str());
    }
  }
  const auto start = std::chrono::steady_clock::now();
  for (int step = static_cast<int>(std::min<std::int64_t>(first_step, std::int64_t{train.steps} + 1));
       step <= train.steps; ++step) {
    const double loss = trainer.step(step);
    if (leader && (step % train.log_every == 0 || step == train.steps))
      std::printf("step %d loss %.6f%s\n", step, loss,
                  trainer.last_result().skipped ? " (skipped: gradient overflow)" : "");
  }
  const double seconds = seconds_since(start);
  if (!save_dir.empty()) {
    const auto save_start = std::chrono::steady_clock::now();
    engine.save(save_dir);
    if (leader)
      std::printf("zest-train: saved a checkpoint of step %d to %s (in %.2f s)\n", train.steps, save_dir.c_str(),
                  seconds_since(save_start));
  }
  if (trace_file) {
    const std::size_t dropped = trace_file->write();
    if (leader)
      std::printf("zest-train: wrote the trace of %d rank(s) to %s%s\n", runtime.world_size(), trace_path.c_str(),
                  dropped > 0 ? fmt::format(" ({} events past its capacity were dropped)", dropped).c_str() : "");
  }
  const EngineStats stats = engine.stats();
  if (leader) {
    const auto mib = [](std::size_t b) { return static_cast<double>(b) / (1 << 20); };
    const MemoryStats& m = stats.memory;
    std::printf("zest-train: %d steps in %.2f s; rank 0 peak device memory %.1f MiB (params %.1f, grads %.1f, "
                "optimizer states %.1f, buffers %.1f) of %.1f MiB; %lld skipped steps\n",
                train.steps, seconds, mib(m.peak_total), mib(m.peak_of(MemoryCategory::params)),
                mib(m.peak_of(MemoryCategory::grads)), mib(m.peak_of(MemoryCategory::optimizer_states)),
                mib(m.peak_of(MemoryCategory::buffers)), mib(m.budget), static_cast<long long>(stats.skipped_steps));
    std::vector<ParamSpec> specs;
    for (std::size_t t = 0; t < engine.tensor_count(); ++t) specs.push_back(engine.spec(t));
    const WireEstimate zero = estimate_wire_bytes(config, specs, runtime.world_size(), runtime.world_size());
    const WireBytes& w = stats.wire_last_step;
    // comm.quantize.grads reduces through all-to-alls.
    const auto reduced = w.of(Collective::all_reduce) + w.of(Collective::reduce_scatter) + w.of(Collective::all_to_all);
    std::printf("zest-train: wire bytes per step (rank 0, the last step): %llu (inside its host %llu, to other "
                "hosts %llu; reductions %llu, gathers %llu); ZeRO's formula %llu\n",
                static_cast<unsigned long long>(w.total()), static_cast<unsigned long long>(w.inside()),
                static_cast<unsigned long long>(w.across()), static_cast<unsigned long long>(reduced),
                static_cast<unsigned long long>(w.of(Collective::all_gather)),
                static_cast<unsigned long long>(zero.zero_formula));
    if (config.offload.optimizer_update_ahead)
      std::printf("zest-train: offload.optimizer.update_ahead: %lld groups updated during backward and kept, "
                  "%lld redone\n",
                  static_cast<long long>(stats.groups_updated_ahead), static_cast<long long>(stats.groups_redone));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A write past the file-size limit (ulimit -f) then fails with EFBIG, which the writers report
  // and clean up after (a temporary file removed, the previous output kept), instead of SIGXFSZ
  // killing the process mid-write and leaving the temporary file behind.
  std::signal(SIGXFSZ, SIG_IGN);
  try {
    return run(argc, argv);
  } catch (const zest::ConfigError& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 2;
  } catch (const zest::Error& error) {
    std::fprintf(stderr, "zest-train: %s\n", error.what());
    return 1;
  }
}
