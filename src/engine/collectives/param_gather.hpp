// Where the parameters live on the device, and how every rank gets full parameters to compute with.
//
// Stages 0-2 keep every group's full segment (the step updates this rank's shard of it in place;
// gather_all() all-gathers the shards after the step). Stage 3 keeps this rank's shard of each
// group (on the device, or with offload.param on the host or NVMe through ParamOffload) plus the
// full segment of small groups (resident); a non-resident group's full parameters exist only
// while it is leased: acquire() all-gathers it into a slot of the gathered-parameter pool, and
// prefetches the next groups of the previous step's acquire order within stage3.prefetch_bytes.
// After a step, consecutive groups whose full parameters fit in buckets.allgather share one
// all-gather through a bucket (config buckets.allgather): with many small groups the collective's
// latency, not the bytes, is what a gather costs.
// With partition.secondary: host (ParamsPlan::secondary_params) a group's first gather after its
// shards changed spans every rank and leaves this rank's slice of the full group among its host's
// ranks in a secondary copy; until the shards change again (the step, set_param, a load) the group's
// gathers run over `host_comm`, each of the host's ranks giving its slice.
// With comm.quantize.params (`quantized`) those stage-3 gathers over every rank send int8 codes
// (QuantizedGather); the gathers after the step (gather_all) stay exact.
// Threading: the engine's host thread; the work runs on the comm stream.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "engine/plan/host_staging.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "engine/optimizer/param_offload.hpp"
#include "engine/collectives/quantized_collectives.hpp"
#include "engine/plan/slot_pool.hpp"
#include "offload/store.hpp"
#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"

namespace zest::engine {

// What ParamGather takes from the config.
struct ParamGatherOptions {
  int stage = 0;
  DType dtype = DType::f32;          // precision.dtype: of the parameters on the device
  std::size_t prefetch_bytes = 0;    // stage3.prefetch_bytes
};
ParamGatherOptions param_gather_options(const Config& config);

class ParamGather {
 public:
  // Allocates the parameters, the gathered-parameter pool and the gather bucket (sizes from
  // `plan`), zeroed; `store` is the NVMe store for offload.param: nvme (null otherwise);
  // `host_comm`: the ranks of this rank's host, with plan.params.secondary_params (null otherwise;
  // Error when it is missing or not plan.params.secondary_ranks large); `quantized`: stage 3's
  // gathers over every rank, with comm.quantize.params (null: exact). Both must outlive this.
  ParamGather(const ParamGatherOptions& options, Device& device, Communicator& comm, Stream& comm_stream,
              const Layout& layout, const MemoryPlan& plan, HostStaging& staging, std::shared_ptr<offload::Store> store,
              Communicator* host_comm = nullptr, QuantizedGather* quantized = nullptr);

  // Before the group is used: stage 3 records the order, gathers the group unless it is resident or
  // prefetched, waits for it and prefetches the next ones. Counts a lease.
  void acquire(int g);
  // Ends a lease. Returns whether the group's gathered buffer went back to the pool (stage 3, its
  // last lease): the next gather may then rewrite it.
  bool release(int g);
  bool any_leased() const;
  // The group's full parameters, where they exist now (stage 3: resident or gathered); throws Error
  // when a stage-3 group is not gathered.
  char* full(int g);

  // Where the step writes the updated parameters of the group's shard (working dtype); null where
  // the shard lives off the device (stage 3, offload.param): then `sink()` takes the update.
  char* shard_out(int g) const;
  HostParamSink* sink() const { return offload_.get(); }
  // After the step's updates went to sink(): waits for them to be stored. Throws IoError.
  void finish_updates();

  // Sets a tensor's device parameters (full segment and this rank's shard, wherever they live)
  // from fp32 host values, converted to the working dtype as the device would. Synchronous.
  void set_tensor(std::size_t tensor, const float* values);
  // Sets [in_shard, in_shard + n) of group g's shard from fp32 host values. Synchronous.
  void write_shard(int g, std::size_t in_shard, const float* values, std::size_t n);
  // Stage 3: forgets prefetched gathers nobody holds, and the secondary copies, after the shards
  // they came from changed.
  void drop_prefetched();
  // After every rank's shard changed: rebuilds the full parameters every rank keeps (stages 1-2:
  // every group; stage 3: the resident ones). Returns when they are in place.
  void gather_all();
  // The acquire order of this step becomes the one the next step prefetches from.
  void end_step();

  std::size_t nvme_bytes() const { return offload_ ? offload_->nvme_bytes() : 0; }
  std::size_t pinned_bytes() const { return offload_ ? offload_->pinned_bytes() : 0; }

 private:
  bool sharded() const { return stage_ == 3; }
  bool offloaded(int g) const { return offload_ && offload_->offloaded(g); }
  std::size_t shard_begin(int g) const { return layout_.shard_begin(g, rank_); }
  std::size_t bytes(std::size_t elements) const { return elements * dtype_size(dtype_); }
  char* at(const DeviceBuffer& buffer, std::size_t elements) const { return buffer.as<char>() + bytes(elements); }
  void start_gather(int g);
  void make_room_for_lease();
  void prefetch();
  void gather_in_place(int g);
  void gather_through_bucket(const GatherRun& run);

  Device& device_;
  Communicator& comm_;
  Stream& stream_;
  const Layout& layout_;
  const MemoryPlan& plan_;
  HostStaging& staging_;
  const int stage_;
  const int rank_;
  const DType dtype_;
  const std::size_t prefetch_bytes_;
  ExactGather exact_;
  ShardGather& gather_;  // stage 3's gathers over every rank: exact_, or comm.quantize.params' quantized one

  DeviceBuffer full_params_;             // stages 0-2: every segment in full
  DeviceBuffer shards_;                  // stage 3 without parameter offload: this rank's shards
  std::vector<DeviceBuffer> resident_;   // stage 3, per group: the full segment, or empty
  SlotPool gathered_;                    // stage 3: full parameters of non-resident groups
  DeviceBuffer gather_bucket_;           // every rank's shards of one run of groups
  std::unique_ptr<ParamOffload> offload_;
  Communicator* host_comm_ = nullptr;    // partition.secondary: host
  DeviceBuffer secondary_;               // this rank's slice of each non-resident group, in group order
  std::vector<std::size_t> secondary_at_;  // group -> its slice in secondary_, elements
  std::vector<bool> secondary_fresh_;    // group -> the slice holds the current parameters
  std::vector<int> gathered_of_;         // group -> gathered slot or -1
  std::vector<int> leases_;              // group -> live leases
  std::vector<int> order_, previous_order_;  // stage 3: groups in acquire order
  std::size_t order_position_ = 0;
};

}  // namespace zest::engine
