// This rank's optimizer states — fp32 master weights and Adam's m and v of its shard — and the
// Adam step over them, behind one interface, so the engine's orchestration never asks where they
// live:
//   DeviceOptimizerStates     on the device (the device's Adam: DeviceMath)
//   OffloadedOptimizer        pinned host memory or an NVMe swap file, stepped by the CPU Adam in a
//                             pipeline of sub-groups (offload.optimizer.device: cpu | nvme)
//   SplitOptimizerStates      one of each over complementary parts of the shard
//                             (offload.optimizer.ratio < 1), stepped at the same time
// The updates ahead of the step (offload.optimizer.update_ahead) are not part of this interface:
// they are OffloadedOptimizer's UpdatesAhead, which the engine holds only when update_ahead is on.
// Offsets and counts are elements of the rank's shard buffer (Layout::shard_numel()).
// Threading: the engine's host thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "optim/cpu_adam.hpp"
#include "optim/states_layout.hpp"
#include "zest/device.hpp"

namespace zest::engine {

// Where the updated low-precision parameters of a group go when they stay on the host (stage 3 with
// offloaded parameters): begin_update gives the host buffer for the group's whole shard (dtype),
// end_update says it is complete. Called from the thread that runs step().
class HostParamSink {
 public:
  virtual ~HostParamSink() = default;
  virtual void* begin_update(int group) = 0;
  virtual void end_update(int group) = 0;
};

// One group's part of the step: this rank's reduced gradient shard (in dtype) where GradBuckets
// keeps it — on the device, or in pinned host memory when the whole optimizer is offloaded
// (ReducePlan::grads_on_host, which OffloadedOptimizer is built from) — and where the updated
// parameters of the shard go: device memory, or (device_out null) the step's HostParamSink.
struct StepGroup {
  const void* grad = nullptr;
  void* device_out = nullptr;
};

// The optimizer parameter groups over the shard buffer: consecutive runs covering it, each with
// its group's hyper-parameters (read at each step, so a change between steps takes effect at the
// next one). Padding belongs to the run before it.
struct HyperRun {
  std::size_t begin = 0, end = 0;  // elements of the shard buffer
  const optim::AdamHyperParams* hyper = nullptr;
};
using HyperRuns = std::vector<HyperRun>;

// Calls f(lo', hi', hyper) for each part of [lo, hi) inside one run, in order.
template <class F>
void for_each_run(const HyperRuns& runs, std::size_t lo, std::size_t hi, F f) {
  for (const HyperRun& r : runs) {
    const std::size_t a = std::max(lo, r.begin), b = std::min(hi, r.end);
    if (a < b) f(a, b, *r.hyper);
  }
}

// How the states store m and v (optimizer.states) and what decides bf16's stochastic rounding: the
// run's seed and each element's global index, (group << 40) + its place in the group's segment, the
// same at every world size and placement (docs/compact-states.md).
struct StatesOptions {
  StatesFormat format = StatesFormat::f32;  // of m and v
  DType master = DType::f32;                // of the master weights (bf16: rounded as the moments)
  std::uint64_t seed = 0;
  std::vector<std::uint64_t> shard_index;  // per layout group: the global index of this rank's shard start

  // The rounding of the elements from `in_group` of group g's shard.
  optim::CpuAdam::CompactRounding rounding(int g, std::size_t in_group) const {
    return {seed, shard_index[static_cast<std::size_t>(g)] + in_group};
  }
  optim::StatesForm form() const { return {format, master}; }
};

class OptimizerStates {
 public:
  virtual ~OptimizerStates() = default;

  // Master weights of [offset, offset + count), from or to fp32 host memory, synchronously.
  virtual void write_master(std::size_t offset, const float* values, std::size_t count) = 0;
  virtual void read_master(std::size_t offset, float* values, std::size_t count) = 0;

  // The three states of [offset, offset + count), side by side in host memory (checkpoints):
  // visit(master, m, v, first, n) for consecutive pieces, `first` counted from `offset`; with
  // `write_back`, what the visit leaves there is stored back. Nothing passes through device memory
  // the plan did not reserve.
  using StatesVisit = std::function<void(float* master, float* m, float* v, std::size_t first, std::size_t n)>;
  virtual void visit_states(std::size_t offset, std::size_t count, bool write_back, const StatesVisit& visit) = 0;

  // One Adam step over the whole shard. `groups` has one entry per layout group; the gradients must
  // be complete (on the comm stream, which the step orders after). Returns when the
  // updated parameters are on the device (or handed to `sink`) and the states are stored.
  virtual void step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args, HostParamSink* sink) = 0;

  virtual std::size_t nvme_bytes() const = 0;    // of the swap file
  virtual std::size_t pinned_bytes() const = 0;  // pinned host memory held for the states
};

// Calls visit(master, m, v, first + k, len) for elements [at, at + n) of the states at `base` laid
// out by `layout`, in consecutive pieces (k counted from `at`): fp32 states in place, in one piece;
// compact ones chunk by chunk of whole int8 blocks, m and v (and a bf16 master) widened to fp32 in
// `scratch` (grown once to 3 * kVisitChunk floats) and, with `write_back`, narrowed back after the
// visit. A round trip leaves compact states as they were (optim::narrow_moments; a bf16 master
// rounds to nearest).
// Where the layout holds no master (StatesLayout::Master::elsewhere), `master` is the fp32 master of
// [at, at + n), visited in place.
inline constexpr std::size_t kVisitChunk = std::size_t{1} << 16;
void visit_laid_out(const optim::StatesLayout& layout, char* base, std::size_t at, std::size_t n, std::size_t first,
                    bool write_back, const OptimizerStates::StatesVisit& visit, std::vector<float>& scratch,
                    float* master = nullptr);

}  // namespace zest::engine
