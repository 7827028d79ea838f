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

int bench_adam(int argc, char** argv) {
  if (args::asks_for_help(argc, argv)) return args::print_usage(kBenchUsage);
  long long threads = 1, reps = 7;
  std::size_t params = 100000000;
  std::string mode_name = "fp32", device = "cpu", states_name = "fp32", master_name = "fp32";
  bool json = false, with_peers = false, threads_given = false, ahead = false;
  std::string python;
  try {
    for (int i = 0; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--json") json = true;
      else if (arg == "--peers") with_peers = true;
      else if (arg == "--ahead") ahead = true;
      else if (arg == "--master") master_name = args::value_of(argc, argv, i);
      else if (arg == "--python") python = args::value_of(argc, argv, i);
      else if (arg == "--threads") {
        threads = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 1024);
        threads_given = true;
      }
      // 10^11 values: 1.6 TB of fp32 arrays, past any machine this runs on.
      else if (arg == "--params") params = args::parse_count(arg, args::value_of(argc, argv, i), 1, 100'000'000'000);
      else if (arg == "--reps") reps = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 1000);
      else if (arg == "--mode") mode_name = args::value_of(argc, argv, i);
      else if (arg == "--device") device = args::value_of(argc, argv, i);
      else if (arg == "--states") states_name = args::value_of(argc, argv, i);
      else throw args::UsageError(std::string("invalid argument '").append(arg).append("'"));
    }
    if (with_peers && (device != "cpu" || mode_name != "fp32"))
      throw args::UsageError("--peers measures the cpu Adam in fp32 (--device cpu --mode fp32)");
    if (!python.empty() && !with_peers) throw args::UsageError("--python goes with --peers");
    if (states_name != "fp32" && states_name != "bf16" && states_name != "int8")
      throw args::UsageError(std::string("unknown --states '").append(states_name).append("'"));
    if (states_name != "fp32" && device != "cpu")
      throw args::UsageError("--states bf16|int8 measures the cpu Adam (--device cpu)");
    if (master_name != "fp32" && master_name != "bf16")
      throw args::UsageError(std::string("unknown --master '").append(master_name).append("'"));
    if (master_name == "bf16" && states_name == "fp32")
      throw args::UsageError("--master bf16 goes with compact moments (--states bf16|int8), as optimizer.master does");
    if (ahead && device != "cpu") throw args::UsageError("--ahead measures the cpu Adam (--device cpu)");
  } catch (const args::UsageError& error) {
    std::fprintf(stderr, "zest bench adam: %s\n%s", error.what(), kBenchUsage);
    return 2;
  }
  const Mode* mode = nullptr;
  for (const Mode& m : kModes)
    if (mode_name == m.name) mode = &m;
  if (mode == nullptr || (device != "cpu" && device != "cuda")) {
    std::fprintf(stderr, "zest bench adam: unknown %s '%s'\n%s", mode == nullptr ? "mode" : "device",
                 mode == nullptr ? mode_name.c_str() : device.c_str(), kBenchUsage);
    return 2;
  }
  const std::size_t n = static_cast<std::size_t>(params);
  // p read and written (8, or 4 for a bf16 master), m and v read and written, the gradient read,
  // the copy written; int8 also reads and writes one float scale per state and block. The
  // roofline's kernel has an fp32 master.
  const bool compact = states_name != "fp32";
  const bool int8 = states_name == "int8";
  const bool bf16_master = master_name == "bf16";
  const std::size_t state_size = int8 ? 1 : compact ? 2 : 4;
  const std::size_t blocks = int8 ? (n + optim::kInt8Block - 1) / optim::kInt8Block : 0;
  const double roofline_bytes_per_param = 8.0 + 4.0 * static_cast<double>(state_size) +
                                          (int8 ? 16.0 / static_cast<double>(optim::kInt8Block) : 0.0) +
                                          static_cast<double>(dtype_size(mode->grad)) +
                                          (mode->out ? static_cast<double>(dtype_size(mode->out_dtype)) : 0.0);
  const double bytes_per_param = roofline_bytes_per_param - (bf16_master ? 4.0 : 0.0);

  try {
    if (device == "cuda") {
      const kernels::CudaAdamBenchResult r = kernels::bench_cuda_adam(n, mode->grad, mode->out,
                                                                      mode->out_dtype, static_cast<int>(reps));
      if (json) {
        const nlohmann::ordered_json out = {{"device", "cuda"},
                                            {"mode", mode->name},
                                            {"params", n},
                                            {"params_per_s", r.params_per_s},
                                            {"bytes_per_param", bytes_per_param},
                                            {"copy_bytes_per_s", r.copy_bytes_per_s},
                                            {"copy_fraction", r.params_per_s * bytes_per_param / r.copy_bytes_per_s}};
        std::printf("%s\n", out.dump().c_str());
      } else {
        std::printf("cuda adam %s, %zu params: %.3g params/s = %.1f GB/s, %.2f of copy bandwidth (%.1f GB/s)\n",
                    mode->name, n, r.params_per_s, r.params_per_s * bytes_per_param / 1e9,
                    r.params_per_s * bytes_per_param / r.copy_bytes_per_s, r.copy_bytes_per_s / 1e9);
      }
      return 0;
    }

    optim::AdamHyperParams hp;
    // With the peers: AdamW with torch's default weight decay, so the check covers decoupled decay
    // and every row times the update people run.
    if (with_peers) hp.weight_decay = 0.01;
    std::optional<AdamPeers> peers;
    std::array<double, 3> check_diff{};
    if (with_peers) {
      if (python.empty()) {
        const char* venv = std::getenv("ZEST_VENV");
        if (venv == nullptr || *venv == '\0')
          throw Error("--peers needs the Python environment with torch and deepspeed: `source "
                      "scripts/setup.sh` (scripts/python-env.sh makes it and sets ZEST_VENV) or pass "
                      "--python PATH");
        python = std::string(venv) + "/bin/python3";
      }
      peers.emplace(python, n, hp);
      check_diff = check_peers(*peers, hp);
    }

    // One arm per thread count: with the peers and no --threads, 1 and all (0: every cpu this
    // process may use), as DeepSpeed and torch are run.
    struct Arm {
      std::unique_ptr<optim::CpuAdam> ours, scalar;
      std::vector<double> t_ours, t_roof, t_scalar, t_ahead;
      std::array<std::vector<double>, 3> t_peer;
    };
    std::vector<Arm> arms;
    for (const long long t :
         with_peers && !threads_given ? std::vector<long long>{1, 0} : std::vector<long long>{threads}) {
      Arm& arm = arms.emplace_back();
      arm.ours = std::make_unique<optim::CpuAdam>(hp, static_cast<int>(t));
      arm.scalar = std::make_unique<optim::CpuAdam>(hp, static_cast<int>(t), std::vector<int>{}, optim::Isa::scalar);
    }
    // On a one-cpu machine "all" is 1: one arm.
    if (arms.size() == 2 && arms[1].ours->threads() == 1) arms.pop_back();

    Array p(n * 4), m(n * state_size), v(n * state_size), g(n * dtype_size(mode->grad)), out(mode->out ? n * 2 : 0);
    Array p16(bf16_master ? n * 2 : 0);
    // The second copy of the states for --ahead (the update ahead reads one, writes the other).
    const std::size_t n2 = ahead ? n : 0;
    Array p2(n2 * (bf16_master ? 2 : 4)), m2(n2 * state_size), v2(n2 * state_size);
    // Bounded, normal-range values: no denormals or overflow over the repetitions.
    for (std::size_t i = 0; i < n; ++i) {
      const float x = 0.5f + static_cast<float>(i % 1000) * 1e-3f;
      p.as<float>()[i] = x;
      if (bf16_master) p16.as<std::uint16_t>()[i] = float_to_bf16(x);
      if (mode->grad == DType::f32) {
        g.as<float>()[i] = x - 1.0f;
      } else {
        g.as<std::uint16_t>()[i] = mode->grad == DType::bf16 ? float_to_bf16(x - 1.0f) : float_to_fp16(x - 1.0f);
      }
    }
    const std::span<float> ps(p.as<float>(), n), ms(m.as<float>(), compact ? 0 : n), vs(v.as<float>(), compact ? 0 : n);
    Array m_scales(blocks * 4), v_scales(blocks * 4), m_scales2(ahead ? blocks * 4 : 0),
        v_scales2(ahead ? blocks * 4 : 0);
    const StatesFormat format = int8 ? StatesFormat::int8 : compact ? StatesFormat::bf16 : StatesFormat::f32;
    const optim::CpuAdam::CompactStates cs{format, m.data, v.data, n, m_scales.as<float>(), v_scales.as<float>()};
    const optim::ConstTensorSpan gs{g.data, mode->grad, n};
    const optim::TensorSpan os{mode->out ? out.data : nullptr, mode->out_dtype, n};
    auto roofline_pass = [&](optim::CpuAdam& adam) {
      if (compact) adam.roofline_compact_pass(ps, cs, gs, os);
      else adam.roofline_pass(ps, ms, vs, gs, os);
    };
    // One copy of the states: the master (fp32 or bf16) and the moments (step_compact takes fp32
    // states to step() and step_compact_from to step_from(), bit for bit).
    struct Copy {
      void* master;
      optim::CpuAdam::CompactStates states;
    };
    const Copy one{bf16_master ? p16.data : p.data, cs};
    const Copy two{p2.data, {format, m2.data, v2.data, n, m_scales2.as<float>(), v_scales2.as<float>()}};
    // The step on `to`, in place (from null) or from another copy.
    auto step_on = [&](optim::CpuAdam& adam, const Copy* from, const Copy& to, std::int64_t k) {
      if (bf16_master) {
        const std::span<std::uint16_t> master(static_cast<std::uint16_t*>(to.master), n);
        if (from) adam.step_compact_from({from->master, from->states}, master, to.states, gs, {k}, {1, 0}, os);
        else adam.step_compact(master, to.states, gs, {k}, {1, 0}, os);
      } else {
        const std::span<float> master(static_cast<float*>(to.master), n);
        if (from) adam.step_compact_from({from->master, from->states}, master, to.states, gs, {k}, {1, 0}, os);
        else adam.step_compact(master, to.states, gs, {k}, {1, 0}, os);
      }
    };
    auto step_pass = [&](optim::CpuAdam& adam, std::int64_t k) { step_on(adam, nullptr, one, k); };
    // The update ahead: from one copy to the other and back, alternately.
    bool forward = true;
    auto ahead_pass = [&](optim::CpuAdam& adam, std::int64_t k) {
      step_on(adam, forward ? &one : &two, forward ? two : one, k);
      forward = !forward;
    };

    using Clock = std::chrono::steady_clock;
    auto time_pass = [](const std::function<void()>& pass) {
      const auto start = Clock::now();
      pass();
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    std::int64_t step = 1;
    // One untimed pass of each warms the thread pools; then all interleave, round by round (zest's
    // three, then the peers', at one thread count, then the next), so drifting machine load
    // affects them alike.
    for (Arm& arm : arms) {
      roofline_pass(*arm.ours);
      step_pass(*arm.ours, step++);
      step_pass(*arm.scalar, step++);
      if (ahead) ahead_pass(*arm.ours, step++);
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
    for (long long r = 0; r < reps; ++r) {
      for (Arm& arm : arms) {
        settle();
        arm.t_roof.push_back(time_pass([&] { roofline_pass(*arm.ours); }));
        arm.t_ours.push_back(time_pass([&] { step_pass(*arm.ours, step++); }));
        arm.t_scalar.push_back(time_pass([&] { step_pass(*arm.scalar, step++); }));
        if (ahead) arm.t_ahead.push_back(time_pass([&] { ahead_pass(*arm.ours, step++); }));
        if (!peers) continue;
        settle();
        const std::array<double, 3> seconds = peers->round(arm.ours->threads());
        for (std::size_t j = 0; j < seconds.size(); ++j) arm.t_peer[j].push_back(seconds[j]);
      }
    }

    for (const Arm& arm : arms) {
      const optim::CpuAdam& ours = *arm.ours;
      const double ours_pps = static_cast<double>(n) / median(arm.t_ours);
      const double roof_pps = static_cast<double>(n) / median(arm.t_roof);
      const double scalar_pps = static_cast<double>(n) / median(arm.t_scalar);
      // A row's share of the roofline's bandwidth (its params/s times its bytes per parameter):
      // zest's rows move bytes_per_param, the peers fp32 states'.
      const double roof_bytes_per_s = roof_pps * roofline_bytes_per_param;
      const double fp32_bytes_per_param = 24.0 + static_cast<double>(dtype_size(mode->grad));
      const auto of_roofline = [&](double pps, double bytes) { return pps * bytes / roof_bytes_per_s; };
      const double ahead_pps = ahead ? static_cast<double>(n) / median(arm.t_ahead) : 0.0;
      if (json) {
        nlohmann::ordered_json out = {{"device", "cpu"},
                                      {"mode", mode->name},
                                      {"states", states_name},
                                      {"master", master_name},
                                      {"isa", optim::isa_name(ours.isa())},
                                      {"threads", ours.threads()},
                                      {"params", n},
                                      {"reps", reps},
                                      {"bytes_per_param", bytes_per_param},
                                      {"roofline_bytes_per_param", roofline_bytes_per_param},
                                      {"params_per_s", ours_pps},
                                      {"roofline_params_per_s", roof_pps},
                                      {"roofline_ratio", of_roofline(ours_pps, bytes_per_param)},
                                      {"scalar_params_per_s", scalar_pps},
                                      {"scalar_ratio", of_roofline(scalar_pps, bytes_per_param)},
                                      {"spread", spread(arm.t_ours)}};
        if (ahead) {
          out["ahead_params_per_s"] = ahead_pps;
          out["ahead_ratio"] = ahead_pps / ours_pps;
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
                            {"roofline_ratio", of_roofline(pps, fp32_bytes_per_param)},
                            {"spread", spread(arm.t_peer[j])},
                            {"zest_ratio", ours_pps / pps},
                            {"check_max_abs_diff", check_diff[j]}});
          }
          out["median_s"] = median(arm.t_ours);
          out["roofline_median_s"] = median(arm.t_roof);
        }
        // What the peers' Python printed may be any bytes: replaced where not UTF-8, not a lost row.
        std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
        continue;
      }
      std::printf("cpu adam %s, %s states, %s master, %zu params, %d thread(s), %s, median of %lld:\n", mode->name,
                  states_name.c_str(), master_name.c_str(), n, ours.threads(), optim::isa_name(ours.isa()), reps);
      std::printf("  ours      %.4g params/s  %6.2f GB/s  %.3f of roofline\n", ours_pps,
                  ours_pps * bytes_per_param / 1e9, of_roofline(ours_pps, bytes_per_param));
      std::printf("  roofline  %.4g params/s  %6.2f GB/s  (%.4g B/param, in place)\n", roof_pps,
                  roof_bytes_per_s / 1e9, roofline_bytes_per_param);
      std::printf("  scalar    %.4g params/s  %6.2f GB/s  %.3f of roofline\n", scalar_pps,
                  scalar_pps * bytes_per_param / 1e9, of_roofline(scalar_pps, bytes_per_param));
      if (ahead)
        std::printf("  ahead     %.4g params/s  %6.2f GB/s  %.3f of the step in place (the same bytes: one copy read, "
                    "the other written)\n",
                    ahead_pps, ahead_pps * bytes_per_param / 1e9, ahead_pps / ours_pps);
      std::printf("  spread (max-min)/median of ours: %.1f%%\n", 100.0 * spread(arm.t_ours));
      if (!peers) continue;
      // The same columns, at the same thread count and size, with each one's spread and how many
      // times faster zest is.
      for (std::size_t j = 0; j < AdamPeers::kNames.size(); ++j) {
        if (!peers->why_not(j).empty()) {
          std::printf("  %-22s not run: %s\n", AdamPeers::kNames[j], peers->why_not(j).c_str());
          continue;
        }
        const double pps = static_cast<double>(n) / median(arm.t_peer[j]);
        std::printf("  %-22s %.4g params/s  %6.2f GB/s  %.3f of roofline  spread %.1f%%  zest %.2fx\n",
                    AdamPeers::kNames[j], pps, pps * fp32_bytes_per_param / 1e9, of_roofline(pps, fp32_bytes_per_param),
                    100.0 * spread(arm.t_peer[j]), ours_pps / pps);
      }
    }
    if (peers && !json) {
      std::printf("peers: %s; AdamW, weight decay %g; largest difference from zest's parameters after "
                  "%d steps on %zu parameters:", peers->versions().c_str(), hp.weight_decay, kCheckSteps,
                  kCheckParams);
      for (std::size_t j = 0; j < AdamPeers::kNames.size(); ++j)
        if (peers->why_not(j).empty()) std::printf("%s %s %.2g", j ? "," : "", AdamPeers::kNames[j], check_diff[j]);
      std::printf(" (tolerance %.0e)\n", kCheckTolerance);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zest bench adam: %s\n", e.what());
    return 1;
  }
}

}  // namespace zest::cli
