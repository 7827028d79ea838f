// The element math of compact optimizer states (docs/compact-states.md), shared by every CPU
// instruction-set variant and (later) the CUDA kernels: the counter-based random bits of
// stochastic rounding and the rounding itself. The fp32 update stays adam_update (adam_math.hpp).
//
// The per-element functions are templates over the unsigned 32-bit word type U: uint32_t for the
// scalar build and CUDA, a GCC vector of uint32_t for the SIMD builds (whose instantiations then
// name the vector type, as adam_kernels.cpp requires). They use only +, *, ^, &, |, ~ and shifts,
// no comparison (a comparison gives bool on scalars but a mask vector on vectors), so one text
// means the same on every type. All of it is exact integer arithmetic: every backend gets the
// same bits.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "runtime/host/half.hpp"
#include "zest/dtype.hpp"

namespace zest::optim {

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijective 64-bit mix.
ZEST_HOST_DEVICE inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The key of one step's rounding bits; computed once per step on the host.
ZEST_HOST_DEVICE inline std::uint64_t rounding_key(std::uint64_t seed, std::int64_t step) {
  return splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(step)));
}

// MurmurHash3's 32-bit finalizer (Appleby): a bijective mix with full avalanche.
template <class U>
ZEST_HOST_DEVICE inline U fmix32(U h) {
  h = h ^ (h >> 16);
  h = h * 0x85ebca6bu;
  h = h ^ (h >> 13);
  h = h * 0xc2b2ae35u;
  return h ^ (h >> 16);
}

// The 32 random bits of global element index (hi:lo), for the step's key (key_hi:key_lo). The low
// 16 bits round m, the high 16 bits round v. One fmix32 per element: the high word, the same for
// 2^32 elements in a row, is mixed into the key (fmix32(hi ^ key_hi), which a vector loop computes
// once per run), not hashed per element after the low word (the chain of four multiplies that took
// the bf16-states kernel 1.19x its time). For a fixed element, key_lo is uniform over the steps, so
// the word fmix32 hashes is, and fmix32 being a bijection, so are the bits: the rounding stays
// unbiased.
template <class U>
ZEST_HOST_DEVICE inline U state_random_bits(U lo, U hi, U key_lo, U key_hi) {
  return fmix32(lo ^ (key_lo + fmix32(hi ^ key_hi)));
}

// The 16 random bits (in the low half of the word) that round a bf16 master weight of global index
// (hi:lo): the same hash over the complemented key, a stream apart from m's and v's.
template <class U>
ZEST_HOST_DEVICE inline U master_random_bits(U lo, U hi, U key_lo, U key_hi) {
  return state_random_bits(lo, hi, ~key_lo, ~key_hi) & 0xffffu;
}

// (base_hi:base_lo) + offset as two words, offset < 2^32 (the lanes of one vector): the carry out of
// the low word computed without a comparison.
template <class U>
ZEST_HOST_DEVICE inline void add_index(U base_lo, U base_hi, U offset, U& lo, U& hi) {
  lo = base_lo + offset;
  hi = base_hi + (((base_lo & offset) | ((base_lo | offset) & ~lo)) >> 31);
}

// The bf16 bit pattern (in the low 16 bits) of the float with bit pattern u, rounded
// stochastically with the 16 random bits r (< 0x10000): up in magnitude exactly when
// r >= 0x10000 - (u & 0xffff), i.e. with probability (u & 0xffff) / 65536, so the expected
// result is the float itself. NaN becomes a quiet NaN keeping its top bits (as float_to_bf16);
// Inf stays Inf.
template <class U>
ZEST_HOST_DEVICE inline U stochastic_round_bf16_bits(U u, U r) {
  const U magnitude = u & 0x7fffffffu;
  // All ones when magnitude > 0x7f800000 (NaN): the subtraction then wraps into the top bit.
  const U nan = U{} - ((0x7f800000u - magnitude) >> 31);
  const U rounded = (u + r) >> 16;
  const U quiet = (u >> 16) | 0x40u;
  return (rounded & ~nan) | (quiet & nan);
}

// ---- int8 states: block-wise dynamic quantization (Dettmers et al. 2022), scalar math so far ----
//
// The dynamic code over w magnitude bits (w = 7 for signed m, whose byte's top bit is the sign;
// w = 8 for v >= 0): for a magnitude byte b > 0 with e leading zeros in its w bits, the next bit
// is the indicator 1 and the k = w - 1 - e bits below it a fraction j; the value is
// 10^-e * (0.1 + 0.9 * (j + 1) / 2^k), the top of the j-th of 2^k equal intervals of (0.1, 1]
// scaled by 10^-e; b = 0 is 0. The paper takes the intervals' centres and appends 1; tops make
// the largest value exactly 1, so the element that sets a block's scale is stored exactly and the
// scale, and with it the whole block, decays at beta2 instead of shrinking by the top gap each
// step. Values grow with b, so encoding is a search over the midpoints of consecutive values. Each value is rounded to
// 16 significant bits so that every midpoint is exactly a float: the float comparison x > midpoint then decides nearest
// exactly.
constexpr std::size_t kInt8Block = 64;  // elements per scale: Layout::kAlign, so every shard, sub-group and optimizer
                                        // group boundary is a block boundary

struct DynamicCode {
  std::uint32_t magnitudes = 0;  // 128 (signed) or 256 (unsigned)
  float values[256] = {};        // by magnitude byte, increasing, values[0] = 0
  // (values[b] + values[b + 1]) / 2, exact, for b + 1 < magnitudes; 256 entries (the rest 0) so
  // that SIMD code can hold the table in whole registers.
  float midpoints[256] = {};

  // For the SIMD encoders: a closed-form guess of the byte. Decade e of a is #{i in 1..w-1 : a <=
  // decade_threshold[i - 1]}; within it the bytes are linear in a: byte b's value lies at x = b +
  // 0.5 - guess_slack of x = a * decade_slope[e] + decade_offset[e]. The boundary between bytes b
  // and b + 1, their midpoint, then lies within slack of x = b + 1 - slack, where slack (built
  // below) is the largest distance of a midpoint from its place on the line (the values are rounded
  // to 16 significant bits) plus 1e-4 for the float rounding of x. So with g = floor(x) the byte is
  // g or g + 1, and it is g for sure where x - g < guess_band = 1 - 2 * slack: only lanes above the
  // band (at most 0.15 % of them) need the exact comparison with midpoints[g] (dynamic_encode_from_guess).
  // Checked on every float, each ISA. Unused thresholds are +Inf, unused decades 0.
  float decade_threshold[8] = {};  // fl(10^-i), i = 1..7
  float decade_slope[16] = {};     // 10^e * 2^k / 0.9 (lowest decade: 10^(w-1))
  float decade_offset[16] = {};    // 2^k * 8/9 - 1 + 0.5 - slack (lowest decade: 0.5 - slack)
  float guess_band = 0.0f;
  // The decade from one table read by the float's exponent field E (bits 23..30; at least 96, and
  // indexed by E & 31): each binade holds at most one threshold, so e = e0 - (a > t), e0 the decade
  // of the binade's bottom and t its threshold (FLT_MAX where it holds none). binade_key[E & 31] is
  // t with e0 in the low 4 bits of its significand (a change of at most 15 units in the last place
  // of t: either decade's line holds near a threshold), so (bits of key) - (a > key) has e in its
  // low 4 bits, all that _mm512_permutexvar_ps reads. Decade -1 (slot 15, the decade of a >= 1 in
  // the binades that alias [1, 2): only Inf and a >= 2, which encode as the top byte) repeats
  // decade 0. (Exponent fields above 127, finite a >= 2, land in any slot: every decade's line puts
  // them beyond the top byte.)
  float binade_key[32] = {};

  // For the SIMD decoders: values[b] in closed form. With k = floor(log2 b), the exponent of the
  // float 2b + 1 less 1 (for b = 0 its exponent is 0, slot 15 here, which holds 0), values[b] is
  // n * value_step[k] rounded to 16 significant bits (to nearest, ties to even), where n = 9b + 9 -
  // 8 * 2^k = 4.5 * (2b + 1) + value_base[k] is an integer: 10^-e * (0.1 + 0.9 (j + 1) / 2^k) =
  // (2^k + 9 (j + 1)) * 10^-(e+1) / 2^k. In float the product (one rounding) then the rounding to 16
  // bits give every value exactly (checked on every byte of both codes, each ISA).
  float value_step[16] = {};  // 10^-(e+1) / 2^k, e = w - 1 - k
  float value_base[16] = {};  // 4.5 - 8 * 2^k
};

// Built on the host (once); the CUDA kernels will take a copy in constant memory.
inline DynamicCode make_dynamic_code(bool is_signed) {
  DynamicCode code;
  const int width = is_signed ? 7 : 8;
  code.magnitudes = 1u << width;
  for (std::uint32_t b = 1; b < code.magnitudes; ++b) {
    int e = 0;
    while ((b & (1u << (width - 1 - e))) == 0) ++e;
    const int k = width - 1 - e;
    const std::uint32_t j = b & ((1u << k) - 1u);
    const double exact = std::pow(10.0, -e) * (0.1 + 0.9 * (static_cast<double>(j) + 1.0) / std::ldexp(1.0, k));
    int exponent = 0;
    std::frexp(exact, &exponent);
    code.values[b] = static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(exact, 16 - exponent)), exponent - 16));
  }
  for (std::uint32_t b = 0; b + 1 < code.magnitudes; ++b)
    code.midpoints[b] = static_cast<float>((static_cast<double>(code.values[b]) + code.values[b + 1]) / 2.0);
  // The guess (decade_slope). Decade e holds the bytes 2^k + j, k = w - 1 - e, whose values
  // are linear in j: b = 2^k - 1 + (y * 10^e - 0.1) * 2^k / 0.9 at value y. The line also passes
  // through the decade's lower neighbour (y = 10^-(e+1) gives b = 2^k - 1), so it locates every
  // midpoint from the one below the decade to the top. The lowest decade (k = 0: byte 1, 10^-(w-1))
  // has 0 below it instead: its line is b = y * 10^(w-1).
  const auto line = [&](std::uint32_t b, double y) {  // the byte coordinate of y in b's decade
    const int k = 31 - __builtin_clz(b);
    const double span = std::ldexp(1.0, k);
    return k == 0 ? y * std::pow(10.0, width - 1)
                  : y * std::pow(10.0, width - 1 - k) * span / 0.9 + span * 8.0 / 9.0 - 1.0;
  };
  double slack = 0.0;
  for (std::uint32_t b = 0; b + 1 < code.magnitudes; ++b)
    slack = std::fmax(slack, std::fabs(line(b + 1, code.midpoints[b]) - (b + 0.5)));
  slack += 1e-4;
  code.guess_band = static_cast<float>(1.0 - 2.0 * slack);
  for (int i = 1; i <= 7; ++i)
    code.decade_threshold[i - 1] = i < width ? static_cast<float>(std::pow(10.0, -i)) : INFINITY;
  for (int e = 0; e < width; ++e) {
    const std::uint32_t first = 1u << (width - 1 - e);  // the decade's first byte, 2^k
    code.decade_slope[e] = static_cast<float>(line(first, 1.0) - line(first, 0.0));
    code.decade_offset[e] = static_cast<float>(line(first, 0.0) + 0.5 - slack);
  }
  for (int k = 0; k < width; ++k) {
    code.value_step[k] = static_cast<float>(std::pow(10.0, k - width) / std::ldexp(1.0, k));
    code.value_base[k] = static_cast<float>(4.5 - 8.0 * std::ldexp(1.0, k));
  }
  code.decade_slope[15] = code.decade_slope[0];
  code.decade_offset[15] = code.decade_offset[0];
  for (int field = 96; field < 128; ++field) {
    const double bottom = std::ldexp(1.0, field - 127);
    std::uint32_t decade = 0;
    float threshold = 0x1.fffffep127f;
    for (int i = 1; i < width; ++i) {
      const double t = code.decade_threshold[i - 1];
      if (t >= bottom) ++decade;
      if (t >= bottom && t < 2.0 * bottom) threshold = code.decade_threshold[i - 1];
    }
    code.binade_key[field & 31] = bits_float((float_bits(threshold) & ~0xfu) | decade);
  }
  return code;
}

// The magnitude byte nearest to a >= 0 (ties to the smaller; beyond the top value, the top; NaN,
// 0): a branch-free binary search over the midpoints, the same steps on every backend. F/U: the
// float and word types; ops.gather(table, index) reads a table per lane, ops.greater(a, b) is all
// ones where a > b (false for NaN) and 0 elsewhere.
template <class F, class U, class Ops>
ZEST_HOST_DEVICE inline U dynamic_encode_magnitude(const DynamicCode& code, F a, const Ops& ops) {
  U b = U{};
  for (std::uint32_t step = code.magnitudes >> 1; step > 0; step >>= 1)
    b = b + (ops.greater(a, ops.gather(code.midpoints, b + (step - 1u))) & step);
  return b;
}

// The same byte from a guess g for which it is g or g + 1 (the SIMD encoders' closed form, see
// DynamicCode::decade_slope): one exact comparison with the midpoint above g, so the result is the binary
// search's on every input. g <= magnitudes - 2.
template <class F, class U, class Ops>
ZEST_HOST_DEVICE inline U dynamic_encode_from_guess(const DynamicCode& code, F a, U guess, const Ops& ops) {
  return guess + (ops.greater(a, ops.gather(code.midpoints, guess)) & 1u);
}

// The byte of a signed (m) value from its float bits and magnitude byte: the sign on top, except
// for magnitude 0 (-0 and values that round to 0 encode as +0).
template <class U>
ZEST_HOST_DEVICE inline U signed_code_byte(U word, U magnitude) {
  const U nonzero = (magnitude + 0x7fu) >> 7;  // magnitude <= 127
  return magnitude | (((word >> 31) & nonzero) << 7);
}

// The byte of an unsigned (v) value from its float bits and magnitude byte: a finite v above 0
// never stores 0, but the code's smallest value. Rounded to 0 while its m was not, an element's
// next update was about m / sqrt((1 - beta2) g^2), unbounded by Adam's step of about lr (the
// "zero-point problem" of low-bit second moments, Li et al. 2023, who drop 0 from v's map): on an
// unstable model int8 states diverged where fp32 recovered. Rounded up, √v can only be larger, so the step only
// smaller. 0, -0 and NaN stay 0.
template <class U>
ZEST_HOST_DEVICE inline U unsigned_code_byte(U word, U magnitude) {
  const U x = word & 0x7fffffffu;
  const U finite_positive = ((x + 0x7fffffffu) >> 31) & (((0x7f800000u - x) >> 31) ^ 1u);
  const U zero = ((magnitude + 0xffu) >> 8) ^ 1u;  // magnitude <= 255
  return magnitude | (finite_positive & zero);
}

// The float bits of a code byte times the scale: the sign bit flipped for a signed byte's top bit.
template <class U>
ZEST_HOST_DEVICE inline U signed_code_sign(U byte) {
  return (byte & 0x80u) << 24;
}

struct ScalarCodeOps {
  ZEST_HOST_DEVICE float gather(const float* table, std::uint32_t index) const { return table[index]; }
  ZEST_HOST_DEVICE std::uint32_t greater(float a, float b) const { return a > b ? ~0u : 0u; }
};

// What every |x| of a block is multiplied by before encoding: |x| / scale with one division per
// block, not per element (per-element divisions cost the AVX-512 int8 kernel 1.14x its time). The
// quotient is (|x| * pre) * inv, inv = 1 / (scale * pre): pre is 1, except below float's normal
// range (a subnormal or zero scale), where 1 / scale would overflow and pre = 2^64 scales the block
// exactly into range first. An all-zero block multiplies 0 by Inf: NaN, which encodes as 0; an Inf
// scale gives inv = 0.
struct BlockReciprocal {
  float pre = 1.0f;
  float inv = 0.0f;
};
ZEST_HOST_DEVICE inline BlockReciprocal block_reciprocal(float scale) {
  const float pre = scale >= 0x1p-126f ? 1.0f : 0x1p64f;
  return {pre, 1.0f / (scale * pre)};
}

// Quantizes n <= kInt8Block values to bytes with the block's scale, its largest magnitude: each
// |x| times the block's reciprocal (block_reciprocal) is encoded (for v, unsigned_code_byte keeps
// positive values off 0). NaN elements are skipped by the
// maximum and encode as 0: the engine skips steps with nonfinite gradients before they reach the
// states. Returns the scale.
ZEST_HOST_DEVICE inline float quantize_block(const DynamicCode& code, bool is_signed, const float* x,
                                             std::size_t n, std::uint8_t* q) {
  float scale = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = fabsf(x[i]);
    scale = a > scale ? a : scale;
  }
  const BlockReciprocal r = block_reciprocal(scale);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t magnitude =
        dynamic_encode_magnitude<float, std::uint32_t>(code, fabsf(x[i]) * r.pre * r.inv, ScalarCodeOps{});
    q[i] = static_cast<std::uint8_t>(is_signed ? signed_code_byte(float_bits(x[i]), magnitude)
                                               : unsigned_code_byte(float_bits(x[i]), magnitude));
  }
  return scale;
}

ZEST_HOST_DEVICE inline float dequantize(const DynamicCode& code, bool is_signed, std::uint8_t q, float scale) {
  const std::uint32_t byte = q;
  if (!is_signed) return code.values[byte] * scale;
  return bits_float(float_bits(code.values[byte & 0x7fu] * scale) ^ signed_code_sign(byte));
}

}  // namespace zest::optim
