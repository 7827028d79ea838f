#include <cuda_runtime.h>

#include "kernels/grad_stats_pack.hpp"
#include "runtime/device/cuda_check.hpp"

namespace zest::kernels {
namespace {

__global__ void pack_grad_stats_kernel(const double* sum_squares, const int* nonfinite, float* reduced) {
  const bool bad = *nonfinite != 0;
  reduced[0] = bad ? 0.0f : static_cast<float>(*sum_squares);
  reduced[1] = bad ? 1.0f : 0.0f;
}

}  // namespace

void pack_grad_stats_async(const double* sum_squares, const int* nonfinite, float* reduced,
                           cudaStream_t stream) {
  pack_grad_stats_kernel<<<1, 1, 0, stream>>>(sum_squares, nonfinite, reduced);
  ZEST_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zest::kernels
