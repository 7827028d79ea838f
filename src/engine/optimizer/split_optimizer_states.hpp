// Partial optimizer offload (offload.optimizer.ratio < 1): the states of the first part of the
// shard stay on the device (DeviceOptimizerStates over plan.device_states.range), those of the rest are
// offloaded (OffloadedOptimizer over plan.optimizer_offload.range), and this forwards each call to
// the one that holds the elements, cutting ranges at the boundary (where it falls and why:
// device_kept_numel in memory_plan.cpp). A step launches the device's Adam on the stream first,
// runs the offloaded pipeline on the host meanwhile, then waits for the stream, so the two updates
// overlap.
// Threading: the engine's host thread.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "engine/optimizer/device_optimizer_states.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/offloaded_optimizer.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "zest/device.hpp"

namespace zest::engine {

class SplitOptimizerStates final : public OptimizerStates {
 public:
  // `stream`: the one `on_device` steps on. `boundary`: the first offloaded element of the shard
  // buffer; `on_device` holds [0, boundary), `offloaded` the rest, neither empty.
  SplitOptimizerStates(const Layout& layout, Stream& stream, std::unique_ptr<DeviceOptimizerStates> on_device,
                       std::unique_ptr<OffloadedOptimizer> offloaded, std::size_t boundary);

  void write_master(std::size_t offset, const float* values, std::size_t count) override;
  void read_master(std::size_t offset, float* values, std::size_t count) override;
  void visit_states(std::size_t offset, std::size_t count, bool write_back, const StatesVisit& visit) override;
  void step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args, HostParamSink* sink) override;
  std::size_t nvme_bytes() const override { return offloaded_->nvme_bytes(); }
  std::size_t pinned_bytes() const override { return offloaded_->pinned_bytes(); }

 private:
  // Calls f(part, offset', count', first) for the parts of [offset, offset + count) on each side of
  // the boundary, `first` counted from `offset`.
  template <class F>
  void for_each_part(std::size_t offset, std::size_t count, F f);

  Stream& stream_;
  std::unique_ptr<DeviceOptimizerStates> on_device_;
  std::unique_ptr<OffloadedOptimizer> offloaded_;
  const std::size_t boundary_;  // the first offloaded element of the shard buffer
  const int cut_group_;         // the group whose shard the boundary cuts, or -1
};

}  // namespace zest::engine
