// fp16 and bf16 conversions shared by host and CUDA code (the MPI reduction op, the Adam kernels'
// low-precision outputs). Round-to-nearest-even; NaN stays NaN, Inf stays Inf.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zest/dtype.hpp"

#if defined(__CUDACC__)
#define ZEST_HOST_DEVICE __host__ __device__
#else
#define ZEST_HOST_DEVICE
#endif

namespace zest {

ZEST_HOST_DEVICE inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

ZEST_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

ZEST_HOST_DEVICE inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

ZEST_HOST_DEVICE inline float bf16_to_float(std::uint16_t h) {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

ZEST_HOST_DEVICE inline std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to Inf (or is Inf)
  if (abs < 0x38800000u) {
    // Subnormal or zero in fp16: shift the full mantissa into place, rounding to nearest even.
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // below half the smallest subnormal
    const std::uint32_t exponent = abs >> 23;
    const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14..24
    std::uint32_t result = mantissa >> shift;
    const std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
  const std::uint32_t rebased = abs - 0x38000000u;
  const std::uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

ZEST_HOST_DEVICE inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // Inf/NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);
  // Subnormal: normalize.
  std::uint32_t e = 113u;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mantissa & 0x3ffu) << 13));
}

// Element i of a host buffer of `dtype`, as float (exact: every f16/bf16 value is a float).
inline float load_as_float(const void* data, DType dtype, std::size_t i) {
  switch (dtype) {
    case DType::f16: return fp16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::f32: break;
  }
  return static_cast<const float*>(data)[i];
}

// Stores `value` as element i of a host buffer of `dtype`, rounding to nearest even.
inline void store_from_float(void* data, DType dtype, std::size_t i, float value) {
  switch (dtype) {
    case DType::f16: static_cast<std::uint16_t*>(data)[i] = float_to_fp16(value); return;
    case DType::bf16: static_cast<std::uint16_t*>(data)[i] = float_to_bf16(value); return;
    case DType::f32: break;
  }
  static_cast<float*>(data)[i] = value;
}

}  // namespace zest
