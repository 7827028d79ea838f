// Gradient statistics before a step: sum of squares (for the global norm and clipping) and the
// overflow flag the fused Adam reads, in one pass over all gradient tensors.
#include <cuda_runtime.h>

#include "kernels/adam.hpp"
#include "kernels/dtype_access.cuh"
#include "kernels/multi_tensor.cuh"
#include "runtime/device/cuda_check.hpp"

namespace zest::kernels {
namespace {

using detail::kChunk;
using detail::kThreads;
using detail::load_element;
using Table = detail::TensorTable<CudaGradTensor>;

template <DType G>
__global__ void __launch_bounds__(kThreads) grad_stats(Table table, double* sum_squares, int* overflow) {
  const CudaGradTensor& t = table.tensors[table.block_tensor[blockIdx.x]];
  const std::int64_t begin = static_cast<std::int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const std::int64_t end = begin + kChunk < t.count ? begin + kChunk : t.count;
  double sum = 0.0;
  bool bad = false;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float x = load_element<G>(t.grad, i);
    bad = bad || !isfinite(x);
    sum += static_cast<double>(x) * x;
  }
  if (bad) *overflow = 1;  // every writer writes 1: the race is benign
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  __shared__ double warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double block = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) block += warp_sums[w];
    atomicAdd(sum_squares, block);
  }
}

template <DType G>
void launch_all(std::span<const CudaGradTensor> grads, double* sum_squares, int* overflow, cudaStream_t s) {
  detail::for_each_launch(grads.data(), grads.size(), [&](const Table& table, int blocks) {
    grad_stats<G><<<blocks, kThreads, 0, s>>>(table, sum_squares, overflow);
    ZEST_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace

void launch_grad_stats(std::span<const CudaGradTensor> grads, DType grad_dtype, double* sum_squares,
                       int* overflow, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (grad_dtype) {
    case DType::f32: return launch_all<DType::f32>(grads, sum_squares, overflow, s);
    case DType::bf16: return launch_all<DType::bf16>(grads, sum_squares, overflow, s);
    case DType::f16: return launch_all<DType::f16>(grads, sum_squares, overflow, s);
  }
}

}  // namespace zest::kernels
