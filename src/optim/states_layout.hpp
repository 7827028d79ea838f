// Where the optimizer states of `count` consecutive elements lie in one buffer, in every format of
// optimizer.states (docs/compact-states.md):
//
//   [ master: count floats | m: count states | v: count states | m scales | v scales ]
//
// a state being a float (fp32), a bf16 bit pattern (bf16) or a code byte (int8), and the scales (int8
// only) one float per block of kInt8Block elements from element 0. The engine keeps one such buffer
// per piece of its states (an offloaded sub-group; the device's part), so a piece moves to and from
// NVMe as one region, and the bytes the plan counts are the bytes allocated.
#pragma once

#include <cstddef>
#include <span>

#include "optim/compact_math.hpp"
#include "optim/cpu_adam.hpp"
#include "zest/dtype.hpp"

namespace zest::optim {

constexpr std::size_t state_bytes(StatesFormat format) {
  return format == StatesFormat::f32 ? 4 : format == StatesFormat::bf16 ? 2 : 1;
}

class StatesLayout {
 public:
  StatesLayout(StatesFormat format, std::size_t count) : format_(format), count_(count) {}

  // Bytes of the whole buffer for `count` elements.
  static constexpr std::size_t bytes(StatesFormat format, std::size_t count) {
    return count * (sizeof(float) + 2 * state_bytes(format)) + 2 * blocks(format, count) * sizeof(float);
  }
  // Scales per state: one per block for int8, none otherwise.
  static constexpr std::size_t blocks(StatesFormat format, std::size_t count) {
    return format == StatesFormat::int8 ? (count + kInt8Block - 1) / kInt8Block : 0;
  }

  StatesFormat format() const { return format_; }
  std::size_t count() const { return count_; }
  std::size_t bytes() const { return bytes(format_, count_); }

  float* master(char* base) const { return reinterpret_cast<float*>(base); }
  char* m(char* base) const { return base + count_ * sizeof(float); }
  char* v(char* base) const { return m(base) + count_ * state_bytes(format_); }
  float* m_scales(char* base) const { return reinterpret_cast<float*>(v(base) + count_ * state_bytes(format_)); }
  float* v_scales(char* base) const { return m_scales(base) + blocks(format_, count_); }

  // The moments of elements [at, at + n) of the buffer at `base`, for CpuAdam::step_compact. For
  // int8, `at` must start a block (the caller's ranges are kInt8Block-aligned).
  CpuAdam::CompactStates moments(char* base, std::size_t at, std::size_t n) const {
    const std::size_t element = state_bytes(format_);
    CpuAdam::CompactStates s{format_, m(base) + at * element, v(base) + at * element, n};
    if (format_ == StatesFormat::int8) {
      s.m_scale = m_scales(base) + at / kInt8Block;
      s.v_scale = v_scales(base) + at / kInt8Block;
    }
    return s;
  }

 private:
  StatesFormat format_;
  std::size_t count_;
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
