// Compact optimizer states (docs/compact-states.md): every instruction-set variant of the bf16-states
// Adam equals the independent scalar reference (compact_reference.hpp) bit for bit; the threaded
// front end does too, whatever its tiling; stochastic rounding is unbiased; and v decays under
// beta2 = 0.999 where round-to-nearest provably stalls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "optim/compact_math.hpp"
#include "optim/compact_reference.hpp"
#include "optim/cpu_adam.hpp"
#include "optim/states_layout.hpp"
#include "optim/supported_isas.hpp"
#include "runtime/host/half.hpp"

namespace zest::optim {
namespace {

using test::ReferenceBf16StatesAdam;
using test::StateRoundingMode;
using test::bits_of;
using test::widen_bf16;
using test::reference_master_bits;
using test::reference_stochastic_bf16;
using test::supported_isas;

// Gradients as the kernel reads them (`dtype`) and as the reference does (widened to float).
struct Grads {
  DType dtype = DType::f32;
  std::vector<std::uint16_t> half;
  std::vector<float> f32;
  const void* data() const { return dtype == DType::f32 ? static_cast<const void*>(f32.data()) : half.data(); }
};

Grads random_grads(DType dtype, std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Grads g{dtype, {}, {}};
  for (std::size_t i = 0; i < n; ++i) {
    // Spread magnitudes over several binades, with some zeros.
    const float x = i % 11 == 3 ? 0.0f : normal(rng) * std::ldexp(1.0f, static_cast<int>(i % 9) - 6);
    if (dtype == DType::f32) {
      g.f32.push_back(x);
    } else {
      const std::uint16_t h = dtype == DType::bf16 ? float_to_bf16(x) : float_to_fp16(x);
      g.half.push_back(h);
      g.f32.push_back(dtype == DType::bf16 ? bf16_to_float(h) : fp16_to_float(h));
    }
  }
  return g;
}

struct Bf16States {
  std::vector<float> p;
  std::vector<std::uint16_t> m, v;
  explicit Bf16States(std::size_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) p.push_back(uniform(rng));
    m.assign(n, 0);
    v.assign(n, 0);
  }
};

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(bits_of(a[i]), bits_of(b[i])) << what << " element " << i << ": " << a[i] << " vs " << b[i];
}

void expect_same(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(a[i], b[i]) << what << " element " << i << ": " << widen_bf16(a[i]) << " vs " << widen_bf16(b[i]);
}

struct KernelCase {
  AdamHyperParams hp;
  DType grad_dtype;
  bool out;
  std::uint64_t first_index;
};

// Odd lengths (every tail of every vector width), several steps, each gradient type, with and
// without the bf16 parameter copy, and a first index whose vectors cross 2^32 (the carry).
TEST(CompactAdam, EveryVariantEqualsTheReferenceBitForBit) {
  const AdamHyperParams adamw{OptimizerType::adamw, 1e-2, 0.9, 0.999, 1e-8, 0.1};
  const AdamHyperParams adam{OptimizerType::adam, 3e-3, 0.8, 0.99, 1e-6, 0.01};
  const std::uint64_t seed = 0x5eed1234abcdull;
  for (const KernelCase& kc : {KernelCase{adamw, DType::f32, false, 0}, KernelCase{adamw, DType::bf16, true, 12345},
                               KernelCase{adam, DType::f16, true, (1ull << 32) - 5},
                               KernelCase{adam, DType::f32, false, (1ull << 40) + 3}}) {
    for (std::size_t n : {1u, 2u, 7u, 8u, 15u, 16u, 17u, 31u, 33u, 100u, 1027u}) {
      std::mt19937 rng(static_cast<unsigned>(n));
      const Bf16States init(n, rng);
      std::vector<Grads> grads;
      for (int s = 0; s < 5; ++s) grads.push_back(random_grads(kc.grad_dtype, n, rng));
      ReferenceBf16StatesAdam reference{kc.hp, seed, StateRoundingMode::stochastic};
      Bf16States want = init;
      std::vector<std::vector<std::uint16_t>> want_out;
      for (int s = 0; s < 5; ++s) {
        reference.step(want.p, want.m, want.v, grads[s].f32, s + 1, kc.first_index, 0.5, 0.75);
        std::vector<std::uint16_t> out;
        for (float x : want.p) out.push_back(float_to_bf16(x));
        want_out.push_back(out);
      }
      for (Isa isa : supported_isas()) {
        const std::string what = std::string(isa_name(isa)) + " n=" + std::to_string(n) + " grad " +
                                 std::string(dtype_name(kc.grad_dtype)) + " first " + std::to_string(kc.first_index);
        Bf16States got = init;
        std::vector<std::uint16_t> out(n);
        for (int s = 0; s < 5; ++s) {
          CompactAdamRange r;
          r.master = got.p.data();
          r.m = got.m.data();
          r.v = got.v.data();
          r.grad = grads[s].data();
          r.grad_dtype = kc.grad_dtype;
          r.out = kc.out ? out.data() : nullptr;
          r.count = n;
          r.first_index = kc.first_index;
          adam_kernels(isa).adam_compact(r, make_adam_coefficients(kc.hp, s + 1, 0.5, 0.75),
                                         StateRounding{rounding_key(seed, s + 1)});
          if (kc.out) expect_same(out, want_out[s], what + " out step " + std::to_string(s + 1));
        }
        expect_same_bits(got.p, want.p, what + " p");
        expect_same(got.m, want.m, what + " m");
        expect_same(got.v, want.v, what + " v");
      }
    }
  }
}

// A bf16 master (optimizer.master: bf16) with bf16 or int8 states: the master widened, the same
// step, the result rounded stochastically with the master's bits; every variant and thread count
// equals that reference bit for bit, over tiles (the third, short one too), the bf16 copy is the
// master itself, and updates far below a bf16 step still move the master (unbiased rounding).
TEST(CompactAdam, Bf16MasterEqualsTheReferenceBitForBit) {
  const AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  const std::size_t n = 2 * CpuAdam::kTileElements + 77;
  const std::uint64_t first_index = (1ull << 32) - 1000, seed = 99;
  for (const StatesFormat format : {StatesFormat::bf16, StatesFormat::int8}) {
    std::mt19937 rng(5);
    std::vector<std::uint16_t> init(n);
    for (auto& x : init) x = float_to_bf16(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng));
    const std::size_t states = format == StatesFormat::bf16 ? 2 : 1;
    const std::size_t blocks = (n + kInt8Block - 1) / kInt8Block;
    // The reference: fp32 master widened from the bf16 one, stepped by the fp32-master CpuAdam
    // (itself held to the references above), then rounded with reference_master_bits.
    std::vector<std::uint16_t> want = init;
    std::vector<unsigned char> want_m(n * states, 0), want_v(n * states, 0);
    std::vector<float> want_ms(blocks, 0), want_vs(blocks, 0);
    CpuAdam scalar(hp, 1, {}, Isa::scalar);
    std::vector<Grads> grads;
    for (std::int64_t step = 1; step <= 3; ++step) {
      grads.push_back(random_grads(DType::bf16, n, rng));
      std::vector<float> p(n);
      for (std::size_t i = 0; i < n; ++i) p[i] = widen_bf16(want[i]);
      scalar.step_compact(p, {format, want_m.data(), want_v.data(), n, want_ms.data(), want_vs.data()},
                          {grads.back().data(), DType::bf16, n}, {step}, {seed, first_index});
      for (std::size_t i = 0; i < n; ++i)
        want[i] = reference_stochastic_bf16(p[i], reference_master_bits(seed, step, first_index + i));
    }
    for (Isa isa : supported_isas()) {
      for (int threads : {1, 3}) {
        const std::string what = std::string(states_format_name(format)) + " states, " + isa_name(isa) + ", " +
                                 std::to_string(threads) + " thread(s)";
        CpuAdam adam(hp, threads, {}, isa);
        std::vector<std::uint16_t> got = init, out(n);
        std::vector<unsigned char> m(n * states, 0), v(n * states, 0);
        std::vector<float> ms(blocks, 0), vs(blocks, 0);
        for (std::int64_t step = 1; step <= 3; ++step)
          adam.step_compact(std::span<std::uint16_t>(got), {format, m.data(), v.data(), n, ms.data(), vs.data()},
                            {grads[static_cast<std::size_t>(step - 1)].data(), DType::bf16, n}, {step},
                            {seed, first_index}, {out.data(), DType::bf16, n});
        expect_same(got, want, what + " master");
        expect_same(out, got, what + " copy");
        EXPECT_EQ(m, want_m) << what;
        EXPECT_EQ(v, want_v) << what;
      }
    }
  }
  // lr 1e-6 against weights near 1 (a bf16 step there is 2^-7): round to nearest would never move
  // them; stochastic rounding moves each by the expected amount on average.
  const AdamHyperParams tiny{OptimizerType::adam, 1e-6, 0.9, 0.999, 1e-8, 0.0};
  const std::size_t k = 4096;
  std::vector<std::uint16_t> master(k, float_to_bf16(1.0f));
  std::vector<std::uint16_t> m(k, 0), v(k, 0);
  std::vector<float> g(k, 1.0f);
  CpuAdam adam(tiny, 1);
  const int steps = 200;
  for (std::int64_t step = 1; step <= steps; ++step)
    adam.step_compact(std::span<std::uint16_t>(master), {StatesFormat::bf16, m.data(), v.data(), k},
                      {g.data(), DType::f32, k}, {step}, {1, 0});
  double mean = 0;
  for (std::uint16_t x : master) mean += widen_bf16(x);
  mean /= static_cast<double>(k);
  EXPECT_NEAR(mean, 1.0 - steps * 1e-6, 3e-5);  // Adam's step with constant gradients is lr
  EXPECT_LT(mean, 1.0 - steps * 1e-6 / 2);
}

TEST(CompactAdam, Bf16MasterRefusesWhatItCannotDo) {
  CpuAdam adam(AdamHyperParams{}, 1);
  std::vector<std::uint16_t> master(4);
  std::vector<float> m(4), v(4), g(4), out(4);
  EXPECT_THROW(adam.step_compact(std::span<std::uint16_t>(master), {StatesFormat::f32, m.data(), v.data(), 4},
                                 {g.data(), DType::f32, 4}, {1}, {}),
               Error);
  std::vector<std::uint16_t> m16(4), v16(4);
  EXPECT_THROW(adam.step_compact(std::span<std::uint16_t>(master), {StatesFormat::bf16, m16.data(), v16.data(), 4},
                                 {g.data(), DType::f32, 4}, {1}, {}, {out.data(), DType::f32, 4}),
               Error);
}

// Tiles and threads change nothing: the bits depend on the global index only.
TEST(CompactAdam, ThreadedFrontEndEqualsTheReference) {
  const AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  const std::size_t n = 3 * CpuAdam::kTileElements + 77;
  const std::uint64_t first_index = 987654321;
  std::mt19937 rng(7);
  const Bf16States init(n, rng);
  ReferenceBf16StatesAdam reference{hp, 42, StateRoundingMode::stochastic};
  for (Isa isa : supported_isas()) {
    CpuAdam adam(hp, 3, {}, isa);
    Bf16States want = init;
    Bf16States got = init;
    std::mt19937 grad_rng(11);
    for (std::int64_t step = 1; step <= 3; ++step) {
      const Grads g = random_grads(DType::bf16, n, grad_rng);
      reference.step(want.p, want.m, want.v, g.f32, step, first_index);
      adam.step_compact(got.p, {StatesFormat::bf16, got.m.data(), got.v.data(), n},
                        {g.data(), DType::bf16, n}, {step}, {42, first_index});
    }
    expect_same_bits(got.p, want.p, std::string(isa_name(isa)) + " p");
    expect_same(got.m, want.m, std::string(isa_name(isa)) + " m");
    expect_same(got.v, want.v, std::string(isa_name(isa)) + " v");
  }
}

TEST(CompactAdam, Fp32FormatIsStepBitForBit) {
  const AdamHyperParams hp{OptimizerType::adam, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  const std::size_t n = 1000;
  std::mt19937 rng(3);
  const Grads g = random_grads(DType::f32, n, rng);
  std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  std::vector<float> p2 = p, m2 = m, v2 = v;
  CpuAdam adam(hp, 2);
  for (std::int64_t step = 1; step <= 3; ++step) {
    adam.step(p, m, v, {g.f32.data(), DType::f32, n}, {step});
    adam.step_compact(p2, {StatesFormat::f32, m2.data(), v2.data(), n}, {g.f32.data(), DType::f32, n}, {step},
                      {99, 5});
  }
  expect_same_bits(p2, p, "p");
  expect_same_bits(m2, m, "m");
  expect_same_bits(v2, v, "v");
}

// The shared rounding equals the reference for every 16-bit r on values of every kind, and is
// exactly unbiased over r: of the 65536 values of r, exactly (u & 0xffff) round up, so the mean
// over a uniform r is x itself.
TEST(StochasticRounding, SharedMathEqualsReferenceAndIsExactlyUnbiasedOverR) {
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 1.00390625f, 1.0f + 0x1p-9f, -3.14159f, 0.999f * 0.7f,
                            1e-40f, -1e-42f, 0x1p-126f, 3.3e38f, -3.4028235e38f, INFINITY, -INFINITY,
                            std::nanf(""), -std::nanf("0x12345"), 1e30f, 6.1e-5f};
  for (float x : specials) {
    const std::uint32_t u = bits_of(x);
    std::uint32_t ups = 0;
    for (std::uint32_t r = 0; r < 0x10000u; ++r) {
      const std::uint32_t got = stochastic_round_bf16_bits<std::uint32_t>(u, r);
      ASSERT_EQ(got, test::reference_stochastic_bf16(x, static_cast<std::uint16_t>(r))) << x << " r=" << r;
      if (got != (u >> 16)) ++ups;
    }
    if (!std::isnan(x)) {
      EXPECT_EQ(ups, u & 0xffffu) << x;
    }
  }
}

// The hash's bits are uniform enough: over 2^20 consecutive elements, the mean of the rounded value
// of a fixed x is within 6 standard deviations of x, for both the m (low) and v (high) 16 bits.
// Each rounding is x_lo + ulp * Bernoulli(f), so the mean of N has standard deviation
// ulp * sqrt(f (1 - f) / N); 6 sigma makes a false failure (for truly random bits) ~2e-9.
TEST(StochasticRounding, UnbiasedOverElementsWithAFixedSeed) {
  const std::size_t n = std::size_t{1} << 20;
  const std::uint64_t key = rounding_key(2024, 17);
  for (float x : {1.0f + 0x1p-9f, 0.3f, -7.77f, 1.0f + 0x1p-16f * 3.0f}) {
    const std::uint32_t u = bits_of(x);
    const double lo = std::fabs(static_cast<double>(widen_bf16(static_cast<std::uint16_t>(u >> 16))));
    const double ulp = std::fabs(static_cast<double>(widen_bf16(static_cast<std::uint16_t>((u >> 16) + 1)))) - lo;
    const double f = (std::fabs(static_cast<double>(x)) - lo) / ulp;
    const double sigma = ulp * std::sqrt(f * (1.0 - f) / static_cast<double>(n));
    for (int half : {0, 1}) {
      double sum = 0.0;
      for (std::uint64_t i = 0; i < n; ++i) {
        std::uint32_t lo_word = 0;
        std::uint32_t hi_word = 0;
        add_index<std::uint32_t>(0xfff00000u, 7u, static_cast<std::uint32_t>(i), lo_word, hi_word);
        const std::uint32_t bits = state_random_bits<std::uint32_t>(lo_word, hi_word, static_cast<std::uint32_t>(key),
                                                                    static_cast<std::uint32_t>(key >> 32));
        const std::uint32_t r = half == 0 ? (bits & 0xffffu) : (bits >> 16);
        sum += widen_bf16(static_cast<std::uint16_t>(stochastic_round_bf16_bits<std::uint32_t>(u, r)));
      }
      const double mean = sum / static_cast<double>(n);
      EXPECT_LE(std::fabs(mean - static_cast<double>(x)), 6.0 * sigma)
          << x << (half == 0 ? " m bits" : " v bits") << ": mean " << mean << ", sigma " << sigma;
    }
  }
}

// Round to nearest: 0.999 * v differs from v by less than half a bf16 ulp for every bf16 v (the
// design note's arithmetic; every binade behaves as [1, 2)), so v never decays. Stochastic
// rounding follows 0.999^t in expectation; the kernels show it over 693 steps (0.999^693 ~ 0.5).
TEST(CompactAdam, RoundToNearestStallsVWhereStochasticRoundingDecays) {
  const float beta2 = 0.999f;
  const float one_minus_beta2 = static_cast<float>(1.0 - 0.999);
  for (std::uint16_t h = 0x3f80; h < 0x4000; ++h) {  // every bf16 in [1, 2)
    const float v = widen_bf16(h);
    const float decayed = v * beta2 + (0.0f * 0.0f) * one_minus_beta2;  // adam_update with g = 0
    ASSERT_LT(decayed, v);
    ASSERT_EQ(float_to_bf16(decayed), h) << v << " decays under round to nearest";
  }

  const AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.0};
  const std::size_t n = 4096;
  const int steps = 693;
  const std::vector<float> g(n, 0.0f);
  std::vector<float> p(n, 1.0f);
  std::vector<std::uint16_t> m(n, 0), v(n, float_to_bf16(1.0f));
  std::vector<float> p_rtn = p;
  std::vector<std::uint16_t> m_rtn = m, v_rtn = v;
  const ReferenceBf16StatesAdam nearest{hp, 1, StateRoundingMode::nearest};
  for (Isa isa : supported_isas()) {
    CpuAdam adam(hp, 2, {}, isa);
    std::vector<float> pk = p;
    std::vector<std::uint16_t> mk = m, vk = v;
    for (int s = 1; s <= steps; ++s)
      adam.step_compact(pk, {StatesFormat::bf16, mk.data(), vk.data(), n}, {g.data(), DType::f32, n}, {s}, {1, 0});
    // v stays in (0, 1], where every rounding is between bf16 neighbours at most 2^-8 apart, so each
    // adds variance at most (2^-8)^2 / 4: after t steps an element's standard deviation is below
    // sqrt(t) * 2^-9 = 0.051, the mean of n's below 0.051 / 64 = 0.0008. The bound is 6 of those.
    double sum = 0.0;
    for (std::uint16_t h : vk) sum += widen_bf16(h);
    const double expected = std::pow(static_cast<double>(beta2), steps);
    EXPECT_NEAR(sum / static_cast<double>(n), expected, 0.005) << isa_name(isa);
  }
  for (int s = 1; s <= steps; ++s) nearest.step(p_rtn, m_rtn, v_rtn, g, s, 0);
  for (std::uint16_t h : v_rtn) ASSERT_EQ(h, float_to_bf16(1.0f)) << "round to nearest moved v";
}

TEST(CompactAdam, RefusesWhatItCannotDo) {
  const AdamHyperParams hp{};
  CpuAdam adam(hp, 1);
  std::vector<float> p(4, 0.0f), g(4, 0.0f);
  std::vector<std::uint16_t> m(4, 0), v(4, 0);
  EXPECT_THROW(adam.step_compact(p, {StatesFormat::int8, m.data(), v.data(), 4}, {g.data(), DType::f32, 4}, {1}, {}),
               Error);  // no scales
  EXPECT_THROW(adam.roofline_compact_pass(p, {StatesFormat::int8, m.data(), v.data(), 4}, {g.data(), DType::f32, 4}),
               Error);  // no scales
  EXPECT_THROW(adam.step_compact(p, {StatesFormat::bf16, m.data(), v.data(), 3}, {g.data(), DType::f32, 4}, {1}, {}),
               Error);
  EXPECT_THROW(adam.step_compact(p, {StatesFormat::bf16, nullptr, v.data(), 4}, {g.data(), DType::f32, 4}, {1}, {}),
               Error);
  EXPECT_THROW(adam.step_compact(p, {StatesFormat::bf16, m.data(), v.data(), 4}, {g.data(), DType::f32, 4}, {1},
                                 {0, UINT64_MAX - 2}),
               Error);
}

// The dynamic code as built for the kernels equals its definition, increases, and has midpoints
// that are floats exactly (so float comparisons decide nearest exactly).
TEST(Int8States, DynamicCodeMatchesItsDefinition) {
  for (bool is_signed : {true, false}) {
    const DynamicCode code = make_dynamic_code(is_signed);
    const int width = is_signed ? 7 : 8;
    ASSERT_EQ(code.magnitudes, 1u << width);
    for (std::uint32_t b = 0; b < code.magnitudes; ++b) {
      ASSERT_EQ(bits_of(code.values[b]), bits_of(test::reference_code_value(b, width))) << b;
      if (b + 1 < code.magnitudes) {
        ASSERT_LT(code.values[b], code.values[b + 1]) << b;
        ASSERT_EQ(2.0 * static_cast<double>(code.midpoints[b]),
                  static_cast<double>(code.values[b]) + static_cast<double>(code.values[b + 1])) << b;
      }
    }
    EXPECT_EQ(code.values[code.magnitudes - 1], 1.0f);
  }
}

// Blocks of every kind (zeros, -0, a subnormal scale, many binades, a short block) through the
// shared quantizer equal the brute-force reference byte for byte, and each element's round trip
// error is at most the code's largest half gap times the scale: 0.9/128 * scale for m, below the
// scale/127 of a linear code, and 0.9/256 * scale for v. The slack covers the two float roundings
// (|x| / scale, value * scale): a few units in the last place of the scale.
TEST(Int8States, QuantizerEqualsReferenceAndRoundTripIsBounded) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (bool is_signed : {true, false}) {
    const DynamicCode code = make_dynamic_code(is_signed);
    double half_gap = 0.0;
    for (std::uint32_t b = 0; b + 1 < code.magnitudes; ++b)
      half_gap = std::max(half_gap, (static_cast<double>(code.values[b + 1]) - code.values[b]) / 2.0);
    // Rounding the values to 16 significant bits moves each by at most 2^-17, a half gap by as much.
    EXPECT_LE(half_gap, (is_signed ? 0.9 / 128.0 : 0.9 / 256.0) + 0x1p-17);
    EXPECT_LT(half_gap, 1.0 / 127.0);
    for (int trial = 0; trial < 40; ++trial) {
      const std::size_t n = trial % 5 == 4 ? 37 : kInt8Block;  // a short last block too
      std::vector<float> x(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float magnitude = std::ldexp(normal(rng), -static_cast<int>(rng() % 24));  // many binades
        x[i] = is_signed ? magnitude : magnitude * magnitude;
      }
      if (trial == 0) std::fill(x.begin(), x.end(), 0.0f);
      if (trial == 1) x[3] = -0.0f;
      if (trial == 2)
        for (float& value : x) value *= 1e-39f;  // a subnormal scale
      std::vector<std::uint8_t> want;
      const float want_scale = test::reference_quantize_block(is_signed, x, want);
      std::vector<std::uint8_t> got(n);
      const float scale = quantize_block(code, is_signed, x.data(), n, got.data());
      ASSERT_EQ(bits_of(scale), bits_of(want_scale));
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], want[i]) << (is_signed ? "m" : "v") << " trial " << trial << " element " << i;
        const float back = dequantize(code, is_signed, got[i], scale);
        ASSERT_EQ(bits_of(back), bits_of(test::reference_dequantize(is_signed, want[i], want_scale)));
        const double bound = half_gap * scale + 4.0 * std::ldexp(static_cast<double>(scale), -23);
        ASSERT_LE(std::fabs(static_cast<double>(back) - x[i]), bound) << x[i] << " -> " << back;
      }
    }
  }
}

struct Int8States {
  std::vector<float> p;
  std::vector<std::uint8_t> m, v;
  std::vector<float> m_scale, v_scale;
  Int8States(std::size_t n, std::mt19937& rng) : m(n, 0), v(n, 0) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) p.push_back(uniform(rng));
    m_scale.assign((n + kInt8Block - 1) / kInt8Block, 0.0f);
    v_scale = m_scale;
  }
  CpuAdam::CompactStates states() {
    return {StatesFormat::int8, m.data(), v.data(), p.size(), m_scale.data(), v_scale.data()};
  }
  void expect_equal(const Int8States& want, const std::string& what) const {
    expect_same_bits(p, want.p, what + " p");
    expect_same_bits(m_scale, want.m_scale, what + " m scales");
    expect_same_bits(v_scale, want.v_scale, what + " v scales");
    ASSERT_EQ(m, want.m) << what << " m bytes";
    ASSERT_EQ(v, want.v) << what << " v bytes";
  }
};

// v's code keeps every finite positive value off 0 (unsigned_code_byte): far below its block's
// largest, a v stores the smallest code value, 1e-7 of the scale, so √v never collapses to 0 while
// m does not (the update would be m / eps). 0, -0 and NaN still store 0; m's code is unchanged.
TEST(Int8States, NoPositiveVStoresZero) {
  const DynamicCode code = make_dynamic_code(false);
  const std::vector<float> x{1.0f, 1e-12f, 0.0f, -0.0f, 3e-8f, 6e-8f, 0.5f, std::nanf("")};
  std::vector<std::uint8_t> q(x.size());
  EXPECT_EQ(quantize_block(code, false, x.data(), x.size(), q.data()), 1.0f);
  EXPECT_EQ(q, (std::vector<std::uint8_t>{255, 1, 0, 0, 1, 1, q[6], 0}));
  EXPECT_GT(q[6], 1);
  EXPECT_EQ(dequantize(code, false, 1, 1.0f), code.values[1]);
  EXPECT_NEAR(code.values[1], 1e-7, 1e-12);
  // m: a value far below the block's largest still rounds to 0 (the update is then 0 / √v).
  const DynamicCode signed_code = make_dynamic_code(true);
  const std::vector<float> m{1.0f, 1e-12f};
  std::vector<std::uint8_t> qm(2);
  quantize_block(signed_code, true, m.data(), 2, qm.data());
  EXPECT_EQ(qm[1], 0);
}

// Where a range has three blocks or more, its second block's gradients become zeros (scales stay
// 0) and its third's tiny, so that m's scale there is subnormal (the encode's pre = 2^64 path).
void quiet_blocks(Grads& g) {
  if (g.f32.size() < 3 * kInt8Block) return;
  for (std::size_t i = kInt8Block; i < 3 * kInt8Block; ++i) {
    const float x = i < 2 * kInt8Block ? 0.0f : g.f32[i] * 1e-39f;
    if (g.dtype == DType::f32) {
      g.f32[i] = x;
    } else {
      g.half[i] = float_to_bf16(x);
      g.f32[i] = bf16_to_float(g.half[i]);
    }
  }
}

// The int8-states step of every variant, one thread and threaded (tiles of several blocks), equals
// the block-wise reference bit for bit: short, odd and several-block lengths (with a zero and a
// subnormal-scale block), 4 steps.
TEST(Int8States, EveryVariantEqualsTheReferenceBitForBit) {
  const AdamHyperParams hp{OptimizerType::adamw, 1e-2, 0.9, 0.999, 1e-8, 0.1};
  const test::ReferenceInt8StatesAdam reference{hp, kInt8Block};
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{17}, std::size_t{255}, std::size_t{256},
                        std::size_t{257}, std::size_t{1000}, 2 * CpuAdam::kTileElements + 300}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      std::mt19937 rng(static_cast<unsigned>(n) + 1);
      const Int8States init(n, rng);
      std::vector<Grads> grads;
      for (int s = 0; s < 4; ++s) {
        grads.push_back(random_grads(dtype, n, rng));
        quiet_blocks(grads.back());
      }
      Int8States want = init;
      for (int s = 0; s < 4; ++s)
        reference.step(want.p, want.m, want.v, want.m_scale, want.v_scale, grads[s].f32, s + 1, 0.5, 1.0);
      for (Isa isa : supported_isas()) {
        CpuAdam adam(hp, 3, {}, isa);
        Int8States got = init;
        for (int s = 0; s < 4; ++s)
          adam.step_compact(got.p, got.states(), {grads[s].data(), dtype, n}, {s + 1, 0.5, 1.0}, {});
        got.expect_equal(want, std::string(isa_name(isa)) + " n=" + std::to_string(n) + " " +
                                   std::string(dtype_name(dtype)));
      }
    }
  }
}

// The block's largest element is stored exactly (the code's top is 1), so with zero gradients the
// scale decays at beta2 and every element keeps its code: each dequantized v follows
// v(0) * 0.999^t to float rounding (here within 1e-4 relative after 693 steps), where bf16 with
// round-to-nearest stalls (RoundToNearestStallsVWhereStochasticRoundingDecays).
TEST(Int8States, VDecaysAtBeta2WithZeroGradients) {
  const AdamHyperParams hp{OptimizerType::adamw, 1e-3, 0.9, 0.999, 1e-8, 0.0};
  const std::size_t n = 3 * kInt8Block + 5;
  std::mt19937 rng(9);
  Int8States s(n, rng);
  CpuAdam adam(hp, 1);
  const Grads first = random_grads(DType::f32, n, rng);
  adam.step_compact(s.p, s.states(), {first.data(), DType::f32, n}, {1}, {});
  const DynamicCode code = make_dynamic_code(false);
  std::vector<float> v0;
  for (std::size_t i = 0; i < n; ++i) v0.push_back(dequantize(code, false, s.v[i], s.v_scale[i / kInt8Block]));
  const std::vector<float> zero(n, 0.0f);
  const int steps = 693;
  for (int t = 2; t <= steps + 1; ++t) adam.step_compact(s.p, s.states(), {zero.data(), DType::f32, n}, {t}, {});
  const double decay = std::pow(static_cast<double>(0.999f), steps);
  for (std::size_t i = 0; i < n; ++i) {
    const double got = dequantize(code, false, s.v[i], s.v_scale[i / kInt8Block]);
    ASSERT_NEAR(got, v0[i] * decay, 1e-4 * v0[i] * decay + 1e-30) << "element " << i << " from " << v0[i];
  }
}

// step_compact_from (the update ahead of an offloaded step, which must keep the current states)
// leaves in the destination the bytes step_compact leaves in place, the whole StatesLayout region
// (master, m, v, int8's scales), for both compact formats and both masters, over several threaded
// tiles, and leaves the source as it was; it refuses a source of another format or length, or a
// null one.
TEST(CompactStates, StepFromWritesWhatTheStepInPlaceWritesAndKeepsTheSource) {
  const AdamHyperParams hp{OptimizerType::adamw, 1e-2, 0.9, 0.999, 1e-8, 0.1};
  const std::size_t n = 2 * CpuAdam::kTileElements + 320;
  for (StatesFormat format : {StatesFormat::bf16, StatesFormat::int8}) {
    for (DType master : {DType::f32, DType::bf16}) {
      const StatesLayout layout({format, master}, n);
      const std::string what = std::string(format == StatesFormat::int8 ? "int8" : "bf16") +
                               (master == DType::bf16 ? " states, bf16 master" : " states, fp32 master");
      std::mt19937 rng(3);
      CpuAdam adam(hp, 3);
      std::vector<char> source(layout.bytes(), 0);
      {  // a master of random values, then two steps in place: states of every kind of value
        std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
        for (std::size_t i = 0; i < n; ++i) {
          if (master == DType::bf16) layout.bf16_master(source.data())[i] = float_to_bf16(uniform(rng));
          else layout.master(source.data())[i] = uniform(rng);
        }
      }
      const auto step = [&](char* from, char* to, const Grads& g, std::int64_t t) {
        const CpuAdam::CompactStates states = layout.moments(to, 0, n);
        const CpuAdam::CompactRounding rounding{7, 1000};
        if (from == to && master == DType::bf16)
          adam.step_compact(std::span<std::uint16_t>(layout.bf16_master(to), n), states, {g.data(), g.dtype, n}, {t},
                            rounding);
        else if (from == to)
          adam.step_compact(std::span<float>(layout.master(to), n), states, {g.data(), g.dtype, n}, {t}, rounding);
        else if (master == DType::bf16)
          adam.step_compact_from({layout.bf16_master(from), layout.moments(from, 0, n)},
                                 std::span<std::uint16_t>(layout.bf16_master(to), n), states, {g.data(), g.dtype, n},
                                 {t}, rounding);
        else
          adam.step_compact_from({layout.master(from), layout.moments(from, 0, n)},
                                 std::span<float>(layout.master(to), n), states, {g.data(), g.dtype, n}, {t}, rounding);
      };
      for (std::int64_t t = 1; t <= 2; ++t) step(source.data(), source.data(), random_grads(DType::bf16, n, rng), t);
      const Grads g = random_grads(DType::bf16, n, rng);
      std::vector<char> want = source;
      step(want.data(), want.data(), g, 3);
      const std::vector<char> before = source;
      std::vector<char> got(layout.bytes(), static_cast<char>(0xab));
      step(source.data(), got.data(), g, 3);
      EXPECT_TRUE(got == want) << what << ": the destination differs from the step in place";
      EXPECT_TRUE(source == before) << what << ": the source changed";
      EXPECT_FALSE(want == before) << what << ": the step changed nothing, so the test proves nothing";
    }
  }
  CpuAdam adam(hp, 1);
  std::vector<float> p(64), m(64), v(64), g(64);
  const CpuAdam::CompactStates bf16{StatesFormat::bf16, m.data(), v.data(), 64};
  EXPECT_THROW(adam.step_compact_from({p.data(), {StatesFormat::int8, m.data(), v.data(), 64}}, std::span<float>(p),
                                      bf16, {g.data(), DType::f32, 64}, {1}, {}),
               Error);
  EXPECT_THROW(adam.step_compact_from({p.data(), {StatesFormat::bf16, m.data(), v.data(), 32}}, std::span<float>(p),
                                      bf16, {g.data(), DType::f32, 64}, {1}, {}),
               Error);
  EXPECT_THROW(adam.step_compact_from({nullptr, bf16}, std::span<float>(p), bf16, {g.data(), DType::f32, 64}, {1}, {}),
               Error);
}

// fp32 parameters kept apart from the master (the engine's) are written in the update's pass: they
// hold the updated master's bits exactly, for every state format and variant, over several tiles
// and a ragged tail, nothing outside them is written, and writing them changes nothing else.
TEST(CompactStates, Fp32ParametersWrittenInThePassEqualTheMaster) {
  const AdamHyperParams hp{OptimizerType::adamw, 1e-2, 0.9, 0.999, 1e-8, 0.1};
  const std::size_t n = 2 * CpuAdam::kTileElements + 77;
  constexpr std::uint32_t kGuard = 0x7fa5a5a5u;
  for (StatesFormat format : {StatesFormat::f32, StatesFormat::bf16, StatesFormat::int8}) {
    for (Isa isa : supported_isas()) {
      const std::string what = std::string(isa_name(isa)) + (format == StatesFormat::f32    ? " fp32 states"
                                                             : format == StatesFormat::bf16 ? " bf16 states"
                                                                                            : " int8 states");
      const StatesLayout layout({format, DType::f32}, n);
      std::mt19937 rng(11);
      std::vector<char> with(layout.bytes(), 0);
      std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
      for (std::size_t i = 0; i < n; ++i) layout.master(with.data())[i] = uniform(rng);
      std::vector<char> without = with;
      std::vector<float> out(n + 2, bits_float(kGuard));
      CpuAdam adam(hp, 2, {}, isa);
      const auto step = [&](std::vector<char>& states, const Grads& g, std::int64_t t, TensorSpan params) {
        float* const master = layout.master(states.data());
        const ConstTensorSpan grad{g.data(), g.dtype, n};
        if (format == StatesFormat::f32)
          adam.step({master, n}, {master + n, n}, {master + 2 * n, n}, grad, {t}, params);
        else
          adam.step_compact({master, n}, layout.moments(states.data(), 0, n), grad, {t}, {5, 0}, params);
      };
      for (std::int64_t t = 1; t <= 2; ++t) {
        const Grads g = random_grads(DType::f32, n, rng);
        step(with, g, t, {out.data() + 1, DType::f32, n});
        step(without, g, t, {});
      }
      EXPECT_TRUE(with == without) << what << ": writing the parameters changed the states";
      const float* const master = layout.master(with.data());
      EXPECT_EQ(float_bits(out[0]), kGuard) << what;
      EXPECT_EQ(float_bits(out[n + 1]), kGuard) << what;
      std::size_t differ = 0;
      for (std::size_t i = 0; i < n; ++i) differ += float_bits(out[i + 1]) != float_bits(master[i]);
      EXPECT_EQ(differ, 0u) << what << ": parameters that are not the master's bits";
    }
  }
}

}  // namespace
}  // namespace zest::optim
