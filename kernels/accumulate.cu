// Grid-stride loops like cast.cu: accumulation is memory-bound, one thread per element is enough,
// and 64-bit indices cover counts past 2^31.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/accumulate.hpp"
#include "kernels/dtype_access.cuh"
#include "runtime/device/cuda_check.hpp"

namespace zest::kernels {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 8192;

using detail::narrow;
using detail::Storage;
using detail::widen;

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
