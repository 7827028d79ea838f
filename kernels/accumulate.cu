// Grid-stride loops like cast.cu: accumulation is memory-bound, one thread per element is enough,
// and 64-bit indices cover counts past 2^31.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/accumulate.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/half.hpp"

namespace zest::kernels {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 8192;

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

template <DType T>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(Storage<T>* __restrict__ dst, const Storage<T>* __restrict__ src, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    // A plain add, not an FMA: the host loop computes exactly this.
    dst[i] = narrow<T>(__fadd_rn(widen<T>(dst[i]), widen<T>(src[i])));
  }
}

template <DType T>
void launch(void* dst, const void* src, std::size_t count, cudaStream_t stream) {
  const std::size_t blocks = std::min<std::size_t>((count + kThreads - 1) / kThreads, kMaxBlocks);
  accumulate_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<Storage<T>*>(dst), static_cast<const Storage<T>*>(src), count);
  ZEST_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void accumulate_async(void* dst, const void* src, DType dtype, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;  // a launch with an empty grid is an error
  switch (dtype) {
    case DType::f32: return launch<DType::f32>(dst, src, count, stream);
    case DType::f16: return launch<DType::f16>(dst, src, count, stream);
    case DType::bf16: return launch<DType::bf16>(dst, src, count, stream);
  }
}

}  // namespace zest::kernels
