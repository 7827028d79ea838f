// What zest's pinned host memory is for: the labels the engine gives its Device::allocate_pinned
// calls, so that Device::pinned_stats and zest::estimate_memory show the bytes by purpose. The
// device counts labels without knowing what they mean (zest::HostLabel, zest/device.hpp).
#pragma once

#include <cstddef>
#include <string_view>

#include "zest/device.hpp"

namespace zest {

//   engine             the engine's own block: the step's scalars, set_param/get_param staging
//   optimizer_states   offload.optimizer cpu: the shard's fp32 master, m and v (12 B/parameter)
//   optimizer_staging  the offloaded step's gradient and parameter staging slots (buffer_count)
//   optimizer_swap     offload.optimizer nvme: buffer_count sub-groups' states, the NVMe I/O buffers
//   param_shards       offload.param cpu: every offloaded group's shard
//   param_swap         offload.param nvme: the fetch and update buffers the shards move through
//   grad_shards        the whole optimizer offloaded at stages 2-3: this rank's accumulated gradient
//                      shard, and the buffer a micro-batch's reduced gradients land in to be added
//   other              anything else (a trainer's, a benchmark's): what the device counts unlabelled
enum class HostPurpose : unsigned char {
  engine, optimizer_states, optimizer_staging, optimizer_swap, param_shards, param_swap, grad_shards, other
};
inline constexpr std::size_t kHostPurposeCount = 8;
template <>
inline constexpr bool is_host_label<HostPurpose> = true;
static_assert(kHostPurposeCount == HostLabel::kCount, "one device label per purpose");
static_assert(HostLabel(HostPurpose::other).index() == HostLabel::unlabelled().index(),
              "what the device counts unlabelled is the engine's `other`");

constexpr std::string_view host_purpose_name(HostPurpose purpose) {
  switch (purpose) {
    case HostPurpose::engine: return "engine";
    case HostPurpose::optimizer_states: return "optimizer_states";
    case HostPurpose::optimizer_staging: return "optimizer_staging";
    case HostPurpose::optimizer_swap: return "optimizer_swap";
    case HostPurpose::param_shards: return "param_shards";
    case HostPurpose::param_swap: return "param_swap";
    case HostPurpose::grad_shards: return "grad_shards";
    case HostPurpose::other: return "other";
  }
  return "unknown";
}

}  // namespace zest
