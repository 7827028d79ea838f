// The last piece of the gradient statistics on the GPU: launch_grad_stats (kernels/adam.hpp)
// leaves a double sum and an int flag; the ranks all-reduce two floats. Packing them on the GPU
// lets the all-reduce follow on the same stream, with no host round trip before it.
#pragma once

#include <cuda_runtime_api.h>

namespace zest::kernels {

// reduced[0] = *nonfinite ? 0 : float(*sum_squares), reduced[1] = *nonfinite ? 1 : 0. Device
// pointers; one thread, queued on `stream`. Throws SystemError when the launch fails.
void pack_grad_stats_async(const double* sum_squares, const int* nonfinite, float* reduced,
                           cudaStream_t stream);

}  // namespace zest::kernels
