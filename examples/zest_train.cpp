// zest-train: a character-level language model trained with zest for everything optimizer-side.
//
//   mpirun -np 4 zest-train --config configs/train-tiny.yaml [--steps N]
//
// The model computes in fp32 on the host (its own forward and backward, OpenBLAS for the matrix
// products); zest owns the parameters, gradients and optimizer states on the device, in the stage
// and precision the config chooses. Rank r trains on its slice of each step's global batch, and the
// batch is a function of (seed, step) alone, so the loss at step n is the same for any rank count,
// stage and offload mode.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "charlm/batch_sampler.hpp"
#include "charlm/char_mlp.hpp"
#include "charlm/text_corpus.hpp"
#include "runtime/half.hpp"
#include "train_config.hpp"
#include "zest/zest.hpp"

namespace {

using namespace zest;

void to_float(const void* src, DType dtype, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const auto bits = static_cast<const std::uint16_t*>(src)[i];
    dst[i] = dtype == DType::f16 ? fp16_to_float(bits) : bf16_to_float(bits);
  }
}

// dst = src * scale, in the engine's dtype.
void store_scaled(const float* src, double scale, void* dst, DType dtype, std::size_t n) {
  const float s = static_cast<float>(scale);
  for (std::size_t i = 0; i < n; ++i) {
    const float value = src[i] * s;
    if (dtype == DType::f32) static_cast<float*>(dst)[i] = value;
    else static_cast<std::uint16_t*>(dst)[i] = dtype == DType::f16 ? float_to_fp16(value) : float_to_bf16(value);
  }
}

// Connects the model's per-group hooks to the engine: a group is leased when the model needs its
// parameters and released when the next group is needed; its gradients are handed over as soon as
// backward finishes them, so their reduction overlaps the rest of backward.
class EngineBinding {
 public:
  EngineBinding(Engine& engine, const charlm::CharMlp& model)
      : engine_(engine), leases_(static_cast<std::size_t>(engine.group_count())) {
    const auto& params = model.parameters();
    for (const auto& p : params) {
      grads_.emplace_back(p.numel());
      if (engine.dtype() != DType::f32) converted_.emplace_back(p.numel());
    }
    param_ptrs_.assign(params.size(), nullptr);
    for (std::size_t t = 0; t < params.size(); ++t) grad_ptrs_.push_back(grads_[t].data());
    hooks_.params_needed = [this](int group) { lease(group); };
    hooks_.grads_ready = [this](int group) { hand_over(group); };
  }

  std::span<float* const> params() const { return param_ptrs_; }
  std::span<float* const> grads() const { return grad_ptrs_; }
  const charlm::GroupHooks& hooks() const { return hooks_; }
  void release_all() {
    for (auto& lease : leases_) lease.reset();
  }

 private:
  void lease(int group) {
    release_all();
    auto& lease = leases_[static_cast<std::size_t>(group)];
    lease.emplace(engine_.acquire(group));
    for (std::size_t t = 0; t < engine_.size(); ++t) {
      if (engine_.spec(t).group != group) continue;
      void* device = lease->param(t);
      if (engine_.dtype() == DType::f32) {
        param_ptrs_[t] = static_cast<float*>(device);
      } else {
        to_float(device, engine_.dtype(), converted_[t].data(), converted_[t].size());
        param_ptrs_[t] = converted_[t].data();
      }
    }
  }

  void hand_over(int group) {
    auto& lease = leases_[static_cast<std::size_t>(group)];
    for (std::size_t t = 0; t < engine_.size(); ++t)
      if (engine_.spec(t).group == group)
        store_scaled(grads_[t].data(), engine_.loss_scale(), lease->grad(t), engine_.dtype(), grads_[t].size());
    engine_.grads_ready(group);
  }

  Engine& engine_;
  std::vector<std::optional<Engine::GroupLease>> leases_;
  std::vector<std::vector<float>> grads_, converted_;  // host fp32 scratch, allocated once
  std::vector<float*> param_ptrs_, grad_ptrs_;
  charlm::GroupHooks hooks_;
};

int usage() {
  std::fprintf(stderr, "usage: zest-train --config FILE [--steps N]\n");
  return 2;
}

int run(int argc, char** argv) {
  std::string config_path;
  std::optional<int> steps_flag;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--config") == 0 && i + 1 < argc) config_path = argv[++i];
    else if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps_flag = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--save") == 0 || std::strcmp(argv[i], "--load") == 0) {
      std::fprintf(stderr, "zest-train: %s needs checkpoints, which this build does not have yet\n", argv[i]);
      return 2;
    } else return usage();
  }
  if (config_path.empty()) return usage();

  const Config config = load_config(config_path, {"model", "train"});
  train::TrainConfig train = train::load_train_config(config_path);
  if (steps_flag) train.steps = *steps_flag;
  Runtime runtime(config);
  const bool leader = runtime.rank() == 0;

  const charlm::TextCorpus corpus = charlm::TextCorpus::load(train.text);
  train.model.vocab = corpus.vocab_size();
  const int accumulation = config.gradient_accumulation_steps;
  if (train.global_batch % static_cast<std::size_t>(accumulation) != 0)
    throw Error("train.global_batch (" + std::to_string(train.global_batch) +
                ") must divide into gradient_accumulation_steps (" + std::to_string(accumulation) + ") micro-batches");
  const std::size_t micro_batch = train.global_batch / static_cast<std::size_t>(accumulation);
  const charlm::ExampleRange largest = charlm::rank_slice(micro_batch, 0, runtime.world_size());
  // One BLAS thread per rank when ranks share the cores.
  const int blas_threads = std::max<int>(1, static_cast<int>(runtime.cpus().size()));
  charlm::CharMlp model(train.model, std::max<std::size_t>(1, largest.count + 1), blas_threads);

  std::vector<ParamSpec> specs;
  for (const auto& p : model.parameters()) specs.push_back({p.name, p.shape, p.group});
  Engine engine(config, runtime.device(), runtime.comm(), specs);
  for (std::size_t t = 0; t < specs.size(); ++t) {
    std::vector<float> values(specs[t].numel());
    model.init_tensor(t, 0, values, train.seed);
    engine.set_param(t, values.data());
  }
  if (leader)
    std::printf("zest-train: %zu parameters, stage %d, %s, %d rank(s), global batch %zu\n", engine.numel(),
                config.stage, std::string(dtype_name(config.precision.dtype)).c_str(), runtime.world_size(),
                train.global_batch);

  EngineBinding binding(engine, model);
  const charlm::BatchSampler sampler(corpus.tokens().size(), train.model.context, train.global_batch, train.seed);
  std::vector<charlm::Token> windows((largest.count + 1) * sampler.window());
  auto stream = runtime.device().create_stream();
  DeviceBuffer loss_buffer = runtime.device().allocate(sizeof(float), MemoryCategory::buffers);
  const auto start = std::chrono::steady_clock::now();
  for (int step = 1; step <= train.steps; ++step) {
    double loss = 0;
    for (int micro = 0; micro < accumulation; ++micro) {
      charlm::ExampleRange range = charlm::rank_slice(micro_batch, runtime.rank(), runtime.world_size());
      range.first += static_cast<std::size_t>(micro) * micro_batch;
      std::span<charlm::Token> mine(windows.data(), range.count * sampler.window());
      sampler.gather(corpus.tokens(), static_cast<std::uint64_t>(step), range, mine);
      loss += model.forward_backward(binding.params(), binding.grads(), mine,
                                     static_cast<double>(train.global_batch), &binding.hooks());
      binding.release_all();
    }
    const StepResult result = engine.step();
    // The loss of the whole global batch: the sum of every rank's share.
    float* total = loss_buffer.as<float>();
    *total = static_cast<float>(loss);
    if (runtime.device().host_accessible()) {
      runtime.comm().all_reduce(total, total, 1, DType::f32, ReduceOp::sum, *stream);
      stream->synchronize();
    }
    if (leader && (step % train.log_every == 0 || step == train.steps))
      std::printf("step %d loss %.6f%s\n", step, *total, result.skipped ? " (skipped: gradient overflow)" : "");
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const EngineStats stats = engine.stats();
  if (leader) {
    const auto mib = [](std::size_t b) { return static_cast<double>(b) / (1 << 20); };
    const MemoryStats& m = stats.memory;
    std::printf("zest-train: %d steps in %.2f s; rank 0 peak device memory %.1f MiB (params %.1f, grads %.1f, "
                "optimizer states %.1f, buffers %.1f) of %.1f MiB; %lld skipped steps\n",
                train.steps, seconds, mib(m.peak_total), mib(m.peak_of(MemoryCategory::params)),
                mib(m.peak_of(MemoryCategory::grads)), mib(m.peak_of(MemoryCategory::optimizer_states)),
                mib(m.peak_of(MemoryCategory::buffers)), mib(m.budget), static_cast<long long>(stats.skipped_steps));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
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
