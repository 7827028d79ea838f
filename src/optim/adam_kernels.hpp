// The single-threaded CPU kernels, compiled once per instruction set from adam_kernels.cpp. The
// threaded front end (cpu_adam.hpp) splits work into tiles and calls these on each tile.
#pragma once

#include <cstddef>

#include "optim/adam_math.hpp"
#include "zest/dtype.hpp"

namespace zest::optim {

enum class Isa { scalar, avx2, avx512 };

// "scalar", "avx2", "avx512"
const char* isa_name(Isa isa);

// One contiguous range of an Adam update: fp32 master/m/v updated in place, gradients in
// `grad_dtype`, and (when `out` is set) the updated parameters written as `out_dtype` into `out`.
struct AdamRange {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* out = nullptr;          // optional low-precision copy of the updated parameters
  DType out_dtype = DType::bf16;  // f16 or bf16 when `out` is set
  std::size_t count = 0;
};

// What the engine needs about gradients before a step, from one pass over them.
struct GradStats {
  double sum_squares = 0.0;  // of the gradients as stored (before any scale); void if nonfinite
  bool nonfinite = false;    // some gradient is Inf or NaN
};

struct AdamKernels {
  Isa isa;
  void (*adam)(const AdamRange& range, const AdamCoefficients& c);
  // The same memory traffic as `adam` with trivial arithmetic: the machine's roofline for it.
  void (*roofline)(const AdamRange& range);
  GradStats (*grad_stats)(const void* grad, DType grad_dtype, std::size_t count);
};

// The kernels of one instruction set; Isa::avx2/avx512 must be supported by this CPU.
const AdamKernels& adam_kernels(Isa isa);

#define ZEST_DECLARE_ADAM_KERNELS(ns)                                                   \
  namespace ns {                                                                        \
  void adam(const AdamRange& range, const AdamCoefficients& c);                         \
  void roofline(const AdamRange& range);                                                \
  GradStats grad_stats(const void* grad, DType grad_dtype, std::size_t count);          \
  }
ZEST_DECLARE_ADAM_KERNELS(scalar_isa)
ZEST_DECLARE_ADAM_KERNELS(avx2_isa)
ZEST_DECLARE_ADAM_KERNELS(avx512_isa)
#undef ZEST_DECLARE_ADAM_KERNELS

// True when this CPU (and OS) runs the instruction set.
bool cpu_supports(Isa isa);
// The best supported instruction set, unless ZEST_ADAM_ISA (scalar|avx2|avx512) names one; throws
// zest::Error when that names an unknown or unsupported one.
Isa select_isa();

}  // namespace zest::optim
