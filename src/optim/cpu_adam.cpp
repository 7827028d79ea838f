#include "optim/cpu_adam.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "optim/states_layout.hpp"
#include "runtime/host/half.hpp"
#include "runtime/host/thread_binding.hpp"
#include "zest/error.hpp"

namespace zest::optim {
namespace {

// `cpus` empty: every cpu the process may use (detail::allowed_cpus), and with threads 0 one thread
// per cpu there.
// Resolved once, here, so the thread count and the arena's cpus cannot disagree.
PinnedArena make_arena(int threads, std::vector<int> cpus) {
  if (threads < 0) throw Error(fmt::format("CPU Adam thread count must be >= 0 (0 = one per CPU), got {}", threads));
  if (cpus.empty()) cpus = detail::allowed_cpus();
  if (threads == 0) threads = static_cast<int>(cpus.size());
  return PinnedArena(threads, std::move(cpus));
}

AdamRange offset(const AdamRange& r, std::size_t begin, std::size_t end) {
  AdamRange tile = r;
  tile.master += begin;
  tile.m += begin;
  tile.v += begin;
  if (r.master_in != nullptr) {
    tile.master_in += begin;
    tile.m_in += begin;
    tile.v_in += begin;
  }
  tile.grad = static_cast<const unsigned char*>(r.grad) + begin * dtype_size(r.grad_dtype);
  if (r.out != nullptr) tile.out = static_cast<unsigned char*>(r.out) + begin * dtype_size(r.out_dtype);
  tile.count = end - begin;
  return tile;
}

std::string size_mismatch(const char* name, std::size_t got, std::size_t want) {
  return fmt::format("CpuAdam::step: {} has {} elements but master has {}; pass spans of one length", name, got, want);
}

}  // namespace

CpuAdam::CpuAdam(const AdamHyperParams& hyper, int threads, std::vector<int> cpus)
    : CpuAdam(hyper, threads, std::move(cpus), select_isa()) {}

CpuAdam::CpuAdam(const AdamHyperParams& hyper, int threads, std::vector<int> cpus, Isa isa)
    : hyper_(hyper),
      kernels_(&adam_kernels(isa)),
      arena_(make_arena(threads, std::move(cpus))) {}

AdamRange CpuAdam::checked_range(std::span<float> master, std::span<float> m, std::span<float> v,
                                 ConstTensorSpan grad, TensorSpan out) const {
  const std::size_t n = master.size();
  if (m.size() != n) throw Error(size_mismatch("m", m.size(), n));
  if (v.size() != n) throw Error(size_mismatch("v", v.size(), n));
  AdamRange r{master.data(), m.data(), v.data(), nullptr, DType::f32, nullptr, DType::bf16, n};
  check_grad_and_out(n, grad, out, r);
  return r;
}

template <class Range>
void CpuAdam::check_grad_and_out(std::size_t n, ConstTensorSpan grad, TensorSpan out, Range& r) {
  if (grad.count != n) throw Error(size_mismatch("grad", grad.count, n));
  if (n > 0 && grad.data == nullptr) throw Error("CpuAdam::step: grad.data is null; pass the gradients");
  r.grad = grad.data;
  r.grad_dtype = grad.dtype;
  if (out.data != nullptr) {
    if (out.count != n) throw Error(size_mismatch("out", out.count, n));
    r.out = out.data;
    r.out_dtype = out.dtype;
  }
}

void CpuAdam::step(std::span<float> master, std::span<float> m, std::span<float> v,
                   ConstTensorSpan grad, const AdamStepArgs& args, TensorSpan out) {
  const AdamRange range = checked_range(master, m, v, grad, out);
  const AdamCoefficients c = make_adam_coefficients(hyper_, args.step, args.grad_scale, args.clip_coef);
  const auto adam = kernels_->adam;
  arena_.for_each_tile(range.count, kTileElements, [&](std::size_t begin, std::size_t end) {
    adam(offset(range, begin, end), c);
  });
}

void CpuAdam::step_from(SourceStates from, std::span<float> master, std::span<float> m, std::span<float> v,
                        ConstTensorSpan grad, const AdamStepArgs& args, TensorSpan out) {
  const AdamRange range = checked_range(master, m, v, grad, out);
  if (range.count > 0 && (from.master == nullptr || from.m == nullptr || from.v == nullptr))
    throw Error("CpuAdam::step_from: a source state is null; pass master, m and v to read from");
  const AdamCoefficients c = make_adam_coefficients(hyper_, args.step, args.grad_scale, args.clip_coef);
  const auto adam = kernels_->adam;
  AdamRange ahead = range;
  ahead.master_in = from.master;
  ahead.m_in = from.m;
  ahead.v_in = from.v;
  arena_.for_each_tile(range.count, kTileElements, [&](std::size_t begin, std::size_t end) {
    adam(offset(ahead, begin, end), c);
  });
}

CompactAdamRange CpuAdam::checked_compact_range(float* master, std::size_t n, CompactStates states,
                                                ConstTensorSpan grad, CompactRounding rounding,
                                                TensorSpan out) const {
  if (states.count != n) throw Error(size_mismatch("m and v", states.count, n));
  if (n > 0 && (states.m == nullptr || states.v == nullptr))
    throw Error("CpuAdam::step_compact: m or v is null; pass both states");
  if (states.format == StatesFormat::f32)
    throw Error("CpuAdam: fp32 states take step()");
  if (states.format == StatesFormat::int8 && n > 0 && (states.m_scale == nullptr || states.v_scale == nullptr))
    throw Error("CpuAdam::step_compact: int8 states need m_scale and v_scale, one float per block of "
                "kInt8Block elements");
  if (rounding.first_index > UINT64_MAX - n)
    throw Error("CpuAdam::step_compact: first_index + count overflows 64 bits; pass the global "
                "index of master[0]");
  CompactAdamRange range;
  range.master = master;
  range.m = states.m;
  range.v = states.v;
  range.states = states.format;
  range.count = n;
  range.first_index = rounding.first_index;
  if (states.format == StatesFormat::int8) {
    range.m_scale = states.m_scale;
    range.v_scale = states.v_scale;
    range.m_code = &dynamic_code(true);
    range.v_code = &dynamic_code(false);
  }
  check_grad_and_out(n, grad, out, range);
  return range;
}

template <class Kernel>
void CpuAdam::for_each_compact_tile(const CompactAdamRange& range, const Kernel& kernel) {
  static_assert(kTileElements % kInt8Block == 0, "an int8 block must not straddle two tiles");
  const std::size_t state_size = range.states == StatesFormat::int8 ? 1 : 2;
  arena_.for_each_tile(range.count, kTileElements, [&](std::size_t begin, std::size_t end) {
    CompactAdamRange tile = range;
    if (range.states == StatesFormat::int8) {
      tile.m_scale += begin / kInt8Block;
      tile.v_scale += begin / kInt8Block;
    }
    if (tile.master != nullptr) tile.master += begin;
    tile.m = static_cast<unsigned char*>(range.m) + begin * state_size;
    tile.v = static_cast<unsigned char*>(range.v) + begin * state_size;
    if (range.master_in != nullptr) tile.master_in += begin;
    if (range.m_in != nullptr) {
      tile.m_in = static_cast<const unsigned char*>(range.m_in) + begin * state_size;
      tile.v_in = static_cast<const unsigned char*>(range.v_in) + begin * state_size;
      if (range.states == StatesFormat::int8) {
        tile.m_scale_in += begin / kInt8Block;
        tile.v_scale_in += begin / kInt8Block;
      }
    }
    tile.grad = static_cast<const unsigned char*>(range.grad) + begin * dtype_size(range.grad_dtype);
    if (range.out != nullptr)
      tile.out = static_cast<unsigned char*>(range.out) + begin * dtype_size(range.out_dtype);
    tile.count = end - begin;
    tile.first_index = range.first_index + begin;
    kernel(tile);
  });
}

namespace {

// Throws unless `from` can be read as the source of a step on `states` (same format and length).
void check_source(const CpuAdam::CompactSource& from, const CpuAdam::CompactStates& states) {
  if (from.states.format != states.format || from.states.count != states.count)
    throw Error("CpuAdam::step_compact_from: the source states differ in format or length from the destination; "
                "pass the same sub-group's states");
  if (states.count > 0 &&
      (from.master == nullptr || from.states.m == nullptr || from.states.v == nullptr ||
       (states.format == StatesFormat::int8 && (from.states.m_scale == nullptr || from.states.v_scale == nullptr))))
    throw Error(
        "CpuAdam::step_compact_from: a source state is null; pass the master, m, v (and int8's scales) to read from");
}

// The kernel reads the moments (and int8's scales) of `from`, not the destination's.
void read_moments_from(const CpuAdam::CompactSource& from, CompactAdamRange& range) {
  range.m_in = from.states.m;
  range.v_in = from.states.v;
  range.m_scale_in = from.states.m_scale;
  range.v_scale_in = from.states.v_scale;
}

}  // namespace

void CpuAdam::step_compact(std::span<float> master, CompactStates states, ConstTensorSpan grad,
                           const AdamStepArgs& args, CompactRounding rounding, TensorSpan out) {
  compact_step(nullptr, master, states, grad, args, rounding, out);
}

void CpuAdam::step_compact(std::span<std::uint16_t> master, CompactStates states, ConstTensorSpan grad,
                           const AdamStepArgs& args, CompactRounding rounding, TensorSpan out) {
  compact_step(nullptr, master, states, grad, args, rounding, out);
}

void CpuAdam::step_compact_from(const CompactSource& from, std::span<float> master, CompactStates states,
                                ConstTensorSpan grad, const AdamStepArgs& args, CompactRounding rounding,
                                TensorSpan out) {
  check_source(from, states);
  compact_step(&from, master, states, grad, args, rounding, out);
}

void CpuAdam::step_compact_from(const CompactSource& from, std::span<std::uint16_t> master, CompactStates states,
                                ConstTensorSpan grad, const AdamStepArgs& args, CompactRounding rounding,
                                TensorSpan out) {
  check_source(from, states);
  compact_step(&from, master, states, grad, args, rounding, out);
}

void CpuAdam::compact_step(const CompactSource* from, std::span<float> master, CompactStates states,
                           ConstTensorSpan grad, const AdamStepArgs& args, CompactRounding rounding, TensorSpan out) {
  if (states.format == StatesFormat::f32) {
    const std::size_t n = master.size();
    if (states.count != n) throw Error(size_mismatch("m and v", states.count, n));
    const std::span<float> m{static_cast<float*>(states.m), n}, v{static_cast<float*>(states.v), n};
    if (from == nullptr) {
      step(master, m, v, grad, args, out);
    } else {
      step_from({static_cast<const float*>(from->master), static_cast<const float*>(from->states.m),
                 static_cast<const float*>(from->states.v)},
                master, m, v, grad, args, out);
    }
    return;
  }
  CompactAdamRange range = checked_compact_range(master.data(), master.size(), states, grad, rounding, out);
  if (from != nullptr) {
    range.master_in = static_cast<const float*>(from->master);
    read_moments_from(*from, range);
  }
  const AdamCoefficients c = make_adam_coefficients(hyper_, args.step, args.grad_scale, args.clip_coef);
  const StateRounding keys{rounding_key(rounding.seed, args.step)};
  const auto adam = kernels_->adam_compact;
  for_each_compact_tile(range, [&](const CompactAdamRange& tile) { adam(tile, c, keys); });
}

void CpuAdam::compact_step(const CompactSource* from, std::span<std::uint16_t> master, CompactStates states,
                           ConstTensorSpan grad, const AdamStepArgs& args, CompactRounding rounding, TensorSpan out) {
  if (states.format == StatesFormat::f32)
    throw Error("CpuAdam::step_compact: a bf16 master needs bf16 or int8 states (optimizer.states), not fp32");
  if (out.data != nullptr && out.dtype == DType::f32)
    throw Error("CpuAdam::step_compact: with a bf16 master the parameter copy is bf16 or fp16, not fp32");
  if (!master.empty() && master.data() == nullptr) throw Error("CpuAdam::step_compact: the master is null");
  // The kernel writes no copy; each tile's copy is taken from its rounded master below.
  CompactAdamRange range = checked_compact_range(nullptr, master.size(), states, grad, rounding, out);
  range.out = nullptr;
  if (from != nullptr) read_moments_from(*from, range);
  const auto* const master_in = from != nullptr ? static_cast<const std::uint16_t*>(from->master) : master.data();
  const AdamCoefficients c = make_adam_coefficients(hyper_, args.step, args.grad_scale, args.clip_coef);
  const StateRounding keys{rounding_key(rounding.seed, args.step)};
  const AdamKernels& k = *kernels_;
  for_each_compact_tile(range, [&](const CompactAdamRange& tile) {
    const std::size_t begin = tile.first_index - range.first_index;
    std::uint16_t* const bf16 = master.data() + begin;
    alignas(64) float p[kTileElements];  // the tile's master in fp32, in this thread's cache
    k.widen_bf16(master_in + begin, p, tile.count);
    CompactAdamRange in_cache = tile;
    in_cache.master = p;
    k.adam_compact(in_cache, c, keys);
    k.round_master(p, bf16, tile.count, tile.first_index, keys);
    if (out.data == nullptr) return;
    auto* const copy = static_cast<std::uint16_t*>(out.data) + begin;
    if (out.dtype == DType::bf16) {
      std::memcpy(copy, bf16, tile.count * sizeof(std::uint16_t));
    } else {
      for (std::size_t i = 0; i < tile.count; ++i) copy[i] = float_to_fp16(bf16_to_float(bf16[i]));
    }
  });
}

void CpuAdam::roofline_compact_pass(std::span<float> master, CompactStates states, ConstTensorSpan grad,
                                    TensorSpan out) {
  const CompactAdamRange range = checked_compact_range(master.data(), master.size(), states, grad, {}, out);
  const auto roofline = kernels_->roofline_compact;
  for_each_compact_tile(range, [&](const CompactAdamRange& tile) { roofline(tile); });
}

void CpuAdam::roofline_pass(std::span<float> master, std::span<float> m, std::span<float> v,
                            ConstTensorSpan grad, TensorSpan out) {
  const AdamRange range = checked_range(master, m, v, grad, out);
  const auto roofline = kernels_->roofline;
  arena_.for_each_tile(range.count, kTileElements, [&](std::size_t begin, std::size_t end) {
    roofline(offset(range, begin, end));
  });
}

GradStats CpuAdam::grad_stats(ConstTensorSpan grad) {
  if (grad.count > 0 && grad.data == nullptr)
    throw Error("CpuAdam::grad_stats: grad.data is null; pass the gradients");
  const std::size_t tiles = (grad.count + kTileElements - 1) / kTileElements;
  // One slot per tile, summed in tile order afterwards: the result does not depend on which
  // thread ran which tile. The vector is small (8 bytes per 16K gradients).
  std::vector<GradStats> partial(tiles);
  const auto stats = kernels_->grad_stats;
  const std::size_t size = dtype_size(grad.dtype);
  arena_.for_each_tile(grad.count, kTileElements, [&](std::size_t begin, std::size_t end) {
    partial[begin / kTileElements] =
        stats(static_cast<const unsigned char*>(grad.data) + begin * size, grad.dtype, end - begin);
  });
  GradStats total;
  for (const GradStats& p : partial) {
    total.sum_squares += p.sum_squares;
    total.nonfinite = total.nonfinite || p.nonfinite;
  }
  return total;
}

}  // namespace zest::optim
