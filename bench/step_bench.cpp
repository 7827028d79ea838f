// zest bench step: the offloaded Adam step with the optimizer states on NVMe, against the limit the
// disk sets. One step reads every sub-group's fp32 master, m and v from the swap file and writes
// them back (EngineStats::nvme_bytes each way); at the store's measured bandwidths that takes
// nvme_bytes / read_bw + nvme_bytes / write_bw, and the step can be no faster unless the Adam
// compute and the transfers overlap perfectly and reads and writes share the disk for free. The
// ratio limit / measured step time says how much of the step is the disk (target >= 0.85: the
// compute hides behind the I/O). Resident memory is reported to show that the host holds only the
// configured sub-group slots, not the states. --optimizer-on-device keeps the states on the device
// instead (no disk), so that what is left of step() is the Adam math and the parameter all-gather.
//
// --update-ahead measures offload.optimizer.update_ahead (the offloaded states updated during
// backward, as each group's gradient shard is reduced, so that step() only commits): two engines
// with the same config, weights and gradients but that key, today's pipeline (false) and the one
// that updates ahead (true), step in turn. What counts is the step time backward does not hide,
// from the last grads_ready() to step()'s return: the exposed step. The backward stand-in sleeps
// between groups (--backward seconds in all; auto: as long as today's warm-up step), the device
// busy with the next layer while the host and the disk are free. Goal: ahead / today <= 0.25 when
// backward lasts at least as long as the step's I/O. The two engines' parameters must stay
// bit-identical: updating ahead may never change results.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "args/args.hpp"
#include "base/trace.hpp"
#include "bench_commands.hpp"
#include "runtime/host/half.hpp"
#include "runtime/host/thread_binding.hpp"
#include "zest/trace.hpp"
#include "store_bandwidth.hpp"
#include "zest/zest.hpp"

namespace zest::cli {
namespace {

constexpr const char* kUsage =
    "usage: zest bench step --path DIR [--params N] [--steps N] [--dtype bf16|fp16|fp32]\n"
    "                       [--sub-group SIZE] [--buffers N] [--groups N] [--device-memory SIZE]\n"
    "                       [--io-size GiB] [--reps N] [--bucket SIZE] [--allgather SIZE]\n"
    "                       [--optimizer-on-device | --optimizer-on-host] [--placement rank|shared]\n"
    "                       [--update-ahead] [--backward SECONDS|auto] [--no-set-param] [--json] [--trace FILE]\n"
    "                       [--states LIST]\n"
    "  A world of one (or every rank under mpirun) builds an Engine on the cpu device (stage 2) with\n"
    "  offload.optimizer.device nvme in DIR, --params parameters (default 2e8) in --groups equal\n"
    "  groups (default 64), and times --steps (default 3) optimizer steps; the NvmeStore's sequential\n"
    "  bandwidth is measured in DIR first (--io-size GiB, default 4, --reps 3; every rank at once);\n"
    "  rank 0 reports its own figures. DIR needs the states (12 bytes per parameter) plus --io-size\n"
    "  free. --no-set-param leaves the weights zero (set_param with offloaded states rewrites a whole\n"
    "  sub-group per 1M-value chunk: minutes at 2e9). Defaults: bf16, the config's sub-group (256MiB)\n"
    "  and buffer count (4); the device budget fits params and grads. --bucket sets buckets.reduce\n"
    "  (default 25MiB; 1 reduces one group per collective); the backward stand-in (gradient writes\n"
    "  and their reductions) is timed per step next to step(). --allgather sets buckets.allgather (default\n"
    "  25MiB; 1 all-gathers one group per collective after the step). --optimizer-on-device keeps the\n"
    "  optimizer states on the device (no --path, no disk figures): step() is then the Adam math and the\n"
    "  parameter all-gather. --optimizer-on-host keeps them in pinned host memory (offload.optimizer.device\n"
    "  cpu, no --path): step() is then the CPU Adam on the host states. --placement shared runs the\n"
    "  rank's host threads as zest did before each rank had its own cpus (every rank's CPU Adam on the\n"
    "  machine's first cpu, cores / ranks threads each), to compare with the default, rank.\n"
    "  --backward SECONDS makes the backward stand-in last that long: it sleeps SECONDS / groups after\n"
    "  each group but the last (default 0). --update-ahead builds two engines,\n"
    "  offload.optimizer.update_ahead false (today) and true (ahead), in DIR/zest-bench-today and\n"
    "  DIR/zest-bench-update-ahead (made and removed by the run; it refuses to start if either exists),\n"
    "  or with --optimizer-on-host, not with --optimizer-on-device. After a warm-up step each they step\n"
    "  in turn, and the run reports the exposed step (from the last grads_ready() to step()'s return) of\n"
    "  each, their ratio (goal <= 0.25) and whether their parameters stayed bit-identical (exit 1 if\n"
    "  not). --backward defaults to auto there: as long as today's warm-up step. The two engines share\n"
    "  the device budget (--device-memory).\n"
    "  --trace FILE writes a Chrome trace (chrome://tracing, ui.perfetto.dev) of every rank's timed steps,\n"
    "  warm-up included, to FILE, a new file (an existing one is refused before any work).\n"
    "  --states LIST: optimizer.states, one or several of fp32, bf16, int8 separated by commas (default\n"
    "  fp32). Several build one engine each in turn, after the one bandwidth measurement, and report\n"
    "  each format's step, bytes per parameter moved per step and ratio to its disk bound side by side,\n"
    "  with the speed-up over the first (not with --update-ahead or --trace).\n";

struct Options {
  std::string path;
  std::size_t params = 200'000'000;
  int steps = 3;
  DType dtype = DType::bf16;
  std::size_t sub_group = 0;  // 0: the config default
  int buffers = 0;            // 0: the config default
  int groups = 64;
  std::size_t device_memory = 0;  // 0: fitted to params and grads
  std::size_t bucket = 0;         // buckets.reduce; 0: the config default
  std::size_t allgather = 0;      // buckets.allgather; 0: the config default
  bool on_device = false;         // optimizer states on the device: no NVMe
  bool on_host = false;           // optimizer states in pinned host memory: no NVMe
  bool shared_placement = false;  // the placement before each rank had its own cpus
  double io_gib = 4.0;
  int reps = 3;
  bool set_param = true;
  bool json = false;
  bool update_ahead = false;       // two engines: offload.optimizer.update_ahead false and true
  std::optional<double> backward;  // the stand-in's seconds; unset: auto (--update-ahead) or 0
  std::string trace;               // --trace FILE; empty: none
  std::vector<StatesFormat> states{StatesFormat::f32};  // --states: one engine each
};

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// VmRSS or VmHWM of this process from /proc/self/status, in bytes (0 where unavailable).
std::size_t proc_status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0)
      return static_cast<std::size_t>(std::strtoull(line.c_str() + key.size() + 1, nullptr, 10)) * 1024;
  }
  return 0;
}

double median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one.append(" ").append(five).append(" ").append(fifteen);
}

// Small, nonzero, varying weights: enough that Adam's update is not the trivial one.
void fill_weights(std::vector<float>& values, std::size_t first) {
  for (std::size_t i = 0; i < values.size(); ++i)
    values[i] = static_cast<float>(static_cast<int>((first + i) % 2001) - 1000) * 1e-5f;
}

// Overwrites a gradient of `count` elements with `value` in dtype: the stand-in for backward.
void fill_grad(void* grad, std::size_t count, DType dtype, float value) {
  if (dtype == DType::f32) {
    std::fill_n(static_cast<float*>(grad), count, value);
  } else {
    const std::uint16_t bits = dtype == DType::bf16 ? float_to_bf16(value) : float_to_fp16(value);
    std::fill_n(static_cast<std::uint16_t*>(grad), count, bits);
  }
}

// One result as a JSON object of its own (several follow one another for --states a,b): a path
// that is not UTF-8 is replaced, not a reason to lose the figures.
void print_json(const nlohmann::ordered_json& out) {
  std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
}

// Builds an engine and, unless --no-set-param, sets its weights; records the seconds each took.
std::unique_ptr<Engine> build_engine(const Config& config, Runtime& runtime, const std::vector<ParamSpec>& specs,
                                     bool set_param, double& setup_seconds, double& set_param_seconds) {
  runtime.comm().barrier();
  auto start = Clock::now();
  auto engine = std::make_unique<Engine>(config, runtime.device(), runtime.comm(), specs);
  setup_seconds = seconds_since(start);
  set_param_seconds = 0;
  if (set_param) {
    start = Clock::now();
    std::vector<float> values;
    std::size_t first = 0;
    for (std::size_t t = 0; t < engine->tensor_count(); ++t) {
      values.resize(engine->spec(t).numel());
      fill_weights(values, first);
      first += values.size();
      engine->set_param(t, values);
    }
    set_param_seconds = seconds_since(start);
  }
  return engine;
}

struct StepTiming {
  double backward = 0;  // the stand-in, to the return of the last grads_ready()
  double exposed = 0;   // from there to step()'s return: what the step adds to an iteration
  double step = 0;      // step() alone
  StepResult result;
};

// One iteration on `engine`: backward's stand-in, then step(). The stand-in writes every gradient
// once, through the leases, in backward order, the value set by `step` alone (so that two engines
// given the same steps see the same gradients); after each group's grads_ready() but the last it
// sleeps backward / groups seconds: the device computing the next group's gradients while the host
// and the disk are free, which is when an engine that updates ahead works. Backward ends when the last
// group is handed over.
StepTiming timed_step(Engine& engine, Communicator& comm, DType dtype, int step, double backward) {
  const float grad = 1e-3f * static_cast<float>(engine.loss_scale()) * static_cast<float>(step + 1);
  const std::chrono::duration<double> pause(backward / engine.group_count());
  StepTiming timing;
  const auto start = Clock::now();
  trace::Span backward_span("backward stand-in", trace::Lane::backward, step);
  for (int g = engine.group_count() - 1; g >= 0; --g) {
    {
      const trace::Span span("gradient hand-off", trace::Lane::backward, g);
      auto lease = engine.acquire(g);
      for (std::size_t t = 0; t < engine.tensor_count(); ++t)
        if (engine.spec(t).group == g) fill_grad(lease.grad(t).data, engine.spec(t).numel(), dtype, grad);
      engine.grads_ready(g);
    }
    if (g > 0 && backward > 0) std::this_thread::sleep_for(pause);
  }
  backward_span.end();
  const auto backward_end = Clock::now();
  timing.backward = std::chrono::duration<double>(backward_end - start).count();
  comm.barrier();
  const auto step_start = Clock::now();
  timing.result = engine.step();
  timing.step = seconds_since(step_start);
  timing.exposed = seconds_since(backward_end);
  if (timing.result.skipped)
    throw Error(fmt::format("step {} was skipped (overflow); the benchmark's gradients must be finite", step + 1));
  return timing;
}

// "fp32,int8" -> {f32, int8}; each name once.
std::vector<StatesFormat> parse_states(std::string_view list) {
  std::vector<StatesFormat> formats;
  for (std::size_t at = 0; at <= list.size();) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const StatesFormat format = args::parse_states_format("--states", list.substr(at, comma - at));
    if (std::find(formats.begin(), formats.end(), format) != formats.end())
      throw args::UsageError(std::string("--states: '").append(states_format_name(format)).append("' is listed twice"));
    formats.push_back(format);
    at = comma + 1;
  }
  return formats;
}

int parse(int argc, char** argv, Options& o) {
  constexpr std::size_t kGiB = std::size_t{1} << 30;
  bool backward_auto = false;  // auto given: it needs --update-ahead
  try {
    for (int i = 0; i < argc; ++i) {
      const std::string_view arg = argv[i];
      const auto value = [&] { return args::value_of(argc, argv, i); };
      const auto count = [&](long long lo, long long hi) {
        return static_cast<int>(args::parse_integer(arg, value(), lo, hi));
      };
      if (arg == "--json") o.json = true;
      else if (arg == "--optimizer-on-device") o.on_device = true;
      else if (arg == "--optimizer-on-host") o.on_host = true;
      else if (arg == "--placement") {
        const std::string_view p = value();
        if (p != "rank" && p != "shared")
          throw args::UsageError(std::string("--placement: expected rank or shared, found '").append(p).append("'"));
        o.shared_placement = p == "shared";
      }
      else if (arg == "--no-set-param") o.set_param = false;
      else if (arg == "--update-ahead") o.update_ahead = true;
      else if (arg == "--backward") {
        const std::string_view b = value();
        o.backward = b == "auto" ? std::nullopt : std::optional(args::parse_number(arg, b, 0, 1e6));
        backward_auto = b == "auto";
      }
      else if (arg == "--path") o.path = args::path_of(argc, argv, i);
      else if (arg == "--trace") o.trace = args::path_of(argc, argv, i);
      else if (arg == "--params") o.params = args::parse_count(arg, value(), 1, 1'000'000'000'000);
      else if (arg == "--steps") o.steps = count(1, 1'000'000);
      else if (arg == "--groups") o.groups = count(1, 1'000'000);
      else if (arg == "--buffers") o.buffers = count(2, 64);  // offload.optimizer.buffer_count's range
      else if (arg == "--reps") o.reps = count(1, 1000);
      else if (arg == "--io-size") o.io_gib = args::parse_number(arg, value(), 0.001, 16384);
      else if (arg == "--sub-group")
        o.sub_group = args::parse_size(arg, value(), 768, 64 * kGiB);  // offload.sub_group's floor
      else if (arg == "--device-memory") o.device_memory = args::parse_size(arg, value(), 16 << 20, 16384 * kGiB);
      else if (arg == "--bucket") o.bucket = args::parse_size(arg, value(), 4, 64 * kGiB);  // the buckets' floor
      else if (arg == "--allgather") o.allgather = args::parse_size(arg, value(), 4, 64 * kGiB);
      else if (arg == "--states") o.states = parse_states(value());
      else if (arg == "--dtype") {
        const std::string_view d = value();
        if (d == "bf16") o.dtype = DType::bf16;
        else if (d == "fp16") o.dtype = DType::f16;
        else if (d == "fp32") o.dtype = DType::f32;
        else throw args::UsageError(std::string("--dtype: expected bf16, fp16 or fp32, found '").append(d).append("'"));
      } else {
        throw args::UsageError(std::string("unexpected argument '").append(arg).append("'"));
      }
    }
    if (o.on_device && o.on_host)
      throw args::UsageError("--optimizer-on-device and --optimizer-on-host exclude each other");
    if (o.update_ahead && o.on_device)
      throw args::UsageError("--update-ahead needs the whole optimizer offloaded: not with --optimizer-on-device");
    if (backward_auto && !o.update_ahead)
      throw args::UsageError("--backward auto (as long as today's warm-up step) needs --update-ahead; give seconds");
    if (o.states.size() > 1 && (o.update_ahead || !o.trace.empty()))
      throw args::UsageError("--states with several formats measures plain steps: not with --update-ahead or --trace");
    if (o.path.empty() && !o.on_device && !o.on_host) throw args::UsageError("--path DIR is required");
    if (!o.on_device && !o.on_host) args::check_output_directory("--path", o.path);
  } catch (const args::UsageError& error) {
    std::fprintf(stderr, "zest bench step: %s\n%s", error.what(), kUsage);
    return 2;
  }
  if (static_cast<std::size_t>(o.groups) > o.params) o.groups = static_cast<int>(o.params);
  return 0;
}

// A directory this run makes for one engine's swap file (each engine's NVMe store makes a directory
// of its own inside it; one each keeps the two engines' disk traffic apart in the figures). One
// that exists is refused, not reused: the bench removes only what it made. The guard removes it if
// it is still empty (rmdir removes nothing else); remove() does so now and says when it could not.
class ScratchDirectory {
 public:
  ScratchDirectory() = default;
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  ~ScratchDirectory() {
    if (!path_.empty()) ::rmdir(path_.c_str());
  }

  void make(const std::string& path) {
    if (::mkdir(path.c_str(), 0777) != 0) {
      std::string message = path;
      if (errno == EEXIST)
        throw Error(
            message.append(" exists (left by an earlier run?): --update-ahead makes its own directory for each "
                           "engine's swap file and uses no other; remove it or give another --path"));
      throw Error(fmt::format("{}: cannot make the directory ({})", message, std::strerror(errno)));
    }
    path_ = path;
  }

  void remove() {
    if (path_.empty()) return;
    const std::string path = std::exchange(path_, std::string());
    if (::rmdir(path.c_str()) != 0)
      throw Error(
          fmt::format("cannot remove {} ({}), which this run made for a swap file", path, std::strerror(errno)));
  }

 private:
  std::string path_;  // empty: nothing made, or removed already
};

// One engine's share of an --update-ahead run: its setup and the counted steps.
struct EngineRun {
  double setup_seconds = 0, set_param_seconds = 0;
  std::vector<double> backward, exposed, step;  // one a counted step
  StepResult last;
  EngineStats stats;

  void add(const StepTiming& timing) {
    backward.push_back(timing.backward);
    exposed.push_back(timing.exposed);
    step.push_back(timing.step);
    last = timing.result;
  }
};

struct UpdateAheadRun {
  double backward = 0;  // the stand-in's seconds, auto resolved
  EngineRun today, ahead;
  std::string difference;  // the first tensor whose parameters differ; empty: bit-identical
  std::size_t numel = 0;
  int groups = 0;
};

// The first tensor whose fp32 master weights differ, bit for bit, between two engines; empty when
// none does. Collective (get_param); every rank gets the same answer.
std::string first_difference(Engine& a, Engine& b) {
  std::vector<float> x, y;
  for (std::size_t t = 0; t < a.tensor_count(); ++t) {
    x.resize(a.spec(t).numel());
    y.resize(x.size());
    a.get_param(t, x);
    b.get_param(t, y);
    if (std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0) return a.spec(t).name;
  }
  return {};
}

// The --update-ahead run: both engines built, a warm-up step each, then --steps steps in turn. The
// engines are gone when it returns (their swap files with them).
UpdateAheadRun run_update_ahead(const Options& o, const Config& today_config, const Config& ahead_config,
                                Runtime& runtime, const std::vector<ParamSpec>& specs, TraceFile* trace_file) {
  Communicator& comm = runtime.comm();
  UpdateAheadRun run;
  const auto today = build_engine(today_config, runtime, specs, o.set_param, run.today.setup_seconds,
                                  run.today.set_param_seconds);
  const auto ahead =
      build_engine(ahead_config, runtime, specs, o.set_param, run.ahead.setup_seconds, run.ahead.set_param_seconds);
  if (trace_file) trace_file->restart();
  // Warm-up, not counted. With auto, today's runs without the sleeps and its step() sets the
  // backward of every later step (the slowest rank's, so that every rank sleeps alike).
  double warm[] = {timed_step(*today, comm, o.dtype, 0, o.backward.value_or(0)).step};
  comm.all_reduce_host(warm, ReduceOp::max);
  run.backward = o.backward.value_or(warm[0]);
  timed_step(*ahead, comm, o.dtype, 0, run.backward);
  // In turn, so that a busy disk or machine slows both alike.
  for (int step = 1; step <= o.steps; ++step) {
    run.today.add(timed_step(*today, comm, o.dtype, step, run.backward));
    run.ahead.add(timed_step(*ahead, comm, o.dtype, step, run.backward));
  }
  if (trace_file) trace_file->write();
  run.difference = first_difference(*today, *ahead);
  run.today.stats = today->stats();
  run.ahead.stats = ahead->stats();
  run.numel = today->numel();
  run.groups = today->group_count();
  return run;
}

// Rank 0's report of an --update-ahead run; `config` is today's engine's.
void report_update_ahead(const Options& o, const Config& config, const bench::StoreBandwidth& bw,
                         const UpdateAheadRun& run, int ranks, const HostMemoryStats& pinned,
                         const std::string& load_before) {
  const bool nvme = !o.on_host;
  const EngineRun &today = run.today, &ahead = run.ahead;
  const double exposed_today = median(today.exposed), exposed_ahead = median(ahead.exposed);
  const double exposed_ratio = exposed_ahead / exposed_today;
  // Today's pipeline reads and writes every sub-group's region once a step.
  const auto state_bytes = static_cast<double>(today.stats.nvme_bytes);
  const double limit = nvme ? state_bytes / bw.read_bytes_per_s + state_bytes / bw.write_bytes_per_s : 0.0;
  const std::size_t rss = proc_status_bytes("VmRSS"), hwm = proc_status_bytes("VmHWM");
  const std::string load_after = load_average();
  const char* placement = o.shared_placement ? "shared" : "rank";
  const std::string dtype(dtype_name(o.dtype));
  const bool identical = run.difference.empty();
  if (o.json) {
    nlohmann::ordered_json out = {{"update_ahead", true},
                                  {"params", run.numel},
                                  {"groups", run.groups},
                                  {"dtype", dtype},
                                  {"ranks", ranks},
                                  {"steps", o.steps},
                                  {"path", o.path},
                                  {"sub_group_bytes", config.offload.sub_group_bytes},
                                  {"buffers", config.offload.optimizer.buffer_count},
                                  {"reduce_bucket_bytes", config.buckets.reduce_bytes},
                                  {"allgather_bucket_bytes", config.buckets.allgather_bytes},
                                  {"optimizer_on_device", false},
                                  {"optimizer_on_host", o.on_host},
                                  {"placement", placement},
                                  {"adam_threads", config.optimizer.threads},
                                  {"backward_seconds", run.backward},
                                  {"backward_measured_seconds_today", median(today.backward)},
                                  {"backward_measured_seconds_update_ahead", median(ahead.backward)},
                                  {"step_seconds_today", median(today.step)},
                                  {"step_seconds_update_ahead", median(ahead.step)},
                                  {"exposed_seconds_today", exposed_today},
                                  {"exposed_seconds_update_ahead", exposed_ahead},
                                  {"exposed_samples_today", today.exposed},
                                  {"exposed_samples_update_ahead", ahead.exposed},
                                  {"exposed_ratio", exposed_ratio},
                                  {"target_exposed_ratio", 0.25},
                                  {"identical", identical},
                                  {"setup_seconds", today.setup_seconds},
                                  {"set_param_seconds", today.set_param_seconds},
                                  {"grad_norm", today.last.grad_norm},
                                  {"nvme_bytes", today.stats.nvme_bytes},
                                  {"nvme_bytes_update_ahead", ahead.stats.nvme_bytes},
                                  {"offload_pinned_bytes", today.stats.offload_pinned_bytes},
                                  {"offload_pinned_bytes_update_ahead", ahead.stats.offload_pinned_bytes}};
    if (nvme) {
      out["direct"] = bw.direct;
      out["bytes_read_per_step"] = out["bytes_written_per_step"] = today.stats.nvme_bytes;
      out["write_bytes_per_s"] = bw.write_bytes_per_s;
      out["read_bytes_per_s"] = bw.read_bytes_per_s;
      out["bandwidth_sample_bytes"] = bw.bytes;
      out["disk_bound_seconds"] = limit;
    }
    out["rss_bytes"] = rss;
    out["peak_rss_bytes"] = hwm;
    out["pinned_peak_bytes"] = pinned.peak;
    out["device_budget_bytes"] = config.device.memory;
    out["loadavg_before"] = load_before;
    out["loadavg_after"] = load_after;
    print_json(out);
    return;
  }
  const auto gb = [](double bytes) { return bytes / 1e9; };
  const std::string states =
      nvme ? std::string("on NVMe in ").append(o.path).append(bw.direct ? " (O_DIRECT)" : " (buffered)")
           : std::string("in pinned host memory");
  std::printf("zest bench step --update-ahead: %zu params (%s, %d groups), %d rank(s), states %s, placement %s\n",
              run.numel, dtype.c_str(), run.groups, ranks, states.c_str(), placement);
  std::printf(
      "  engines today (update_ahead false) and ahead (true) built in %.1f + %.1f s, weights set in %.1f + %.1f s%s\n",
      today.setup_seconds, ahead.setup_seconds, today.set_param_seconds, ahead.set_param_seconds,
      o.set_param ? "" : " (left zero: --no-set-param)");
  if (nvme)
    std::printf(
        "  store write %.3f GB/s, read %.3f GB/s: today's %.2f GB read + written per step -> disk-bound %.3f s\n",
        gb(bw.write_bytes_per_s), gb(bw.read_bytes_per_s), gb(state_bytes), limit);
  std::printf("  backward stand-in %.4f s (%s) over %d groups; measured median today %.4f s, ahead %.4f s\n",
              run.backward, o.backward ? "--backward" : "auto: today's warm-up step()", run.groups,
              median(today.backward), median(ahead.backward));
  std::printf("  step() median of %d: today %.4f s, ahead %.4f s\n", o.steps, median(today.step), median(ahead.step));
  std::printf("  exposed step (last grads_ready() to step()'s return) median: today %.4f s, ahead %.4f s\n"
              "  -> ratio %.3f (goal <= 0.25 when backward lasts at least as long as the step's I/O)\n",
              exposed_today, exposed_ahead, exposed_ratio);
  if (identical) std::printf("  parameters after the steps: bit-identical\n");
  else std::printf("  parameters after the steps: DIFFER, first in %s\n", run.difference.c_str());
  if (nvme)
    std::printf("  states on disk: today %.2f GB, ahead %.2f GB\n", gb(state_bytes),
                gb(static_cast<double>(ahead.stats.nvme_bytes)));
  std::printf("  pinned for offload: today %.2f GB, ahead %.2f GB\n",
              gb(static_cast<double>(today.stats.offload_pinned_bytes)),
              gb(static_cast<double>(ahead.stats.offload_pinned_bytes)));
  std::printf("  resident: %.2f GB now, %.2f GB peak; pinned peak %.2f GB\n", gb(static_cast<double>(rss)),
              gb(static_cast<double>(hwm)), gb(static_cast<double>(pinned.peak)));
  std::printf("  load average before %s, after %s\n", load_before.c_str(), load_after.c_str());
}
// One format's engine (optimizer.states), its timed steps and what the report needs.
struct FormatRun {
  StatesFormat format = StatesFormat::f32;
  Config config;
  std::size_t numel = 0;
  int groups = 0;
  EngineStats stats;
  StepResult last;
  std::vector<double> step_seconds;
  double step_median = 0, backward_median = 0, total_median = 0;
  double setup_seconds = 0, set_param_seconds = 0, grad_seconds = 0;
  double limit = 0;  // the disk-bound step, 0 without NVMe
  std::size_t rss = 0, hwm = 0, pinned_peak = 0;
};

FormatRun run_format(const Options& o, const Config& config, Runtime& runtime, const std::vector<ParamSpec>& specs,
                     const bench::StoreBandwidth& bw, TraceFile* trace_file) {
  FormatRun run;
  run.format = config.optimizer.states;
  run.config = config;
  const auto engine_owner = build_engine(config, runtime, specs, o.set_param, run.setup_seconds, run.set_param_seconds);
  Engine& engine = *engine_owner;
  if (trace_file) trace_file->restart();
  std::vector<double> backward_seconds, total_seconds;
  for (int step = 0; step < o.steps; ++step) {
    const StepTiming timing = timed_step(engine, runtime.comm(), o.dtype, step, o.backward.value_or(0));
    backward_seconds.push_back(timing.backward);
    run.grad_seconds += timing.backward;
    run.step_seconds.push_back(timing.step);
    total_seconds.push_back(timing.backward + timing.step);
    run.last = timing.result;
  }
  if (trace_file) trace_file->write();
  run.numel = engine.numel();
  run.groups = engine.group_count();
  run.stats = engine.stats();
  run.step_median = median(run.step_seconds);
  run.backward_median = median(backward_seconds);
  run.total_median = median(total_seconds);
  // Each step reads every sub-group's region once and writes it back once.
  const auto moved = static_cast<double>(run.stats.nvme_bytes);
  run.limit = o.on_device || o.on_host ? 0.0 : moved / bw.read_bytes_per_s + moved / bw.write_bytes_per_s;
  run.rss = proc_status_bytes("VmRSS");
  run.hwm = proc_status_bytes("VmHWM");
  run.pinned_peak = runtime.device().pinned_stats().peak;
  return run;
}

// One format's figures (text or a JSON line); `first`: the run the speed-up is against.
void report_format(const Options& o, const FormatRun& r, const FormatRun& first, const bench::StoreBandwidth& bw,
                   int ranks, const std::string& load_before, const std::string& load_after) {
  const Config& config = r.config;
  const EngineStats& stats = r.stats;
  const double ratio = r.limit / r.step_median;
  const std::string states(states_format_name(r.format));
  // Disk bytes per parameter per step, read + written (this rank's shard of the parameters).
  const double shard_params = static_cast<double>(r.numel) / ranks;
  const double disk_bytes_per_param = 2.0 * static_cast<double>(stats.nvme_bytes) / shard_params;
  const double speedup = first.step_median / r.step_median;
  const char* placement = o.shared_placement ? "shared" : "rank";
  if (o.json) {
    const nlohmann::ordered_json out = {{"params", r.numel},
                                        {"groups", r.groups},
                                        {"dtype", dtype_name(o.dtype)},
                                        {"states", states},
                                        {"ranks", ranks},
                                        {"steps", o.steps},
                                        {"path", o.path},
                                        {"sub_group_bytes", config.offload.sub_group_bytes},
                                        {"buffers", config.offload.optimizer.buffer_count},
                                        {"direct", bw.direct},
                                        {"reduce_bucket_bytes", config.buckets.reduce_bytes},
                                        {"allgather_bucket_bytes", config.buckets.allgather_bytes},
                                        {"optimizer_on_device", o.on_device},
                                        {"optimizer_on_host", o.on_host},
                                        {"placement", placement},
                                        {"adam_threads", config.optimizer.threads},
                                        {"backward_seconds", r.backward_median},
                                        {"backward_plus_step_seconds", r.total_median},
                                        {"step_seconds", r.step_median},
                                        {"step_samples", r.step_seconds},
                                        {"setup_seconds", r.setup_seconds},
                                        {"set_param_seconds", r.set_param_seconds},
                                        {"grad_write_seconds", r.grad_seconds},
                                        {"grad_norm", r.last.grad_norm},
                                        {"nvme_bytes", stats.nvme_bytes},
                                        {"bytes_read_per_step", stats.nvme_bytes},
                                        {"bytes_written_per_step", stats.nvme_bytes},
                                        {"disk_bytes_per_param_per_step", disk_bytes_per_param},
                                        {"speedup_over_" + std::string(states_format_name(first.format)), speedup},
                                        {"write_bytes_per_s", bw.write_bytes_per_s},
                                        {"read_bytes_per_s", bw.read_bytes_per_s},
                                        {"bandwidth_sample_bytes", bw.bytes},
                                        {"disk_bound_seconds", r.limit},
                                        {"ratio", ratio},
                                        {"target_ratio", 0.85},
                                        {"rss_bytes", r.rss},
                                        {"peak_rss_bytes", r.hwm},
                                        {"offload_pinned_bytes", stats.offload_pinned_bytes},
                                        {"pinned_peak_bytes", r.pinned_peak},
                                        {"device_budget_bytes", config.device.memory},
                                        {"loadavg_before", load_before},
                                        {"loadavg_after", load_after}};
    print_json(out);
    return;
  }
  const auto gb = [](double bytes) { return bytes / 1e9; };
  if (o.on_device || o.on_host) {
    std::printf("zest bench step: %zu params (%s, %d groups), %d rank(s), %s states %s, placement %s\n", r.numel,
                std::string(dtype_name(o.dtype)).c_str(), r.groups, ranks, states.c_str(),
                o.on_host ? "in pinned host memory" : "on the device", placement);
    std::printf("  engine built in %.1f s, weights set in %.1f s%s\n", r.setup_seconds, r.set_param_seconds,
                o.set_param ? "" : " (left zero: --no-set-param)");
    std::printf("  step() median of %d: %.4f s\n", o.steps, r.step_median);
  } else {
    std::printf("zest bench step: %zu params (%s, %d groups), %d rank(s), %s states on NVMe in %s (%s)\n", r.numel,
                std::string(dtype_name(o.dtype)).c_str(), r.groups, ranks, states.c_str(), o.path.c_str(),
                bw.direct ? "O_DIRECT" : "buffered");
    std::printf("  sub-group %s, %d buffers; engine built in %.1f s, weights set in %.1f s%s\n",
                format_size(config.offload.sub_group_bytes).c_str(), config.offload.optimizer.buffer_count,
                r.setup_seconds, r.set_param_seconds, o.set_param ? "" : " (left zero: --no-set-param)");
    std::printf("  store bandwidth (median of %d over %.2f GB): write %.3f GB/s, read %.3f GB/s\n", o.reps,
                gb(static_cast<double>(bw.bytes)), gb(bw.write_bytes_per_s), gb(bw.read_bytes_per_s));
    std::printf("  per step: %.2f GB read + %.2f GB written (%.2f bytes per parameter) -> disk-bound limit %.3f s\n",
                gb(static_cast<double>(stats.nvme_bytes)), gb(static_cast<double>(stats.nvme_bytes)),
                disk_bytes_per_param, r.limit);
    std::printf("  step() median of %d: %.3f s -> ratio %.3f (target >= 0.85)\n", o.steps, r.step_median, ratio);
  }
  if (&r != &first)
    std::printf("  %s states: %.2fx the step of %s states\n", states.c_str(), speedup,
                std::string(states_format_name(first.format)).c_str());
  std::printf("  buckets.allgather %s\n", format_size(config.buckets.allgather_bytes).c_str());
  std::printf("  buckets.reduce %s: backward (gradient writes, reductions launched) median %.4f s, backward + step()\n"
              "  median %.4f s\n", format_size(config.buckets.reduce_bytes).c_str(), r.backward_median, r.total_median);
  std::printf("  resident: %.2f GB now, %.2f GB peak (states on disk: %.2f GB); pinned %.2f GB (offload %.2f GB)\n",
              gb(static_cast<double>(r.rss)), gb(static_cast<double>(r.hwm)), gb(static_cast<double>(stats.nvme_bytes)),
              gb(static_cast<double>(r.pinned_peak)), gb(static_cast<double>(stats.offload_pinned_bytes)));
  std::printf("  load average before %s, after %s\n", load_before.c_str(), load_after.c_str());
}


}  // namespace

int bench_step(int argc, char** argv) {
  if (args::asks_for_help(argc, argv)) return args::print_usage(kUsage);
  Options o;
  if (const int rc = parse(argc, argv, o); rc != 0) return rc;
  try {
    Config config;
    config.stage = 2;
    config.device.type = DeviceType::cpu;
    config.precision.dtype = o.dtype;
    if (o.on_host) {
      config.offload.optimizer.device = OffloadDevice::cpu;
    } else if (!o.on_device) {
      config.offload.optimizer.device = OffloadDevice::nvme;
      config.offload.optimizer.paths = {o.path};
    }
    if (o.sub_group > 0) config.offload.sub_group_bytes = o.sub_group;
    if (o.buffers > 0) config.offload.optimizer.buffer_count = o.buffers;
    if (o.bucket > 0) config.buckets.reduce_bytes = o.bucket;
    if (o.allgather > 0) config.buckets.allgather_bytes = o.allgather;
    // Params and grads in dtype (with the states on the device, 12 bytes per parameter too: more
    // than this rank's shard of them needs), with room for padding and the buckets; --update-ahead's two
    // engines share the device.
    const std::size_t model_bytes =
        2 * dtype_size(o.dtype) * o.params + (o.on_device ? 12 * o.params : 0);
    const std::size_t engines = o.update_ahead ? 2 : 1;
    config.device.memory = o.device_memory > 0 ? o.device_memory
                                               : engines * (model_bytes + model_bytes / 16 + (std::size_t{256} << 20));
    config = parse_config(to_yaml(config));  // validated like a user's file

    // --placement shared: what zest did before placement: every rank's threads on every allowed cpu,
    // and hardware threads / world size Adam threads per rank.
    const auto runtime_owner = o.shared_placement ? std::make_unique<Runtime>(config, detail::allowed_cpus())
                                                  : std::make_unique<Runtime>(config);
    Runtime& runtime = *runtime_owner;
    if (o.shared_placement)
      config.optimizer.threads =
          std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / runtime.world_size());
    Communicator& comm = runtime.comm();
    const bool lead = runtime.rank() == 0;
    // Refuses an existing file before any work; recording starts anew before the timed steps.
    std::optional<TraceFile> trace_file;
    if (!o.trace.empty()) trace_file.emplace(o.trace, comm);
    const std::string load_before = load_average();

    // --update-ahead on NVMe: each engine's own swap directory, made before the bandwidth test so that a
    // leftover stops the run at once; the first rank of each host makes them, for its ranks' files.
    // The guards outlive the engines (run_update_ahead's), so a swap file is gone before its directory.
    const std::string today_path = o.path + "/zest-bench-today", ahead_path = o.path + "/zest-bench-update-ahead";
    ScratchDirectory today_directory, ahead_directory;
    if (o.update_ahead && !o.on_host) {
      if (runtime.local_rank() == 0) {
        today_directory.make(today_path);
        ahead_directory.make(ahead_path);
      }
      comm.barrier();
    }

    // The disk's figures first, on the same directory, before the swap file and the device
    // buffers take the page cache and memory.
    const auto io_bytes = static_cast<std::size_t>(o.io_gib * static_cast<double>(std::size_t{1} << 30));
    comm.barrier();
    // Every rank at once, as in the step (they share the disk). The engine's store does not register
    // its staging buffers with the ring: measure that path.
    const bench::StoreBandwidth bw = o.on_device || o.on_host
                                         ? bench::StoreBandwidth{}
                                         : bench::measure_store_bandwidth(o.path, runtime.rank(), runtime.cpus(),
                                                                          io_bytes, config.io, o.reps, false);

    std::vector<ParamSpec> specs;
    const std::size_t per_group = o.params / static_cast<std::size_t>(o.groups);
    for (int g = 0; g < o.groups; ++g) {
      const std::size_t n =
          g + 1 < o.groups ? per_group : o.params - per_group * static_cast<std::size_t>(o.groups - 1);
      specs.push_back({std::string("layer").append(std::to_string(g)), {n}, g});
    }
    if (o.update_ahead) {
      // Two configs that differ in offload.optimizer.update_ahead alone (and the swap directory).
      Config today_config = config, ahead_config = config;
      ahead_config.offload.optimizer_update_ahead = true;
      if (!o.on_host) {
        today_config.offload.optimizer.paths = {today_path};
        ahead_config.offload.optimizer.paths = {ahead_path};
      }
      today_config = parse_config(to_yaml(today_config));
      ahead_config = parse_config(to_yaml(ahead_config));
      const UpdateAheadRun run =
          run_update_ahead(o, today_config, ahead_config, runtime, specs, trace_file ? &*trace_file : nullptr);
      comm.barrier();  // every rank's engines, and so their swap files, are gone
      today_directory.remove();
      ahead_directory.remove();
      if (lead)
        report_update_ahead(o, today_config, bw, run, comm.size(), runtime.device().pinned_stats(), load_before);
      if (!run.difference.empty())
        throw Error(std::string("the parameters of the engine that updates ahead differ from today's, first in ")
                        .append(run.difference)
                        .append(": offload.optimizer.update_ahead must not change results"));
      return 0;
    }

    std::vector<FormatRun> runs;
    for (const StatesFormat format : o.states) {
      Config format_config = config;
      format_config.optimizer.states = format;
      format_config = parse_config(to_yaml(format_config));
      runs.push_back(run_format(o, format_config, runtime, specs, bw, trace_file ? &*trace_file : nullptr));
    }
    const std::string load_after = load_average();
    if (!lead) return 0;
    for (const FormatRun& run : runs) report_format(o, run, runs.front(), bw, comm.size(), load_before, load_after);
    return 0;
  } catch (const ConfigError& error) {  // the input, not the run: exit 2 as for a bad flag
    std::fprintf(stderr, "%s\n", error.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zest bench step: %s\n", e.what());
    return 1;
  }
}

}  // namespace zest::cli
