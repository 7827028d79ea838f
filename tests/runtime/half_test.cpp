// fp16/bf16 conversions (src/runtime/host/half.hpp) against references built independently with
// double arithmetic: exact values from the bit fields with ldexp, rounding by nearest distance.
#include "runtime/host/half.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace zest {
namespace {

// The exact value of an fp16 bit pattern, from its fields (Inf and NaN as themselves).
double fp16_value(std::uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0x1f)
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

double bf16_value(std::uint16_t b) {
  const int sign = (b & 0x8000) ? -1 : 1;
  const int exponent = (b >> 7) & 0xff;
  const int mantissa = b & 0x7f;
  if (exponent == 0xff)
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(mantissa, -133);
  return sign * std::ldexp(128 + mantissa, exponent - 134);
}

// Round-to-nearest-even of a finite `x` onto a format whose non-negative finite values are
// `magnitudes` (ascending, index == bit pattern), with overflow to Inf at the IEEE threshold: a
// value rounds to Inf when it is at least max + half an ulp, i.e. as if Inf were the next value
// (`inf_as`), ties going to Inf's even pattern.
std::uint16_t nearest_even(double x, const std::vector<double>& magnitudes, double inf_as,
                           std::uint16_t inf_bits) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  auto upper = std::lower_bound(magnitudes.begin(), magnitudes.end(), a);
  std::size_t hi = static_cast<std::size_t>(upper - magnitudes.begin());
  if (hi < magnitudes.size() && magnitudes[hi] == a) return static_cast<std::uint16_t>(sign | hi);
  // a lies strictly between magnitudes[hi - 1] and magnitudes[hi] (or inf_as past the end).
  const std::size_t lo = hi - 1;
  const double hi_value = hi < magnitudes.size() ? magnitudes[hi] : inf_as;
  const std::uint16_t hi_bits = hi < magnitudes.size() ? static_cast<std::uint16_t>(hi) : inf_bits;
  const double below = a - magnitudes[lo];
  const double above = hi_value - a;
  std::uint16_t bits;
  if (below < above)
    bits = static_cast<std::uint16_t>(lo);
  else if (above < below)
    bits = hi_bits;
  else
    bits = (lo % 2 == 0) ? static_cast<std::uint16_t>(lo) : hi_bits;
  return static_cast<std::uint16_t>(sign | bits);
}

const std::vector<double>& fp16_magnitudes() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (std::uint32_t h = 0; h <= 0x7bff; ++h) t.push_back(fp16_value(static_cast<std::uint16_t>(h)));
    return t;
  }();
  return table;
}

const std::vector<double>& bf16_magnitudes() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (std::uint32_t b = 0; b <= 0x7f7f; ++b) t.push_back(bf16_value(static_cast<std::uint16_t>(b)));
    return t;
  }();
  return table;
}

std::uint16_t reference_fp16(float f) {
  return nearest_even(f, fp16_magnitudes(), 65536.0, 0x7c00);
}

std::uint16_t reference_bf16(float f) {
  return nearest_even(f, bf16_magnitudes(), std::ldexp(1.0, 128), 0x7f80);
}

bool is_fp16_nan(std::uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool is_bf16_nan(std::uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

// Every float pattern with a stride, plus the neighbourhoods of every rounding boundary.
template <class Check>
void for_test_floats(const std::vector<double>& magnitudes, Check check) {
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4093) check(bits_float(static_cast<std::uint32_t>(u)));
  for (std::size_t i = 0; i + 1 < magnitudes.size(); ++i) {
    const float mid = static_cast<float>((magnitudes[i] + magnitudes[i + 1]) / 2);  // exact in float
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f),
                    static_cast<float>(magnitudes[i])}) {
      check(f);
      check(-f);
    }
  }
}

TEST(Fp16, DecodesEveryPatternExactly) {
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = fp16_to_float(bits);
    const double expected = fp16_value(bits);
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), expected) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(Fp16, EveryPatternRoundTrips) {
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const std::uint16_t back = float_to_fp16(fp16_to_float(bits));
    if (is_fp16_nan(bits)) {
      // NaN stays NaN with its sign and payload; a signaling NaN comes back quiet.
      ASSERT_EQ(back, bits | 0x0200) << std::hex << h;
    } else {
      ASSERT_EQ(back, bits) << std::hex << h;
    }
  }
}

TEST(Fp16, RoundsToNearestEvenLikeTheReference) {
  std::size_t checked = 0;
  for_test_floats(fp16_magnitudes(), [&](float f) {
    if (std::isnan(f)) return;
    const std::uint16_t expected =
        std::isinf(f) ? static_cast<std::uint16_t>(f < 0 ? 0xfc00 : 0x7c00) : reference_fp16(f);
    ASSERT_EQ(float_to_fp16(f), expected) << "float bits " << std::hex << float_bits(f);
    ++checked;
  });
  EXPECT_GT(checked, 1000000u);
}

TEST(Fp16, SpecialValues) {
  EXPECT_EQ(float_to_fp16(0.0f), 0x0000);
  EXPECT_EQ(float_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_fp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_fp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);            // the largest finite
  EXPECT_EQ(float_to_fp16(65519.996f), 0x7bff);          // just below max + half ulp
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);            // max + half ulp: overflows to Inf
  EXPECT_EQ(float_to_fp16(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -14)), 0x0400);  // the smallest normal
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -25)), 0x0000);  // a tie: to even (zero)
  EXPECT_EQ(float_to_fp16(std::ldexp(1.5f, -25)), 0x0001);  // above the tie
  EXPECT_EQ(float_to_fp16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 subnormal ulps: tie to even
  EXPECT_EQ(float_to_fp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, down to even
  EXPECT_EQ(float_to_fp16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie, up to even
  // NaN stays NaN, whatever payload bits the conversion drops.
  EXPECT_TRUE(is_fp16_nan(float_to_fp16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_fp16_nan(float_to_fp16(bits_float(0x7f800001u))));  // payload in the low bits
  EXPECT_TRUE(is_fp16_nan(float_to_fp16(bits_float(0xff800001u))));
  EXPECT_EQ(float_to_fp16(bits_float(0xff800001u)) & 0x8000, 0x8000);
}

TEST(Bf16, DecodesEveryPatternExactly) {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = bf16_to_float(bits);
    const double expected = bf16_value(bits);
    if (std::isnan(expected))
      ASSERT_TRUE(std::isnan(f)) << std::hex << b;
    else
      ASSERT_EQ(static_cast<double>(f), expected) << std::hex << b;
  }
}

TEST(Bf16, EveryPatternRoundTrips) {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const std::uint16_t back = float_to_bf16(bf16_to_float(bits));
    ASSERT_EQ(back, is_bf16_nan(bits) ? (bits | 0x0040) : bits) << std::hex << b;
  }
}

TEST(Bf16, RoundsToNearestEvenLikeTheReference) {
  std::size_t checked = 0;
  for_test_floats(bf16_magnitudes(), [&](float f) {
    if (std::isnan(f)) return;
    const std::uint16_t expected =
        std::isinf(f) ? static_cast<std::uint16_t>(f < 0 ? 0xff80 : 0x7f80) : reference_bf16(f);
    ASSERT_EQ(float_to_bf16(f), expected) << "float bits " << std::hex << float_bits(f);
    ++checked;
  });
  EXPECT_GT(checked, 1000000u);
}

TEST(Bf16, SpecialValues) {
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the max
  EXPECT_EQ(float_to_bf16(bits_float(0x7f7f7fffu)), 0x7f7f);            // just below the tie
  EXPECT_EQ(float_to_bf16(bits_float(0x00000001u)), 0x0000);            // float subnormal
  EXPECT_EQ(float_to_bf16(bits_float(0x00008000u)), 0x0000);            // tie to even
  EXPECT_EQ(float_to_bf16(bits_float(0x00018000u)), 0x0002);            // tie to even, up
  // A NaN whose payload lies only in the dropped bits must not turn into Inf.
  EXPECT_TRUE(is_bf16_nan(float_to_bf16(bits_float(0x7f800001u))));
  EXPECT_TRUE(is_bf16_nan(float_to_bf16(bits_float(0xff800001u))));
  EXPECT_TRUE(is_bf16_nan(float_to_bf16(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace zest
