// Where the optimizer states of `count` consecutive elements lie in one buffer, in every format of
// optimizer.states (docs/compact-states.md):
//
//   [ master: count fp32 or bf16 | m: count states | v: count states | m scales | v scales ]
//
// a state being a float (fp32), a bf16 bit pattern (bf16) or a code byte (int8), and the scales (int8
// only) one float per block of kInt8Block elements from element 0. A layout without its master
// (Master::elsewhere: the engine's fp32 parameters are the master weights) starts at m. The engine
// keeps one such buffer per piece of its states (an offloaded sub-group; the device's part), so a
// piece moves to and from NVMe as one region, and the bytes the plan counts are the bytes allocated.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/compact_math.hpp"
#include "optim/cpu_adam.hpp"
#include "zest/dtype.hpp"
#include "zest/error.hpp"

namespace zest::optim {

constexpr std::size_t state_bytes(StatesFormat format) {
  return format == StatesFormat::f32 ? 4 : format == StatesFormat::bf16 ? 2 : 1;
}

// How a run keeps its states: m and v (optimizer.states) and the master weights (optimizer.master:
// fp32, or bf16 with compact moments).
struct StatesForm {
  StatesFormat moments = StatesFormat::f32;
  DType master = DType::f32;
  bool plain() const { return moments == StatesFormat::f32 && master == DType::f32; }
};

class StatesLayout {
 public:
  enum class Master { here, elsewhere };
  // Master::elsewhere needs an fp32 master (Error otherwise: only fp32 parameters can be one).
  StatesLayout(StatesForm form, std::size_t count, Master master = Master::here)
      : form_(form), count_(count), master_(master) {
    if (master == Master::elsewhere && form.master != DType::f32)
      throw Error("StatesLayout: only an fp32 master can live outside the states (in fp32 parameters)");
  }

  // Bytes of the whole buffer for `count` elements.
  static constexpr std::size_t bytes(StatesForm form, std::size_t count, Master master = Master::here) {
    return scales_offset(form, count, master) + 2 * blocks(form.moments, count) * sizeof(float);
  }
  // Where the scales start: after master, m and v, rounded up to a float (a count the engine
  // uses, a multiple of 64, needs no rounding).
  static constexpr std::size_t scales_offset(StatesForm form, std::size_t count, Master master = Master::here) {
    const std::size_t end = count * (master_bytes(form, master) + 2 * state_bytes(form.moments));
    return (end + alignof(float) - 1) / alignof(float) * alignof(float);
  }
  static constexpr std::size_t master_bytes(StatesForm form, Master master) {
    return master == Master::here ? dtype_size(form.master) : 0;
  }
  // Scales per state: one per block for int8, none otherwise.
  static constexpr std::size_t blocks(StatesFormat format, std::size_t count) {
    return format == StatesFormat::int8 ? (count + kInt8Block - 1) / kInt8Block : 0;
  }

  StatesForm form() const { return form_; }
  StatesFormat format() const { return form_.moments; }
  std::size_t count() const { return count_; }
  bool master_here() const { return master_ == Master::here; }
  std::size_t bytes() const { return bytes(form_, count_, master_); }

  // The master weights: fp32 (master()) or bf16 bit patterns (bf16_master()), as the form says;
  // only where the layout holds them (master_here()).
  float* master(char* base) const { return reinterpret_cast<float*>(base); }
  std::uint16_t* bf16_master(char* base) const { return reinterpret_cast<std::uint16_t*>(base); }
  char* m(char* base) const { return base + count_ * master_bytes(form_, master_); }
  char* v(char* base) const { return m(base) + count_ * state_bytes(form_.moments); }
  float* m_scales(char* base) const { return reinterpret_cast<float*>(base + scales_offset(form_, count_, master_)); }
  float* v_scales(char* base) const { return m_scales(base) + blocks(form_.moments, count_); }

  // The moments of elements [at, at + n) of the buffer at `base`, for CpuAdam::step_compact. For
  // int8, `at` must start a block (the caller's ranges are kInt8Block-aligned): Error otherwise,
  // since a part of a block would be quantized with a scale the rest of it shares.
  CpuAdam::CompactStates moments(char* base, std::size_t at, std::size_t n) const {
    if (form_.moments == StatesFormat::int8 && at % kInt8Block != 0)
      throw Error("StatesLayout: int8 states are updated in whole blocks of 64 elements; a part must start one");
    const std::size_t element = state_bytes(form_.moments);
    CpuAdam::CompactStates s{form_.moments, m(base) + at * element, v(base) + at * element, n};
    if (form_.moments == StatesFormat::int8) {
      s.m_scale = m_scales(base) + at / kInt8Block;
      s.v_scale = v_scales(base) + at / kInt8Block;
    }
    return s;
  }

 private:
  StatesForm form_;
  std::size_t count_;
  Master master_;
};

// The int8 states' codes (make_dynamic_code), built once: signed for m, unsigned for v.
const DynamicCode& dynamic_code(bool is_signed);

// m and v of `n` elements, widened to fp32 (exact for bf16; the code values times the block's scale
// for int8) into m_out and v_out; `states` as moments() gives them, n == states.count.
void widen_moments(const CpuAdam::CompactStates& states, float* m_out, float* v_out);

// The reverse, for values the caller set (a checkpoint's, a user's): m and v rounded into
// `states`: to the nearest bf16 (a widened bf16 value comes back unchanged), or per block to the
// nearest code value of the block's new scale (a widened int8 block comes back to the same bytes).
void narrow_moments(const float* m, const float* v, const CpuAdam::CompactStates& states);

}  // namespace zest::optim
