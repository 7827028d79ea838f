// The CPU Adam against an independent double-precision reference, every instruction-set variant
// against the others (bit for bit), the threaded front end against the single-threaded kernel,
// low-precision outputs against runtime/host/half.hpp, and the argument checks.
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "optim/adam_reference.hpp"
#include "optim/cpu_adam.hpp"
#include "optim/supported_isas.hpp"
#include "runtime/host/half.hpp"
#include "runtime/host/thread_binding.hpp"

namespace zest::optim {
namespace {

using test::ReferenceAdam;
using test::supported_isas;

// Gradients as stored in `dtype`, and the same values widened to float.
struct Grads {
  std::vector<std::uint16_t> half;
  std::vector<float> f32;
  const void* data(DType dtype) const {
    return dtype == DType::f32 ? static_cast<const void*>(f32.data()) : half.data();
  }
};

Grads store_as(DType dtype, std::vector<float> values) {
  Grads g;
  if (dtype == DType::f32) {
    g.f32 = std::move(values);
    return g;
  }
  for (float x : values) {
    const std::uint16_t h = dtype == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
    g.half.push_back(h);
    g.f32.push_back(dtype == DType::bf16 ? bf16_to_float(h) : fp16_to_float(h));
  }
  return g;
}

struct State {
  std::vector<float> p, m, v;
  explicit State(const std::vector<float>& init) : p(init), m(init.size(), 0.0f), v(init.size(), 0.0f) {}
  AdamRange range(const Grads& g, DType dtype) {
    return {p.data(), m.data(), v.data(), g.data(dtype), dtype, nullptr, DType::bf16, p.size()};
  }
};

// Magnitude classes per element, cycling with the index: zeros, tiny, ordinary and huge values,
// chosen so that g*g stays finite in float (the double reference would not overflow).
float adversarial_grad_scale(DType dtype, std::size_t i) {
  static const float f32_classes[] = {0.0f, 1e-20f, 1e-6f, 1.0f, 1e4f, 1e15f, 3e-3f};
  static const float f16_classes[] = {0.0f, 1e-7f, 1e-3f, 1.0f, 6e4f, 0.5f, 3e-3f};
  const std::size_t k = i % 7;
  return dtype == DType::f16 ? f16_classes[k] : f32_classes[k];
}

float adversarial_param(std::size_t i) {
  static const float classes[] = {0.0f, 1e-30f, 1e-3f, 1.0f, -1e6f, 1e15f, 0.25f, -3.0f, 7e-8f};
  return classes[i % 9];
}

struct Case {
  OptimizerType type;
  DType grad_dtype;
  bool adversarial;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << (c.type == OptimizerType::adam ? "Adam " : "AdamW ") << dtype_name(c.grad_dtype)
      << (c.adversarial ? " adversarial" : " random");
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string name = info.param.type == OptimizerType::adam ? "Adam_" : "AdamW_";
  name.append(dtype_name(info.param.grad_dtype)).append(info.param.adversarial ? "_adversarial" : "_random");
  return name;
}

class AdamAgainstReference : public testing::TestWithParam<Case> {};

// Thousands of steps on every supported variant: each stays within stated bounds of the double
// reference, and all variants agree bit for bit (same operation order, no FMA contraction).
TEST_P(AdamAgainstReference, EveryVariantTracksDoubleReference) {
  const Case c = GetParam();
  const std::size_t n = 263;  // odd: exercises every vector width's tail
  const int steps = c.adversarial ? 1000 : 2000;
  AdamHyperParams hp{c.type, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  const double grad_scale = 1.0 / 1024.0, clip = 0.75;

  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> init(n);
  for (std::size_t i = 0; i < n; ++i)
    init[i] = c.adversarial ? adversarial_param(i) * (1.0f + 0.1f * normal(rng)) : normal(rng);

  ReferenceAdam ref(hp, init);
  const std::vector<Isa> isas = supported_isas();
  std::vector<State> states(isas.size(), State(init));
  std::vector<double> gmax(n, 0.0);  // largest |scaled gradient| each element has seen

  for (int t = 1; t <= steps; ++t) {
    std::vector<float> raw(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float magnitude = c.adversarial ? adversarial_grad_scale(c.grad_dtype, i) : 1.0f;
      raw[i] = magnitude * normal(rng) * 1024.0f / (c.grad_dtype == DType::f16 && c.adversarial ? 1024.0f : 1.0f);
      if (c.grad_dtype == DType::f16) raw[i] = std::clamp(raw[i], -60000.0f, 60000.0f);  // stay finite
    }
    const Grads g = store_as(c.grad_dtype, raw);
    for (std::size_t i = 0; i < n; ++i) {
      const double effective = std::fabs(g.f32[i] * grad_scale * clip) +
                               (c.type == OptimizerType::adam ? hp.weight_decay * std::fabs(ref.p[i]) : 0.0);
      gmax[i] = std::max(gmax[i], effective);
    }
    ref.step(g.f32, t, grad_scale, clip);
    const AdamCoefficients coef = make_adam_coefficients(hp, t, grad_scale, clip);
    for (std::size_t k = 0; k < isas.size(); ++k) adam_kernels(isas[k]).adam(states[k].range(g, c.grad_dtype), coef);
  }

  // Bounds: p accumulates one float rounding per step (relative 2^-24 each), plus the update's own
  // relative error (a few ulp of lr); m and v carry a few ulp of the largest input they have seen,
  // and v a denormal floor for tiny gradients whose squares fall below FLT_MIN. With L2 decay
  // (Adam) the gradient includes weight_decay * p, so p's own drift enters m and v too.
  const double ulp = std::ldexp(1.0, -24);
  for (std::size_t k = 0; k < isas.size(); ++k) {
    SCOPED_TRACE(isa_name(isas[k]));
    const State& s = states[k];
    double worst_p = 0, worst_m = 0, worst_v = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double p_bound = 2.0 * steps * ulp * std::fabs(ref.p[i]) + steps * hp.lr * 1e-6 + 1e-37;
      const double p_drift = c.type == OptimizerType::adam ? hp.weight_decay * p_bound : 0.0;
      const double m_bound = 64.0 * ulp * gmax[i] + p_drift + 1e-37;
      const double v_bound = 1024.0 * ulp * gmax[i] * gmax[i] + 4.0 * gmax[i] * p_drift + 1e-41;
      worst_p = std::max(worst_p, std::fabs(s.p[i] - ref.p[i]) / p_bound);
      worst_m = std::max(worst_m, std::fabs(s.m[i] - ref.m[i]) / m_bound);
      worst_v = std::max(worst_v, std::fabs(s.v[i] - ref.v[i]) / v_bound);
      ASSERT_TRUE(std::isfinite(s.p[i])) << "element " << i;
    }
    EXPECT_LE(worst_p, 1.0);
    EXPECT_LE(worst_m, 1.0);
    EXPECT_LE(worst_v, 1.0);
    // The reference really moved the parameters (a test with lr = 0 would pass trivially).
    double moved = 0;
    for (std::size_t i = 0; i < n; ++i) moved = std::max(moved, std::fabs(ref.p[i] - init[i]));
    EXPECT_GT(moved, 0.1);
    if (k > 0) {
      EXPECT_EQ(0, std::memcmp(s.p.data(), states[0].p.data(), n * 4)) << "p differs from scalar";
      EXPECT_EQ(0, std::memcmp(s.m.data(), states[0].m.data(), n * 4)) << "m differs from scalar";
      EXPECT_EQ(0, std::memcmp(s.v.data(), states[0].v.data(), n * 4)) << "v differs from scalar";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, AdamAgainstReference,
    testing::Values(Case{OptimizerType::adam, DType::f32, false}, Case{OptimizerType::adamw, DType::f32, false},
                    Case{OptimizerType::adam, DType::bf16, false}, Case{OptimizerType::adamw, DType::bf16, false},
                    Case{OptimizerType::adamw, DType::f16, false}, Case{OptimizerType::adam, DType::f16, false},
                    Case{OptimizerType::adam, DType::f32, true}, Case{OptimizerType::adamw, DType::f32, true},
                    Case{OptimizerType::adamw, DType::bf16, true}, Case{OptimizerType::adam, DType::f16, true}),
    case_name);

// With lr = 0 the master passes through unchanged, so the low-precision copy must be exactly
// half.hpp's conversion of any bit pattern: ties, subnormals, overflow to Inf, NaN payloads.
TEST(AdamLowPrecisionOut, BitExactAgainstReferenceConversion) {
  std::mt19937 rng(99);
  std::vector<std::uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                     0x7f800001u, 0xffffffffu, 0x3f808000u, 0x3f818000u, 0x3f80c000u,
                                     0x477fefffu, 0x477ff000u, 0x33000000u, 0x33000001u, 0x00000001u,
                                     0x387fc000u, 0x7f7fffffu, 0x38800000u, 0x3f800fffu, 0x3f801000u};
  for (int i = 0; i < 40000; ++i) bits.push_back(rng());
  for (int i = 0; i < 4000; ++i) bits.push_back(0x3f800000u + (rng() & 0xffffu));  // dense near 1
  const std::size_t n = bits.size() + 5;  // ragged tail
  bits.resize(n, 0x3f7fffffu);
  std::vector<float> init(n);
  for (std::size_t i = 0; i < n; ++i) init[i] = bits_float(bits[i]);
  const Grads g = store_as(DType::f32, std::vector<float>(n, 0.5f));
  const AdamCoefficients coef = make_adam_coefficients({OptimizerType::adamw, 0.0, 0.9, 0.999, 1e-8, 0.0}, 1);

  for (DType out_dtype : {DType::bf16, DType::f16}) {
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " " + std::string(dtype_name(out_dtype)));
      State s(init);
      std::vector<std::uint16_t> out(n, 0xdeadu);
      AdamRange r = s.range(g, DType::f32);
      r.out = out.data();
      r.out_dtype = out_dtype;
      adam_kernels(isa).adam(r, coef);
      std::size_t mismatches = 0, nans = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (std::isnan(init[i])) {
          ++nans;
          ASSERT_TRUE(std::isnan(s.p[i]));
        } else {
          ASSERT_EQ(float_bits(s.p[i]), bits[i]) << "master changed at " << i;
        }
        const std::uint16_t want = out_dtype == DType::bf16 ? float_to_bf16(s.p[i]) : float_to_fp16(s.p[i]);
        mismatches += out[i] != want;
      }
      EXPECT_EQ(mismatches, 0u);
      EXPECT_GT(nans, 10u);  // the random patterns included NaNs, so NaN handling was exercised
    }
  }
}

// Odd lengths at unaligned addresses: same result as the scalar variant, nothing outside touched.
TEST(AdamKernels, OddLengthsUnalignedAndGuarded) {
  const AdamCoefficients coef = make_adam_coefficients({OptimizerType::adam, 1e-2, 0.9, 0.99, 1e-8, 0.1}, 3, 0.5, 0.9);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t n : {0u, 1u, 3u, 7u, 8u, 9u, 15u, 16u, 17u, 31u, 33u, 100u, 1031u}) {
    for (DType gd : {DType::f32, DType::bf16, DType::f16}) {
      std::vector<float> init(n + 2), raw(n + 2);
      for (auto& x : init) x = normal(rng);
      for (auto& x : raw) x = normal(rng);
      const Grads g = store_as(gd, raw);
      std::vector<std::vector<float>> results;
      std::vector<std::vector<std::uint16_t>> outs;
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " n=" + std::to_string(n));
        State s(init);
        std::fill(s.m.begin(), s.m.end(), 0.01f);
        std::fill(s.v.begin(), s.v.end(), 0.02f);
        std::vector<std::uint16_t> out(n + 2, 0xabcdu);
        // Offset by one element: 4-byte (fp32) and 2-byte (bf16) aligned, never 64-byte aligned.
        AdamRange r{s.p.data() + 1, s.m.data() + 1, s.v.data() + 1,
                    static_cast<const unsigned char*>(g.data(gd)) + dtype_size(gd), gd, out.data() + 1,
                    DType::bf16, n};
        adam_kernels(isa).adam(r, coef);
        EXPECT_EQ(float_bits(s.p[0]), float_bits(init[0]));
        EXPECT_EQ(float_bits(s.p[n + 1]), float_bits(init[n + 1]));
        EXPECT_EQ(s.m[n + 1], 0.01f);
        EXPECT_EQ(s.v[0], 0.02f);
        EXPECT_EQ(out[0], 0xabcdu);
        EXPECT_EQ(out[n + 1], 0xabcdu);
        results.push_back(s.p);
        outs.push_back(out);
      }
      for (std::size_t k = 1; k < results.size(); ++k) {
        EXPECT_EQ(0, std::memcmp(results[k].data(), results[0].data(), (n + 2) * 4)) << "n=" << n;
        EXPECT_EQ(outs[k], outs[0]) << "n=" << n;
      }
    }
  }
}

// Normal random weights and gradients of n elements, the gradients stored as bf16 too.
struct RandomProblem {
  std::vector<float> init, raw;
  Grads g;
  RandomProblem(std::size_t n, unsigned seed) : init(n), raw(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& x : init) x = normal(rng);
    for (auto& x : raw) x = normal(rng);
    g = store_as(DType::bf16, raw);
  }
};

constexpr AdamHyperParams kAdamW{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01};

TEST(CpuAdam, ThreadsAndTilesGiveTheKernelsResult) {
  const std::size_t n = 3 * CpuAdam::kTileElements + 123;
  const RandomProblem problem(n, 5);
  const std::vector<float>& init = problem.init;
  const Grads& g = problem.g;
  const AdamHyperParams hp = kAdamW;

  State expect(init);
  std::vector<std::uint16_t> expect_out(n);
  AdamRange r = expect.range(g, DType::bf16);
  r.out = expect_out.data();
  adam_kernels(Isa::scalar).adam(r, make_adam_coefficients(hp, 4, 0.25, 0.5));

  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    CpuAdam adam(hp, threads);
    EXPECT_EQ(adam.threads(), threads);
    State s(init);
    std::vector<std::uint16_t> out(n);
    adam.step(s.p, s.m, s.v, {g.data(DType::bf16), DType::bf16, n}, {4, 0.25, 0.5},
              {out.data(), DType::bf16, n});
    EXPECT_EQ(0, std::memcmp(s.p.data(), expect.p.data(), n * 4));
    EXPECT_EQ(0, std::memcmp(s.v.data(), expect.v.data(), n * 4));
    EXPECT_EQ(out, expect_out);
  }
}

// step_from: the result of step() in the destination, bit for bit, with the source untouched (the
// offloaded optimizer's update ahead of the step keeps the current states this way).
TEST(CpuAdam, StepFromWritesStepsResultElsewhereAndLeavesTheSource) {
  const std::size_t n = 2 * CpuAdam::kTileElements + 77;
  const RandomProblem problem(n, 9);
  const std::vector<float>& init = problem.init;
  const std::vector<float>& raw = problem.raw;
  const Grads& g = problem.g;
  const AdamStepArgs args{3, 0.5, 0.75};
  CpuAdam adam(kAdamW, 2);

  // Moments from an earlier step, so that all three states carry information.
  const auto with_moments = [&] {
    State s(init);
    for (std::size_t i = 0; i < n; ++i) {
      s.m[i] = 0.1f * raw[i];
      s.v[i] = 0.01f * raw[i] * raw[i];
    }
    return s;
  };
  State in_place = with_moments();
  std::vector<std::uint16_t> expect_out(n);
  adam.step(in_place.p, in_place.m, in_place.v, {g.data(DType::bf16), DType::bf16, n}, args,
            {expect_out.data(), DType::bf16, n});

  const State source = with_moments();
  State dest(std::vector<float>(n, 42.0f));
  dest.m.assign(n, 42.0f);
  dest.v.assign(n, 42.0f);
  std::vector<std::uint16_t> out(n);
  adam.step_from({source.p.data(), source.m.data(), source.v.data()}, dest.p, dest.m, dest.v,
                 {g.data(DType::bf16), DType::bf16, n}, args, {out.data(), DType::bf16, n});
  EXPECT_EQ(0, std::memcmp(dest.p.data(), in_place.p.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(dest.m.data(), in_place.m.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(dest.v.data(), in_place.v.data(), n * 4));
  EXPECT_EQ(out, expect_out);
  const State untouched = with_moments();
  EXPECT_EQ(0, std::memcmp(source.p.data(), untouched.p.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(source.m.data(), untouched.m.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(source.v.data(), untouched.v.data(), n * 4));
  EXPECT_THROW(adam.step_from({}, dest.p, dest.m, dest.v, {g.data(DType::bf16), DType::bf16, n}, args), Error);
}

// The engine builds its CpuAdam with the rank's cpus (Device::host_cpus) and optimizer.threads (0
// by default): it must run there, one thread per cpu, and not on the first cpu of the machine
// (where every rank of a node used to meet). Without cpus it spreads over every allowed cpu.
TEST(CpuAdam, RunsOnTheCpusItIsGivenOneThreadEachElseOnEveryAllowedCpu) {
  const std::vector<int> allowed = detail::allowed_cpus();
  const int last = allowed.back();
  const AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  EXPECT_EQ(CpuAdam(hp, 0, {last}).threads(), 1);
  EXPECT_EQ(CpuAdam(hp, 3, {last}).threads(), 3);
  EXPECT_EQ(CpuAdam(hp, 0).threads(), static_cast<int>(allowed.size()));
  EXPECT_EQ(PinnedArena(1, {}).cpus(), allowed);

  PinnedArena arena(2, {last});
  EXPECT_EQ(arena.cpus(), std::vector<int>{last});
  std::mutex mutex;
  std::set<int> ran_on;
  arena.for_each_tile(64, 1, [&](std::size_t, std::size_t) {
    const int cpu = sched_getcpu();  // pinned threads run only on their cpu
    const std::lock_guard lock(mutex);
    ran_on.insert(cpu);
  });
  EXPECT_EQ(ran_on, std::set<int>{last});
}

// threads 0 counts the cpus given, whatever order the constructor's arguments are evaluated in.
TEST(CpuAdam, ZeroThreadsCountTheGivenCpus) {
  const AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  EXPECT_EQ(CpuAdam(hp, 0, {detail::allowed_cpus().front()}).threads(), 1);
}

TEST(CpuAdam, GradStatsSumOfSquaresAndNonfinite) {
  const std::size_t n = 2 * CpuAdam::kTileElements + 77;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> raw(n);
  for (auto& x : raw) x = normal(rng);
  raw[5] = 1e30f;  // huge but finite: its square overflows float, not the double sum
  CpuAdam adam({}, 2);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<float> values = raw;
    if (dtype == DType::f16) values[5] = 60000.0f;
    Grads g = store_as(dtype, values);
    long double want = 0;
    for (float x : g.f32) want += static_cast<long double>(x) * x;
    for (Isa isa : supported_isas()) {
      const GradStats s = adam_kernels(isa).grad_stats(g.data(dtype), dtype, n);
      EXPECT_FALSE(s.nonfinite) << isa_name(isa);
      EXPECT_NEAR(s.sum_squares, static_cast<double>(want), 1e-12 * static_cast<double>(want)) << isa_name(isa);
    }
    const GradStats threaded = adam.grad_stats({g.data(dtype), dtype, n});
    EXPECT_NEAR(threaded.sum_squares, static_cast<double>(want), 1e-12 * static_cast<double>(want));
    // One Inf or NaN anywhere, including the ragged tail, is found.
    for (std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
      for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
        std::vector<float> v2 = values;
        v2[at] = bad;
        Grads g2 = store_as(dtype, v2);
        for (Isa isa : supported_isas())
          EXPECT_TRUE(adam_kernels(isa).grad_stats(g2.data(dtype), dtype, n).nonfinite)
              << isa_name(isa) << " at " << at;
        EXPECT_TRUE(adam.grad_stats({g2.data(dtype), dtype, n}).nonfinite);
      }
    }
  }
}

TEST(CpuAdam, RejectsMismatchedArguments) {
  CpuAdam adam({}, 1);
  std::vector<float> p(6), m(6), v(5), g(6);
  try {
    adam.step(p, m, v, {g.data(), DType::f32, 6}, {});
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("v has 5 elements but master has 6"), std::string::npos) << e.what();
  }
  std::vector<float> v6(6);
  EXPECT_THROW(adam.step(p, m, v6, {nullptr, DType::f32, 6}, {}), Error);
  std::vector<float> out(5);
  try {
    adam.step(p, m, v6, {g.data(), DType::f32, 6}, {}, {out.data(), DType::f32, 5});
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out has 5 elements but master has 6"), std::string::npos) << e.what();
  }
  try {
    adam.step(p, m, v6, {g.data(), DType::f32, 6}, {0, 1.0, 1.0});
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("count from 1, got 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(CpuAdam({}, -1), Error);
  EXPECT_THROW(CpuAdam({}, 1, {100000}), Error);
}

TEST(Isa, EnvironmentForcesAVariant) {
  const char* saved = std::getenv("ZEST_ADAM_ISA");
  const std::string restore = saved ? saved : "";
  setenv("ZEST_ADAM_ISA", "scalar", 1);
  EXPECT_EQ(select_isa(), Isa::scalar);
  EXPECT_EQ(CpuAdam({}, 1).isa(), Isa::scalar);
  setenv("ZEST_ADAM_ISA", "sse9", 1);
  try {
    select_isa();
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ZEST_ADAM_ISA=sse9"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("scalar, avx2 or avx512"), std::string::npos);
  }
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    setenv("ZEST_ADAM_ISA", isa_name(isa), 1);
    if (cpu_supports(isa)) {
      EXPECT_EQ(select_isa(), isa);
    } else {
      EXPECT_THROW(select_isa(), Error);
    }
  }
  unsetenv("ZEST_ADAM_ISA");
  const Isa best = select_isa();
  EXPECT_TRUE(cpu_supports(best));
  if (cpu_supports(Isa::avx512)) {
    EXPECT_EQ(best, Isa::avx512);
  }
  if (!restore.empty()) setenv("ZEST_ADAM_ISA", restore.c_str(), 1);
}

}  // namespace
}  // namespace zest::optim
