// zest bench adam: the CPU Adam's throughput against the machine's in-place roofline for the same
// access pattern (a streaming kernel reading p, g, m, v and writing p, m, v [, low-precision p]
// with the same tiles and threads) and against the scalar variant, all measured in one run; with
// --peers also against DeepSpeed's CPU Adam and torch's AdamW, timed in a Python child (AdamPeers)
// whose rounds interleave with zest's.
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "adam_peers.hpp"
#include "args/args.hpp"
#include "bench_commands.hpp"
#include "cuda_adam_bench.hpp"
#include "optim/cpu_adam.hpp"
#include "zest_build_config.h"

namespace zest::cli {
namespace {

constexpr const char* kBenchUsage =
    "usage: zest bench adam [--threads N] [--params N] [--mode MODE] [--reps N] [--json]\n"
    "                       [--device cpu|cuda] [--states fp32|bf16|int8] [--master fp32|bf16] [--ahead]\n"
    "                       [--peers [--python PATH]]\n"
    "  MODE: fp32 | bf16-grad | fp16-grad | fp32-bf16-out | bf16-grad-bf16-out | fp16-grad-fp16-out\n"
    "  defaults: --threads 1 --params 100000000 --mode fp32 --reps 7 --device cpu --states fp32\n"
    "  --states bf16|int8: m and v stored as bf16 (stochastic rounding) or int8 (block-wise dynamic\n"
    "  code), docs/compact-states.md; cpu only. --master bf16 (with bf16|int8 states): bf16 master\n"
    "  weights (optimizer.master); its ratio is to the roofline's bandwidth (that kernel has an fp32\n"
    "  master).\n"
    "  --ahead: also the step that reads the states from one copy and writes them to another (the\n"
    "  offloaded update ahead: step_from, step_compact_from), against the step in place.\n"
    "  ZEST_ADAM_ISA=scalar|avx2|avx512 forces the CPU variant.\n"
    "  --peers: also DeepSpeed's CPU Adam and torch.optim.AdamW (fp32 states, cpu; zest's row is in\n"
    "  --states and --master), at 1 thread and at all threads unless --threads is given; PATH: the\n"
    "  Python with torch and deepspeed (default $ZEST_VENV/bin/python3; scripts/python-env.sh makes\n"
    "  that environment).\n";

struct Mode {
  const char* name;
  DType grad;
  bool out;
  DType out_dtype;
};

constexpr Mode kModes[] = {
    {"fp32", DType::f32, false, DType::bf16},
    {"bf16-grad", DType::bf16, false, DType::bf16},
    {"fp16-grad", DType::f16, false, DType::f16},
    {"fp32-bf16-out", DType::f32, true, DType::bf16},
    {"bf16-grad-bf16-out", DType::bf16, true, DType::bf16},
    {"fp16-grad-fp16-out", DType::f16, true, DType::f16},
};

// One large array, 2 MiB aligned and on transparent huge pages where the kernel allows, touched
// once so no page fault lands inside a timed pass.
struct Array {
  void* data = nullptr;
  std::size_t bytes = 0;
  explicit Array(std::size_t n) : bytes(std::max<std::size_t>(n, 1)) {
    const std::size_t align = std::size_t{2} << 20;
    bytes = (bytes + align - 1) / align * align;
    data = std::aligned_alloc(align, bytes);
    if (data == nullptr)
      throw Error(fmt::format("zest bench adam: cannot allocate {} bytes; pass a smaller --params", bytes));
    madvise(data, bytes, MADV_HUGEPAGE);  // advice only: without THP the bench still runs
    std::memset(data, 0, bytes);
  }
  ~Array() { std::free(data); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(data); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double spread(const std::vector<double>& t) {
  return (*std::max_element(t.begin(), t.end()) - *std::min_element(t.begin(), t.end())) / median(t);
}

// The peers' check: their parameters after kCheckSteps steps on kCheckParams parameters (several
// tiles and a vector tail) against zest's. The tolerance is about 4 ulps of these values (< 2) per
// step: the same update rounded in another order (DeepSpeed applies the decay as a multiply of its
// own: 5 ulps after 5 steps), while a different update (decay coupled to the gradient as in Adam,
// no bias correction) moves them by more than 1e-5 a step (1% of lr).
constexpr std::size_t kCheckParams = 40009;
constexpr int kCheckSteps = 5;
constexpr double kCheckTolerance = 4e-6;

// Largest |peer - zest| per peer (NaN where a peer cannot run); throws when one exceeds the tolerance.
std::array<double, 3> check_peers(AdamPeers& peers, const optim::AdamHyperParams& hp) {
  optim::CpuAdam adam(hp, 1);
  std::vector<float> p(kCheckParams), m(kCheckParams), v(kCheckParams), g(kCheckParams);
  for (std::size_t i = 0; i < kCheckParams; ++i) p[i] = AdamPeers::check_input(i, 0);
  for (int k = 1; k <= kCheckSteps; ++k) {
    for (std::size_t i = 0; i < kCheckParams; ++i) g[i] = AdamPeers::check_input(i, k);
    adam.step(p, m, v, {g.data(), DType::f32, kCheckParams}, {k});
  }
  const std::array<std::vector<float>, 3> theirs = peers.check(kCheckParams, kCheckSteps);
  std::array<double, 3> diff{};
  for (std::size_t j = 0; j < diff.size(); ++j) {
    if (theirs[j].empty()) {
      diff[j] = std::nan("");
      continue;
    }
    for (std::size_t i = 0; i < theirs[j].size(); ++i) {
      const double d = std::fabs(static_cast<double>(theirs[j][i]) - p[i]);
      if (!(d <= diff[j])) diff[j] = d;  // a NaN sticks
    }
    if (!(diff[j] <= kCheckTolerance))
      throw Error(fmt::format(
          "--peers: {} computes another update than zest: largest difference {} after {} steps (tolerance {})",
          AdamPeers::kNames[j], diff[j], kCheckSteps, kCheckTolerance));
  }
  return diff;
}

}  // namespace
}  // namespace zest::cli

#if !ZEST_HAVE_CUDA
namespace zest::kernels {
CudaAdamBenchResult bench_cuda_adam(std::size_t, DType, bool, DType, int) {
  throw SystemError("zest bench adam --device cuda: this zest was built without CUDA; rebuild with "
                    "nvcc on the PATH (meson -Dcuda=enabled) or use --device cpu");
}
}  // namespace zest::kernels
#endif

namespace zest::cli {

namespace {

struct Options {
  long long threads = 1, reps = 7;
  std::size_t params = 100000000;
  std::string mode_name = "fp32", device = "cpu", states_name = "fp32", master_name = "fp32";
  bool json = false, with_peers = false, threads_given = false, ahead = false;
  std::string python;
  const Mode* mode = nullptr;
};

// The command line; throws args::UsageError.
Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--json") o.json = true;
    else if (arg == "--peers") o.with_peers = true;
    else if (arg == "--ahead") o.ahead = true;
    else if (arg == "--master") o.master_name = args::value_of(argc, argv, i);
    else if (arg == "--python") o.python = args::value_of(argc, argv, i);
    else if (arg == "--threads") {
      o.threads = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 1024);
      o.threads_given = true;
    }
    // 10^11 values: 1.6 TB of fp32 arrays, past any machine this runs on.
    else if (arg == "--params") o.params = args::parse_count(arg, args::value_of(argc, argv, i), 1, 100'000'000'000);
    else if (arg == "--reps") o.reps = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 1000);
    else if (arg == "--mode") o.mode_name = args::value_of(argc, argv, i);
    else if (arg == "--device") o.device = args::value_of(argc, argv, i);
    else if (arg == "--states") o.states_name = args::value_of(argc, argv, i);
    else throw args::UsageError(std::string("invalid argument '").append(arg).append("'"));
  }
  if (o.with_peers && (o.device != "cpu" || o.mode_name != "fp32"))
    throw args::UsageError("--peers measures the cpu Adam in fp32 (--device cpu --mode fp32)");
  if (!o.python.empty() && !o.with_peers) throw args::UsageError("--python goes with --peers");
  if (o.states_name != "fp32" && o.states_name != "bf16" && o.states_name != "int8")
    throw args::UsageError(std::string("unknown --states '").append(o.states_name).append("'"));
  if (o.states_name != "fp32" && o.device != "cpu")
    throw args::UsageError("--states bf16|int8 measures the cpu Adam (--device cpu)");
  if (o.master_name != "fp32" && o.master_name != "bf16")
    throw args::UsageError(std::string("unknown --master '").append(o.master_name).append("'"));
  if (o.master_name == "bf16" && o.states_name == "fp32")
    throw args::UsageError("--master bf16 goes with compact moments (--states bf16|int8), as optimizer.master does");
  if (o.ahead && o.device != "cpu") throw args::UsageError("--ahead measures the cpu Adam (--device cpu)");
  for (const Mode& m : kModes)
    if (o.mode_name == m.name) o.mode = &m;
  if (o.mode == nullptr) throw args::UsageError(std::string("unknown mode '").append(o.mode_name).append("'"));
  if (o.device != "cpu" && o.device != "cuda")
    throw args::UsageError(std::string("unknown device '").append(o.device).append("'"));
  return o;
}

// What one parameter's update moves. p read and written (8, or 4 for a bf16 master), m and v read
// and written, the gradient read, the copy written; int8 also reads and writes one float scale per
// state and block. The roofline's kernel has an fp32 master.
struct Traffic {
  bool compact, int8, bf16_master;
  StatesFormat format;
  std::size_t state_size;  // bytes of one moment
  std::size_t blocks;      // int8 scales per moment
  double roofline_bytes_per_param, bytes_per_param;
};

Traffic traffic_of(const Options& o, std::size_t n) {
  Traffic t{};
  t.compact = o.states_name != "fp32";
  t.int8 = o.states_name == "int8";
  t.bf16_master = o.master_name == "bf16";
  t.format = t.int8 ? StatesFormat::int8 : t.compact ? StatesFormat::bf16 : StatesFormat::f32;
  t.state_size = t.int8 ? 1 : t.compact ? 2 : 4;
  t.blocks = t.int8 ? (n + optim::kInt8Block - 1) / optim::kInt8Block : 0;
  t.roofline_bytes_per_param = 8.0 + 4.0 * static_cast<double>(t.state_size) +
                               (t.int8 ? 16.0 / static_cast<double>(optim::kInt8Block) : 0.0) +
                               static_cast<double>(dtype_size(o.mode->grad)) +
                               (o.mode->out ? static_cast<double>(dtype_size(o.mode->out_dtype)) : 0.0);
  t.bytes_per_param = t.roofline_bytes_per_param - (t.bf16_master ? 4.0 : 0.0);
  return t;
}

void run_cuda(const Options& o, std::size_t n, double bytes_per_param) {
  const kernels::CudaAdamBenchResult r =
      kernels::bench_cuda_adam(n, o.mode->grad, o.mode->out, o.mode->out_dtype, static_cast<int>(o.reps));
  if (o.json) {
    const nlohmann::ordered_json out = {{"device", "cuda"},
                                        {"mode", o.mode->name},
                                        {"params", n},
                                        {"params_per_s", r.params_per_s},
                                        {"bytes_per_param", bytes_per_param},
                                        {"copy_bytes_per_s", r.copy_bytes_per_s},
                                        {"copy_fraction", r.params_per_s * bytes_per_param / r.copy_bytes_per_s}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("cuda adam %s, %zu params: %.3g params/s = %.1f GB/s, %.2f of copy bandwidth (%.1f GB/s)\n",
                o.mode->name, n, r.params_per_s, r.params_per_s * bytes_per_param / 1e9,
                r.params_per_s * bytes_per_param / r.copy_bytes_per_s, r.copy_bytes_per_s / 1e9);
  }
}

// The arrays of one measurement and its three passes: the roofline's, the step in place and the
// update ahead (from one copy of the states to the other and back, alternately).
class CpuPasses {
 public:
  CpuPasses(const Options& o, const Traffic& t, std::size_t n)
      : t_(t),
        n_(n),
        p_(n * 4),
        m_(n * t.state_size),
        v_(n * t.state_size),
        g_(n * dtype_size(o.mode->grad)),
        out_(o.mode->out ? n * 2 : 0),
        p16_(t.bf16_master ? n * 2 : 0),
        p2_(o.ahead ? n * (t.bf16_master ? 2 : 4) : 0),
        m2_(o.ahead ? n * t.state_size : 0),
        v2_(o.ahead ? n * t.state_size : 0),
        m_scales_(t.blocks * 4),
        v_scales_(t.blocks * 4),
        m_scales2_(o.ahead ? t.blocks * 4 : 0),
        v_scales2_(o.ahead ? t.blocks * 4 : 0),
        gs_{g_.data, o.mode->grad, n},
        os_{o.mode->out ? out_.data : nullptr, o.mode->out_dtype, n},
        one_{t.bf16_master ? p16_.data : p_.data,
             {t.format, m_.data, v_.data, n, m_scales_.as<float>(), v_scales_.as<float>()}},
        two_{p2_.data, {t.format, m2_.data, v2_.data, n, m_scales2_.as<float>(), v_scales2_.as<float>()}} {
    // Bounded, normal-range values: no denormals or overflow over the repetitions.
    for (std::size_t i = 0; i < n; ++i) {
      const float x = 0.5f + static_cast<float>(i % 1000) * 1e-3f;
      p_.as<float>()[i] = x;
      if (t.bf16_master) p16_.as<std::uint16_t>()[i] = float_to_bf16(x);
      if (o.mode->grad == DType::f32) {
        g_.as<float>()[i] = x - 1.0f;
      } else {
        g_.as<std::uint16_t>()[i] = o.mode->grad == DType::bf16 ? float_to_bf16(x - 1.0f) : float_to_fp16(x - 1.0f);
      }
    }
  }

  void roofline(optim::CpuAdam& adam) {
    const std::span<float> ps(p_.as<float>(), n_);
    if (t_.compact) {
      adam.roofline_compact_pass(ps, one_.states, gs_, os_);
    } else {
      adam.roofline_pass(ps, {m_.as<float>(), n_}, {v_.as<float>(), n_}, gs_, os_);
    }
  }
  void step(optim::CpuAdam& adam, std::int64_t k) { step_on(adam, nullptr, one_, k); }
  void ahead(optim::CpuAdam& adam, std::int64_t k) {
    step_on(adam, forward_ ? &one_ : &two_, forward_ ? two_ : one_, k);
    forward_ = !forward_;
  }

 private:
  // One copy of the states: the master (fp32 or bf16) and the moments (step_compact takes fp32
  // states to step() and step_compact_from to step_from(), bit for bit).
  struct Copy {
    void* master;
    optim::CpuAdam::CompactStates states;
  };
  // The step on `to`, in place (from null) or from another copy.
  void step_on(optim::CpuAdam& adam, const Copy* from, const Copy& to, std::int64_t k) {
    if (t_.bf16_master) {
      const std::span<std::uint16_t> master(static_cast<std::uint16_t*>(to.master), n_);
      if (from) adam.step_compact_from({from->master, from->states}, master, to.states, gs_, {k}, {1, 0}, os_);
      else adam.step_compact(master, to.states, gs_, {k}, {1, 0}, os_);
    } else {
      const std::span<float> master(static_cast<float*>(to.master), n_);
      if (from) adam.step_compact_from({from->master, from->states}, master, to.states, gs_, {k}, {1, 0}, os_);
      else adam.step_compact(master, to.states, gs_, {k}, {1, 0}, os_);
    }
  }

  const Traffic t_;
  const std::size_t n_;
  Array p_, m_, v_, g_, out_, p16_;
  Array p2_, m2_, v2_;  // the second copy of the states, for --ahead
  Array m_scales_, v_scales_, m_scales2_, v_scales2_;
  const optim::ConstTensorSpan gs_;
  const optim::TensorSpan os_;
  const Copy one_, two_;
  bool forward_ = true;
};

// One thread count's Adams and their times: with the peers and no --threads, 1 and all (0: every
// cpu this process may use), as DeepSpeed and torch are run.
struct Arm {
  std::unique_ptr<optim::CpuAdam> ours, scalar;
  std::vector<double> t_ours, t_roof, t_scalar, t_ahead;
  std::array<std::vector<double>, 3> t_peer;
};

std::vector<Arm> make_arms(const Options& o, const optim::AdamHyperParams& hp) {
  std::vector<Arm> arms;
  for (const long long t :
       o.with_peers && !o.threads_given ? std::vector<long long>{1, 0} : std::vector<long long>{o.threads}) {
    Arm& arm = arms.emplace_back();
    arm.ours = std::make_unique<optim::CpuAdam>(hp, static_cast<int>(t));
    arm.scalar = std::make_unique<optim::CpuAdam>(hp, static_cast<int>(t), std::vector<int>{}, optim::Isa::scalar);
  }
  // On a one-cpu machine "all" is 1: one arm.
  if (arms.size() == 2 && arms[1].ours->threads() == 1) arms.pop_back();
  return arms;
}

// One untimed pass of each warms the thread pools; then all interleave, round by round (zest's
// three, then the peers', at one thread count, then the next), so drifting machine load affects
// them alike.
void time_rounds(const Options& o, std::vector<Arm>& arms, CpuPasses& passes, std::optional<AdamPeers>& peers) {
  using Clock = std::chrono::steady_clock;
  auto time_pass = [](const std::function<void()>& pass) {
    const auto start = Clock::now();
    pass();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  std::int64_t step = 1;
  for (Arm& arm : arms) {
    passes.roofline(*arm.ours);
    passes.step(*arm.ours, step++);
    passes.step(*arm.scalar, step++);
    if (o.ahead) passes.ahead(*arm.ours, step++);
    if (peers) peers->round(arm.ours->threads());
  }
  // With the peers, a pause where zest hands over to them and back: the idle threads of the one
  // before (oneTBB's workers, libgomp's) spin a while before they sleep, and on a machine with
  // few cores they would run beside the next one's threads (measured here: at 2 threads and 1e6
  // parameters DeepSpeed's step took 70 times as long right after zest's passes as 20 ms later).
  // Not between zest's roofline pass and its step: the step then finds its arrays in the caches
  // as each peer's timed step does after its untimed one.
  auto settle = [&] {
    if (peers) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  for (long long r = 0; r < o.reps; ++r) {
    for (Arm& arm : arms) {
      settle();
      arm.t_roof.push_back(time_pass([&] { passes.roofline(*arm.ours); }));
      arm.t_ours.push_back(time_pass([&] { passes.step(*arm.ours, step++); }));
      arm.t_scalar.push_back(time_pass([&] { passes.step(*arm.scalar, step++); }));
      if (o.ahead) arm.t_ahead.push_back(time_pass([&] { passes.ahead(*arm.ours, step++); }));
      if (!peers) continue;
      settle();
      const std::array<double, 3> seconds = peers->round(arm.ours->threads());
      for (std::size_t j = 0; j < seconds.size(); ++j) arm.t_peer[j].push_back(seconds[j]);
    }
  }
}

// One arm's figures: params/s of each row, and a row's share of the roofline's bandwidth (its
// params/s times its bytes per parameter; zest's rows move bytes_per_param, the peers fp32
// states').
struct ArmFigures {
  double ours_pps, roof_pps, scalar_pps, ahead_pps, roof_bytes_per_s, fp32_bytes_per_param;
  double of_roofline(double pps, double bytes) const { return pps * bytes / roof_bytes_per_s; }
};

ArmFigures figures_of(const Options& o, const Traffic& t, std::size_t n, const Arm& arm) {
  ArmFigures f{};
  f.ours_pps = static_cast<double>(n) / median(arm.t_ours);
  f.roof_pps = static_cast<double>(n) / median(arm.t_roof);
  f.scalar_pps = static_cast<double>(n) / median(arm.t_scalar);
  f.ahead_pps = o.ahead ? static_cast<double>(n) / median(arm.t_ahead) : 0.0;
  f.roof_bytes_per_s = f.roof_pps * t.roofline_bytes_per_param;
  f.fp32_bytes_per_param = 24.0 + static_cast<double>(dtype_size(o.mode->grad));
  return f;
}

void print_json(const Options& o, const Traffic& t, std::size_t n, const optim::AdamHyperParams& hp, const Arm& arm,
                const std::optional<AdamPeers>& peers, const std::array<double, 3>& check_diff) {
  const ArmFigures f = figures_of(o, t, n, arm);
  const optim::CpuAdam& ours = *arm.ours;
  nlohmann::ordered_json out = {{"device", "cpu"},
                                {"mode", o.mode->name},
                                {"states", o.states_name},
                                {"master", o.master_name},
                                {"isa", optim::isa_name(ours.isa())},
                                {"threads", ours.threads()},
                                {"params", n},
                                {"reps", o.reps},
                                {"bytes_per_param", t.bytes_per_param},
                                {"roofline_bytes_per_param", t.roofline_bytes_per_param},
                                {"params_per_s", f.ours_pps},
                                {"roofline_params_per_s", f.roof_pps},
                                {"roofline_ratio", f.of_roofline(f.ours_pps, t.bytes_per_param)},
                                {"scalar_params_per_s", f.scalar_pps},
                                {"scalar_ratio", f.of_roofline(f.scalar_pps, t.bytes_per_param)},
                                {"spread", spread(arm.t_ours)}};
  if (o.ahead) {
    out["ahead_params_per_s"] = f.ahead_pps;
    out["ahead_ratio"] = f.ahead_pps / f.ours_pps;
    out["ahead_spread"] = spread(arm.t_ahead);
  }
  if (peers) {
    out["weight_decay"] = hp.weight_decay;
    out["peer_versions"] = peers->versions();
    out["check_params"] = kCheckParams;
    out["check_steps"] = kCheckSteps;
    nlohmann::ordered_json& rows = out["peers"] = nlohmann::ordered_json::array();
    for (std::size_t j = 0; j < AdamPeers::kNames.size(); ++j) {
      if (!peers->why_not(j).empty()) {
        rows.push_back({{"name", AdamPeers::kNames[j]}, {"error", peers->why_not(j)}});
        continue;
      }
      const double pps = static_cast<double>(n) / median(arm.t_peer[j]);
      rows.push_back({{"name", AdamPeers::kNames[j]},
                      {"params", n},
                      {"median_s", median(arm.t_peer[j])},
                      {"params_per_s", pps},
                      {"roofline_ratio", f.of_roofline(pps, f.fp32_bytes_per_param)},
                      {"spread", spread(arm.t_peer[j])},
                      {"zest_ratio", f.ours_pps / pps},
                      {"check_max_abs_diff", check_diff[j]}});
    }
    out["median_s"] = median(arm.t_ours);
    out["roofline_median_s"] = median(arm.t_roof);
  }
  // What the peers' Python printed may be any bytes: replaced where not UTF-8, not a lost row.
  std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
}

void print_text(const Options& o, const Traffic& t, std::size_t n, const Arm& arm,
                const std::optional<AdamPeers>& peers) {
  const ArmFigures f = figures_of(o, t, n, arm);
  const optim::CpuAdam& ours = *arm.ours;
  std::printf("cpu adam %s, %s states, %s master, %zu params, %d thread(s), %s, median of %lld:\n", o.mode->name,
              o.states_name.c_str(), o.master_name.c_str(), n, ours.threads(), optim::isa_name(ours.isa()), o.reps);
  std::printf("  ours      %.4g params/s  %6.2f GB/s  %.3f of roofline\n", f.ours_pps,
              f.ours_pps * t.bytes_per_param / 1e9, f.of_roofline(f.ours_pps, t.bytes_per_param));
  std::printf("  roofline  %.4g params/s  %6.2f GB/s  (%.4g B/param, in place)\n", f.roof_pps,
              f.roof_bytes_per_s / 1e9, t.roofline_bytes_per_param);
  std::printf("  scalar    %.4g params/s  %6.2f GB/s  %.3f of roofline\n", f.scalar_pps,
              f.scalar_pps * t.bytes_per_param / 1e9, f.of_roofline(f.scalar_pps, t.bytes_per_param));
  if (o.ahead)
    std::printf("  ahead     %.4g params/s  %6.2f GB/s  %.3f of the step in place (the same bytes: one copy read, "
                "the other written)\n",
                f.ahead_pps, f.ahead_pps * t.bytes_per_param / 1e9, f.ahead_pps / f.ours_pps);
  std::printf("  spread (max-min)/median of ours: %.1f%%\n", 100.0 * spread(arm.t_ours));
  if (!peers) return;
  // The same columns, at the same thread count and size, with each one's spread and how many
  // times faster zest is.
  for (std::size_t j = 0; j < AdamPeers::kNames.size(); ++j) {
    if (!peers->why_not(j).empty()) {
      std::printf("  %-22s not run: %s\n", AdamPeers::kNames[j], peers->why_not(j).c_str());
      continue;
    }
    const double pps = static_cast<double>(n) / median(arm.t_peer[j]);
    std::printf("  %-22s %.4g params/s  %6.2f GB/s  %.3f of roofline  spread %.1f%%  zest %.2fx\n",
                AdamPeers::kNames[j], pps, pps * f.fp32_bytes_per_param / 1e9,
                f.of_roofline(pps, f.fp32_bytes_per_param), 100.0 * spread(arm.t_peer[j]), f.ours_pps / pps);
  }
}

void print_peer_check(const AdamPeers& peers, const optim::AdamHyperParams& hp,
                      const std::array<double, 3>& check_diff) {
  std::printf("peers: %s; AdamW, weight decay %g; largest difference from zest's parameters after "
              "%d steps on %zu parameters:", peers.versions().c_str(), hp.weight_decay, kCheckSteps, kCheckParams);
  for (std::size_t j = 0; j < AdamPeers::kNames.size(); ++j)
    if (peers.why_not(j).empty()) std::printf("%s %s %.2g", j ? "," : "", AdamPeers::kNames[j], check_diff[j]);
  std::printf(" (tolerance %.0e)\n", kCheckTolerance);
}

// The peers' Python: --python, or the environment's that scripts/python-env.sh makes.
std::string peers_python(const std::string& given) {
  if (!given.empty()) return given;
  const char* venv = std::getenv("ZEST_VENV");
  if (venv == nullptr || *venv == '\0')
    throw Error("--peers needs the Python environment with torch and deepspeed: `source "
                "scripts/setup.sh` (scripts/python-env.sh makes it and sets ZEST_VENV) or pass "
                "--python PATH");
  return std::string(venv) + "/bin/python3";
}

}  // namespace

int bench_adam(int argc, char** argv) {
  if (args::asks_for_help(argc, argv)) return args::print_usage(kBenchUsage);
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const args::UsageError& error) {
    std::fprintf(stderr, "zest bench adam: %s\n%s", error.what(), kBenchUsage);
    return 2;
  }
  const std::size_t n = o.params;
  const Traffic traffic = traffic_of(o, n);
  try {
    if (o.device == "cuda") {
      run_cuda(o, n, traffic.bytes_per_param);
      return 0;
    }
    optim::AdamHyperParams hp;
    // With the peers: AdamW with torch's default weight decay, so the check covers decoupled decay
    // and every row times the update people run.
    if (o.with_peers) hp.weight_decay = 0.01;
    std::optional<AdamPeers> peers;
    std::array<double, 3> check_diff{};
    if (o.with_peers) {
      peers.emplace(peers_python(o.python), n, hp);
      check_diff = check_peers(*peers, hp);
    }
    std::vector<Arm> arms = make_arms(o, hp);
    CpuPasses passes(o, traffic, n);
    time_rounds(o, arms, passes, peers);
    for (const Arm& arm : arms) {
      if (o.json) print_json(o, traffic, n, hp, arm, peers, check_diff);
      else print_text(o, traffic, n, arm, peers);
    }
    if (peers && !o.json) print_peer_check(*peers, hp, check_diff);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zest bench adam: %s\n", e.what());
    return 1;
  }
}

}  // namespace zest::cli
