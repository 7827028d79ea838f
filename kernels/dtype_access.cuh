// Element access by DType in device code: f32 is stored as float, bf16 and f16 as their 16-bit
// patterns; values travel through float (widening is exact, so a low-to-low conversion rounds
// once). The conversions are the host's (runtime/host/half.hpp), so host and device round alike.
#pragma once

#include <cstdint>
#include <type_traits>

#include "runtime/host/half.hpp"
#include "zest/dtype.hpp"

namespace zest::kernels::detail {

template <DType T>
using Storage = std::conditional_t<T == DType::f32, float, std::uint16_t>;

template <DType T>
__device__ inline float widen(Storage<T> x) {
  if constexpr (T == DType::f32) {
    return x;
  } else if constexpr (T == DType::bf16) {
    return bf16_to_float(x);
  } else {
    return fp16_to_float(x);
  }
}

template <DType T>
__device__ inline Storage<T> narrow(float x) {
  if constexpr (T == DType::f32) {
    return x;
  } else if constexpr (T == DType::bf16) {
    return float_to_bf16(x);
  } else {
    return float_to_fp16(x);
  }
}

// Element i of an untyped buffer of T, as float.
template <DType T>
__device__ inline float load_element(const void* data, std::int64_t i) {
  return widen<T>(static_cast<const Storage<T>*>(data)[i]);
}

}  // namespace zest::kernels::detail
