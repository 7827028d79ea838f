// Optimizer states on the device: fp32 master weights, m and v of this rank's shard (of
// plan.device_states.range, the part a partial offload keeps on the device) in one device buffer
// laid out by optim::StatesLayout (m and v in optimizer.states' format), stepped by the device's
// Adam (DeviceMath) on the comm stream. Host access (set_param, get_param, checkpoints) goes through
// the engine's pinned staging in chunks; compact states are visited in place where the device is
// host memory (cpu), and elsewhere a chunk of whole int8 blocks at a time, laid out in the staging
// as a piece of their own. Where plan.device_states.master_in_params, the master weights are the
// fp32 parameters' own shard: the buffer holds m and v (StatesLayout::Master::elsewhere), and the
// Adam updates the parameters in place. Offsets are of the shard buffer and must lie in
// plan.device_states.range.
#pragma once

#include <vector>

#include "engine/math/device_math.hpp"
#include "engine/plan/host_staging.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "zest/device.hpp"

namespace zest::engine {

class DeviceOptimizerStates final : public OptimizerStates {
 public:
  // Allocates the states of plan.device_states.range (plan.device_states.bytes, zeroed) and, where
  // stage 3's parameters are offloaded, the buffer their updates pass through
  // (plan.device_states.update_out). `states`: the format and rounding of m and v (kept by the
  // caller); a bf16 master needs a host-accessible device (Error otherwise: the CUDA Adam keeps an
  // fp32 master). `params_shards`: where plan.device_states.master_in_params, each layout group's
  // shard of the fp32 parameters on the device (ParamGather::shard_out), which then are the master
  // weights; empty otherwise.
  DeviceOptimizerStates(Device& device, Stream& stream, DeviceMath& math, const Layout& layout, const MemoryPlan& plan,
                        DType dtype, HostStaging& staging, const HyperRuns& runs, const StatesOptions& states,
                        std::vector<float*> params_shards = {});

  void write_master(std::size_t offset, const float* values, std::size_t count) override;
  void read_master(std::size_t offset, float* values, std::size_t count) override;
  void visit_states(std::size_t offset, std::size_t count, bool write_back, const StatesVisit& visit) override;
  void step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args, HostParamSink* sink) override;
  std::size_t nvme_bytes() const override { return 0; }
  std::size_t pinned_bytes() const override { return 0; }

 private:
  // Appends `part` (of group g's shard, in range_) to shards_, one piece per optimizer parameter
  // group in it; `grad` and `out` hold the part's first element.
  void add_shard(int g, ShardRange part, const char* grad, char* out);
  // visit_states of compact states the host cannot read: [at, at + count) of the states' buffer
  // through the staging.
  void visit_staged(std::size_t at, std::size_t count, bool write_back, const StatesVisit& visit);
  // Copies the states' elements [lo, lo + piece.count()) (lo starts an int8 block) between the
  // device buffer and `host`, laid out there by `piece`; queued on the stream.
  void copy_piece(const optim::StatesLayout& piece, char* host, std::size_t lo, bool to_host);
  // Throws Error unless [offset, offset + count) lies in range_.
  void check_range(std::size_t offset, std::size_t count) const;
  // State k (0 master, 1 m, 2 v) of shard element `offset` in the states' buffer: the master where
  // the buffer holds it in fp32, m and v where they are fp32.
  float* at(int k, std::size_t offset) const;
  // The fp32 master of shard element `offset` of group g: in the buffer, or in the parameters
  // (contiguous within one group's shard only).
  float* master_of(int g, std::size_t offset) const;
  // Queues a copy of `bytes` between the device and the host, the way `to_host` says.
  void copy(char* device, char* host, std::size_t bytes, bool to_host);
  // Calls f(master, first, n) for consecutive pieces of the master weights of [offset, offset +
  // count), each contiguous (one group's, where they are the parameters), `first` counted from offset.
  template <class F>
  void for_each_master_piece(std::size_t offset, std::size_t count, F f) const;

  Device& device_;
  Stream& stream_;
  DeviceMath& math_;
  const Layout& layout_;
  const DType dtype_;
  HostStaging& staging_;
  const HyperRuns& runs_;
  const ShardRange range_;
  const StatesOptions& options_;
  const optim::StatesLayout layout_of_states_;
  DeviceBuffer states_;
  const std::vector<float*> params_shards_;  // per group, where the master is the parameters
  std::vector<float> visit_scratch_;  // compact states' m and v widened for visit_states
  DeviceBuffer update_out_;  // offloaded parameters: one group's updated shard on its way to the host
  std::vector<AdamShard> shards_;  // the stream reads them until the step's math has run
};

}  // namespace zest::engine
