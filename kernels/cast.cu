// One thread per element in a grid-stride loop: a memory-bound conversion needs no more, and the
// loop covers counts beyond what one launch's grid holds. Indices are 64-bit, so tensors past
// 2^31 elements convert correctly.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cast.hpp"
#include "kernels/dtype_access.cuh"
#include "runtime/device/cuda_check.hpp"

namespace zest::kernels {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU several times over; the grid-stride loop does the rest.
constexpr std::size_t kMaxBlocks = 8192;

using detail::narrow;
using detail::Storage;
using detail::widen;

template <DType From, DType To>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const Storage<From>* __restrict__ src, Storage<To>* __restrict__ dst, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    dst[i] = narrow<To>(widen<From>(src[i]));
  }
}

template <DType From, DType To>
void launch(const void* src, void* dst, std::size_t count, cudaStream_t stream) {
  const std::size_t blocks = std::min<std::size_t>((count + kThreads - 1) / kThreads, kMaxBlocks);
  cast_kernel<From, To><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const Storage<From>*>(src), static_cast<Storage<To>*>(dst), count);
  ZEST_CUDA_CHECK(cudaGetLastError());
}

template <DType From>
void launch_to(const void* src, void* dst, DType dst_type, std::size_t count, cudaStream_t stream) {
  switch (dst_type) {
    case DType::f32: return launch<From, DType::f32>(src, dst, count, stream);
    case DType::f16: return launch<From, DType::f16>(src, dst, count, stream);
    case DType::bf16: return launch<From, DType::bf16>(src, dst, count, stream);
  }
}

}  // namespace

void cast_async(const void* src, DType src_type, void* dst, DType dst_type, std::size_t count,
                cudaStream_t stream) {
  if (count == 0) return;  // a launch with an empty grid is an error
  if (src_type == dst_type) {
    if (src == dst) return;
    ZEST_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * dtype_size(src_type), cudaMemcpyDefault, stream));
    return;
  }
  switch (src_type) {
    case DType::f32: return launch_to<DType::f32>(src, dst, dst_type, count, stream);
    case DType::f16: return launch_to<DType::f16>(src, dst, dst_type, count, stream);
    case DType::bf16: return launch_to<DType::bf16>(src, dst, dst_type, count, stream);
  }
}

}  // namespace zest::kernels
