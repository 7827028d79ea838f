// The CPU Adam: one call updates fp32 master weights and moments in place from gradients in fp32,
// bf16 or fp16, optionally writing a bf16/fp16 copy of the updated weights, in one pass over
// memory, in parallel over pinned threads. The engine calls it on each (sub-group of a) shard.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "optim/adam_kernels.hpp"
#include "optim/adam_math.hpp"
#include "optim/pinned_arena.hpp"
#include "zest/dtype.hpp"

namespace zest::optim {

// A typed, read-only view of `count` elements (gradients).
struct ConstTensorSpan {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::size_t count = 0;
};

// A typed view of `count` writable elements (the low-precision parameter copy).
struct TensorSpan {
  void* data = nullptr;
  DType dtype = DType::bf16;
  std::size_t count = 0;
};

struct AdamStepArgs {
  std::int64_t step = 1;     // the step being taken, from 1 (bias correction)
  double grad_scale = 1.0;   // multiplies the gradients: 1 / loss scale
  double clip_coef = 1.0;    // min(1, max_norm / global norm), or 1 without clipping
  bool operator==(const AdamStepArgs&) const = default;
};

class CpuAdam {
 public:
  // Elements per tile: p, g, m, v and the output of one tile (about 460 KiB in fp32) stay within
  // one core's L2 while it works through them.
  static constexpr std::size_t kTileElements = 16384;

  // threads 0: one per CPU in `cpus`. `cpus` empty: every CPU this process may use (the engine
  // passes the rank's share of the machine, Device::host_cpus, where the Runtime chose one). The variant
  // is select_isa()'s (ZEST_ADAM_ISA forces one). Throws zest::Error on invalid arguments.
  CpuAdam(const AdamHyperParams& hyper, int threads, std::vector<int> cpus = {});
  CpuAdam(const AdamHyperParams& hyper, int threads, std::vector<int> cpus, Isa isa);

  // Updates master, m, v in place; when `out.data` is set, writes the updated parameters there
  // as out.dtype (bf16, f16, or f32: parameters kept apart from the master weights, written in the
  // same pass instead of copied after it). All spans must have the same length and must not overlap. Not
  // thread-safe: one step at a time per CpuAdam. Throws zest::Error on mismatched arguments.
  void step(std::span<float> master, std::span<float> m, std::span<float> v,
            ConstTensorSpan grad, const AdamStepArgs& args, TensorSpan out = {});

  // The states an update reads when it writes elsewhere (step_from): fp32 arrays of the step's length.
  struct SourceStates {
    const float* master = nullptr;
    const float* m = nullptr;
    const float* v = nullptr;
  };
  // As step(), but the states are read from `from` (which it leaves as they are) and the updated
  // ones written to master, m and v, in the same one pass over them: an update that must keep the
  // old states reads each byte of them once and writes each byte of the new ones once, as step()
  // does in place (no copy first). `from` must not overlap the destinations.
  void step_from(SourceStates from, std::span<float> master, std::span<float> m, std::span<float> v,
                 ConstTensorSpan grad, const AdamStepArgs& args, TensorSpan out = {});

  // m and v in a compact format (docs/compact-states.md): `count` elements each, as bf16 bit
  // patterns (uint16) for bf16, as float for f32, as bytes of the dynamic codes for int8, whose
  // blocks of kInt8Block elements from master[0] have one scale each in m_scale and v_scale
  // (ceil(count / kInt8Block) floats each; all zero, with zero bytes, for zero states).
  struct CompactStates {
    StatesFormat format = StatesFormat::bf16;
    void* m = nullptr;
    void* v = nullptr;
    std::size_t count = 0;
    float* m_scale = nullptr;  // int8
    float* v_scale = nullptr;  // int8
  };
  // What decides the stochastic rounding's bits besides the step: a run's seed and the global
  // index of master[0] in the flat parameter space (so any tiling, thread count, ISA or sharding
  // rounds the same element the same way).
  struct CompactRounding {
    std::uint64_t seed = 0;
    std::uint64_t first_index = 0;
  };
  // As step(), with m and v stored as states.format: each is widened to fp32, updated by the same
  // fp32 Adam, and rounded back: stochastically for bf16, to the nearest code value of the block's
  // new scale for int8 (rounding unused). The parameter update uses the unrounded fp32 moments.
  // f32 is step() itself (rounding unused), bit for bit. Throws zest::Error on mismatched arguments.
  void step_compact(std::span<float> master, CompactStates states, ConstTensorSpan grad,
                    const AdamStepArgs& args, CompactRounding rounding, TensorSpan out = {});

  // As step_compact, with the master weights in bf16 (optimizer.master: bf16): each tile of the
  // master is widened to fp32 in cache, updated by the same kernel, and rounded back stochastically
  // with its own stream of the rounding bits (master_random_bits: unbiased, so updates far below a
  // bf16 step still add up). `out`, when set, receives that bf16 master (bf16: its bits; f16:
  // converted); an fp32 `out` is refused, as are fp32 states. Throws zest::Error on mismatched
  // arguments.
  void step_compact(std::span<std::uint16_t> master, CompactStates states, ConstTensorSpan grad,
                    const AdamStepArgs& args, CompactRounding rounding, TensorSpan out = {});

  // The states an update reads when it writes elsewhere (step_compact_from): the master weights
  // (fp32, or bf16 bit patterns for the bf16-master overload) and the moments, in the step's format
  // and of its length. Only read.
  struct CompactSource {
    const void* master = nullptr;
    CompactStates states;
  };
  // As step_compact(), but the states are read from `from` (which it leaves as they are) and the
  // updated ones written to master and states, in one pass as step_from(). `from` must not overlap
  // the destinations. fp32 states are step_from() itself.
  void step_compact_from(const CompactSource& from, std::span<float> master, CompactStates states,
                         ConstTensorSpan grad, const AdamStepArgs& args, CompactRounding rounding,
                         TensorSpan out = {});
  void step_compact_from(const CompactSource& from, std::span<std::uint16_t> master, CompactStates states,
                         ConstTensorSpan grad, const AdamStepArgs& args, CompactRounding rounding,
                         TensorSpan out = {});

  // Sum of squares of `grad` (as stored, before any scale) and whether any element is Inf/NaN;
  // the sum means nothing when one is.
  GradStats grad_stats(ConstTensorSpan grad);

  // Benchmark only: the same memory traffic and tiling as step_compact() with trivial arithmetic.
  void roofline_compact_pass(std::span<float> master, CompactStates states, ConstTensorSpan grad,
                             TensorSpan out = {});

  // Benchmark only: the same memory traffic and tiling as step() with trivial arithmetic.
  void roofline_pass(std::span<float> master, std::span<float> m, std::span<float> v,
                     ConstTensorSpan grad, TensorSpan out = {});

  const AdamHyperParams& hyper() const { return hyper_; }
  void set_hyper(const AdamHyperParams& hyper) { hyper_ = hyper; }
  Isa isa() const { return kernels_->isa; }
  int threads() const { return arena_.threads(); }

 private:
  AdamRange checked_range(std::span<float> master, std::span<float> m, std::span<float> v,
                          ConstTensorSpan grad, TensorSpan out) const;
  // `master` may be null (a bf16 master, set per tile); n: the elements.
  CompactAdamRange checked_compact_range(float* master, std::size_t n, CompactStates states, ConstTensorSpan grad,
                                         CompactRounding rounding, TensorSpan out) const;
  template <class Kernel>
  void for_each_compact_tile(const CompactAdamRange& range, const Kernel& kernel);
  // step_compact and step_compact_from (from null: in place).
  void compact_step(const CompactSource* from, std::span<float> master, CompactStates states, ConstTensorSpan grad,
                    const AdamStepArgs& args, CompactRounding rounding, TensorSpan out);
  void compact_step(const CompactSource* from, std::span<std::uint16_t> master, CompactStates states,
                    ConstTensorSpan grad, const AdamStepArgs& args, CompactRounding rounding, TensorSpan out);
  // Checks the gradient and the optional copy against n elements and sets them in r.
  template <class Range>
  static void check_grad_and_out(std::size_t n, ConstTensorSpan grad, TensorSpan out, Range& r);

  AdamHyperParams hyper_;
  const AdamKernels* kernels_;
  PinnedArena arena_;
};

}  // namespace zest::optim
