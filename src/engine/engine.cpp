#include "zest/engine.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/publish.hpp"
#include "checkpoint/reader.hpp"
#include "engine/device_math.hpp"
#include "engine/layout.hpp"
#include "engine/loss_scaler.hpp"
#include "engine/memory_plan.hpp"
#include "engine/offloaded_optimizer.hpp"
#include "engine/param_offload.hpp"
#include "offload/nvme_store.hpp"
#include "optim/cpu_adam.hpp"
#include "runtime/half.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using engine::Layout;

using engine::kScalarsBytes;

char* at(const DeviceBuffer& buffer, std::size_t elements, DType dtype) {
  return static_cast<char*>(buffer.data()) + elements * dtype_size(dtype);
}

int default_threads(const Config& config, const Communicator& comm) {
  if (config.optimizer.threads > 0) return config.optimizer.threads;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / comm.size());
}

// Both gradient buckets are taken only while the trainer holds gradients it has not handed over.
constexpr const char* kBucketRemedy = "call grads_ready(group) once a group's gradients are written, before asking "
                                      "for those of more groups";

// A reusable device buffer with the event that marks the end of its last use.
struct Slot {
  DeviceBuffer buffer;
  std::unique_ptr<Event> free_after;
  int owner = -1;  // group using it, or -1
  DeviceBuffer shard;  // stage 3 with offloaded parameters: the fetched shard the gather reads
};

// The groups whose gradients share one staging slot and are reduced by one collective.
struct Bucket {
  struct Entry {
    int group = 0;
    std::size_t offset = 0;  // of the group's padded segment in the slot, elements
  };
  std::vector<Entry> entries;  // in the order grad() placed them; a group twice for two micro-batches
  std::size_t used = 0;        // elements
  int writing = 0;             // entries whose grads_ready has not come yet
  bool sealed = false;         // takes no more groups: reduced as soon as writing is 0
};

// The rank's swap file for `target` (nvme), shared by the optimizer and the parameters when both
// name the same directory: one store per directory keeps one file per rank there.
std::shared_ptr<offload::Store> nvme_store(const Config& config, const OffloadTarget& target, int rank,
                                           std::shared_ptr<offload::Store>& shared, std::string& shared_path) {
  if (target.device != OffloadDevice::nvme) return nullptr;
  if (shared && shared_path == target.path) return shared;
  offload::NvmeStoreOptions options;
  options.directory = target.path;
  options.rank = rank;
  options.io = config.io;
  shared = std::make_shared<offload::NvmeStore>(std::move(options));
  shared_path = target.path;
  return shared;
}

}  // namespace

struct Engine::State {
  State(const Config& c, Device& d, Communicator& k, std::vector<ParamSpec> p)
      : config(c),
        device(d),
        comm(k),
        specs(std::move(p)),
        stage(c.stage),
        dtype(c.precision.dtype),
        rank(k.rank()),
        layout(specs, c.stage == 0 ? 1 : k.size()),
        plan(engine::plan_memory(c, layout)),
        scaler(c.precision.loss_scale),
        math(engine::make_device_math(d, optim::hyper_params_from(c.optimizer), default_threads(c, k),
                                      static_cast<std::size_t>(layout.group_count()))),
        comm_stream(d.create_stream()) {}

  const Config config;
  Device& device;
  Communicator& comm;
  const std::vector<ParamSpec> specs;
  const int stage;
  const DType dtype;
  const int rank;
  const Layout layout;
  const engine::MemoryPlan plan;  // every size allocated below
  engine::LossScaler scaler;
  std::unique_ptr<engine::DeviceMath> math;

  // Stage 0-2: every segment in full. Stage 3: this rank's shards, plus resident small groups.
  DeviceBuffer full_params;
  DeviceBuffer param_shards;
  std::vector<DeviceBuffer> resident;  // stage 3, per group: the full segment, or empty
  // Accumulated gradient: full segments (stages 0, 1) or this rank's shards (stages 2, 3).
  DeviceBuffer grads;
  // fp32 master weights and Adam moments of this rank's shards (all segments in stage 0).
  DeviceBuffer master, m, v;
  DeviceBuffer scalars;  // engine::GradStatsScalars; its two floats are reduced across ranks

  // Pinned host memory: the step's scalars as the host reads them (first kScalarsBytes), then the
  // set_param/get_param staging of staging_elements fp32 values and as many in dtype.
  HostBuffer pinned;
  std::size_t staging_elements = 0;
  // The spans of one step's math, reserved for every group; the stream reads them until step() ends.
  std::vector<engine::GradSpan> grad_spans;
  std::vector<engine::AdamShard> adam_shards;

  std::vector<Slot> staging;      // reduce buckets: where backward writes gradients; all zero while free
  std::vector<Bucket> buckets;    // per staging slot
  int open_bucket = -1;           // the staging slot grad() places the next group in, or -1
  std::size_t bucket_limit = 0;   // elements: buckets.reduce; a larger group fills a bucket alone
  std::size_t smallest_group = 0; // elements: a bucket with less room left is full
  std::vector<Slot> gathered;     // stage 3: full parameters of non-resident groups
  std::vector<int> staging_of;    // group -> staging slot its gradient is being written to, or -1
  std::vector<std::size_t> staged_at;  // group -> its offset in that slot, elements
  std::vector<int> gathered_of;   // group -> gathered slot or -1
  std::vector<int> leases;        // group -> live leases
  std::vector<bool> accumulated;  // group -> has a gradient this step
  std::vector<bool> summed;       // group -> `grads` holds its reduced sum: the next one adds to it

  std::vector<int> order, previous_order;  // stage 3: groups in acquire order
  std::size_t order_position = 0;

  std::int64_t steps = 0, skipped = 0;
  double last_norm = 0;

  // Offload (issue 5): optimizer states on the host or NVMe, stage 3's parameter shards likewise.
  std::shared_ptr<offload::Store> optimizer_store, param_store;
  std::unique_ptr<engine::OffloadedOptimizer> offloaded;
  std::unique_ptr<engine::ParamOffload> param_offload;
  std::vector<engine::OffloadGroup> offload_groups;
  DeviceBuffer update_out;  // offloaded parameters, device Adam: one group's updated shard
  DeviceBuffer gather_bucket;  // gather_through_bucket: every rank's shards of one run of groups

  // Declared last, so it is destroyed first: destroying a stream waits for its work, which may
  // still refer to the buffers and spans above (when construction or a step failed part-way).
  std::unique_ptr<Stream> comm_stream;

  engine::GradStatsScalars* device_scalars() const { return scalars.as<engine::GradStatsScalars>(); }
  const engine::GradStatsScalars& host_scalars() const { return *pinned.as<engine::GradStatsScalars>(); }
  float* staging_f32() const { return reinterpret_cast<float*>(pinned.as<char>() + kScalarsBytes); }
  // fp32 parameters upload straight from staging_f32.
  void* staging_param() const {
    return dtype == DType::f32 ? static_cast<void*>(staging_f32())
                               : static_cast<void*>(staging_f32() + staging_elements);
  }

  bool grads_full() const { return stage <= 1; }
  bool params_offloaded(int g) const { return param_offload && param_offload->offloaded(g); }
  bool params_sharded() const { return stage == 3; }
  std::size_t shard_begin(int g) const {
    return layout.partitions() == 1 ? 0 : static_cast<std::size_t>(rank) * layout.group(g).shard;
  }
  std::size_t bytes(std::size_t elements) const { return elements * dtype_size(dtype); }

  // The group's full parameters, where they exist now (stage 3: resident or gathered).
  char* group_params(int g) {
    if (!params_sharded()) return at(full_params, layout.group(g).full_offset, dtype);
    if (!resident[static_cast<std::size_t>(g)].data() && gathered_of[static_cast<std::size_t>(g)] < 0)
      throw Error(std::string("Engine: group ").append(std::to_string(g)).append(" is not gathered"));
    return resident[static_cast<std::size_t>(g)]
               ? static_cast<char*>(resident[static_cast<std::size_t>(g)].data())
               : static_cast<char*>(gathered[static_cast<std::size_t>(gathered_of[static_cast<std::size_t>(g)])].buffer.data());
  }

  // A free slot (its last use finished); waits for the oldest use when all are idle but pending.
  int take_slot(std::vector<Slot>& slots, int group, const char* what, const char* remedy) {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].owner < 0) {
        slots[i].free_after->synchronize();
        slots[i].owner = group;
        return static_cast<int>(i);
      }
    }
    throw Error(std::string("Engine: every ").append(what).append(" buffer is in use (")
                    .append(std::to_string(slots.size()))
                    .append(" of them); ").append(remedy));
  }

  void start_gather(int g) {
    const int slot = take_slot(gathered, g, "gathered-parameter", "release leases sooner, or raise stage3.max_live");
    gathered_of[static_cast<std::size_t>(g)] = slot;
    const auto& place = layout.group(g);
    Slot& s = gathered[static_cast<std::size_t>(slot)];
    const void* shard = param_shards ? at(param_shards, place.shard_offset, dtype) : nullptr;
    if (params_offloaded(g)) {
      param_offload->fetch(g, s.shard.data(), static_cast<std::size_t>(slot), *comm_stream);
      shard = s.shard.data();
    }
    comm.all_gather(shard, s.buffer.data(), place.shard, dtype, *comm_stream);
    comm_stream->record(*s.free_after);
  }

  // Before a lease's gather: when prefetching has filled every buffer with groups nobody holds
  // yet (the trainer left the previous step's order), gives up the one needed last; it is gathered
  // again when its turn comes. Leased buffers are never taken.
  void make_room_for_lease() {
    if (std::any_of(gathered.begin(), gathered.end(), [](const Slot& s) { return s.owner < 0; })) return;
    const auto upcoming = previous_order.begin() + static_cast<std::ptrdiff_t>(order_position);
    std::size_t victim = gathered.size();
    std::ptrdiff_t victim_turn = -1;
    for (std::size_t i = 0; i < gathered.size(); ++i) {
      const int owner = gathered[i].owner;
      if (leases[static_cast<std::size_t>(owner)] > 0) continue;
      const std::ptrdiff_t turn = std::find(upcoming, previous_order.end(), owner) - upcoming;
      if (turn > victim_turn) {
        victim = i;
        victim_turn = turn;
      }
    }
    if (victim == gathered.size()) return;  // every buffer is leased: take_slot says so
    gathered_of[static_cast<std::size_t>(gathered[victim].owner)] = -1;
    gathered[victim].owner = -1;  // take_slot waits for its gather to finish before reuse
  }

  // Stage 3: gathers the next groups of the previous step's order, within prefetch_bytes.
  void prefetch() {
    std::size_t budget = config.stage3.prefetch_bytes;
    for (std::size_t i = order_position; i < previous_order.size(); ++i) {
      const int g = previous_order[i];
      const std::size_t size = bytes(layout.group(g).padded);
      if (resident[static_cast<std::size_t>(g)] || gathered_of[static_cast<std::size_t>(g)] >= 0) continue;
      if (size > budget) break;
      const bool free_slot = std::any_of(gathered.begin(), gathered.end(), [](const Slot& s) { return s.owner < 0; });
      if (!free_slot) break;
      start_gather(g);
      budget -= size;
    }
  }

  // Where the parameters of a group's shard live on the device, in the working dtype (the step
  // writes its updates there); null where they stay off the device (stage 3, offloaded parameters).
  char* param_shard_out(int g) const {
    const auto& place = layout.group(g);
    if (!params_sharded()) return at(full_params, place.full_offset + shard_begin(g), dtype);
    if (!param_offload) return at(param_shards, place.shard_offset, dtype);
    if (params_offloaded(g)) return nullptr;
    return static_cast<char*>(resident[static_cast<std::size_t>(g)].data()) + bytes(shard_begin(g));
  }

  // Sets elements [in_shard, in_shard + n) of group g's parameter shard from fp32 host values,
  // wherever the shard lives (device, or the parameter offload). Returns when they are there.
  void write_param_shard(int g, std::size_t in_shard, const float* values, std::size_t n) {
    for (std::size_t first = 0; first < n; first += staging_elements) {
      const std::size_t count = std::min(staging_elements, n - first);
      const void* source = values + first;
      if (dtype != DType::f32) {
        for (std::size_t i = 0; i < count; ++i) store_from_float(staging_param(), dtype, i, values[first + i]);
        source = staging_param();
      }
      if (params_offloaded(g)) {
        param_offload->write(g, in_shard + first, source, count);
      } else {
        device.copy_async(param_shard_out(g) + bytes(in_shard + first), source, bytes(count), *comm_stream);
        comm_stream->synchronize();
      }
    }
  }

  // Stage 3: forgets prefetched gathers nobody holds, after the shards they came from changed.
  void drop_gathered() {
    for (Slot& slot : gathered) {
      if (slot.owner < 0 || leases[static_cast<std::size_t>(slot.owner)] > 0) continue;
      gathered_of[static_cast<std::size_t>(slot.owner)] = -1;
      slot.owner = -1;  // take_slot waits for its gather before reuse
    }
  }

  // After every rank's shard of the parameters changed: every rank needs the full parameters
  // again, except stage 3's gathered-on-use groups. Returns when they are in place. Consecutive
  // small groups share one collective (config buckets.allgather): with many small groups the
  // per-collective latency, not the bytes, is what the gather costs.
  void gather_params() {
    for (const engine::GatherRun& run : plan.gather_runs) {
      if (run.groups.size() == 1) gather_in_place(run.groups.front());
      else gather_through_bucket(run);
    }
    comm_stream->synchronize();
  }

  // One group's all-gather straight into its full segment: no copies beyond bringing the updated
  // shard to its place in the segment (stage 3 updates a separate shard buffer).
  void gather_in_place(int g) {
    const auto& place = layout.group(g);
    char* const full = group_params(g);
    char* const own = full + bytes(shard_begin(g));
    const char* const updated = param_shard_out(g);
    if (updated != own) device.copy_async(own, updated, bytes(place.shard), *comm_stream);
    if (layout.partitions() > 1) comm.all_gather(own, full, place.shard, dtype, *comm_stream);
  }

  // Several groups in one all-gather: the bucket holds rank r's shards of the run's groups, one
  // after another, at r * run.shard; each group's own shard is copied in, every rank's piece of it
  // copied out to its full segment. The copies cost far less than a collective per group, and the
  // runs are small (they fit in buckets.allgather), so the bytes copied stay small too.
  void gather_through_bucket(const engine::GatherRun& run) {
    Stream& stream = *comm_stream;
    char* const bucket = static_cast<char*>(gather_bucket.data());
    char* const mine = bucket + bytes(static_cast<std::size_t>(rank) * run.shard);
    std::size_t offset = 0;  // of the group's shard in a rank's piece of the bucket
    for (int g : run.groups) {
      device.copy_async(mine + bytes(offset), param_shard_out(g), bytes(layout.group(g).shard), stream);
      offset += layout.group(g).shard;
    }
    comm.all_gather(mine, bucket, run.shard, dtype, stream);
    offset = 0;
    for (int g : run.groups) {
      const std::size_t shard = layout.group(g).shard;
      char* const full = group_params(g);
      const char* const updated = param_shard_out(g);
      for (std::size_t r = 0; r < static_cast<std::size_t>(layout.partitions()); ++r) {
        char* const piece = full + bytes(r * shard);
        if (piece != updated) device.copy_async(piece, bucket + bytes(r * run.shard + offset), bytes(shard), stream);
      }
      offset += shard;
    }
  }

  void release(int g) {
    if (--leases[static_cast<std::size_t>(g)] > 0 || !params_sharded()) return;
    const int slot = gathered_of[static_cast<std::size_t>(g)];
    if (slot < 0) return;
    gathered[static_cast<std::size_t>(slot)].owner = -1;  // the gather's event already passed
    gathered_of[static_cast<std::size_t>(g)] = -1;
  }

  // Gradient buckets (config buckets.reduce): groups are placed in the open bucket in the order the
  // trainer asks for their gradients (backward order), so many small layers cost one collective
  // instead of one each: per-collective latency, not bandwidth, dominates small messages.

  // Where group g's gradient of this micro-batch is written: its place in the open bucket.
  char* staged_grad(int g) {
    if (staging_of[static_cast<std::size_t>(g)] < 0) place_in_bucket(g);
    const Slot& slot = staging[static_cast<std::size_t>(staging_of[static_cast<std::size_t>(g)])];
    return static_cast<char*>(slot.buffer.data()) + bytes(staged_at[static_cast<std::size_t>(g)]);
  }

  // Appends the group to the open bucket; a group that does not fit seals it and opens another.
  void place_in_bucket(int g) {
    const std::size_t need = layout.group(g).padded;
    if (open_bucket >= 0 && buckets[static_cast<std::size_t>(open_bucket)].used + need > bucket_limit)
      seal(open_bucket);
    // A free slot is all zeros (zeroed after each reduction, on the comm stream), so padding and
    // tensors the trainer leaves unwritten reduce as zeros.
    if (open_bucket < 0) open_bucket = take_slot(staging, g, "gradient bucket", kBucketRemedy);
    const int slot = open_bucket;
    Bucket& b = buckets[static_cast<std::size_t>(slot)];
    b.entries.push_back({g, b.used});
    staging_of[static_cast<std::size_t>(g)] = slot;
    staged_at[static_cast<std::size_t>(g)] = b.used;
    b.used += need;
    ++b.writing;
    // No group fits in what is left: reduce as soon as the groups in it are ready, not at the
    // next grad().
    if (b.used + smallest_group > bucket_limit) seal(slot);
  }

  // The bucket takes no more groups; it is reduced once every group in it is ready.
  void seal(int slot) {
    Bucket& b = buckets[static_cast<std::size_t>(slot)];
    b.sealed = true;
    if (open_bucket == slot) open_bucket = -1;
    if (b.writing == 0) reduce_bucket(slot);
  }

  // grads_ready: the group's gradient in its bucket is complete.
  void mark_ready(int g) {
    const int slot = staging_of[static_cast<std::size_t>(g)];
    staging_of[static_cast<std::size_t>(g)] = -1;
    accumulated[static_cast<std::size_t>(g)] = true;
    Bucket& b = buckets[static_cast<std::size_t>(slot)];
    if (--b.writing == 0 && b.sealed) reduce_bucket(slot);
  }

  // step(): the open bucket is reduced however full it is.
  void flush_buckets() {
    for (std::size_t g = 0; g < staging_of.size(); ++g)
      if (staging_of[g] >= 0)
        throw Error(std::string("Engine::step: the gradient of group ").append(std::to_string(g))
                        .append(" was requested through a lease's grad() but grads_ready(").append(std::to_string(g))
                        .append(") was not called; call it once the group's gradients are written"));
    if (open_bucket >= 0) seal(open_bucket);
  }

  // One collective over the bucket's used span, then each group added to the accumulated gradient
  // (the first reduction of a step overwrites it). Stages 2 and 3 keep only this rank's shard of
  // each group. A bucket of one group is reduce-scattered. A bucket of several groups is
  // all-reduced and each rank takes its shards from the result: a reduce-scatter would need the
  // groups' shards packed rank-major, i.e. a second bucket-sized buffer and a copy each way, while
  // the all-reduce needs no memory beyond the plan. It moves about twice a reduce-scatter's bytes,
  // which matters only for large groups, and those fill a bucket alone: several groups share one
  // only when each is smaller than buckets.reduce, where the collective's latency dominates.
  void reduce_bucket(int slot) {
    Slot& staging_slot = staging[static_cast<std::size_t>(slot)];
    Bucket& b = buckets[static_cast<std::size_t>(slot)];
    char* const data = static_cast<char*>(staging_slot.buffer.data());
    Stream& stream = *comm_stream;
    const bool scatter = !grads_full() && b.entries.size() == 1;
    if (scatter) {
      const int g = b.entries.front().group;
      comm.reduce_scatter(data, data + bytes(shard_begin(g)), layout.group(g).shard, dtype, ReduceOp::sum, stream);
    } else if (comm.size() > 1) {
      comm.all_reduce(data, data, b.used, dtype, ReduceOp::sum, stream);
    }
    for (const Bucket::Entry& e : b.entries) {
      const auto& place = layout.group(e.group);
      const bool first = !summed[static_cast<std::size_t>(e.group)];
      summed[static_cast<std::size_t>(e.group)] = true;
      char* const reduced = data + bytes(e.offset);
      if (grads_full())
        math->accumulate(at(grads, place.full_offset, dtype), reduced, place.padded, dtype, first, stream);
      else
        math->accumulate(at(grads, place.shard_offset, dtype), reduced + bytes(shard_begin(e.group)), place.shard,
                         dtype, first, stream);
    }
    device.memset_async(data, 0, bytes(b.used), stream);
    comm_stream->record(*staging_slot.free_after);
    staging_slot.owner = -1;
    b.entries.clear();
    b.used = 0;
    b.sealed = false;
    if (!config.buckets.overlap_comm) comm_stream->synchronize();
  }
};

Engine::Engine(const Config& config, Device& device, Communicator& comm, std::vector<ParamSpec> params)
    : state_(std::make_unique<State>(config, device, comm, std::move(params))) {
  State& s = *state_;
  const Layout& layout = s.layout;
  const engine::MemoryPlan& plan = s.plan;
  const std::size_t groups = static_cast<std::size_t>(layout.group_count());
  s.param_shards = device.allocate(plan.param_shards, MemoryCategory::params);
  for (std::size_t size : plan.resident) s.resident.push_back(device.allocate(size, MemoryCategory::params));
  s.full_params = device.allocate(plan.full_params, MemoryCategory::params);
  s.grads = device.allocate(plan.grads, MemoryCategory::grads);
  s.master = device.allocate(plan.optimizer_state, MemoryCategory::optimizer_states);
  s.m = device.allocate(plan.optimizer_state, MemoryCategory::optimizer_states);
  s.v = device.allocate(plan.optimizer_state, MemoryCategory::optimizer_states);
  s.scalars = device.allocate(plan.scalars, MemoryCategory::buffers);
  for (std::size_t i = 0; i < engine::MemoryPlan::kStagingSlots; ++i)
    s.staging.push_back(Slot{device.allocate(plan.staging_slot, MemoryCategory::buffers), device.create_event(), -1, {}});
  s.buckets.resize(s.staging.size());
  for (Bucket& b : s.buckets) b.entries.reserve(groups);
  s.bucket_limit = plan.bucket_fill;
  s.smallest_group = layout.group(0).padded;
  for (int g = 1; g < layout.group_count(); ++g) s.smallest_group = std::min(s.smallest_group, layout.group(g).padded);
  for (std::size_t i = 0; i < plan.gathered_count; ++i)
    s.gathered.push_back(Slot{device.allocate(plan.gathered_slot, MemoryCategory::buffers), device.create_event(), -1,
                              device.allocate(plan.gathered_shard, MemoryCategory::buffers)});
  std::string store_path;
  std::shared_ptr<offload::Store> shared_store;
  if (plan.offload_optimizer) {
    s.optimizer_store = nvme_store(config, config.offload.optimizer, s.rank, shared_store, store_path);
    s.offloaded = std::make_unique<engine::OffloadedOptimizer>(config, device, layout, plan.optimizer_offload, s.dtype,
                                                               default_threads(config, comm), s.optimizer_store);
    s.offload_groups.resize(groups);
  }
  if (plan.offload_params) {
    s.param_store = nvme_store(config, config.offload.param, s.rank, shared_store, store_path);
    s.param_offload = std::make_unique<engine::ParamOffload>(device, layout, plan.param_offload, s.dtype, s.param_store);
    s.update_out = device.allocate(plan.update_out, MemoryCategory::buffers);
  }
  s.gather_bucket = device.allocate(plan.gather_bucket, MemoryCategory::buffers);
  s.staging_elements = plan.staging_elements;
  s.pinned = device.allocate_pinned(plan.engine_pinned);
  s.grad_spans.reserve(groups);
  s.adam_shards.reserve(groups);
  s.staging_of.assign(groups, -1);
  s.staged_at.assign(groups, 0);
  s.gathered_of.assign(groups, -1);
  s.leases.assign(groups, 0);
  s.accumulated.assign(groups, false);
  s.summed.assign(groups, false);

  // Zeros where the step reads before anything is written: padding, moments, unwritten gradients.
  Stream& stream = *s.comm_stream;
  for (const DeviceBuffer* b : {&s.master, &s.m, &s.v, &s.grads, &s.full_params, &s.param_shards})
    if (*b) device.memset_async(b->data(), 0, b->bytes(), stream);
  for (const DeviceBuffer& r : s.resident)
    if (r) device.memset_async(r.data(), 0, r.bytes(), stream);
  for (const Slot& slot : s.staging) device.memset_async(slot.buffer.data(), 0, slot.buffer.bytes(), stream);
  stream.synchronize();
}

Engine::~Engine() {
  try {
    state_->comm_stream->synchronize();
  } catch (...) {
    // Destruction must not throw; a failed reduction was already reported by step().
  }
}

std::size_t Engine::size() const { return state_->specs.size(); }
const ParamSpec& Engine::spec(std::size_t tensor) const { return state_->specs.at(tensor); }
std::size_t Engine::numel() const { return state_->layout.numel(); }
int Engine::group_count() const { return state_->layout.group_count(); }
DType Engine::dtype() const { return state_->dtype; }
double Engine::loss_scale() const { return state_->scaler.scale(); }

void Engine::set_param(std::size_t tensor, const float* values) {
  State& s = *state_;
  const auto& t = s.layout.tensor(tensor);
  const auto& g = s.layout.group(t.group);
  Stream& stream = *s.comm_stream;
  // This rank's shard of the segment: [begin, end) in segment elements.
  const std::size_t begin = s.shard_begin(t.group), end = begin + g.shard;
  char* const master = s.master ? reinterpret_cast<char*>(s.master.as<float>() + g.shard_offset) : nullptr;
  s.drop_gathered();  // a prefetched copy of this group would hold the old values
  // Offloaded master weights take the tensor's whole part of this shard in one call, so each NVMe
  // sub-group it touches is read and rewritten once, not once per staging chunk.
  if (s.offloaded) {
    const std::size_t lo = std::max(t.offset, begin), hi = std::min(t.offset + t.numel, end);
    if (lo < hi) s.offloaded->write_master(g.shard_offset + (lo - begin), values + (lo - t.offset), hi - lo);
  }
  for (std::size_t first = 0; first < t.numel; first += s.staging_elements) {
    const std::size_t count = std::min(s.staging_elements, t.numel - first);
    std::memcpy(s.staging_f32(), values + first, count * sizeof(float));
    // 16-bit parameters cross to the device as 16 bits, converted on the host exactly as the GPU
    // cast would.
    if (s.dtype != DType::f32)
      for (std::size_t i = 0; i < count; ++i) store_from_float(s.staging_param(), s.dtype, i, values[first + i]);
    // The chunk in segment elements, and its part inside this rank's shard.
    const std::size_t lo = t.offset + first, hi = lo + count;
    const std::size_t mine_lo = std::max(lo, begin), mine_hi = std::min(hi, end);
    const bool has_mine = mine_lo < mine_hi;
    const char* param = static_cast<const char*>(s.staging_param());
    if (has_mine && !s.offloaded) {
      // Master weights: the part of the tensor inside this rank's shard of the segment.
      s.device.copy_async(master + (mine_lo - begin) * sizeof(float),
                          reinterpret_cast<const char*>(s.staging_f32()) + (mine_lo - lo) * sizeof(float),
                          (mine_hi - mine_lo) * sizeof(float), stream);
    }
    // Device parameters in the working dtype.
    if (!s.params_sharded()) {
      s.device.copy_async(at(s.full_params, g.full_offset + lo, s.dtype), param, s.bytes(count), stream);
    } else {
      if (has_mine && s.params_offloaded(t.group))
        s.param_offload->write(t.group, mine_lo - begin, param + s.bytes(mine_lo - lo), mine_hi - mine_lo);
      else if (has_mine && s.param_shards)
        s.device.copy_async(at(s.param_shards, g.shard_offset + (mine_lo - begin), s.dtype),
                            param + s.bytes(mine_lo - lo), s.bytes(mine_hi - mine_lo), stream);
      if (const DeviceBuffer& full = s.resident[static_cast<std::size_t>(t.group)])
        s.device.copy_async(static_cast<char*>(full.data()) + s.bytes(lo), param, s.bytes(count), stream);
    }
    stream.synchronize();  // the staging is refilled next
  }
}

void Engine::get_param(std::size_t tensor, float* values) {
  State& s = *state_;
  const auto& t = s.layout.tensor(tensor);
  const auto& g = s.layout.group(t.group);
  Stream& stream = *s.comm_stream;
  const std::size_t begin = s.shard_begin(t.group), end = begin + g.shard;
  const float* const master = s.master ? s.master.as<float>() + g.shard_offset : nullptr;
  float* const staging = s.staging_f32();
  if (s.layout.partitions() == 1) {
    if (s.offloaded) return s.offloaded->read_master(g.shard_offset + t.offset, values, t.numel);
    for (std::size_t first = 0; first < t.numel; first += s.staging_elements) {
      const std::size_t count = std::min(s.staging_elements, t.numel - first);
      s.device.copy_async(staging, master + t.offset + first, count * sizeof(float), stream);
      stream.synchronize();
      std::memcpy(values + first, staging, count * sizeof(float));
    }
    return;
  }
  // Each rank fills its part, -0.0 elsewhere; a sum across ranks assembles the tensor exactly (x +
  // -0.0 is x for every x, -0.0 included, where +0.0 would turn -0.0 into +0.0). The sum runs in a
  // free gradient staging slot, so nothing is allocated outside the memory plan; the slot is all
  // zeros when free and is zeroed again after each chunk.
  const int slot = s.take_slot(s.staging, t.group, "gradient bucket", kBucketRemedy);
  Slot& assembly = s.staging[static_cast<std::size_t>(slot)];
  float* const out = assembly.buffer.as<float>();
  const std::size_t chunk = std::min(s.staging_elements, assembly.buffer.bytes() / sizeof(float));
  for (std::size_t first = 0; first < t.numel; first += chunk) {
    const std::size_t count = std::min(chunk, t.numel - first);
    const std::size_t lo = t.offset + first, hi = lo + count;
    const std::size_t mine_lo = std::max(lo, begin), mine_hi = std::min(hi, end);
    std::fill(staging, staging + count, -0.0f);
    s.device.copy_async(out, staging, count * sizeof(float), stream);
    stream.synchronize();  // the staging is refilled next
    if (mine_lo < mine_hi && s.offloaded) {
      // Through the staging, which the last copy of this chunk overwrites in stream order.
      s.offloaded->read_master(g.shard_offset + (mine_lo - begin), staging, mine_hi - mine_lo);
      s.device.copy_async(out + (mine_lo - lo), staging, (mine_hi - mine_lo) * sizeof(float), stream);
    } else if (mine_lo < mine_hi) {
      s.device.copy_async(out + (mine_lo - lo), master + (mine_lo - begin), (mine_hi - mine_lo) * sizeof(float), stream);
    }
    s.comm.all_reduce(out, out, count, DType::f32, ReduceOp::sum, stream);
    s.device.copy_async(staging, out, count * sizeof(float), stream);
    s.device.memset_async(out, 0, count * sizeof(float), stream);
    stream.synchronize();
    std::memcpy(values + first, staging, count * sizeof(float));
  }
  stream.record(*assembly.free_after);
  assembly.owner = -1;
}

Engine::GroupLease Engine::acquire(int group) {
  State& s = *state_;
  if (group < 0 || group >= s.layout.group_count())
    throw Error(std::string("Engine::acquire: no group ").append(std::to_string(group)).append(" (there are ")
                    .append(std::to_string(s.layout.group_count())).append(")"));
  const std::size_t g = static_cast<std::size_t>(group);
  if (s.params_sharded()) {
    s.order.push_back(group);
    if (s.order_position < s.previous_order.size() && s.previous_order[s.order_position] == group) ++s.order_position;
    if (!s.resident[g] && s.gathered_of[g] < 0) {
      s.make_room_for_lease();
      s.start_gather(group);
    }
    if (!s.resident[g]) s.gathered[static_cast<std::size_t>(s.gathered_of[g])].free_after->synchronize();
    s.prefetch();
  }
  ++s.leases[g];
  return GroupLease(this, group);
}

Engine::GroupLease::GroupLease(GroupLease&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)), group_(other.group_) {}

Engine::GroupLease& Engine::GroupLease::operator=(GroupLease&& other) noexcept {
  if (this != &other) {
    if (engine_) engine_->state_->release(group_);
    engine_ = std::exchange(other.engine_, nullptr);
    group_ = other.group_;
  }
  return *this;
}

Engine::GroupLease::~GroupLease() {
  if (engine_) engine_->state_->release(group_);
}

void* Engine::GroupLease::param(std::size_t tensor) const {
  State& s = *engine_->state_;
  const auto& t = s.layout.tensor(tensor);
  if (t.group != group_)
    throw Error(std::string("Engine: parameter '").append(s.specs[tensor].name).append("' belongs to group ")
                    .append(std::to_string(t.group)).append(", not to the leased group ").append(std::to_string(group_)));
  return s.group_params(group_) + s.bytes(t.offset);
}

void* Engine::GroupLease::grad(std::size_t tensor) const {
  State& s = *engine_->state_;
  const auto& t = s.layout.tensor(tensor);
  if (t.group != group_)
    throw Error(std::string("Engine: gradient of '").append(s.specs[tensor].name).append("' belongs to group ")
                    .append(std::to_string(t.group)).append(", not to the leased group ").append(std::to_string(group_)));
  return s.staged_grad(group_) + s.bytes(t.offset);
}

void Engine::grads_ready(int group) {
  State& s = *state_;
  if (group < 0 || group >= s.layout.group_count())
    throw Error(std::string("Engine::grads_ready: no group ").append(std::to_string(group)).append(" (there are ")
                    .append(std::to_string(s.layout.group_count())).append(")"));
  if (s.staging_of[static_cast<std::size_t>(group)] < 0)
    throw Error(std::string("Engine::grads_ready(").append(std::to_string(group))
                    .append("): no gradient of this group was requested through a lease's grad() since its last "
                            "grads_ready"));
  s.mark_ready(group);
}

StepResult Engine::step() {
  State& s = *state_;
  Stream& stream = *s.comm_stream;
  const Layout& layout = s.layout;
  s.flush_buckets();
  ++s.steps;

  // The gradient each rank updates with: its shard of every segment.
  auto grad_of = [&](int g) {
    const auto& place = layout.group(g);
    const std::size_t offset = s.grads_full() ? place.full_offset + s.shard_begin(g) : place.shard_offset;
    return at(s.grads, offset, s.dtype);
  };
  // Statistics after the reductions (same stream), agreed across ranks, then read by the host.
  s.grad_spans.clear();
  for (int g = 0; g < layout.group_count(); ++g)
    if (s.accumulated[static_cast<std::size_t>(g)]) s.grad_spans.push_back({grad_of(g), layout.group(g).shard});
  engine::GradStatsScalars* scalars = s.device_scalars();
  s.math->grad_stats(s.grad_spans, s.dtype, scalars, stream);
  if (layout.partitions() > 1)
    s.comm.all_reduce(scalars->reduced, scalars->reduced, 2, DType::f32, ReduceOp::sum, stream);
  s.device.copy_async(s.pinned.data(), scalars, sizeof(engine::GradStatsScalars), stream);
  stream.synchronize();
  const engine::GradStatsScalars& agreed = s.host_scalars();
  // One partition: nothing was reduced, and the double sum is exact.
  const bool reduced = layout.partitions() > 1;
  const double sum_squares = reduced ? agreed.reduced[0] : agreed.sum_squares;
  const bool overflow = reduced ? agreed.reduced[1] > 0 : agreed.nonfinite != 0;

  const double scale = s.scaler.scale();
  StepResult result;
  result.skipped = overflow || !std::isfinite(sum_squares);
  result.grad_norm = result.skipped ? 0.0 : std::sqrt(sum_squares) / scale;
  s.scaler.update(result.skipped);
  result.loss_scale = s.scaler.scale();
  s.last_norm = result.grad_norm;
  std::fill(s.accumulated.begin(), s.accumulated.end(), false);
  std::fill(s.summed.begin(), s.summed.end(), false);
  std::swap(s.previous_order, s.order);  // keeps both vectors' capacity
  s.order.clear();
  s.order_position = 0;
  if (result.skipped) {
    ++s.skipped;
    // Ordered before the next step's first accumulation, on the same stream.
    s.device.memset_async(s.grads.data(), 0, s.grads.bytes(), stream);
    return result;
  }

  const double max_norm = s.config.gradient_clipping;
  optim::AdamStepArgs args;
  args.step = s.steps - s.skipped;
  args.grad_scale = 1.0 / scale;
  args.clip_coef = max_norm > 0 && result.grad_norm > max_norm ? max_norm / (result.grad_norm + 1e-6) : 1.0;
  if (s.offloaded) {
    for (int g = 0; g < layout.group_count(); ++g) s.offload_groups[static_cast<std::size_t>(g)] = {grad_of(g), s.param_shard_out(g)};
    s.offloaded->step(s.offload_groups, args, s.param_offload.get());
    if (s.param_offload) s.param_offload->finish_updates();
  } else {
    s.adam_shards.clear();
    for (int g = 0; g < layout.group_count(); ++g) {
      const auto& place = layout.group(g);
      if (char* out = s.param_shard_out(g))
        s.adam_shards.push_back({s.master.as<float>() + place.shard_offset, s.m.as<float>() + place.shard_offset,
                                 s.v.as<float>() + place.shard_offset, grad_of(g), out, place.shard});
    }
    s.math->adam_step(s.adam_shards, s.dtype, s.dtype, args, stream);
    if (s.param_offload) stream.synchronize();  // the stream has read adam_shards, refilled below
    // Offloaded parameters with the optimizer on the device: each group's updated shard passes
    // through one device buffer on its way to the host.
    for (int g = 0; s.param_offload && g < layout.group_count(); ++g) {
      if (!s.params_offloaded(g)) continue;
      const auto& place = layout.group(g);
      s.adam_shards.assign(1, {s.master.as<float>() + place.shard_offset, s.m.as<float>() + place.shard_offset,
                               s.v.as<float>() + place.shard_offset, grad_of(g), s.update_out.data(), place.shard});
      s.math->adam_step(s.adam_shards, s.dtype, s.dtype, args, stream);
      s.device.copy_async(s.param_offload->begin_update(g), s.update_out.data(), s.bytes(place.shard), stream);
      stream.synchronize();
      s.param_offload->end_update(g);
    }
    if (s.param_offload) s.param_offload->finish_updates();
  }
  s.device.memset_async(s.grads.data(), 0, s.grads.bytes(), stream);
  s.gather_params();
  return result;
}

EngineStats Engine::stats() const {
  const State& s = *state_;
  EngineStats stats{s.steps, s.skipped, s.scaler.scale(), s.last_norm, s.device.memory_stats(), 0, 0};
  if (s.offloaded) {
    stats.nvme_bytes += s.offloaded->nvme_bytes();
    stats.offload_pinned_bytes += s.offloaded->pinned_bytes();
  }
  if (s.param_offload) {
    stats.nvme_bytes += s.param_offload->nvme_bytes();
    stats.offload_pinned_bytes += s.param_offload->pinned_bytes();
  }
  return stats;
}

// ---- Checkpoints -------------------------------------------------------------------------------

namespace {

namespace ckpt = checkpoint;
using ckpt::StateKind;

// The tensor ranges rank `q` of a layout stores in a checkpoint (`saved`: one partition writes
// only on rank 0) or holds in its optimizer shard (every rank when there is one partition), in
// shard order.
std::vector<ckpt::Range> ranges_of(const Layout& layout, int q, bool saved) {
  std::vector<ckpt::Range> ranges;
  if (saved && layout.partitions() == 1 && q != 0) return ranges;
  for (std::size_t t = 0; t < layout.tensor_count(); ++t) {
    const auto& place = layout.tensor(t);
    const auto& g = layout.group(place.group);
    const std::size_t begin = layout.partitions() == 1 ? 0 : static_cast<std::size_t>(q) * g.shard;
    const std::size_t lo = std::max(place.offset, begin), hi = std::min(place.offset + place.numel, begin + g.shard);
    if (lo < hi) ranges.push_back({t, lo - place.offset, hi - place.offset});
  }
  return ranges;
}

// Where tensor element `j` sits in rank `q`'s shard buffer (optimizer states), and in its group's
// shard.
std::size_t in_group_shard(const Layout& layout, int q, std::size_t tensor, std::size_t j) {
  const auto& place = layout.tensor(tensor);
  const std::size_t begin = layout.partitions() == 1 ? 0 : static_cast<std::size_t>(q) * layout.group(place.group).shard;
  return place.offset + j - begin;
}
std::size_t shard_position(const Layout& layout, int q, std::size_t tensor, std::size_t j) {
  return layout.group(layout.tensor(tensor).group).shard_offset + in_group_shard(layout, q, tensor, j);
}

// The settings a checkpoint records, as key=value words.
std::string fingerprint(const Config& c) {
  const auto& o = c.optimizer;
  char text[320];
  std::snprintf(text, sizeof text,
                "stage=%d dtype=%s optimizer=%s lr=%.9g beta1=%.9g beta2=%.9g eps=%.9g weight_decay=%.9g "
                "gradient_clipping=%.9g",
                c.stage, std::string(dtype_name(c.precision.dtype)).c_str(),
                o.type == OptimizerType::adam ? "adam" : "adamw", o.lr, o.beta1, o.beta2, o.eps, o.weight_decay,
                c.gradient_clipping);
  return text;
}

// "key: A in the checkpoint, B now" for each key whose value differs.
std::vector<std::string> config_changes(const std::string& saved, const std::string& now) {
  auto words = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> result;
    std::istringstream in(text);
    for (std::string word; in >> word;) {
      const std::size_t eq = word.find('=');
      if (eq != std::string::npos) result.emplace_back(word.substr(0, eq), word.substr(eq + 1));
    }
    return result;
  };
  std::vector<std::string> changes;
  const auto before = words(saved);
  for (const auto& [key, value] : words(now)) {
    const auto it = std::find_if(before.begin(), before.end(), [&](const auto& w) { return w.first == key; });
    const std::string old = it == before.end() ? std::string("unset") : it->second;
    if (old != value) changes.push_back(std::string(key).append(": ").append(old).append(" in the checkpoint, ").append(value).append(" now"));
  }
  return changes;
}

using ckpt::join;

// Calls visit(range, a, b, at) for the parts [a, b) (tensor elements) of `ranges` inside shard
// positions [lo, lo + n), `at` being a's place from lo. `ranges` are in shard order.
template <class Visit>
void for_each_overlap(const Layout& layout, int q, const std::vector<ckpt::Range>& ranges, std::size_t lo,
                      std::size_t n, Visit visit) {
  for (const ckpt::Range& r : ranges) {
    const std::size_t begin = shard_position(layout, q, r.tensor, r.lo), end = begin + (r.hi - r.lo);
    const std::size_t a = std::max(lo, begin), b = std::min(lo + n, end);
    if (a < b) visit(r, r.lo + (a - begin), r.lo + (b - begin), a - lo);
  }
}

}  // namespace

// Every rank's `words` (the same count on each), in rank order: status and values the ranks agree
// on. 32-bit words travel as fp32 bit patterns, which the gather copies without arithmetic.
static std::vector<std::uint32_t> gather_words(Device& device, Communicator& comm, Stream& stream,
                                               const std::vector<std::uint32_t>& words) {
  const std::size_t n = words.size(), ranks = static_cast<std::size_t>(comm.size());
  if (ranks == 1) return words;
  HostBuffer host = device.allocate_pinned(ranks * n * sizeof(std::uint32_t));
  DeviceBuffer buffer = device.allocate(ranks * n * sizeof(std::uint32_t), MemoryCategory::buffers);
  char* mine = buffer.as<char>() + static_cast<std::size_t>(comm.rank()) * n * sizeof(std::uint32_t);
  std::memcpy(host.data(), words.data(), n * sizeof(std::uint32_t));
  device.copy_async(mine, host.data(), n * sizeof(std::uint32_t), stream);
  comm.all_gather(mine, buffer.data(), n, DType::f32, stream);
  device.copy_async(host.data(), buffer.data(), ranks * n * sizeof(std::uint32_t), stream);
  stream.synchronize();
  std::vector<std::uint32_t> all(ranks * n);
  std::memcpy(all.data(), host.data(), all.size() * sizeof(std::uint32_t));
  return all;
}

// Every rank learns whether any failed; a failed rank rethrows its own error, the others say which
// rank failed (and `consequence`), so that no rank goes on to the next collective phase alone.
static void agree(Device& device, Communicator& comm, Stream& stream, const std::exception_ptr& failure,
                  const std::string& operation, const std::string& consequence = "nothing was changed") {
  const auto flags = gather_words(device, comm, stream, {failure ? 1u : 0u});
  if (failure) std::rethrow_exception(failure);
  for (std::size_t r = 0; r < flags.size(); ++r)
    if (flags[r])
      throw Error(std::string(operation).append(": rank ").append(std::to_string(r))
                      .append(" failed (its error says why); ").append(consequence));
}

static void require_between_steps(const std::vector<bool>& accumulated, const std::vector<int>& leases,
                                  const char* operation) {
  if (std::any_of(accumulated.begin(), accumulated.end(), [](bool a) { return a; }) ||
      std::any_of(leases.begin(), leases.end(), [](int l) { return l > 0; }))
    throw Error(std::string(operation).append(": called inside a step (a gradient is accumulated or a lease held); "
                                              "call it after step() and with every lease released"));
}

void Engine::save(const std::string& dir) {
  State& s = *state_;
  Stream& stream = *s.comm_stream;
  const char* op = "Engine::save";
  require_between_steps(s.accumulated, s.leases, op);
  stream.synchronize();
  const std::string target = ckpt::save_target(dir);

  // Rank 0 checks the target and creates the temporary directory; every rank learns its name.
  std::exception_ptr failure;
  std::uint32_t token = 0;
  if (s.rank == 0) {
    try {
      ckpt::check_save_target(target);
      token = ckpt::create_temp_dir(target, static_cast<std::uint32_t>(::getpid()));
    } catch (...) {
      failure = std::current_exception();
    }
  }
  agree(s.device, s.comm, stream, failure, op);
  const std::string temp = ckpt::temp_dir(target, gather_words(s.device, s.comm, stream, {token})[0]);

  // This rank's three files: each state of each of its ranges, in shard order.
  ckpt::RankEntry mine;
  mine.ranges = ranges_of(s.layout, s.rank, true);
  try {
    std::vector<std::unique_ptr<ckpt::FileWriter>> writers;
    for (int k = 0; k < ckpt::kStates; ++k)
      writers.push_back(std::make_unique<ckpt::FileWriter>(join(temp, ckpt::state_file_name(s.rank, StateKind(k)))));
    if (s.offloaded && !mine.ranges.empty()) {
      // One pass over the shard: each NVMe sub-group is read once, into pinned host memory.
      const auto& last = mine.ranges.back();
      const std::size_t from = shard_position(s.layout, s.rank, mine.ranges.front().tensor, mine.ranges.front().lo);
      const std::size_t to = shard_position(s.layout, s.rank, last.tensor, last.lo) + (last.hi - last.lo);
      s.offloaded->visit_states(from, to - from, false, [&](float* master, float* m, float* v, std::size_t first, std::size_t n) {
        const float* states[] = {master, m, v};
        for_each_overlap(s.layout, s.rank, mine.ranges, from + first, n,
                         [&](const ckpt::Range&, std::size_t a, std::size_t b, std::size_t at) {
                           for (int k = 0; k < ckpt::kStates; ++k) writers[k]->append(states[k] + at, (b - a) * sizeof(float));
                         });
      });
    } else if (!s.offloaded) {
      float* staging = s.staging_f32();
      for (int k = 0; k < ckpt::kStates; ++k) {
        const DeviceBuffer& buffer = k == 0 ? s.master : k == 1 ? s.m : s.v;
        for (const auto& r : mine.ranges) {
          const std::size_t at = shard_position(s.layout, s.rank, r.tensor, r.lo);
          for (std::size_t first = 0; first < r.hi - r.lo; first += s.staging_elements) {
            const std::size_t count = std::min(s.staging_elements, r.hi - r.lo - first);
            s.device.copy_async(staging, buffer.as<float>() + at + first, count * sizeof(float), stream);
            stream.synchronize();
            writers[static_cast<std::size_t>(k)]->append(staging, count * sizeof(float));
          }
        }
      }
    }
    for (int k = 0; k < ckpt::kStates; ++k) {
      auto& w = *writers[static_cast<std::size_t>(k)];
      w.finish();
      mine.files[static_cast<std::size_t>(k)] = {ckpt::state_file_name(s.rank, StateKind(k)), w.bytes(), w.chunk_crcs()};
    }
  } catch (...) {
    failure = std::current_exception();
  }
  agree(s.device, s.comm, stream, failure, op, std::string(target).append(" is unchanged"));

  // Rank 0 writes the manifest: every rank's chunk checksums travel to it as 32-bit words.
  std::vector<std::uint32_t> crcs;
  for (const auto& f : mine.files) crcs.insert(crcs.end(), f.chunk_crcs.begin(), f.chunk_crcs.end());
  const auto counts = gather_words(s.device, s.comm, stream, {static_cast<std::uint32_t>(crcs.size())});
  const std::size_t most = *std::max_element(counts.begin(), counts.end());
  crcs.resize(most);
  const auto all_crcs = gather_words(s.device, s.comm, stream, crcs);
  if (s.rank == 0) {
    try {
      ckpt::Manifest m;
      m.world_size = s.comm.size();
      m.stage = s.stage;
      m.steps = s.steps;
      m.skipped = s.skipped;
      m.loss_scale = s.scaler.scale();
      m.clean_steps = s.scaler.clean_steps();
      m.hysteresis_left = s.scaler.hysteresis_left();
      m.config = fingerprint(s.config);
      for (const ParamSpec& p : s.specs) m.tensors.push_back({p.name, p.shape, p.group, p.numel()});
      for (int q = 0; q < s.comm.size(); ++q) {
        ckpt::RankEntry entry;
        entry.ranges = ranges_of(s.layout, q, true);
        const std::uint64_t bytes = entry.elements() * sizeof(float);
        const std::size_t chunks = static_cast<std::size_t>((bytes + m.chunk_bytes - 1) / m.chunk_bytes);
        auto next = all_crcs.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(q) * most);
        for (int k = 0; k < ckpt::kStates; ++k, next += static_cast<std::ptrdiff_t>(chunks))
          entry.files[static_cast<std::size_t>(k)] = {ckpt::state_file_name(q, StateKind(k)), bytes,
                                                      std::vector<std::uint32_t>(next, next + static_cast<std::ptrdiff_t>(chunks))};
        m.ranks.push_back(std::move(entry));
      }
      const std::string text = ckpt::serialize(m);
      ckpt::write_file_synced(join(temp, ckpt::kManifestName), text.data(), text.size());
      ckpt::fsync_directory(temp);
      ckpt::publish(temp, target);
    } catch (const std::filesystem::filesystem_error& e) {
      failure = std::make_exception_ptr(IoError(std::string(op).append(": ").append(e.what()), target, 0, 0,
                                                e.code().value()));
    } catch (...) {
      failure = std::current_exception();
    }
  }
  agree(s.device, s.comm, stream, failure, op);
}

LoadResult Engine::load(const std::string& dir) {
  State& s = *state_;
  Stream& stream = *s.comm_stream;
  const char* op = "Engine::load";
  require_between_steps(s.accumulated, s.leases, op);
  stream.synchronize();

  // First everything this rank will read is checked, the engine unchanged: the manifest against
  // this model, the files' sizes, and the CRC32C of every chunk holding one of this rank's ranges
  // (only those: a rank reads its own shard's ranges, wherever the saving ranks put them).
  std::unique_ptr<ckpt::Reader> reader;
  const auto mine = ranges_of(s.layout, s.rank, false);
  std::exception_ptr failure;
  try {
    reader = std::make_unique<ckpt::Reader>(dir);
    ckpt::require_model(reader->manifest(), s.specs, dir);
    reader->check_files();
    for (int k = 0; k < ckpt::kStates; ++k)
      for (const auto& r : mine) reader->read(StateKind(k), r.tensor, r.lo, r.hi, nullptr);
  } catch (...) {
    failure = std::current_exception();
  }
  agree(s.device, s.comm, stream, failure, op);

  // Then the states of this rank's shard and its part of the parameters, read again (the page
  // cache usually still holds them) and checked again as they are read.
  try {
    auto read_into = [&](int k, const ckpt::Range& r, std::size_t a, std::size_t b, float* out) {
      reader->read(StateKind(k), r.tensor, a, b, out);
      if (k == 0) s.write_param_shard(s.layout.tensor(r.tensor).group, in_group_shard(s.layout, s.rank, r.tensor, a), out, b - a);
    };
    if (s.offloaded) {
      s.offloaded->visit_states(0, s.layout.shard_numel(), true, [&](float* master, float* m, float* v, std::size_t first, std::size_t n) {
        float* states[] = {master, m, v};
        for (float* state : states) std::fill(state, state + n, 0.0f);  // padding
        for_each_overlap(s.layout, s.rank, mine, first, n, [&](const ckpt::Range& r, std::size_t a, std::size_t b, std::size_t at) {
          for (int k = 0; k < ckpt::kStates; ++k) read_into(k, r, a, b, states[k] + at);
        });
      });
    } else {
      float* staging = s.staging_f32();
      for (int k = 0; k < ckpt::kStates; ++k) {
        float* buffer = (k == 0 ? s.master : k == 1 ? s.m : s.v).as<float>();
        s.device.memset_async(buffer, 0, s.layout.shard_numel() * sizeof(float), stream);  // padding
        for (const auto& r : mine) {
          const std::size_t at = shard_position(s.layout, s.rank, r.tensor, r.lo);
          for (std::size_t first = 0; first < r.hi - r.lo; first += s.staging_elements) {
            const std::size_t count = std::min(s.staging_elements, r.hi - r.lo - first);
            stream.synchronize();  // the staging's previous copy is done
            read_into(k, r, r.lo + first, r.lo + first + count, staging);
            s.device.copy_async(buffer + at + first, staging, count * sizeof(float), stream);
          }
        }
        stream.synchronize();
      }
    }
    s.drop_gathered();
  } catch (...) {
    failure = std::current_exception();
  }
  agree(s.device, s.comm, stream, failure, op,
        "this engine is partly loaded: load a checkpoint again before training");
  s.gather_params();
  const ckpt::Manifest& m = reader->manifest();
  s.steps = m.steps;
  s.skipped = m.skipped;
  s.scaler.restore(m.loss_scale, m.clean_steps, m.hysteresis_left);
  return {m.steps, config_changes(m.config, fingerprint(s.config))};
}

}  // namespace zest
