// Independent scalar references of the compact-state schemes (docs/compact-states.md), written
// from the scheme's definition rather than from src/optim/compact_math.hpp: stochastic rounding
// from the two bf16 neighbours and the probability of the upper one, the random bits from
// 64-bit arithmetic on the element index, the Adam step as plain float loops in the documented
// operation order. The kernels must equal these bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <vector>

#include "optim/adam_math.hpp"
#include "runtime/host/half.hpp"

namespace zest::optim::test {

inline std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float float_of(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float widen_bf16(std::uint16_t h) { return float_of(static_cast<std::uint32_t>(h) << 16); }

inline std::uint64_t reference_splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline std::uint32_t reference_fmix32(std::uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The 32 random bits of global element `index` at `step` for `seed`: low 16 for m, high 16 for v.
inline std::uint32_t reference_random_bits(std::uint64_t seed, std::int64_t step, std::uint64_t index) {
  const std::uint64_t key = reference_splitmix64(seed ^ reference_splitmix64(static_cast<std::uint64_t>(step)));
  const auto word = [](std::uint64_t x, int which) { return static_cast<std::uint32_t>(x >> (32 * which)); };
  return reference_fmix32(word(index, 0) ^ (word(key, 0) + reference_fmix32(word(index, 1) ^ word(key, 1))));
}

// The 16 random bits that round a bf16 master weight: the same hash with the key's bits inverted.
inline std::uint16_t reference_master_bits(std::uint64_t seed, std::int64_t step, std::uint64_t index) {
  const std::uint64_t key = ~reference_splitmix64(seed ^ reference_splitmix64(static_cast<std::uint64_t>(step)));
  const auto word = [](std::uint64_t x, int which) { return static_cast<std::uint32_t>(x >> (32 * which)); };
  return static_cast<std::uint16_t>(
      reference_fmix32(word(index, 0) ^ (word(key, 0) + reference_fmix32(word(index, 1) ^ word(key, 1)))) & 0xffffu);
}

// x rounded to bf16, to the neighbour above in magnitude with probability (|x| - lo) / (hi - lo),
// decided by the 16-bit uniform r: up exactly when r / 65536 >= 1 - that probability. NaN as
// float_to_bf16 (quiet, top bits kept); Inf and exact values unchanged.
inline std::uint16_t reference_stochastic_bf16(float x, std::uint16_t r) {
  if (std::isnan(x)) return float_to_bf16(x);
  const std::uint16_t toward_zero = static_cast<std::uint16_t>(bits_of(x) >> 16);
  const double lo = std::fabs(static_cast<double>(widen_bf16(toward_zero)));
  const double magnitude = std::fabs(static_cast<double>(x));
  if (magnitude == lo || std::isinf(x)) return toward_zero;
  // The bf16 spacing at lo: 2^(exponent - 7), subnormals spaced as the smallest normal binade.
  int exponent = 0;
  std::frexp(lo > 0.0 ? lo : 0x1p-126, &exponent);  // lo = f * 2^exponent, f in [0.5, 1)
  const double spacing = std::ldexp(1.0, std::max(exponent - 1, -126) - 7);
  const double probability_up = (magnitude - lo) / spacing;  // k / 65536 for an integer k, exactly
  const bool up = static_cast<double>(r) + probability_up * 65536.0 >= 65536.0;
  return static_cast<std::uint16_t>(toward_zero + (up ? 1 : 0));  // +1 in magnitude, or to Inf
}

enum class StateRoundingMode { stochastic, nearest };

// Adam/AdamW on one element in float, in the documented order; m and v are the stored moments
// (widened), returned updated and unrounded.
struct ReferenceElementAdam {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bias2, eps, decay, l2, multiplier;
  bool adamw;
  ReferenceElementAdam(const AdamHyperParams& hp, std::int64_t step, double grad_scale, double clip_coef) {
    const double t = static_cast<double>(step);
    beta1 = static_cast<float>(hp.beta1);
    beta2 = static_cast<float>(hp.beta2);
    one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
    one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
    step_size = static_cast<float>(hp.lr / (1.0 - std::pow(hp.beta1, t)));
    inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(hp.beta2, t)));
    eps = static_cast<float>(hp.eps);
    adamw = hp.type == OptimizerType::adamw;
    decay = adamw ? static_cast<float>(1.0 - hp.lr * hp.weight_decay) : 1.0f;
    l2 = adamw ? 0.0f : static_cast<float>(hp.weight_decay);
    multiplier = static_cast<float>(grad_scale * clip_coef);
  }
  void update(float& p, float& m, float& v, float grad) const {
    float g = grad * multiplier;
    if (adamw) {
      p = p * decay;
    } else {
      g = g + p * l2;
    }
    m = m * beta1 + g * one_minus_beta1;
    v = v * beta2 + (g * g) * one_minus_beta2;
    const float denom = std::sqrt(v) * inv_sqrt_bias2 + eps;
    p = p - (m / denom) * step_size;
  }
};

// Adam/AdamW on fp32 master weights and bf16 m and v, one element at a time.
struct ReferenceBf16StatesAdam {
  AdamHyperParams hp;
  std::uint64_t seed = 0;
  StateRoundingMode mode = StateRoundingMode::stochastic;

  // grad: the gradients widened to float; first_index: the global index of p[0].
  void step(std::vector<float>& p, std::vector<std::uint16_t>& m, std::vector<std::uint16_t>& v,
            const std::vector<float>& grad, std::int64_t step, std::uint64_t first_index,
            double grad_scale = 1.0, double clip_coef = 1.0) const {
    const ReferenceElementAdam adam(hp, step, grad_scale, clip_coef);
    for (std::size_t i = 0; i < p.size(); ++i) {
      float m1 = widen_bf16(m[i]);
      float v1 = widen_bf16(v[i]);
      adam.update(p[i], m1, v1, grad[i]);
      if (mode == StateRoundingMode::nearest) {
        m[i] = float_to_bf16(m1);
        v[i] = float_to_bf16(v1);
      } else {
        const std::uint32_t r = reference_random_bits(seed, step, first_index + i);
        m[i] = reference_stochastic_bf16(m1, static_cast<std::uint16_t>(r & 0xffffu));
        v[i] = reference_stochastic_bf16(v1, static_cast<std::uint16_t>(r >> 16));
      }
    }
  }
};

// ---- int8: the dynamic code from its definition and nearest by brute force ----

// The code value of magnitude byte b over `width` bits: e = the leading zeros above b's highest
// set bit, k = the bits below it; 10^-e * (0.1 + 0.9 * (j + 1) / 2^k) with j those k bits,
// rounded to 16 significant bits (to nearest, ties to even).
inline float reference_code_value(std::uint32_t b, int width) {
  if (b == 0) return 0.0f;
  int top = 31;
  while ((b >> top) == 0) --top;
  const int e = width - 1 - top;
  const int k = top;
  const double j = static_cast<double>(b - (1u << top));
  const double exact = std::pow(10.0, -e) * (0.1 + 0.9 * (j + 1.0) / std::pow(2.0, k));
  const double unit = std::pow(2.0, std::floor(std::log2(exact)) - 15);  // 16 significant bits
  return static_cast<float>(std::nearbyint(exact / unit) * unit);
}

// The nearest code magnitude to a (ties to the smaller byte), searching every byte.
inline std::uint32_t reference_encode_magnitude(double a, int width) {
  static const std::vector<float> values7 = [] {
    std::vector<float> t;
    for (std::uint32_t b = 0; b < 128; ++b) t.push_back(reference_code_value(b, 7));
    return t;
  }();
  static const std::vector<float> values8 = [] {
    std::vector<float> t;
    for (std::uint32_t b = 0; b < 256; ++b) t.push_back(reference_code_value(b, 8));
    return t;
  }();
  const std::vector<float>& values = width == 7 ? values7 : values8;
  std::uint32_t best = 0;
  for (std::uint32_t b = 1; b < values.size(); ++b)
    if (std::fabs(a - values[b]) < std::fabs(a - values[best])) best = b;
  return best;
}

// One block: scale = largest magnitude; each x encoded from fl(fl(|x| * pre) * fl(1 / (scale * pre)))
// and its sign, pre = 2^64 for a scale below 2^-126 and 1 otherwise, so the reciprocal is finite
// (0 * Inf: NaN, nearest to no value, encodes as 0); an unsigned (v) x above 0 is at least byte 1.
inline float reference_quantize_block(bool is_signed, const std::vector<float>& x, std::vector<std::uint8_t>& q) {
  const int width = is_signed ? 7 : 8;
  float scale = 0.0f;
  for (float value : x) scale = std::max(scale, std::fabs(value));
  q.assign(x.size(), 0);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float pre = scale < 0x1p-126f ? 0x1p64f : 1.0f;
    const float a = (std::fabs(x[i]) * pre) * (1.0f / (scale * pre));
    const std::uint32_t magnitude = reference_encode_magnitude(a, width);
    // v: a finite value above 0 keeps at least the smallest code value (no v rounds to 0).
    const bool lifted = !is_signed && magnitude == 0 && std::fabs(x[i]) > 0.0f && std::isfinite(x[i]);
    q[i] = static_cast<std::uint8_t>((lifted ? 1u : magnitude) |
                                     (is_signed && std::signbit(x[i]) && magnitude != 0 ? 0x80u : 0u));
  }
  return scale;
}

inline float reference_dequantize(bool is_signed, std::uint8_t q, float scale) {
  const float value = reference_code_value(is_signed ? q & 0x7fu : q, is_signed ? 7 : 8) * scale;
  return is_signed && (q & 0x80u) != 0 ? -value : value;
}

// Adam/AdamW on fp32 master weights and int8 m and v: per block of `block` elements from p[0],
// dequantize with the old scales, update each element, then quantize each state with its new scale.
struct ReferenceInt8StatesAdam {
  AdamHyperParams hp;
  std::size_t block = 64;

  void step(std::vector<float>& p, std::vector<std::uint8_t>& m, std::vector<std::uint8_t>& v,
            std::vector<float>& m_scale, std::vector<float>& v_scale, const std::vector<float>& grad,
            std::int64_t step, double grad_scale = 1.0, double clip_coef = 1.0) const {
    const ReferenceElementAdam adam(hp, step, grad_scale, clip_coef);
    for (std::size_t begin = 0, b = 0; begin < p.size(); begin += block, ++b) {
      const std::size_t end = std::min(p.size(), begin + block);
      std::vector<float> new_m, new_v;
      for (std::size_t i = begin; i < end; ++i) {
        float m1 = reference_dequantize(true, m[i], m_scale[b]);
        float v1 = reference_dequantize(false, v[i], v_scale[b]);
        adam.update(p[i], m1, v1, grad[i]);
        new_m.push_back(m1);
        new_v.push_back(v1);
      }
      std::vector<std::uint8_t> qm, qv;
      m_scale[b] = reference_quantize_block(true, new_m, qm);
      v_scale[b] = reference_quantize_block(false, new_v, qv);
      std::copy(qm.begin(), qm.end(), m.begin() + static_cast<std::ptrdiff_t>(begin));
      std::copy(qv.begin(), qv.end(), v.begin() + static_cast<std::ptrdiff_t>(begin));
    }
  }
};

}  // namespace zest::optim::test
