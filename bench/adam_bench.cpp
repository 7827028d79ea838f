// zest bench adam: the CPU Adam's throughput against the machine's in-place roofline for the same
// access pattern (a streaming kernel reading p, g, m, v and writing p, m, v [, low-precision p]
// with the same tiles and threads) and against the scalar variant, all measured in one run.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "args/args.hpp"
#include "cli/commands.hpp"
#include "kernels/adam_bench.hpp"
#include "optim/cpu_adam.hpp"
#include "zest_build_config.h"

namespace zest::cli {
namespace {

constexpr const char* kBenchUsage =
    "usage: zest bench adam [--threads N] [--params N] [--mode MODE] [--reps N] [--json]\n"
    "                       [--device cpu|cuda]\n"
    "  MODE: fp32 | bf16-grad | fp16-grad | fp32-bf16-out | bf16-grad-bf16-out | fp16-grad-fp16-out\n"
    "  defaults: --threads 1 --params 100000000 --mode fp32 --reps 7 --device cpu\n"
    "  ZEST_ADAM_ISA=scalar|avx2|avx512 forces the CPU variant.\n";

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
    if (data == nullptr) throw Error(std::string("zest bench adam: cannot allocate ").append(std::to_string(bytes)).append(" bytes; pass a smaller --params"));
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
  long long threads = 1, reps = 7;
  std::size_t params = 100000000;
  std::string mode_name = "fp32", device = "cpu";
  bool json = false;
  try {
    for (int i = 0; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--json") json = true;
      else if (arg == "--threads") threads = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 1024);
      // 10^11 values: 1.6 TB of fp32 arrays, past any machine this runs on.
      else if (arg == "--params") params = args::parse_count(arg, args::value_of(argc, argv, i), 1, 100'000'000'000);
      else if (arg == "--reps") reps = args::parse_integer(arg, args::value_of(argc, argv, i), 1, 1000);
      else if (arg == "--mode") mode_name = args::value_of(argc, argv, i);
      else if (arg == "--device") device = args::value_of(argc, argv, i);
      else throw args::UsageError(std::string("invalid argument '").append(arg).append("'"));
    }
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
  const double bytes_per_param = 28.0 - 4.0 + static_cast<double>(dtype_size(mode->grad)) +
                                 (mode->out ? static_cast<double>(dtype_size(mode->out_dtype)) : 0.0);

  try {
    if (device == "cuda") {
      const kernels::CudaAdamBenchResult r = kernels::bench_cuda_adam(n, mode->grad, mode->out,
                                                                      mode->out_dtype, static_cast<int>(reps));
      if (json) {
        std::printf("{\"device\": \"cuda\", \"mode\": \"%s\", \"params\": %zu, \"params_per_s\": %.6g, "
                    "\"bytes_per_param\": %.0f, \"copy_bytes_per_s\": %.6g, \"copy_fraction\": %.4f}\n",
                    mode->name, n, r.params_per_s, bytes_per_param, r.copy_bytes_per_s,
                    r.params_per_s * bytes_per_param / r.copy_bytes_per_s);
      } else {
        std::printf("cuda adam %s, %zu params: %.3g params/s = %.1f GB/s, %.2f of copy bandwidth (%.1f GB/s)\n",
                    mode->name, n, r.params_per_s, r.params_per_s * bytes_per_param / 1e9,
                    r.params_per_s * bytes_per_param / r.copy_bytes_per_s, r.copy_bytes_per_s / 1e9);
      }
      return 0;
    }

    optim::AdamHyperParams hp;
    optim::CpuAdam ours(hp, static_cast<int>(threads));
    optim::CpuAdam scalar(hp, static_cast<int>(threads), {}, optim::Isa::scalar);

    Array p(n * 4), m(n * 4), v(n * 4), g(n * dtype_size(mode->grad)), out(mode->out ? n * 2 : 0);
    // Bounded, normal-range values: no denormals or overflow over the repetitions.
    for (std::size_t i = 0; i < n; ++i) {
      const float x = 0.5f + static_cast<float>(i % 1000) * 1e-3f;
      p.as<float>()[i] = x;
      if (mode->grad == DType::f32) {
        g.as<float>()[i] = x - 1.0f;
      } else {
        g.as<std::uint16_t>()[i] = mode->grad == DType::bf16 ? float_to_bf16(x - 1.0f) : float_to_fp16(x - 1.0f);
      }
    }
    const std::span<float> ps(p.as<float>(), n), ms(m.as<float>(), n), vs(v.as<float>(), n);
    const optim::ConstTensorSpan gs{g.data, mode->grad, n};
    const optim::TensorSpan os{mode->out ? out.data : nullptr, mode->out_dtype, n};

    using Clock = std::chrono::steady_clock;
    auto time_pass = [](const std::function<void()>& pass) {
      const auto start = Clock::now();
      pass();
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    std::int64_t step = 1;
    std::vector<double> t_ours, t_roof, t_scalar;
    // One untimed pass of each warms the thread pool; then the three interleave, so drifting
    // machine load affects them alike.
    ours.roofline_pass(ps, ms, vs, gs, os);
    ours.step(ps, ms, vs, gs, {step++}, os);
    scalar.step(ps, ms, vs, gs, {step++}, os);
    for (long long r = 0; r < reps; ++r) {
      t_roof.push_back(time_pass([&] { ours.roofline_pass(ps, ms, vs, gs, os); }));
      t_ours.push_back(time_pass([&] { ours.step(ps, ms, vs, gs, {step++}, os); }));
      t_scalar.push_back(time_pass([&] { scalar.step(ps, ms, vs, gs, {step++}, os); }));
    }
    const double ours_pps = static_cast<double>(n) / median(t_ours);
    const double roof_pps = static_cast<double>(n) / median(t_roof);
    const double scalar_pps = static_cast<double>(n) / median(t_scalar);
    auto spread = [](const std::vector<double>& t) {
      return (*std::max_element(t.begin(), t.end()) - *std::min_element(t.begin(), t.end())) / median(t);
    };
    if (json) {
      std::printf("{\"device\": \"cpu\", \"mode\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"params\": %zu, "
                  "\"reps\": %lld, \"bytes_per_param\": %.0f, \"params_per_s\": %.6g, "
                  "\"roofline_params_per_s\": %.6g, \"roofline_ratio\": %.4f, "
                  "\"scalar_params_per_s\": %.6g, \"scalar_ratio\": %.4f, \"spread\": %.3f}\n",
                  mode->name, optim::isa_name(ours.isa()), ours.threads(), n, reps, bytes_per_param,
                  ours_pps, roof_pps, ours_pps / roof_pps, scalar_pps, scalar_pps / roof_pps,
                  spread(t_ours));
    } else {
      std::printf("cpu adam %s, %zu params, %d thread(s), %s, median of %lld:\n", mode->name, n,
                  ours.threads(), optim::isa_name(ours.isa()), reps);
      std::printf("  ours      %.4g params/s  %6.2f GB/s  %.3f of roofline\n", ours_pps,
                  ours_pps * bytes_per_param / 1e9, ours_pps / roof_pps);
      std::printf("  roofline  %.4g params/s  %6.2f GB/s  (%.0f B/param, in place)\n", roof_pps,
                  roof_pps * bytes_per_param / 1e9, bytes_per_param);
      std::printf("  scalar    %.4g params/s  %6.2f GB/s  %.3f of roofline\n", scalar_pps,
                  scalar_pps * bytes_per_param / 1e9, scalar_pps / roof_pps);
      std::printf("  spread (max-min)/median of ours: %.1f%%\n", 100.0 * spread(t_ours));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zest bench adam: %s\n", e.what());
    return 1;
  }
}

}  // namespace zest::cli
