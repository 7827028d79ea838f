// zest-gpt: a decoder-only transformer in libtorch, trained with zest::torch::Optimizer in place
// of torch::optim::AdamW (one line), at any ZeRO stage, rank count and offload.
//
//   mpirun -np 4 zest-gpt --config configs/gpt-tiny.yaml [--steps N] [--load DIR] [--save DIR]
//                         [--dump FILE] [--trace FILE]
//   zest-gpt --config configs/gpt-tiny.yaml --reference [--steps N] [--dump FILE]
//
// --reference trains the same model from the same initialisation and data order with
// torch::optim::AdamW (Adam when optimizer.type is adam; gradient_clipping by
// torch::nn::utils::clip_grad_norm_) in this one process. gradient_accumulation_steps splits each
// rank's slice into that many micro-batches, one backward each. --dump FILE writes
// the final parameters (fp32, in named_parameters() order, raw) for comparison. Rank r trains on
// its slice of each step's global batch, a function of (seed, step) alone, so the loss at step n
// is the same for any rank count, stage and offload. --trace FILE writes a Chrome trace of every
// rank's steps (a new file: an existing one is refused).
#include <fnmatch.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "args/args.hpp"
#include "charlm/batch_sampler.hpp"
#include "gpt/gpt_config.hpp"
#include "base/trace.hpp"
#include "gpt/gpt_model.hpp"
#include "zest/trace.hpp"
#include "zest/torch.hpp"
#include "zest/zest.hpp"

namespace {

using namespace zest;

constexpr const char* kUsage =
    "usage: zest-gpt --config FILE [--steps N] [--reference] [--load DIR] [--save DIR] [--dump FILE]\n"
    "                [--trace FILE]\n";

struct Flags {
  std::string config_path, load_dir, save_dir, dump_path, trace_path;
  std::optional<int> steps;
  bool reference = false;
};

// The trained parameters in two torch param groups: with the config's weight decay, and without
// (names matching train.no_decay). Options is AdamWOptions or AdamOptions.
template <class Options>
std::vector<::torch::optim::OptimizerParamGroup> param_groups(const gpt::Gpt& model, const OptimizerConfig& optimizer,
                                                              const std::vector<std::string>& no_decay) {
  std::vector<::torch::Tensor> decayed, plain;
  for (const auto& item : model->named_parameters()) {
    bool matched = false;
    for (const std::string& pattern : no_decay)
      matched = matched || ::fnmatch(pattern.c_str(), item.key().c_str(), 0) == 0;
    (matched ? plain : decayed).push_back(item.value());
  }
  const auto options = [&](double weight_decay) {
    return std::make_unique<Options>(Options(optimizer.lr)
                                         .betas({optimizer.beta1, optimizer.beta2})
                                         .eps(optimizer.eps)
                                         .weight_decay(weight_decay));
  };
  std::vector<::torch::optim::OptimizerParamGroup> groups;
  if (!decayed.empty()) groups.emplace_back(decayed, options(optimizer.weight_decay));
  if (!plain.empty()) groups.emplace_back(plain, options(0.0));
  return groups;
}

// One step's loss on this rank's slice of the global batch: summed over its tokens and divided
// by the global batch's token count, so the ranks' losses (and gradients) add up to the mean.
::torch::Tensor slice_loss(gpt::Gpt& model, const charlm::TextCorpus& corpus, const charlm::BatchSampler& sampler,
                           int step, charlm::ExampleRange range, std::int64_t context) {
  std::vector<charlm::Token> tokens(range.count * sampler.window());
  sampler.gather(corpus.tokens(), static_cast<std::uint64_t>(step), range, tokens);
  const auto windows =
      ::torch::from_blob(tokens.data(),
                         {static_cast<std::int64_t>(range.count), static_cast<std::int64_t>(sampler.window())},
                         ::torch::kInt)
          .to(::torch::kLong);
  const auto logits = model(windows.slice(1, 0, context));
  const auto targets = windows.slice(1, 1, context + 1);
  const auto sum = ::torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(::torch::kFloat), targets.reshape({-1}),
      ::torch::nn::functional::CrossEntropyFuncOptions().reduction(::torch::kSum));
  return sum / static_cast<double>(sampler.global_batch() * static_cast<std::size_t>(context));
}

// --dump's file, created here: an existing file is never overwritten.
class DumpFile {
 public:
  explicit DumpFile(const std::string& path) : path_(path), file_(std::fopen(path.c_str(), "wbx")) {
    if (!file_) throw IoError("zest-gpt: cannot create the --dump file (it must not exist yet)", path, 0, 0, errno);
  }
  ~DumpFile() {
    if (file_) std::fclose(file_);
  }
  DumpFile(const DumpFile&) = delete;
  DumpFile& operator=(const DumpFile&) = delete;
  void write(const float* values, std::size_t count) {
    if (std::fwrite(values, sizeof(float), count, file_) != count)
      throw IoError("zest-gpt: cannot write the --dump file", path_, 0, count * sizeof(float), errno);
  }
  void close() {
    const int result = std::fclose(file_);
    file_ = nullptr;
    if (result != 0) throw IoError("zest-gpt: cannot write the --dump file", path_, 0, 0, errno);
  }

 private:
  std::string path_;
  std::FILE* file_;
};

// What both modes train: the corpus (it fixes the vocabulary), the data order, and the model,
// initialised from train.seed and converted to precision.dtype before any optimizer sees it.
struct Training {
  charlm::TextCorpus corpus;
  gpt::GptShape shape;
  charlm::BatchSampler sampler;
  gpt::Gpt model;
};

Training prepare(const Config& config, const gpt::GptTrainConfig& train) {
  charlm::TextCorpus corpus = charlm::TextCorpus::load(train.text);
  gpt::GptShape shape = train.model;
  shape.vocab = static_cast<std::int64_t>(corpus.vocab_size());
  charlm::BatchSampler sampler(corpus.tokens().size(), static_cast<std::size_t>(shape.context), train.global_batch,
                               train.seed);
  ::torch::manual_seed(train.seed);
  gpt::Gpt model(shape);
  if (config.precision.dtype == DType::bf16) model->to(::torch::kBFloat16);
  if (config.precision.dtype == DType::f16) model->to(::torch::kHalf);
  return {std::move(corpus), shape, sampler, std::move(model)};
}

int run_reference(const Config& config, const gpt::GptTrainConfig& train, const Flags& flags) {
  Training training = prepare(config, train);
  auto& [corpus, shape, sampler, model] = training;
  std::unique_ptr<::torch::optim::Optimizer> optimizer;
  if (config.optimizer.type == OptimizerType::adam)
    optimizer = std::make_unique<::torch::optim::Adam>(
        param_groups<::torch::optim::AdamOptions>(model, config.optimizer, train.no_decay),
        ::torch::optim::AdamOptions(config.optimizer.lr));
  else
    optimizer = std::make_unique<::torch::optim::AdamW>(
        param_groups<::torch::optim::AdamWOptions>(model, config.optimizer, train.no_decay),
        ::torch::optim::AdamWOptions(config.optimizer.lr));
  std::optional<::torch::optim::StepLR> schedule;
  if (train.lr_step_size > 0)
    schedule.emplace(*optimizer, static_cast<unsigned>(train.lr_step_size), train.lr_gamma);
  std::printf("zest-gpt: reference (torch::optim), %lld parameters\n",
              static_cast<long long>(::torch::nn::utils::parameters_to_vector(model->parameters()).numel()));
  for (int step = 1; step <= train.steps; ++step) {
    const auto loss = slice_loss(model, corpus, sampler, step, {0, train.global_batch}, shape.context);
    loss.backward();
    if (config.gradient_clipping > 0)
      ::torch::nn::utils::clip_grad_norm_(model->parameters(), config.gradient_clipping);
    optimizer->step();
    optimizer->zero_grad();
    if (schedule) schedule->step();
    if (step % train.log_every == 0 || step == train.steps)
      std::printf("step %d loss %.7f\n", step, loss.item<double>());
  }
  if (!flags.dump_path.empty()) {
    DumpFile dump(flags.dump_path);
    for (const auto& param : model->parameters()) {
      const auto values = param.detach().to(::torch::kFloat).contiguous();
      dump.write(values.data_ptr<float>(), static_cast<std::size_t>(values.numel()));
    }
    dump.close();
  }
  return 0;
}

int run_zest(const Config& config, const gpt::GptTrainConfig& train, const Flags& flags) {
  Runtime runtime(config);
  const bool leader = runtime.rank() == 0;
  // Refuses an existing file before any work (rank 0 creates it); records from here on.
  std::optional<TraceFile> trace_file;
  if (!flags.trace_path.empty()) trace_file.emplace(flags.trace_path, runtime.comm());
  Training training = prepare(config, train);
  auto& [corpus, shape, sampler, model] = training;
  const std::size_t model_bytes = [&] {
    std::size_t bytes = 0;
    for (const auto& p : model->parameters()) bytes += p.nbytes();
    return bytes;
  }();

  // The one line a torch program changes: zest::torch::Optimizer in place of torch::optim::AdamW.
  zest::torch::Optimizer optimizer(model->named_parameters(),
                                   param_groups<::torch::optim::AdamWOptions>(model, config.optimizer, train.no_decay),
                                   config, &runtime);
  std::optional<::torch::optim::StepLR> schedule;
  if (train.lr_step_size > 0)
    schedule.emplace(optimizer, static_cast<unsigned>(train.lr_step_size), train.lr_gamma);
  if (leader)
    std::printf("zest-gpt: %zu parameters, stage %d, %s, %d rank(s), global batch %zu\n", optimizer.engine().numel(),
                config.stage, std::string(dtype_name(config.precision.dtype)).c_str(), runtime.world_size(),
                train.global_batch);

  // 64-bit: a checkpoint's step count may pass what an int holds; one at or past train.steps
  // trains no more.
  std::int64_t first_step = 1;
  if (!flags.load_dir.empty()) {
    // The schedule's own count catches up; the learning rates are the checkpoint's.
    const LoadResult loaded = optimizer.load(flags.load_dir, schedule ? &*schedule : nullptr);
    first_step = loaded.steps + 1;
    if (leader)
      std::printf("zest-gpt: resumed from %s after step %lld\n", flags.load_dir.c_str(),
                  static_cast<long long>(loaded.steps));
  }
  // This rank's slice of the global batch, in gradient_accumulation_steps micro-batches (one
  // backward each; zest adds their gradients up). Clipping is zest's, from the config.
  const charlm::ExampleRange range = charlm::rank_slice(train.global_batch, runtime.rank(), runtime.world_size());
  const int micro_batches = config.gradient_accumulation_steps;
  for (int step = static_cast<int>(std::min<std::int64_t>(first_step, std::int64_t{train.steps} + 1));
       step <= train.steps; ++step) {
    double total = 0;
    for (int micro = 0; micro < micro_batches; ++micro) {
      const charlm::ExampleRange part = charlm::rank_slice(range.count, micro, micro_batches);
      const trace::Span span("forward + backward", trace::Lane::backward, micro);
      const auto loss = slice_loss(model, corpus, sampler, step, {range.first + part.first, part.count},
                                   shape.context);
      (loss * optimizer.loss_scale()).backward();
      total += loss.item<double>();
    }
    optimizer.step();
    optimizer.zero_grad();
    if (schedule) schedule->step();
    runtime.comm().all_reduce_host(std::span<double>(&total, 1), ReduceOp::sum);
    if (leader && (step % train.log_every == 0 || step == train.steps))
      std::printf("step %d loss %.7f grad_norm %.5f%s\n", step, total, optimizer.last_step().grad_norm,
                  optimizer.last_step().skipped ? " (skipped: overflow)" : "");
  }
  if (trace_file) {
    const std::size_t dropped = trace_file->write();
    if (leader)
      std::printf(
          "zest-gpt: wrote the trace of %d rank(s) to %s%s\n", runtime.world_size(), flags.trace_path.c_str(),
          dropped > 0 ? (" (" + std::to_string(dropped) + " events past its capacity were dropped)").c_str() : "");
  }
  if (!flags.save_dir.empty()) optimizer.save(flags.save_dir);

  Engine& engine = optimizer.engine();
  if (!flags.dump_path.empty()) {
    std::optional<DumpFile> dump;
    if (leader) dump.emplace(flags.dump_path);
    for (std::size_t t = 0; t < engine.tensor_count(); ++t) {  // collective: every rank
      std::vector<float> values(engine.spec(t).numel());
      engine.get_param(t, values);
      if (dump) dump->write(values.data(), values.size());
    }
    if (dump) dump->close();
  }

  const EngineStats stats = engine.stats();
  const MemoryStats& m = stats.memory;
  std::fflush(stdout);
  runtime.comm().barrier();
  std::printf("zest-gpt: rank %d memory: model %zu B; zest peak params %zu B, grads %zu B, optimizer states %zu B, "
              "buffers %zu B; torch-owned parameter storage %zu B; largest transient torch gradient %zu B\n",
              runtime.rank(), model_bytes, m.peak_of(MemoryCategory::params), m.peak_of(MemoryCategory::grads),
              m.peak_of(MemoryCategory::optimizer_states), m.peak_of(MemoryCategory::buffers),
              optimizer.torch_param_bytes(), optimizer.peak_transient_grad_bytes());
  return 0;
}

int run(int argc, char** argv) {
  if (args::asks_for_help(argc - 1, argv + 1)) return args::print_usage(kUsage);
  Flags flags;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--config") flags.config_path = args::path_of(argc, argv, i);
      else if (arg == "--steps")
        flags.steps = static_cast<int>(args::parse_integer(arg, args::value_of(argc, argv, i), 0, 1'000'000'000));
      else if (arg == "--reference") flags.reference = true;
      else if (arg == "--save") flags.save_dir = args::path_of(argc, argv, i);
      else if (arg == "--load") flags.load_dir = args::path_of(argc, argv, i);
      else if (arg == "--dump") flags.dump_path = args::path_of(argc, argv, i);
      else if (arg == "--trace") flags.trace_path = args::path_of(argc, argv, i);
      else throw args::UsageError(std::string("unexpected argument '").append(arg).append("'"));
    }
    if (flags.config_path.empty()) throw args::UsageError("--config FILE is required");
    args::check_distinct_outputs(
        {{"--save", flags.save_dir}, {"--trace", flags.trace_path}, {"--dump", flags.dump_path}});
    if (flags.reference && (!flags.save_dir.empty() || !flags.load_dir.empty()))
      throw args::UsageError("--reference trains with torch alone: it takes no --save or --load");
    if (flags.reference && !flags.trace_path.empty())
      throw args::UsageError("--reference trains with torch alone: there is no zest step to --trace");
  } catch (const args::UsageError& error) {
    std::fprintf(stderr, "zest-gpt: %s\n%s", error.what(), kUsage);
    return 2;
  }
  if (!flags.save_dir.empty()) check_checkpoint_target(flags.save_dir);
  // Before any work, on every rank: a --dump file that exists is refused now, not after training.
  std::error_code ignored;
  if (!flags.dump_path.empty() && std::filesystem::symlink_status(flags.dump_path, ignored).type() !=
                                      std::filesystem::file_type::not_found) {
    std::fprintf(stderr, "zest-gpt: --dump %s exists; zest-gpt writes only a new file: choose another path\n",
                 flags.dump_path.c_str());
    return 2;
  }
  const Config config = load_config(flags.config_path, {"model", "train"});
  gpt::GptTrainConfig train = gpt::load_gpt_train_config(flags.config_path);
  if (flags.steps) train.steps = *flags.steps;
  // One intra-op thread: ranks share the host's cores, and the reference must sum as each rank does.
  ::torch::set_num_threads(1);
  return flags.reference ? run_reference(config, train, flags) : run_zest(config, train, flags);
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
    std::fprintf(stderr, "zest-gpt: %s\n", error.what());
    return 1;
  } catch (const c10::Error& error) {
    std::fprintf(stderr, "zest-gpt: torch: %s\n", error.what_without_backtrace());
    return 1;
  }
}
