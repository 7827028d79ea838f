#include "optim/states_layout.hpp"

#include <algorithm>
#include <cstdint>

namespace zest::optim {

const DynamicCode& dynamic_code(bool is_signed) {
  static const DynamicCode m_code = make_dynamic_code(true);
  static const DynamicCode v_code = make_dynamic_code(false);
  return is_signed ? m_code : v_code;
}

void widen_moments(const CpuAdam::CompactStates& s, float* m_out, float* v_out) {
  const std::size_t n = s.count;
  if (s.format == StatesFormat::f32) {
    std::copy_n(static_cast<const float*>(s.m), n, m_out);
    std::copy_n(static_cast<const float*>(s.v), n, v_out);
  } else if (s.format == StatesFormat::bf16) {
    const auto* m = static_cast<const std::uint16_t*>(s.m);
    const auto* v = static_cast<const std::uint16_t*>(s.v);
    for (std::size_t i = 0; i < n; ++i) {
      m_out[i] = bf16_to_float(m[i]);
      v_out[i] = bf16_to_float(v[i]);
    }
  } else {
    const auto* m = static_cast<const std::uint8_t*>(s.m);
    const auto* v = static_cast<const std::uint8_t*>(s.v);
    for (std::size_t i = 0; i < n; ++i) {
      m_out[i] = dequantize(dynamic_code(true), true, m[i], s.m_scale[i / kInt8Block]);
      v_out[i] = dequantize(dynamic_code(false), false, v[i], s.v_scale[i / kInt8Block]);
    }
  }
}

void narrow_moments(const float* m_in, const float* v_in, const CpuAdam::CompactStates& s) {
  const std::size_t n = s.count;
  if (s.format == StatesFormat::f32) {
    std::copy_n(m_in, n, static_cast<float*>(s.m));
    std::copy_n(v_in, n, static_cast<float*>(s.v));
  } else if (s.format == StatesFormat::bf16) {
    auto* m = static_cast<std::uint16_t*>(s.m);
    auto* v = static_cast<std::uint16_t*>(s.v);
    for (std::size_t i = 0; i < n; ++i) {
      m[i] = float_to_bf16(m_in[i]);
      v[i] = float_to_bf16(v_in[i]);
    }
  } else {
    auto* m = static_cast<std::uint8_t*>(s.m);
    auto* v = static_cast<std::uint8_t*>(s.v);
    for (std::size_t at = 0, block = 0; at < n; at += kInt8Block, ++block) {
      const std::size_t len = std::min(kInt8Block, n - at);
      s.m_scale[block] = quantize_block(dynamic_code(true), true, m_in + at, len, m + at);
      s.v_scale[block] = quantize_block(dynamic_code(false), false, v_in + at, len, v + at);
    }
  }
}

}  // namespace zest::optim
