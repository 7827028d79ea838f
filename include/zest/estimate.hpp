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
#include <cstdint>
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

// `ranks_per_node`: the ranks on each host, which partition.secondary: host's copy depends on (0:
// every rank on one host). Throws Error for a parameter list the Engine refuses (empty, a group not
// one contiguous run, a zero-sized tensor), for ranks < 1 and for ranks_per_node not dividing ranks
// where the secondary partition needs it. The config is taken as valid (parse_config checks it).
MemoryEstimate estimate_memory(const Config& config, const std::vector<ParamSpec>& params, int ranks,
                               int ranks_per_node = 0);

// Bytes one rank sends in one optimizer step, as EngineStats::wire_last_step counts them (the
// pairwise model of zest/communicator.hpp), on `ranks` ranks numbered host by host, `ranks_per_node`
// to a host. From the engine's collectives: gradient_accumulation_steps reductions of every
// gradient (stage 0 all-reduces; stages 1-3 reduce-scatter, multi-group buckets packed), the gather
// of the updated parameters after the step (stages 1-2, and stage 3's resident groups) and stage
// 3's two gathers of every other group per micro-batch, forward and backward (a group the gathered
// pool still holds when backward asks for it is not gathered again: stage3.max_live_bytes can save
// some of those). With partition.secondary: host only a step's first gather of a group spans every
// rank; the others run among the host's ranks, each rank sending its 1/R of the group to the R - 1
// others.
// Not counted: step()'s all-reduce of two floats (the gradient norm and the overflow flag).
struct WireEstimate {
  std::uint64_t reduce = 0;  // gradient reductions
  std::uint64_t gather = 0;  // parameter all-gathers
  std::uint64_t inside = 0;  // of reduce + gather: to ranks on this rank's host
  std::uint64_t across = 0;  // to ranks on other hosts
  // ZeRO's count for the same model: 2Ψ (stages 0-2) or 3Ψ (stage 3) times (n - 1) / n, Ψ the
  // parameters' bytes without padding, one micro-batch.
  std::uint64_t zero_formula = 0;
  std::uint64_t total() const { return reduce + gather; }
};
// Throws Error for the parameter lists estimate_memory refuses, ranks < 1, ranks_per_node outside
// 1..ranks or not dividing ranks, and figures past 64 bits.
WireEstimate estimate_wire_bytes(const Config& config, const std::vector<ParamSpec>& params, int ranks,
                                 int ranks_per_node);

// A model of `params` parameters in `layers` equal groups (one tensor each; the first params %
// layers groups one parameter larger), for estimates from a parameter count. Throws Error when
// layers < 1 or params < layers.
std::vector<ParamSpec> uniform_model(std::size_t params, int layers);

}  // namespace zest
