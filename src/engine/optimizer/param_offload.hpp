// Stage 3's parameter shards off the device (offload.param.device: cpu | nvme). Each offloaded
// group's shard (in the working dtype) is a piece of a Residency: a PinnedResidency holding every
// group's shard at its shard offset (cpu), or an NvmeResidency with one NvmeStore region per
// offloaded group (nvme). Before the group's all-gather the engine fetches it into a device buffer
// on its comm stream, and after the step the updated shard comes back here instead of to a device
// buffer. Small (resident) groups keep their parameters on the device and are not handled here.
//
// nvme: fetches go through the residency's first slots (one per gathered-parameter buffer of the
// engine, reused under the same events), updates through its last two, so one group's shard is
// written while the next is filled. After an IoError in a write the shard holds no data: every
// later fetch or write refuses with an Error (rebuild the engine).
// Threading: the engine's host thread; fetches complete on the comm stream.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "engine/optimizer/residency.hpp"
#include "offload/io_handle.hpp"
#include "offload/store.hpp"
#include "zest/device.hpp"

namespace zest::engine {

class ParamOffload final : public HostParamSink {
 public:
  // `plan` (plan_memory): which groups' shards live here (plan.offloaded[g]) and the buffer sizes,
  // with one fetch slot per gathered-parameter buffer. `store`: the NvmeStore for nvme, null for cpu.
  ParamOffload(Device& device, const Layout& layout, const ParamOffloadPlan& plan, DType dtype,
               std::shared_ptr<offload::Store> store);
  ~ParamOffload() override;
  ParamOffload(const ParamOffload&) = delete;
  ParamOffload& operator=(const ParamOffload&) = delete;

  bool offloaded(int group) const { return offloaded_[static_cast<std::size_t>(group)]; }

  // Sets [offset, offset + count) elements of the group's shard from host `values` (dtype).
  // Synchronous (nvme: read, modify, write the region).
  void write(int group, std::size_t offset, const void* values, std::size_t count);

  // Queues on `stream`: the group's shard into `device_dst` (bytes of the shard), through staging
  // buffer `slot` (nvme), which must not be in use by an earlier fetch still on the stream. An I/O
  // failure surfaces from the stream's synchronize (or an event recorded after it).
  void fetch(int group, void* device_dst, std::size_t slot, Stream& stream);

  // HostParamSink: the updated shard of a group, in host memory; written back at end_update.
  void* begin_update(int group) override;
  void end_update(int group) override;
  // Waits for the updates' writes. Throws IoError.
  void finish_updates();

  std::size_t nvme_bytes() const;
  std::size_t pinned_bytes() const;

 private:
  void check_usable() const;
  // The slot of the i-th update buffer (nvme; cpu updates in place, where slots mean nothing).
  std::size_t update_slot(std::size_t i) const { return fetch_slots_ + i; }

  Device& device_;
  const Layout& layout_;
  DType dtype_;
  std::vector<bool> offloaded_;
  std::size_t fetch_slots_ = 0;        // nvme: the residency's slots before the two update slots
  std::unique_ptr<Residency> shards_;  // a piece per group; null when every group is resident (nvme)
  offload::IoHandle update_writes_[2];
  std::size_t next_update_ = 0;
  std::size_t current_update_ = 0;
  std::string broken_reason_;
};

}  // namespace zest::engine
