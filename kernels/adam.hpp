// The fused multi-tensor Adam and the gradient statistics on CUDA: many tensors per launch, the
// same per-element math as the CPU Adam (src/optim/adam_math.hpp). Plain C++ header: streams are
// passed as `void*` (a cudaStream_t) so callers need no CUDA headers. All pointers are device
// pointers; work is queued on `stream` and the calls return without waiting.
#pragma once

#include <cstdint>
#include <span>

#include "optim/adam_math.hpp"
#include "zest/dtype.hpp"

namespace zest::kernels {

struct CudaAdamTensor {
  float* master = nullptr;   // fp32, updated in place
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;  // in the launch's grad dtype
  void* out = nullptr;         // optional bf16/fp16 copy of the updated parameters
  std::int64_t count = 0;
};

// Updates every tensor (split into as many launches as the kernel's parameter space needs).
// `overflow`, when not null, is a device int read by the kernel itself: nonzero (an Inf/NaN
// gradient found by launch_grad_stats) leaves every tensor unchanged, with no host round trip.
// `has_out` selects whether the tensors' `out` pointers are written (as out_dtype: bf16 or f16).
void launch_multi_tensor_adam(std::span<const CudaAdamTensor> tensors, DType grad_dtype, bool has_out,
                              DType out_dtype, const optim::AdamCoefficients& c, const int* overflow,
                              void* stream);

// A tensor with compact m and v (optimizer.states bf16 or int8, docs/compact-states.md): m and v as
// bf16 bit patterns or dynamic-code bytes; for int8 one scale per optim::kInt8Block elements from
// element 0 in m_scale and v_scale (rewritten by the step); `first_index`: the global index of
// element 0, which with the step's rounding key decides bf16's stochastic rounding.
struct CudaCompactAdamTensor {
  float* master = nullptr;
  void* m = nullptr;
  void* v = nullptr;
  float* m_scale = nullptr;
  float* v_scale = nullptr;
  const void* grad = nullptr;
  void* out = nullptr;
  std::int64_t count = 0;
  std::uint64_t first_index = 0;
};

// As launch_multi_tensor_adam, with compact states: each element's fp32 update is adam_update, its
// moments rounded back as the CPU Adam's step_compact rounds them, in code compiled without FMA
// contraction, so the result equals CpuAdam::step_compact's bit for bit. `rounding_key`:
// optim::rounding_key(seed, step). `states`: bf16 or int8 (Error for fp32: it takes the call above).
void launch_multi_tensor_adam_compact(std::span<const CudaCompactAdamTensor> tensors, StatesFormat states,
                                      DType grad_dtype, bool has_out, DType out_dtype,
                                      const optim::AdamCoefficients& c, std::uint64_t rounding_key,
                                      const int* overflow, void* stream);

struct CudaGradTensor {
  const void* grad = nullptr;
  std::int64_t count = 0;
};

// Adds the sum of squares of all gradients to *sum_squares (device double) and sets *overflow
// (device int) to 1 if any gradient is Inf or NaN. The caller zeroes both first (on the stream).
void launch_grad_stats(std::span<const CudaGradTensor> grads, DType grad_dtype, double* sum_squares,
                       int* overflow, void* stream);

}  // namespace zest::kernels
