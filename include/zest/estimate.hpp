// Memory an Engine needs, without building one: the same sizes the engine allocates (one sizing
// function serves both), per rank, for a config, a parameter list and a world size. Use it to pick
// a stage and an offload mode before a run; `zest estimate` prints it for every configuration.
//
// The figures are exact for an Engine built from the same config and list on `ranks` ranks: its
// device peaks by category (a training step allocates nothing more), the pinned host memory it
// holds (the engine's staging and the offload buffers, as Device::pinned_stats counts them) and
// the bytes of its NVMe swap file. Not included: the trainer's own activations and workspace, the
// CUDA context, and get_param's transient buffer (at most 4 MiB) when called on several ranks.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/engine.hpp"

namespace zest {

struct MemoryEstimate {
  int ranks = 1;
  std::size_t numel = 0;  // parameters, without padding
  std::array<std::size_t, kMemoryCategoryCount> device{};  // per rank, by MemoryCategory
  std::size_t device_total = 0;  // per rank
  std::size_t pinned = 0;        // pinned host memory per rank
  std::array<std::size_t, kHostPurposeCount> pinned_by{};  // the same, by HostPurpose
  std::size_t nvme = 0;          // NVMe swap file per rank (offload device nvme)

  std::size_t device_of(MemoryCategory c) const { return device[static_cast<std::size_t>(c)]; }
  std::size_t pinned_of(HostPurpose p) const { return pinned_by[static_cast<std::size_t>(p)]; }
};

// Throws Error for a parameter list the Engine refuses (empty, a group not one contiguous run, a
// zero-sized tensor) and for ranks < 1. The config is taken as valid (parse_config checks it).
MemoryEstimate estimate_memory(const Config& config, const std::vector<ParamSpec>& params, int ranks);

// A model of `params` parameters in `layers` equal groups (one tensor each; the first params %
// layers groups one parameter larger), for estimates from a parameter count. Throws Error when
// layers < 1 or params < layers.
std::vector<ParamSpec> uniform_model(std::size_t params, int layers);

}  // namespace zest
