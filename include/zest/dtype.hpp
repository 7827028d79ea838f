// Element types zest moves and reduces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace zest {

enum class DType : std::uint8_t { f32, f16, bf16 };

constexpr std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

// How the optimizer stores Adam's moments m and v (optimizer.states; docs/compact-states.md): fp32,
// bf16 with stochastic rounding, or int8 block-wise dynamic quantization with a scale per block.
enum class StatesFormat : std::uint8_t { f32, bf16, int8 };

constexpr std::string_view states_format_name(StatesFormat f) {
  switch (f) {
    case StatesFormat::f32: return "fp32";
    case StatesFormat::bf16: return "bf16";
    case StatesFormat::int8: return "int8";
  }
  return "?";
}

}  // namespace zest
