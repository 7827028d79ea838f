// A plain scalar reference of the block quantization format (src/optim/block_quant_math.hpp),
// written from its definition rather than from the shared math: the scale by std::fabs and
// std::isfinite, the codes by std::nearbyint (round half to even) and std::clamp, the records
// assembled byte by byte. The kernels must equal it bit for bit. Also the test data: blocks of
// ordinary values, outliers, zeros, subnormals, halfway values, counts that end blocks and
// vectors anywhere.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "optim/block_quant_math.hpp"
#include "runtime/host/half.hpp"
#include "zest/dtype.hpp"

namespace zest::optim::test {

inline int reference_qmax(QuantBits bits) { return bits == QuantBits::int8 ? 127 : 7; }

// Values as stored in `dtype` (their bits in `stored`) and widened to float (`values`, exact).
struct TypedValues {
  DType dtype = DType::f32;
  std::vector<float> values;
  std::vector<std::uint16_t> half;
  const void* data() const { return dtype == DType::f32 ? static_cast<const void*>(values.data()) : half.data(); }
};

inline TypedValues as_dtype(const std::vector<float>& x, DType dtype) {
  TypedValues t{dtype, {}, {}};
  for (float v : x) {
    if (dtype == DType::f32) {
      t.values.push_back(v);
    } else {
      const std::uint16_t h = dtype == DType::bf16 ? float_to_bf16(v) : float_to_fp16(v);
      t.half.push_back(h);
      t.values.push_back(dtype == DType::bf16 ? bf16_to_float(h) : fp16_to_float(h));
    }
  }
  return t;
}

inline void append_float(std::vector<std::uint8_t>& out, float x) {
  std::uint8_t b[4];
  std::memcpy(b, &x, 4);
  out.insert(out.end(), b, b + 4);
}

inline float read_float(const std::uint8_t* p) {
  float x;
  std::memcpy(&x, p, 4);
  return x;
}

// The scale of one block: absmax / qmax, NaN if any element is Inf or NaN.
inline float reference_scale(const float* x, std::size_t n, QuantBits bits) {
  float absmax = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return std::numeric_limits<float>::quiet_NaN();
    absmax = std::max(absmax, std::fabs(x[i]));
  }
  return absmax / static_cast<float>(reference_qmax(bits));
}

inline int reference_code(float x, float scale, QuantBits bits) {
  if (std::isnan(scale)) return 0;
  const int q = reference_qmax(bits);
  const float y = scale == 0.0f ? x : x / scale;  // x / 0 would be 0 / 0 or Inf; x is then 0 or tiny
  return static_cast<int>(std::clamp(std::nearbyint(y), static_cast<float>(-q), static_cast<float>(q)));
}

inline std::vector<std::uint8_t> reference_quantize(const std::vector<float>& x, QuantBits bits) {
  std::vector<std::uint8_t> out;
  for (std::size_t first = 0; first < x.size(); first += kQuantBlock) {
    const std::size_t n = std::min(kQuantBlock, x.size() - first);
    const float scale = reference_scale(x.data() + first, n, bits);
    append_float(out, scale);
    std::vector<std::uint8_t> codes;
    for (std::size_t i = 0; i < n; ++i) {
      const int c = reference_code(x[first + i], scale, bits);
      if (bits == QuantBits::int8) {
        codes.push_back(static_cast<std::uint8_t>(c));
      } else if (i % 2 == 0) {
        codes.push_back(static_cast<std::uint8_t>(c & 0xf));
      } else {
        codes.back() = static_cast<std::uint8_t>(codes.back() | ((c & 0xf) << 4));
      }
    }
    while (codes.size() % 4 != 0) codes.push_back(0);
    out.insert(out.end(), codes.begin(), codes.end());
  }
  return out;
}

// The fp32 values of a quantized buffer of `count` elements: code * scale.
inline std::vector<float> reference_values(const std::vector<std::uint8_t>& q, QuantBits bits, std::size_t count) {
  std::vector<float> out;
  const std::uint8_t* p = q.data();
  for (std::size_t first = 0; first < count; first += kQuantBlock) {
    const std::size_t n = std::min(kQuantBlock, count - first);
    const float scale = read_float(p);
    const std::uint8_t* codes = p + 4;
    for (std::size_t i = 0; i < n; ++i) {
      int c;
      if (bits == QuantBits::int8) {
        c = static_cast<std::int8_t>(codes[i]);
      } else {
        const int nibble = (codes[i / 2] >> (4 * (i % 2))) & 0xf;
        c = nibble >= 8 ? nibble - 16 : nibble;
      }
      out.push_back(static_cast<float>(c) * scale);
    }
    const std::size_t code_bytes = bits == QuantBits::int8 ? n : (n + 1) / 2;
    p += 4 + (code_bytes + 3) / 4 * 4;
  }
  return out;
}

// The reference values stored as `dtype`, as bits (f32: the float's bits).
inline std::vector<std::uint32_t> stored_bits(const std::vector<float>& values, DType dtype) {
  std::vector<std::uint32_t> bits;
  for (float v : values) {
    if (dtype == DType::f32) {
      std::uint32_t u;
      std::memcpy(&u, &v, 4);
      bits.push_back(u);
    } else {
      bits.push_back(dtype == DType::bf16 ? float_to_bf16(v) : float_to_fp16(v));
    }
  }
  return bits;
}

// The bits of a kernel's output of `count` elements of `dtype` in `data`.
inline std::vector<std::uint32_t> output_bits(const void* data, DType dtype, std::size_t count) {
  std::vector<std::uint32_t> bits(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (dtype == DType::f32) {
      std::memcpy(&bits[i], static_cast<const unsigned char*>(data) + 4 * i, 4);
    } else {
      bits[i] = static_cast<const std::uint16_t*>(data)[i];
    }
  }
  return bits;
}

// Test values of `count` elements: each block draws from one of several kinds (by block index),
// so every count covers ordinary, outlier, zero, subnormal and halfway blocks.
inline std::vector<float> mixed_values(std::size_t count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count);
  for (std::size_t first = 0; first < count; first += kQuantBlock) {
    const std::size_t n = std::min(kQuantBlock, count - first);
    const std::size_t kind = (first / kQuantBlock + seed) % 8;
    for (std::size_t i = 0; i < n; ++i) {
      float& v = x[first + i];
      switch (kind) {
        case 0: v = normal(rng); break;
        case 1: v = normal(rng) * std::ldexp(1.0f, static_cast<int>(i % 13) - 6); break;  // spread binades
        case 2: v = i == n / 2 ? 3.0e4f : normal(rng) * 1e-2f; break;                     // one outlier
        case 3: v = i % 2 == 0 ? 0.0f : -0.0f; break;                                    // zeros
        case 4: v = normal(rng) * 1e-39f; break;                                          // all subnormal
        case 5: v = i % 3 == 0 ? normal(rng) * 1e-40f : normal(rng) * 1e-3f; break;       // some subnormal
        case 6: v = i == 0 ? 127.0f : static_cast<float>(static_cast<int>(i % 20) - 10) + 0.5f; break;  // halfway
        default: v = normal(rng) * 1e3f; break;
      }
    }
  }
  return x;
}

// Counts that end a block, a vector (8 or 16 lanes) and a tile anywhere.
inline std::vector<std::size_t> test_counts() {
  return {1, 2, 3, 7, 15, 16, 17, 31, 100, 255, 256, 257, 511, 512, 1000, 2049, 64 * 256, 64 * 256 + 3, 70001};
}

}  // namespace zest::optim::test
