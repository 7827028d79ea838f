// The optimizer step with its fp32 master weights and Adam moments (optimizer.states) off the device
// (offload.optimizer.device: cpu | nvme). The rank's shard is cut into sub-groups of at most
// offload.sub_group_bytes of states (a group's shard split further where it is larger), and
// the step runs them through a pipeline on the host thread that calls step():
//
//   gradient of sub-group i+k  device -> pinned staging   (copy stream, k = buffer_count - 1 ahead;
//                              none when plan.grads_on_host: the CPU Adam reads the host shard)
//   states of sub-group i+1    NVMe -> pinned slot          (nvme only; read next)
//   sub-group i                CPU Adam on the pinned states (update this)
//   states of sub-group i-1    pinned slot -> NVMe          (nvme only; write previous)
//   parameters of sub-group i  pinned staging -> device     (upload stream) or into a host sink
//
// It holds the states of plan.range of the shard buffer: all of it, or the part a partial offload
// (offload.optimizer.ratio) sends off the device; offsets are of the shard buffer, inside the range.
// Where they live is a Residency with one piece per sub-group (master, m and v side by side,
// optim::StatesLayout): cpu: a PinnedResidency, the whole range in pinned host memory (12 bytes per
// parameter in fp32), updated in place; nvme: an NvmeResidency, a region per sub-group in the NvmeStore, of which the
// host holds only buffer_count sub-group slots, so the host memory is bounded by the configuration whatever the model's
// size. Each sub-group is updated by SubGroupAdam. Everything is allocated at construction; step() allocates nothing
// large.
//
// offload.optimizer.update_ahead (plan.update_ahead): the residency keeps a spare copy of the
// states, and an UpdatesAhead (updates_ahead()) updates groups into it during backward; step()
// takes the groups whose work ahead holds and runs the pipeline above over the rest (see
// updates_ahead.hpp). Without update_ahead there is none.
//
// After an IoError from step(), the states are inconsistent (some sub-groups hold the new step, one
// whose write failed holds nothing): the optimizer refuses every later call with an Error saying so,
// and the engine must be rebuilt (and its weights set again or loaded from a checkpoint).
// Threading: one host thread drives it (the Engine's).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "engine/optimizer/updates_ahead.hpp"
#include "offload/store.hpp"
#include "optim/cpu_adam.hpp"
#include "zest/device.hpp"

namespace zest::engine {

class OffloadedOptimizer final : public OptimizerStates {
 public:
  // `plan`: its range, sub-groups, slots (offload.optimizer.buffer_count, at least 2, else Error)
  // and buffer sizes (plan_memory). `store`: the NvmeStore for nvme (may be shared with the
  // parameters' offload), null for cpu. `threads`: the CPU Adam's (0 = one per cpu of this rank,
  // Device::host_cpus). `runs`: the optimizer parameter groups over the shard (kept by the caller).
  // Throws OutOfDeviceMemory/SystemError from the pinned allocations, IoError from the store.
  OffloadedOptimizer(Device& device, const OptimizerOffloadPlan& plan, DType dtype, int threads,
                     std::shared_ptr<offload::Store> store, const HyperRuns& runs, const StatesOptions& states);
  ~OffloadedOptimizer() override;
  OffloadedOptimizer(const OffloadedOptimizer&) = delete;
  OffloadedOptimizer& operator=(const OffloadedOptimizer&) = delete;

  // Master weights of [offset, offset + count) of the shard buffer (elements), synchronously.
  // nvme: reads (and for write_master rewrites) the sub-groups the range touches.
  void write_master(std::size_t offset, const float* values, std::size_t count) override;
  void read_master(std::size_t offset, float* values, std::size_t count) override;
  // The three states of [offset, offset + count) of the shard buffer, side by side (checkpoints):
  // visit(master, m, v, first, n) for consecutive pieces, `first` counted from `offset`. nvme: each
  // sub-group the range touches is read once (and written back after its visit when `write_back`),
  // from the swap file into a pinned slot; nothing passes through device memory.
  void visit_states(std::size_t offset, std::size_t count, bool write_back, const StatesVisit& visit) override;

  // One Adam step over the range. `groups` has one entry per layout group; the gradients must be
  // complete on the device (in pinned host memory with plan.grads_on_host). Returns when the
  // parameters are on the device (or handed to `sink`) and the states are stored. Throws IoError
  // (then the optimizer is unusable, see above).
  void step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args, HostParamSink* sink) override;

  // offload.optimizer.update_ahead (plan.update_ahead): the updates ahead of the step; null
  // without update_ahead.
  UpdatesAhead* updates_ahead();

  // Throws the Error every call throws after an I/O failure (see above); nothing otherwise.
  void check_usable() const;

  std::size_t sub_group_count() const;
  std::size_t sub_group_elements() const;  // the largest sub-group
  std::size_t nvme_bytes() const override;    // bytes of the store taken by the states
  std::size_t pinned_bytes() const override;  // pinned host memory it holds

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zest::engine
