// zest bench memory: what each ZeRO stage saves against plain data parallel (stage 0) on a real
// model. It trains the example character MLP for a few steps under each configuration on every rank
// and reports per-rank peak device memory by category, the ZeRO formula's prediction, step time and
// whether the loss equals DDP's; then it searches, per configuration, the largest model that trains
// within a device budget.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "args/args.hpp"
#include "base/files.hpp"
#include "bench_commands.hpp"
#include "charlm/batch_sampler.hpp"
#include "charlm/text_corpus.hpp"
#include "checkpoint/format.hpp"
#include "memory_report.hpp"
#include "trainer.hpp"
#include "zest/zest.hpp"

namespace zest::cli {
namespace {

using bench::FitRecord;
using bench::MemoryRecord;

constexpr const char* kUsage =
    "usage: zest bench memory [--config FILE] [--params N] [--steps N] [--device-memory SIZE]\n"
    "                         [--json FILE] [--csv FILE] [--chart FILE.svg] [--no-fit] [--fit-cap N]\n"
    "                         [--nvme-path DIR]\n"
    "  Run under mpirun -np N (or alone: a world of one). Defaults: the built-in config (cpu device,\n"
    "  bf16, AdamW, 1 MiB buckets: one layer each), --params 4000000, --steps 4, --device-memory\n"
    "  128MiB for the largest-model search, which grows depth with width and stops at --fit-cap\n"
    "  parameters (1e9; a row that reaches it says \">=\"), outputs zest-memory.json,\n"
    "  zest-memory.csv and zest-memory.svg in the current directory.\n"
    "  The nvme offload rows keep their swap files in --nvme-path (default: a fresh directory in the\n"
    "  current directory, removed afterwards).\n"
    "  Peers (torch DDP, FSDP2) beside zest's rows, on the same model, batches and rank count:\n"
    "    zest bench memory --write-peer-inputs DIR [--params N] [--steps N]   (one process: the model's\n"
    "      shape, initial weights and batches, into DIR, which must not hold them yet)\n"
    "    mpirun -np 4 python bench/memory_peers.py DIR --json DIR/peers.json\n"
    "    mpirun -np 4 zest bench memory --peers DIR/peers.json [...]   (their rows in the table, JSON,\n"
    "      CSV and chart, and every row's loss against torch DDP's)\n";

struct Options {
  std::string config_path;
  std::size_t params = 4'000'000;
  int steps = 4;
  std::size_t fit_budget = std::size_t{128} << 20;
  bool fit = true;
  std::size_t fit_cap = 1'000'000'000;  // parameters: the largest model a search tries
  std::string json = "zest-memory.json", csv = "zest-memory.csv", chart = "zest-memory.svg";
  std::string nvme_path;
  std::string write_peer_inputs;  // a directory: write the peers' inputs there, and stop
  std::string peers;              // bench/memory_peers.py's JSON: add its rows
};

struct Configuration {
  std::string name;
  int stage;
  OffloadDevice optimizer = OffloadDevice::none;
  OffloadDevice param = OffloadDevice::none;
  double ratio = 1;  // offload.optimizer.ratio
  StatesFormat states = StatesFormat::f32;  // optimizer.states
  DType master = DType::f32;                // optimizer.master
  bool secondary = false;                   // partition.secondary: host
};

std::string offload_name(OffloadDevice d) {
  return d == OffloadDevice::none ? "none" : d == OffloadDevice::cpu ? "cpu" : "nvme";
}

// The directory the nvme rows swap to: the one given, or a fresh one in the current directory that
// goes away with this object (each rank makes its own; the swap files are per rank anyway).
class SwapDirectory {
 public:
  explicit SwapDirectory(const std::string& given) : path_(given) {
    if (!path_.empty()) return;
    std::string pattern = "zest-bench-nvme-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr)
      throw IoError("zest bench memory: cannot create a directory for the nvme swap files (use --nvme-path DIR)",
                    std::filesystem::current_path().string(), 0, 0, errno);
    path_ = std::filesystem::absolute(pattern).string();
    owned_ = true;
  }
  ~SwapDirectory() {
    std::error_code ignored;
    if (owned_) std::filesystem::remove_all(path_, ignored);
  }
  SwapDirectory(const SwapDirectory&) = delete;
  SwapDirectory& operator=(const SwapDirectory&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool owned_ = false;
};

// The character MLP whose parameter count is closest above `params`, with `shape.layers` hidden
// layers of a width grown to fit.
charlm::CharMlpShape shape_for(std::size_t params, std::size_t vocab, charlm::CharMlpShape shape) {
  shape.vocab = vocab;
  std::size_t lo = 1, hi = 1;
  shape.hidden = hi;
  while (charlm::CharMlp::parameter_count(shape) < params) shape.hidden = hi *= 2;
  while (lo < hi) {
    shape.hidden = (lo + hi) / 2;
    if (charlm::CharMlp::parameter_count(shape) < params) lo = shape.hidden + 1;
    else hi = shape.hidden;
  }
  shape.hidden = hi;
  return shape;
}

// Stage 3 keeps a layer's full parameters only while it is used: prefetch one layer ahead and keep
// at most three layers gathered, whatever the model's size.
void fit_stage3_to(Config& config, const charlm::CharMlp& model) {
  std::vector<std::size_t> group_numel(static_cast<std::size_t>(model.group_count()), 0);
  for (const auto& p : model.parameters()) group_numel[static_cast<std::size_t>(p.group)] += p.numel();
  const std::size_t largest = *std::max_element(group_numel.begin(), group_numel.end());
  const std::size_t layer_bytes = largest * dtype_size(config.precision.dtype);
  config.stage3.prefetch_bytes = layer_bytes;
  config.stage3.max_live_bytes = 3 * layer_bytes;
}

// The ZeRO paper's per-rank bytes for params + grads + optimizer states: d bytes per parameter and
// per gradient (2 for bf16/fp16), 12 for fp32 master, m and v (8 with bf16 m and v, 6.125 with int8
// ones and a float scale each per 64 parameters: optimizer.states); sharded over N from stage 1, 2,
// 3 on.
// What is offloaded counts 0 on the device: optimizer states (the ratio of them), stage 3's
// parameters, and at stages 2-3 with the whole optimizer offloaded the gradient shard (kept on the
// host, as ZeRO-Offload does).
// `host_ranks`: the ranks on each host; a secondary partition adds 1/host_ranks of the parameters.
std::size_t formula_bytes(const Configuration& conf, std::size_t params, std::size_t d, int ranks, int host_ranks) {
  const int stage = conf.stage;
  const double psi = static_cast<double>(params), n = ranks;
  const double p = conf.param == OffloadDevice::none ? static_cast<double>(d) * psi : 0.0;
  const bool grads_on_host = stage >= 2 && conf.optimizer != OffloadDevice::none && conf.ratio == 1;
  const double g = grads_on_host ? 0.0 : static_cast<double>(d) * psi;
  const double k = (conf.master == DType::bf16 ? 2 : 4) +
                   (conf.states == StatesFormat::f32 ? 8 : conf.states == StatesFormat::bf16 ? 4 : 2.125);
  const double os = conf.optimizer == OffloadDevice::none ? k * psi : k * psi * (1 - conf.ratio);
  switch (stage) {
    case 0: return static_cast<std::size_t>(p + g + os);
    case 1: return static_cast<std::size_t>(p + g + os / n);
    case 2: return static_cast<std::size_t>(p + (g + os) / n);
    default: return static_cast<std::size_t>((p + g + os) / n + (conf.secondary && ranks > 1 ? p / host_ranks : 0.0));
  }
}

// The largest value over ranks, in KiB so that a float carries it exactly up to 16 GiB.
// The process's resident memory now (VmRSS) or its peak (VmHWM), and the peak's reset: writing 5
// to clear_refs restarts the peak from the current resident size (Linux 4.0+), so each row
// reports its own peak.
std::size_t rss_field(const char* format) {
  std::FILE* status = std::fopen("/proc/self/status", "r");
  if (status == nullptr) return 0;
  char line[256];
  std::size_t kib = 0;
  while (std::fgets(line, sizeof line, status) != nullptr)
    if (std::sscanf(line, format, &kib) == 1) break;
  std::fclose(status);
  return kib * 1024;
}
std::size_t peak_rss() { return rss_field("VmHWM: %zu kB"); }
std::size_t current_rss() { return rss_field("VmRSS: %zu kB"); }

void reset_peak_rss() {
  if (std::FILE* refs = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", refs);
    std::fclose(refs);
  }
}

// The largest of every rank's `value`. The communicator reduces device memory, which the host may
// not be able to read (cuda), so the value goes there and back by copies.
float max_over_ranks(Communicator& comm, Device& device, Stream& stream, float value) {
  DeviceBuffer buffer = device.allocate(sizeof(float), MemoryCategory::buffers);
  device.copy_async(buffer.data(), &value, sizeof value, stream);
  comm.all_reduce(buffer.data(), buffer.data(), 1, DType::f32, ReduceOp::max, stream);
  device.copy_async(&value, buffer.data(), sizeof value, stream);
  stream.synchronize();
  return value;
}

// Byte counts travel in KiB: a float holds those exactly up to 16 TiB.
std::size_t max_over_ranks(Communicator& comm, Device& device, Stream& stream, std::size_t bytes) {
  return static_cast<std::size_t>(max_over_ranks(comm, device, stream, static_cast<float>((bytes + 1023) / 1024))) *
         1024;
}

class Progress {
 public:
  Progress(bool leader, int total) : leader_(leader), total_(total), tty_(isatty(STDERR_FILENO) != 0) {}
  void show(int done, const std::string& what) {
    if (!leader_) return;
    constexpr int kWidth = 30;
    const int filled = kWidth * done / std::max(1, total_);
    std::fprintf(stderr, "%s[%s%s] %d/%d %-50s%s", tty_ ? "\r" : "",
                 std::string(static_cast<std::size_t>(filled), '#').c_str(),
                 std::string(static_cast<std::size_t>(kWidth - filled), '.').c_str(), done, total_, what.c_str(),
                 tty_ ? "" : "\n");
    if (tty_ && done == total_) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  bool leader_;
  int total_;
  bool tty_;
};

// The configuration's stage and offload on top of `config`.
Config configured(const Configuration& conf, Config config, const std::string& nvme_path) {
  config.stage = conf.stage;
  config.offload.optimizer.device = conf.optimizer;
  config.offload.param.device = conf.param;
  config.offload.optimizer_ratio = conf.ratio;
  config.optimizer.states = conf.states;
  config.optimizer.master = conf.master;
  config.partition.secondary = conf.secondary ? SecondaryPartition::host : SecondaryPartition::none;
  config.offload.optimizer.paths.clear();
  config.offload.param.paths.clear();
  if (conf.optimizer == OffloadDevice::nvme) config.offload.optimizer.paths = {nvme_path};
  if (conf.param == OffloadDevice::nvme) config.offload.param.paths = {nvme_path};
  return config;
}

MemoryRecord measure(const Configuration& conf, Config config, const train::TrainConfig& train,
                     const charlm::TextCorpus& corpus, Runtime& runtime, Stream& stream, int steps,
                     const std::string& nvme_path) {
  config = configured(conf, config, nvme_path);
  Device& device = runtime.device();
  Communicator& comm = runtime.comm();
  comm.barrier();
  device.reset_peak();
  reset_peak_rss();
  const std::size_t start_rss = current_rss();
  MemoryRecord r;
  r.name = conf.name;
  r.stage = conf.stage;
  r.offload_optimizer = offload_name(conf.optimizer);
  r.offload_param = offload_name(conf.param);
  r.offload_ratio = conf.ratio;
  r.states = std::string(states_format_name(conf.states)) + (conf.master == DType::bf16 ? "+bf16 master" : "");
  r.ranks = comm.size();
  std::size_t nvme_bytes = 0;
  std::vector<double> seconds;
  {
    const int blas_threads = std::max<int>(1, static_cast<int>(runtime.cpus().size()));
    train::Trainer trainer(config, train, corpus, device, comm, blas_threads);
    r.params = trainer.engine().numel();
    std::vector<ParamSpec> specs;
    for (std::size_t t = 0; t < trainer.engine().tensor_count(); ++t) specs.push_back(trainer.engine().spec(t));
    const MemoryEstimate estimate = estimate_memory(config, specs, comm.size(), runtime.local_size());
    r.estimate_device_bytes = estimate.device_total;
    r.estimate_pinned_by = estimate.pinned_by;
    r.estimate_pinned_bytes = estimate.pinned;
    r.host_need_bytes = estimate.pinned + (device.host_accessible() ? estimate.device_total : 0);
    for (int step = 1; step <= steps; ++step) {
      comm.barrier();
      const auto start = std::chrono::steady_clock::now();
      r.final_loss = trainer.step(step);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const EngineStats engine_stats = trainer.engine().stats();
    nvme_bytes = engine_stats.nvme_bytes;
    r.wire_bytes = engine_stats.wire_last_step.total();
    r.wire_across_bytes = engine_stats.wire_last_step.across();
    r.wire_formula_bytes = estimate_wire_bytes(config, specs, comm.size(), comm.size()).zero_formula;
  }
  const MemoryStats stats = device.memory_stats();
  r.peak_params_bytes = max_over_ranks(comm, device, stream, stats.peak_of(MemoryCategory::params));
  r.peak_grads_bytes = max_over_ranks(comm, device, stream, stats.peak_of(MemoryCategory::grads));
  r.peak_optimizer_bytes = max_over_ranks(comm, device, stream, stats.peak_of(MemoryCategory::optimizer_states));
  r.peak_buffers_bytes = max_over_ranks(comm, device, stream, stats.peak_of(MemoryCategory::buffers));
  r.peak_device_bytes = max_over_ranks(comm, device, stream, stats.peak_total);
  const HostMemoryStats pinned = device.pinned_stats();
  r.peak_host_pinned_bytes = max_over_ranks(comm, device, stream, pinned.peak);
  for (std::size_t p = 0; p < kHostPurposeCount; ++p)
    r.peak_pinned_by[p] = max_over_ranks(comm, device, stream, pinned.peak_by[p]);
  r.peak_host_rss_bytes = max_over_ranks(comm, device, stream, peak_rss());
  r.start_host_rss_bytes = max_over_ranks(comm, device, stream, start_rss);
  r.nvme_bytes = max_over_ranks(comm, device, stream, nvme_bytes);
  r.formula_bytes = formula_bytes(conf, r.params, dtype_size(config.precision.dtype), r.ranks, runtime.local_size());
  const double model_state = static_cast<double>(r.peak_params_bytes + r.peak_grads_bytes + r.peak_optimizer_bytes);
  // Stage 3 with everything offloaded: the formula puts nothing on the device; what stays there (the
  // small resident groups' parameters) shows in the params column, not as a deviation.
  r.formula_deviation = r.formula_bytes > 0 ? model_state / static_cast<double>(r.formula_bytes) - 1 : 0.0;
  r.estimate_deviation = static_cast<double>(r.peak_device_bytes) / static_cast<double>(r.estimate_device_bytes) - 1;
  // The first step pays page faults of fresh buffers; the median of the rest is the step time.
  std::sort(seconds.begin() + (seconds.size() > 1 ? 1 : 0), seconds.end());
  r.step_seconds = seconds.size() > 1 ? seconds[1 + (seconds.size() - 1) / 2] : seconds.front();
  return r;
}

// The search grows the model as model families grow, in depth as well as in width: a hidden width
// of h has max(L0, h / kWidthPerLayer) layers (L0: the measured model's), so a layer's share of the
// model falls as it grows (1/8 at 4M parameters, 1/26 at 200M, 1/55 at 2B), as it does from
// GPT-2's 124M (12 layers) to GPT-3's 175B (96). Growing the width alone would make one layer an
// eighth of any model, and stage 3's gathered layers a fixed share of the device.
constexpr std::size_t kWidthPerLayer = 64;

charlm::CharMlpShape grown(charlm::CharMlpShape shape, std::size_t hidden, std::size_t min_layers) {
  shape.hidden = hidden;
  shape.layers = std::max(min_layers, hidden / kWidthPerLayer);
  return shape;
}

// What a trial's model was too large for (the order: the codes the ranks agree on by max).
enum class Bound { none = 0, device = 1, host = 2, nvme = 3, cap = 4 };

const char* bound_name(Bound b) {
  switch (b) {
    case Bound::device: return "device memory";
    case Bound::host: return "host RAM";
    case Bound::nvme: return "NVMe space";
    case Bound::cap: return "the search's cap";
    case Bound::none: break;
  }
  return "nothing";
}

// What the host can give each rank: pinned memory (half of what the kernel says is available,
// split among this host's ranks: pinned pages cannot be swapped, and a trial beyond RAM would meet
// the OOM killer, not an exception) and NVMe space (90% of the swap directory's file system's free
// space, split likewise). Read once, before the search.
struct HostLimits {
  std::size_t pinned = 0, nvme = 0;
  std::size_t params_cap = 0;
};

std::size_t available_ram() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

HostLimits host_limits(const std::string& nvme_path, int local_ranks, std::size_t params_cap) {
  const auto share = [&](double bytes) { return static_cast<std::size_t>(bytes / std::max(1, local_ranks)); };
  std::error_code error;
  const auto space = std::filesystem::space(nvme_path, error);
  return {share(0.5 * static_cast<double>(available_ram())),
          error ? 0 : share(0.9 * static_cast<double>(space.available)), params_cap};
}

// Whether a model of `shape` can take a step within `budget` bytes of device memory per rank and
// the host's limits, on every rank, and if not, what it is too large for. Host RAM and NVMe space
// are judged by zest's estimate (exact for the pinned memory and the swap file an engine takes,
// tests/engine/estimate_test.cpp) before anything is allocated; the device by building the engine
// and taking a step (gradients of zero: the question is memory, not learning).
Bound fits(Config config, const charlm::CharMlpShape& shape, std::size_t budget, const HostLimits& limits,
           Runtime& runtime, Stream& stream) {
  Communicator& comm = runtime.comm();
  Bound bound = Bound::none;
  charlm::CharMlp model(shape, 1, 1);
  fit_stage3_to(config, model);
  const std::vector<ParamSpec> params = train::engine_params(model);
  const MemoryEstimate need = estimate_memory(config, params, comm.size(), runtime.local_size());
  if (charlm::CharMlp::parameter_count(shape) > limits.params_cap) bound = Bound::cap;
  else if (need.pinned > limits.pinned) bound = Bound::host;
  else if (need.nvme > limits.nvme) bound = Bound::nvme;
  if (bound == Bound::none) {
    try {
      auto device = make_cpu_device(budget);
      Engine engine(config, *device, comm, params);
      for (int g = engine.group_count() - 1; g >= 0; --g) {
        auto lease = engine.acquire(g);
        for (std::size_t t = 0; t < engine.tensor_count(); ++t)
          if (engine.spec(t).group == g) lease.grad(t);
        engine.grads_ready(g);
      }
      engine.step();
    } catch (const OutOfDeviceMemory&) {
      bound = Bound::device;
    }
  }
  // Every rank must agree, or the next trial's collectives would not match.
  return static_cast<Bound>(
      static_cast<int>(max_over_ranks(comm, runtime.device(), stream, static_cast<float>(bound))));
}

FitRecord largest_fit(const Configuration& conf, const Config& config, charlm::CharMlpShape shape,
                      std::size_t budget, const HostLimits& limits, const std::string& nvme_path, Runtime& runtime,
                      Stream& stream) {
  const Config tried = configured(conf, config, nvme_path);
  const std::size_t min_layers = shape.layers;
  const auto trial = [&](std::size_t hidden) {
    return fits(tried, grown(shape, hidden, min_layers), budget, limits, runtime, stream);
  };
  // Bisect the hidden width: the largest that fits, within 2%.
  std::size_t lo = 1, hi = 2;
  // With a budget that holds no model at all the search would report 0 parameters as a result.
  if (trial(lo) != Bound::none)
    throw Error("--device-memory " + format_size(budget) + " holds no model under " + conf.name +
                ", not even one of hidden width 1 (buckets and working space come first); raise "
                "--device-memory");
  Bound bound = Bound::none;
  while ((bound = trial(hi)) == Bound::none) lo = hi, hi *= 2;
  while (hi - lo > std::max<std::size_t>(1, lo / 50)) {
    const std::size_t mid = (lo + hi) / 2;
    const Bound b = trial(mid);
    if (b == Bound::none) lo = mid;
    else hi = mid, bound = b;
  }
  const charlm::CharMlpShape largest = grown(shape, lo, min_layers);
  Config sized = tried;
  const charlm::CharMlp model(largest, 1, 1);
  fit_stage3_to(sized, model);
  return FitRecord{conf.name,         budget, charlm::CharMlp::parameter_count(largest), largest.layers,
                   bound_name(bound), bound == Bound::cap,
                   estimate_memory(sized, train::engine_params(model), runtime.world_size(), runtime.local_size())};
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw IoError("zest bench memory: cannot write its output", path, 0, text.size(), errno);
}

Config default_config() {
  Config c;
  c.device.memory = std::size_t{4} << 30;  // room for stage 0; the fit search sets its own budget
  c.precision.dtype = DType::bf16;
  c.optimizer.threads = 1;
  // Buckets below one layer of the default model (741 x 741 bf16 = 1.07 MiB): each reduce bucket
  // holds one layer, as in the ZeRO paper's accounting, rather than the whole small model.
  c.buckets.reduce_bytes = c.buckets.allgather_bytes = std::size_t{1} << 20;
  return c;
}

// What bench/memory_peers.py needs to train the same model on the same data as zest's rows: the
// model's shape and the optimizer's settings (model.json), every tensor's initial fp32 values in
// parameters() order (init.f32), and each step's global batch of windows (batches.i32: steps x
// global_batch x window tokens). Files are created exclusively: a directory that holds them
// already is refused, not overwritten.
void write_peer_inputs(const std::string& dir, const Config& config, const train::TrainConfig& train,
                       const charlm::TextCorpus& corpus, int steps) {
  const charlm::CharMlp model(train.model, 1, 1);
  nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
  std::vector<float> init;
  for (std::size_t t = 0; t < model.parameters().size(); ++t) {
    const charlm::ParamInfo& p = model.parameters()[t];
    tensors.push_back({{"name", p.name}, {"shape", p.shape}});
    std::vector<float> values(p.numel());
    model.init_tensor(t, 0, values, train.seed);
    init.insert(init.end(), values.begin(), values.end());
  }
  const charlm::BatchSampler sampler(corpus.tokens().size(), train.model.context, train.global_batch, train.seed);
  std::vector<charlm::Token> batches(static_cast<std::size_t>(steps) * train.global_batch * sampler.window());
  for (int step = 1; step <= steps; ++step) {
    const std::size_t at = static_cast<std::size_t>(step - 1) * train.global_batch * sampler.window();
    sampler.gather(corpus.tokens(), static_cast<std::uint64_t>(step), {0, train.global_batch},
                   std::span<charlm::Token>(batches.data() + at, train.global_batch * sampler.window()));
  }
  const auto& m = train.model;
  const auto& opt = config.optimizer;
  const nlohmann::ordered_json description = {
      {"vocab", m.vocab},
      {"context", m.context},
      {"embed", m.embed},
      {"hidden", m.hidden},
      {"layers", m.layers},
      {"activation", m.activation == charlm::Activation::gelu ? "gelu" : "tanh"},
      {"global_batch", train.global_batch},
      {"steps", steps},
      {"dtype", dtype_name(config.precision.dtype)},
      {"optimizer", opt.type == OptimizerType::adam ? "adam" : "adamw"},
      {"lr", opt.lr},
      {"beta1", opt.beta1},
      {"beta2", opt.beta2},
      {"eps", opt.eps},
      {"weight_decay", opt.weight_decay},
      {"tensors", tensors}};
  const std::string json = description.dump(2) + "\n";
  write_file_synced(join_path(dir, "model.json"), json.data(), json.size());
  write_file_synced(join_path(dir, "init.f32"), init.data(), init.size() * sizeof(float));
  write_file_synced(join_path(dir, "batches.i32"), batches.data(), batches.size() * sizeof(charlm::Token));
  std::printf("zest bench memory: wrote the peers' inputs (%zu parameters, %d steps of %zu windows) to %s\n",
              init.size(), steps, train.global_batch, dir.c_str());
}

// The rows bench/memory_peers.py measured, checked to be of this model and world size.
std::vector<MemoryRecord> read_peers(const std::string& path, std::size_t params, int ranks) {
  const std::string what = "zest bench memory: --peers " + path;
  // A results file of a few rows: anything near a MiB is not one.
  const std::string text = checkpoint::read_regular_file(path, std::size_t{1} << 20, what);
  std::vector<MemoryRecord> peers;
  try {
    const YAML::Node root = YAML::Load(text);  // JSON is YAML
    for (const YAML::Node& p : root["peers"]) {
      MemoryRecord r;
      r.name = p["name"].as<std::string>();
      r.system = p["system"].as<std::string>();
      r.error = p["error"].as<std::string>();
      r.ranks = p["ranks"].as<int>();
      r.params = p["params"].as<std::size_t>();
      if (r.error.empty()) {
        r.peak_params_bytes = p["peak_params_bytes"].as<std::size_t>();
        r.peak_grads_bytes = p["peak_grads_bytes"].as<std::size_t>();
        r.peak_optimizer_bytes = p["peak_optimizer_states_bytes"].as<std::size_t>();
        r.peak_device_bytes = p["peak_model_state_bytes"].as<std::size_t>();
        r.start_host_rss_bytes = p["start_host_rss_bytes"].as<std::size_t>();
        r.peak_host_rss_bytes = p["peak_host_rss_bytes"].as<std::size_t>();
        r.step_seconds = p["step_seconds"].as<double>();
        r.final_loss = p["final_loss"].as<double>();
      }
      if (r.ranks != ranks || r.params != params)
        throw Error(
            fmt::format("{}: '{}' ran {} parameters on {} ranks, this run has {} on {}: write the inputs and run "
                        "the peers again with the same --params and ranks",
                        what, r.name, r.params, r.ranks, params, ranks));
      peers.push_back(r);
    }
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("{} is not bench/memory_peers.py's output ({})", what, e.what()));
  }
  if (peers.empty()) throw Error(what + " holds no peer rows");
  return peers;
}

// Every row against stage 0 (zest's DDP) and, when it ran, the "torch DDP + AdamW" peer: ratios of
// memory and step time, and whether the final loss agrees. bf16/fp16 round differently per stage
// and per system; fp32 agrees to 1e-5.
constexpr double kCompactLossTolerance = 1e-2;

void compare_to_ddp(std::vector<MemoryRecord>& records, DType dtype) {
  const double tolerance = dtype == DType::f32 ? 1e-5 : 2e-3;
  const MemoryRecord ddp = records.front();
  const auto torch_ddp = std::find_if(records.begin(), records.end(), [](const MemoryRecord& r) {
    return r.name == "torch DDP + AdamW" && r.error.empty();
  });
  const std::optional<double> reference =
      torch_ddp == records.end() ? std::nullopt : std::optional(torch_ddp->final_loss);
  for (MemoryRecord& r : records) {
    if (!r.error.empty()) continue;
    r.ratio_to_ddp = static_cast<double>(r.peak_device_bytes) / static_cast<double>(ddp.peak_device_bytes);
    r.step_time_ratio_to_ddp = r.step_seconds / ddp.step_seconds;
    // Compact states remember rounded moments: the loss follows DDP's closely, not to the last bits.
    const double allowed = r.states == "fp32" ? tolerance : kCompactLossTolerance;
    r.loss_matches_ddp = std::abs(r.final_loss - ddp.final_loss) <= allowed * std::abs(ddp.final_loss);
    if (reference) {
      r.loss_difference_to_torch_ddp = std::abs(r.final_loss - *reference) / std::abs(*reference);
      r.loss_matches_torch_ddp = *r.loss_difference_to_torch_ddp <= tolerance;
    }
  }
}

}  // namespace

int bench_memory(int argc, char** argv) {
  if (args::asks_for_help(argc, argv)) return args::print_usage(kUsage);
  Options o;
  try {
    for (int i = 0; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--config") o.config_path = args::path_of(argc, argv, i);
      // Above 10^9 parameters the char MLP's shape search and a CPU run take hours, not a benchmark.
      else if (arg == "--params") o.params = args::parse_count(arg, args::value_of(argc, argv, i), 1000, 1'000'000'000);
      else if (arg == "--steps")
        o.steps = static_cast<int>(args::parse_integer(arg, args::value_of(argc, argv, i), 2, 1'000'000));
      // The built-in config's buckets and working space alone take 3MiB.
      else if (arg == "--device-memory")
        o.fit_budget =
            args::parse_size(arg, args::value_of(argc, argv, i), std::size_t{16} << 20, std::size_t{1} << 40);
      else if (arg == "--json") o.json = args::path_of(argc, argv, i);
      else if (arg == "--csv") o.csv = args::value_of(argc, argv, i);
      else if (arg == "--chart") o.chart = args::value_of(argc, argv, i);
      else if (arg == "--nvme-path") o.nvme_path = args::path_of(argc, argv, i);
      else if (arg == "--write-peer-inputs") o.write_peer_inputs = args::path_of(argc, argv, i);
      else if (arg == "--peers") o.peers = args::path_of(argc, argv, i);
      else if (arg == "--no-fit") o.fit = false;
      else if (arg == "--fit-cap")
        o.fit_cap = args::parse_count(arg, args::value_of(argc, argv, i), 1000, 100'000'000'000);
      else throw args::UsageError(std::string("invalid argument '").append(arg).append("'"));
    }
    // Every output is checked before the benchmark runs, not after.
    args::check_output_file("--json", o.json);
    args::check_output_file("--csv", o.csv);
    args::check_output_file("--chart", o.chart);
    if (!o.nvme_path.empty()) args::check_output_directory("--nvme-path", o.nvme_path);
    if (!o.write_peer_inputs.empty()) args::check_output_directory("--write-peer-inputs", o.write_peer_inputs);
  } catch (const args::UsageError& error) {
    std::fprintf(stderr, "zest bench memory: %s\n%s", error.what(), kUsage);
    return 2;
  }
  try {
    const Config config = o.config_path.empty() ? default_config() : load_config(o.config_path, {"model", "train"});
    train::TrainConfig train = o.config_path.empty() ? train::TrainConfig{} : train::load_train_config(o.config_path);
    Runtime runtime(config);
    const bool leader = runtime.rank() == 0;
    const charlm::TextCorpus corpus = charlm::TextCorpus::load(train.text);
    if (o.config_path.empty()) train.model.layers = 8;  // many layers: what stage 3 gathers one at a time
    train.model = shape_for(o.params, corpus.vocab_size(), train.model);
    if (!o.write_peer_inputs.empty()) {
      if (leader) write_peer_inputs(o.write_peer_inputs, config, train, corpus, o.steps);
      return 0;
    }
    Config tuned = config;
    fit_stage3_to(tuned, charlm::CharMlp(train.model, 1, 1));
    auto stream = runtime.device().create_stream();

    // The stages first, then the offloads. The largest-model search runs over the stages and stage
    // 3's offloads.
    std::vector<Configuration> configurations = {
        {"stage 0 (DDP)", 0},
        {"stage 1", 1},
        {"stage 2", 2},
        {"stage 3", 3},
        {"stage 1 + offload optimizer cpu", 1, OffloadDevice::cpu},
        {"stage 1 + offload optimizer nvme", 1, OffloadDevice::nvme},
        {"stage 2 + offload optimizer cpu", 2, OffloadDevice::cpu},
        {"stage 2 + offload optimizer nvme", 2, OffloadDevice::nvme},
        {"stage 3 + offload optimizer cpu", 3, OffloadDevice::cpu},
        {"stage 3 + offload optimizer nvme", 3, OffloadDevice::nvme},
        {"stage 3 + offload optimizer+param cpu", 3, OffloadDevice::cpu, OffloadDevice::cpu},
        {"stage 3 + offload optimizer+param nvme", 3, OffloadDevice::nvme, OffloadDevice::nvme},
        // Partial offload (offload.optimizer.ratio): half of the states stay on the device.
        {"stage 2 + offload optimizer cpu ratio 0.5", 2, OffloadDevice::cpu, OffloadDevice::none, 0.5},
        {"stage 2 + offload optimizer nvme ratio 0.5", 2, OffloadDevice::nvme, OffloadDevice::none, 0.5},
        // Compact optimizer states (optimizer.states): 8 and about 6 bytes per parameter, not 12.
        {"stage 1 states bf16", 1, OffloadDevice::none, OffloadDevice::none, 1, StatesFormat::bf16},
        {"stage 1 states int8", 1, OffloadDevice::none, OffloadDevice::none, 1, StatesFormat::int8},
        {"stage 2 + offload optimizer cpu states int8", 2, OffloadDevice::cpu, OffloadDevice::none, 1,
         StatesFormat::int8},
        // ... and a bf16 master (optimizer.master): 4.125 bytes per parameter.
        {"stage 1 states int8 + bf16 master", 1, OffloadDevice::none, OffloadDevice::none, 1, StatesFormat::int8,
         DType::bf16},
        // A secondary partition (partition.secondary: host, hpZ): 1/R of the gathered parameters more.
        {"stage 3 + secondary partition host", 3, OffloadDevice::none, OffloadDevice::none, 1, StatesFormat::f32,
         DType::f32, true}};
    // A bf16 master needs 16-bit parameters (the config says why): not with an fp32 --config.
    if (config.precision.dtype == DType::f32)
      std::erase_if(configurations, [](const Configuration& c) { return c.master == DType::bf16; });
    const std::vector<std::size_t> searched = {0, 1, 2, 3, 8, 9, 10, 11};  // ... and stage 3's offloads
    const SwapDirectory swap(o.nvme_path);
    Progress progress(leader, static_cast<int>(configurations.size() + (o.fit ? searched.size() : 0)));
    int done = 0;
    std::vector<MemoryRecord> records;
    for (const Configuration& conf : configurations) {
      progress.show(done++, "training " + conf.name);
      records.push_back(measure(conf, tuned, train, corpus, runtime, *stream, o.steps, swap.path()));
    }
    if (!o.peers.empty()) {
      const std::vector<MemoryRecord> peers = read_peers(o.peers, records.front().params, runtime.world_size());
      records.insert(records.end(), peers.begin(), peers.end());
    }
    compare_to_ddp(records, config.precision.dtype);
    std::vector<FitRecord> fit_records;
    const HostLimits limits = host_limits(swap.path(), runtime.local_size(), o.fit_cap);
    if (o.fit) {
      for (const std::size_t i : searched) {
        const Configuration& conf = configurations[i];
        progress.show(done++, "largest model for " + conf.name);
        fit_records.push_back(
            largest_fit(conf, tuned, train.model, o.fit_budget, limits, swap.path(), runtime, *stream));
      }
    }
    progress.show(done, "done");
    if (leader) {
      std::printf("\nzest bench memory: %zu parameters (char MLP, %zu layers of %zu), %s, %d rank(s), %d steps "
                  "each; stage 3 prefetches 1 layer and keeps at most 3 gathered\n\n",
                  records.front().params, train.model.layers, train.model.hidden,
                  std::string(dtype_name(config.precision.dtype)).c_str(), runtime.world_size(), o.steps);
      std::printf("%s%s%s%s", bench::format_table(records).c_str(), bench::format_host_table(records).c_str(),
                  bench::format_wire_table(records).c_str(), bench::format_fit_table(fit_records).c_str());
      write_file(o.json, bench::to_json(records, fit_records));
      write_file(o.csv, bench::to_csv(records));
      write_file(o.chart, bench::to_svg(records, fit_records));
      std::printf("\nwrote %s, %s and the chart %s\n", o.json.c_str(), o.csv.c_str(), o.chart.c_str());
    }
    return 0;
  } catch (const ConfigError& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 2;
  } catch (const Error& error) {
    std::fprintf(stderr, "zest bench memory: %s\n", error.what());
    return 1;
  }
}

}  // namespace zest::cli
