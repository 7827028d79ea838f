// The single-threaded CPU kernels, compiled once per instruction set from adam_kernels.cpp. The
// threaded front end (cpu_adam.hpp) splits work into tiles and calls these on each tile.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/adam_math.hpp"
#include "optim/compact_math.hpp"
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
  void* out = nullptr;            // optional copy of the updated parameters
  DType out_dtype = DType::bf16;  // f16, bf16 or f32 when `out` is set
  std::size_t count = 0;
  // Where the states are read from when that is not master, m and v themselves (an update that
  // keeps the old states, CpuAdam::step_from): all three, not overlapping the destinations, or none.
  const float* master_in = nullptr;
  const float* m_in = nullptr;
  const float* v_in = nullptr;
};

// One contiguous range of an Adam update with compact states (docs/compact-states.md): the fp32
// master updated in place, m and v stored as `states` and updated in place (bf16: bf16 bit
// patterns, rounded stochastically), the gradient and optional parameter copy as in AdamRange.
// `first_index` is the global index of element 0: it, the step's key and nothing else decide the
// rounding bits, so the result does not depend on tiles, threads or the instruction set.
//
// int8: m and v are bytes of the dynamic codes m_code (signed) and v_code (unsigned), in blocks of
// kInt8Block elements from element 0 (the last may be shorter), each block with its scale in
// m_scale/v_scale (one float per block, rewritten by the step).
struct CompactAdamRange {
  float* master = nullptr;
  void* m = nullptr;
  void* v = nullptr;
  StatesFormat states = StatesFormat::bf16;
  float* m_scale = nullptr;              // int8
  float* v_scale = nullptr;              // int8
  const DynamicCode* m_code = nullptr;   // int8: make_dynamic_code(true)
  const DynamicCode* v_code = nullptr;   // int8: make_dynamic_code(false)
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* out = nullptr;
  DType out_dtype = DType::bf16;
  std::size_t count = 0;
  std::uint64_t first_index = 0;
  // As AdamRange's: where the update reads the master, m, v and (int8) the scales when that is not
  // where it writes them (CpuAdam::step_compact_from). All, not overlapping the destinations, or
  // none; master_in may be set alone (a bf16 master's tile widened in cache).
  const float* master_in = nullptr;
  const void* m_in = nullptr;
  const void* v_in = nullptr;
  const float* m_scale_in = nullptr;  // int8
  const float* v_scale_in = nullptr;  // int8
};

// The step's rounding key: rounding_key(seed, step).
struct StateRounding {
  std::uint64_t key = 0;
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
  // `adam` on compact states: the same fp32 update, the states widened on load and rounded on store.
  void (*adam_compact)(const CompactAdamRange& range, const AdamCoefficients& c,
                       const StateRounding& rounding);
  // The same memory traffic as `adam_compact` with trivial arithmetic.
  void (*roofline_compact)(const CompactAdamRange& range);
  // A bf16 master (optimizer.master: bf16) around `adam_compact`: widened to fp32 before, and the
  // updated fp32 values rounded back stochastically after, with master_random_bits of each
  // element's global index (first_index + i) and the step's key.
  void (*widen_bf16)(const std::uint16_t* from, float* to, std::size_t n);
  void (*round_master)(const float* p, std::uint16_t* master, std::size_t n, std::uint64_t first_index,
                       const StateRounding& rounding);
};

// The kernels of one instruction set; Isa::avx2/avx512 must be supported by this CPU.
const AdamKernels& adam_kernels(Isa isa);

#define ZEST_DECLARE_ADAM_KERNELS(ns)                                                   \
  namespace ns {                                                                        \
  void adam(const AdamRange& range, const AdamCoefficients& c);                         \
  void roofline(const AdamRange& range);                                                \
  GradStats grad_stats(const void* grad, DType grad_dtype, std::size_t count);          \
  void adam_compact(const CompactAdamRange& range, const AdamCoefficients& c,           \
                    const StateRounding& rounding);                                     \
  void roofline_compact(const CompactAdamRange& range);                                 \
  void widen_bf16(const std::uint16_t* from, float* to, std::size_t n);                 \
  void round_master(const float* p, std::uint16_t* master, std::size_t n,               \
                    std::uint64_t first_index, const StateRounding& rounding);          \
  }
ZEST_DECLARE_ADAM_KERNELS(scalar_isa)
ZEST_DECLARE_ADAM_KERNELS(avx2_isa)
ZEST_DECLARE_ADAM_KERNELS(avx512_isa)
#undef ZEST_DECLARE_ADAM_KERNELS

// True when this CPU (and OS) runs the instruction set.
bool cpu_supports(Isa isa);
// Throws zest::Error unless this CPU runs `isa`; `what` names the kernels asked for.
void require_isa(Isa isa, const char* what);

// The table of `isa` among one kernel source's three builds (require_isa checks it).
template <class Kernels>
const Kernels& kernels_for(Isa isa, const char* what, const Kernels& scalar, const Kernels& avx2,
                           const Kernels& avx512) {
  require_isa(isa, what);
  return isa == Isa::avx512 ? avx512 : isa == Isa::avx2 ? avx2 : scalar;
}
// The best supported instruction set, unless ZEST_ADAM_ISA (scalar|avx2|avx512) names one; throws
// zest::Error when that names an unknown or unsupported one.
Isa select_isa();

}  // namespace zest::optim
