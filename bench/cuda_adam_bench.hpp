// The CUDA half of `zest bench adam --device cuda` (bench/cuda_adam_bench.cu), kept out of the
// benchmark's C++ so the zest command needs no CUDA headers.
#pragma once

#include <cstddef>

#include "zest/dtype.hpp"

namespace zest::kernels {

struct CudaAdamBenchResult {
  double params_per_s = 0;       // median over the repetitions
  double copy_bytes_per_s = 0;   // device-to-device cudaMemcpy, bytes read + written per second
};

// Runs the multi-tensor Adam over `params` parameters on GPU 0. Throws SystemError without CUDA
// or without a GPU.
CudaAdamBenchResult bench_cuda_adam(std::size_t params, DType grad_dtype, bool has_out, DType out_dtype,
                                    int reps);

}  // namespace zest::kernels
