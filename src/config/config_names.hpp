// The spelling of each enum value in YAML, shared by the parser and to_yaml so the two cannot
// drift apart.
#pragma once

#include <array>
#include <string>
#include <string_view>

#include "zest/config.hpp"

namespace zest::detail {

template <typename Enum>
struct EnumName {
  std::string_view name;
  Enum value;
};

inline constexpr std::array<EnumName<DeviceType>, 2> kDeviceTypeNames{{
    {"cpu", DeviceType::cpu}, {"cuda", DeviceType::cuda}}};
inline constexpr std::array<EnumName<CommBackend>, 3> kCommBackendNames{{
    {"auto", CommBackend::auto_select}, {"mpi", CommBackend::mpi}, {"nccl", CommBackend::nccl}}};
inline constexpr std::array<EnumName<OptimizerType>, 2> kOptimizerTypeNames{{
    {"adam", OptimizerType::adam}, {"adamw", OptimizerType::adamw}}};
inline constexpr std::array<EnumName<DType>, 3> kDTypeNames{{
    {"fp32", DType::f32}, {"fp16", DType::f16}, {"bf16", DType::bf16}}};
inline constexpr std::array<EnumName<StatesFormat>, 3> kStatesFormatNames{{
    {"fp32", StatesFormat::f32}, {"bf16", StatesFormat::bf16}, {"int8", StatesFormat::int8}}};
inline constexpr std::array<EnumName<SecondaryPartition>, 2> kSecondaryPartitionNames{{
    {"none", SecondaryPartition::none}, {"host", SecondaryPartition::host}}};
inline constexpr std::array<EnumName<QuantizeParams>, 2> kQuantizeParamsNames{{
    {"none", QuantizeParams::none}, {"int8", QuantizeParams::int8}}};
inline constexpr std::array<EnumName<QuantizeGrads>, 3> kQuantizeGradsNames{{
    {"none", QuantizeGrads::none}, {"int8", QuantizeGrads::int8}, {"int4", QuantizeGrads::int4}}};
inline constexpr std::array<EnumName<OffloadDevice>, 3> kOffloadDeviceNames{{
    {"none", OffloadDevice::none}, {"cpu", OffloadDevice::cpu}, {"nvme", OffloadDevice::nvme}}};

template <typename Enum, std::size_t N>
constexpr std::string_view enum_name(const std::array<EnumName<Enum>, N>& names, Enum value) {
  for (const EnumName<Enum>& entry : names)
    if (entry.value == value) return entry.name;
  return "?";
}

// "one of cpu, cuda": what a key with these names accepts.
template <typename Enum, std::size_t N>
std::string expected_choice(const std::array<EnumName<Enum>, N>& names) {
  std::string expected = "one of ";
  for (std::size_t i = 0; i < N; ++i) expected.append(i == 0 ? "" : ", ").append(names[i].name);
  return expected;
}

}  // namespace zest::detail
