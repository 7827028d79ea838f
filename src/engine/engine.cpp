#include "zest/engine.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/checkpoint_format.hpp"
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

// A reusable device buffer with the event that marks the end of its last use.
struct Slot {
  DeviceBuffer buffer;
  std::unique_ptr<Event> free_after;
  int owner = -1;  // group using it, or -1
  DeviceBuffer shard;  // stage 3 with offloaded parameters: the fetched shard the gather reads
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

  std::vector<Slot> staging;      // where backward writes a group's gradients; all zero while free
  std::vector<Slot> gathered;     // stage 3: full parameters of non-resident groups
  std::vector<int> staging_of;    // group -> staging slot or -1
  std::vector<int> gathered_of;   // group -> gathered slot or -1
  std::vector<int> leases;        // group -> live leases
  std::vector<bool> accumulated;  // group -> has a gradient this step

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
  int take_slot(std::vector<Slot>& slots, int group, const char* what) {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].owner < 0) {
        slots[i].free_after->synchronize();
        slots[i].owner = group;
        return static_cast<int>(i);
      }
    }
    throw Error(std::string("Engine: every ").append(what).append(" buffer is in use (")
                    .append(std::to_string(slots.size()))
                    .append(" of them); release leases sooner, or raise stage3.max_live"));
  }

  void start_gather(int g) {
    const int slot = take_slot(gathered, g, "gathered-parameter");
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

  void release(int g) {
    if (--leases[static_cast<std::size_t>(g)] > 0 || !params_sharded()) return;
    const int slot = gathered_of[static_cast<std::size_t>(g)];
    if (slot < 0) return;
    gathered[static_cast<std::size_t>(slot)].owner = -1;  // the gather's event already passed
    gathered_of[static_cast<std::size_t>(g)] = -1;
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
  s.staging_elements = plan.staging_elements;
  s.pinned = device.allocate_pinned(plan.engine_pinned);
  s.grad_spans.reserve(groups);
  s.adam_shards.reserve(groups);
  s.staging_of.assign(groups, -1);
  s.gathered_of.assign(groups, -1);
  s.leases.assign(groups, 0);
  s.accumulated.assign(groups, false);

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
  // Each rank fills its part, zeros elsewhere; a sum across ranks assembles the tensor exactly.
  DeviceBuffer assembled =
      s.device.allocate(std::min(t.numel, s.staging_elements) * sizeof(float), MemoryCategory::buffers);
  float* const out = assembled.as<float>();
  for (std::size_t first = 0; first < t.numel; first += s.staging_elements) {
    const std::size_t count = std::min(s.staging_elements, t.numel - first);
    const std::size_t lo = t.offset + first, hi = lo + count;
    const std::size_t mine_lo = std::max(lo, begin), mine_hi = std::min(hi, end);
    s.device.memset_async(out, 0, count * sizeof(float), stream);
    if (mine_lo < mine_hi && s.offloaded) {
      // Through the staging, which the last copy of this chunk overwrites in stream order.
      s.offloaded->read_master(g.shard_offset + (mine_lo - begin), staging, mine_hi - mine_lo);
      s.device.copy_async(out + (mine_lo - lo), staging, (mine_hi - mine_lo) * sizeof(float), stream);
    } else if (mine_lo < mine_hi) {
      s.device.copy_async(out + (mine_lo - lo), master + (mine_lo - begin), (mine_hi - mine_lo) * sizeof(float), stream);
    }
    s.comm.all_reduce(out, out, count, DType::f32, ReduceOp::sum, stream);
    s.device.copy_async(staging, out, count * sizeof(float), stream);
    stream.synchronize();
    std::memcpy(values + first, staging, count * sizeof(float));
  }
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
  int& slot = s.staging_of[static_cast<std::size_t>(group_)];
  // A free slot is all zeros (zeroed after each use, on the comm stream), so padding and tensors
  // the trainer leaves unwritten reduce as zeros.
  if (slot < 0) slot = s.take_slot(s.staging, group_, "gradient staging");
  return static_cast<char*>(s.staging[static_cast<std::size_t>(slot)].buffer.data()) + s.bytes(t.offset);
}

void Engine::grads_ready(int group) {
  State& s = *state_;
  const std::size_t g = static_cast<std::size_t>(group);
  const int slot = s.staging_of.at(g);
  if (slot < 0)
    throw Error(std::string("Engine::grads_ready(").append(std::to_string(group))
                    .append("): no gradient of this group was requested through a lease's grad()"));
  Slot& staging = s.staging[static_cast<std::size_t>(slot)];
  const auto& place = s.layout.group(group);
  char* data = static_cast<char*>(staging.buffer.data());
  const bool first = !s.accumulated[g];
  s.accumulated[g] = true;
  Stream& stream = *s.comm_stream;
  if (s.grads_full()) {
    if (s.comm.size() > 1) s.comm.all_reduce(data, data, place.padded, s.dtype, ReduceOp::sum, stream);
    s.math->accumulate(at(s.grads, place.full_offset, s.dtype), data, place.padded, s.dtype, first, stream);
  } else {
    char* mine = data + s.bytes(s.shard_begin(group));
    s.comm.reduce_scatter(data, mine, place.shard, s.dtype, ReduceOp::sum, stream);
    s.math->accumulate(at(s.grads, place.shard_offset, s.dtype), mine, place.shard, s.dtype, first, stream);
  }
  s.device.memset_async(data, 0, s.bytes(place.padded), stream);
  s.comm_stream->record(*staging.free_after);
  staging.owner = -1;
  s.staging_of[g] = -1;
  if (!s.config.buckets.overlap_comm) s.comm_stream->synchronize();
}

StepResult Engine::step() {
  State& s = *state_;
  Stream& stream = *s.comm_stream;
  const Layout& layout = s.layout;
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
  // Where the updated parameters of a group's shard go on the device, in the working dtype; null
  // where they stay off the device (stage 3, offloaded parameters).
  auto out_of = [&](int g) -> char* {
    const auto& place = layout.group(g);
    if (!s.params_sharded()) return at(s.full_params, place.full_offset + s.shard_begin(g), s.dtype);
    if (!s.param_offload) return at(s.param_shards, place.shard_offset, s.dtype);
    if (s.params_offloaded(g)) return nullptr;
    return static_cast<char*>(s.resident[static_cast<std::size_t>(g)].data()) + s.bytes(s.shard_begin(g));
  };
  if (s.offloaded) {
    for (int g = 0; g < layout.group_count(); ++g) s.offload_groups[static_cast<std::size_t>(g)] = {grad_of(g), out_of(g)};
    s.offloaded->step(s.offload_groups, args, s.param_offload.get());
    if (s.param_offload) s.param_offload->finish_updates();
  } else {
    s.adam_shards.clear();
    for (int g = 0; g < layout.group_count(); ++g) {
      const auto& place = layout.group(g);
      if (char* out = out_of(g))
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

  // Every rank needs the full updated parameters again, except stage 3's gathered-on-use groups.
  for (int g = 0; g < layout.group_count(); ++g) {
    const auto& place = layout.group(g);
    char* full = nullptr;
    if (!s.params_sharded()) {
      full = at(s.full_params, place.full_offset, s.dtype);
    } else if (s.resident[static_cast<std::size_t>(g)]) {
      full = static_cast<char*>(s.resident[static_cast<std::size_t>(g)].data());
      if (s.param_shards)
        s.device.copy_async(full + s.bytes(s.shard_begin(g)), at(s.param_shards, place.shard_offset, s.dtype),
                            s.bytes(place.shard), stream);
    }
    if (full && layout.partitions() > 1)
      s.comm.all_gather(full + s.bytes(s.shard_begin(g)), full, place.shard, s.dtype, stream);
  }
  stream.synchronize();
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

namespace ckpt = engine::checkpoint;

// The tensor ranges rank `q` of a layout stores in a checkpoint (`saved`: one partition writes
// only on rank 0) or holds in its optimizer shard (every rank when there is one partition).
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

// Where tensor element `j` of a range sits in the rank's shard buffer (optimizer states).
std::size_t shard_position(const Layout& layout, int q, std::size_t tensor, std::size_t j) {
  const auto& place = layout.tensor(tensor);
  const auto& g = layout.group(place.group);
  const std::size_t begin = layout.partitions() == 1 ? 0 : static_cast<std::size_t>(q) * g.shard;
  return g.shard_offset + (place.offset + j - begin);
}

std::string shape_text(const std::vector<std::size_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text.append(i ? ", " : "").append(std::to_string(shape[i]));
  return text.append("]");
}

std::string fingerprint(const Config& c) {
  const auto& o = c.optimizer;
  char text[256];
  std::snprintf(text, sizeof text, "stage=%d dtype=%s optimizer=%s lr=%a beta1=%a beta2=%a eps=%a weight_decay=%a",
                c.stage, std::string(dtype_name(c.precision.dtype)).c_str(),
                o.type == OptimizerType::adam ? "adam" : "adamw", o.lr, o.beta1, o.beta2, o.eps, o.weight_decay);
  return text;
}

std::string join(const std::string& dir, const std::string& name) { return (std::filesystem::path(dir) / name).string(); }

// Throws Error unless every tensor of the manifest is this engine's (name, shape, group), every
// element has exactly one range, and every rank file exists with the size the manifest says.
void validate(const ckpt::Manifest& m, const std::vector<ParamSpec>& specs, const std::string& dir) {
  const std::string where = std::string("checkpoint ").append(dir).append(": ");
  if (m.tensors.size() != specs.size())
    throw Error(std::string(where).append("it holds ").append(std::to_string(m.tensors.size()))
                    .append(" tensors, this model has ").append(std::to_string(specs.size()))
                    .append(": it is a checkpoint of another model"));
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const auto& e = m.tensors[t];
    if (e.name != specs[t].name || e.shape != specs[t].shape || e.group != specs[t].group || e.numel != specs[t].numel())
      throw Error(std::string(where).append("tensor ").append(std::to_string(t)).append(" is '").append(e.name)
                      .append("' ").append(shape_text(e.shape)).append(" group ").append(std::to_string(e.group))
                      .append(" there and '").append(specs[t].name).append("' ").append(shape_text(specs[t].shape))
                      .append(" group ").append(std::to_string(specs[t].group))
                      .append(" here: it is a checkpoint of another model"));
  }
  if (m.files.size() != static_cast<std::size_t>(m.world_size))
    throw Error(std::string(where).append("the manifest lists ").append(std::to_string(m.files.size()))
                    .append(" rank files for world size ").append(std::to_string(m.world_size)));
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> cover(specs.size());
  for (const auto& f : m.files) {
    for (const auto& r : f.ranges) cover[r.tensor].push_back({r.lo, r.hi});
    const std::string path = join(dir, f.name);
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0)
      throw IoError(std::string(where).append("a rank file is missing"), path, 0, 0, errno);
    if (static_cast<std::uint64_t>(info.st_size) != f.bytes || f.bytes != 3 * sizeof(float) * f.elements())
      throw Error(std::string(where).append("rank file ").append(path).append(" has ")
                      .append(std::to_string(info.st_size)).append(" bytes, the manifest says ")
                      .append(std::to_string(f.bytes)).append(" (")
                      .append(std::to_string(3 * sizeof(float) * f.elements()))
                      .append(" by its ranges): the file is truncated or damaged"));
  }
  for (std::size_t t = 0; t < specs.size(); ++t) {
    std::sort(cover[t].begin(), cover[t].end());
    std::size_t next = 0;
    for (const auto& [lo, hi] : cover[t]) {
      if (lo != next) break;
      next = hi;
    }
    if (next != specs[t].numel())
      throw Error(std::string(where).append("the ranges of tensor '").append(specs[t].name)
                      .append("' do not cover it exactly once: the manifest is damaged"));
  }
}

// The rank files of a checkpoint, open for reading ranges of tensors.
class CheckpointReader {
 public:
  CheckpointReader(const ckpt::Manifest& m, const std::string& dir) : manifest_(m) {
    for (const auto& f : m.files) {
      paths_.push_back(join(dir, f.name));
      fds_.push_back(::open(paths_.back().c_str(), O_RDONLY | O_CLOEXEC));
      if (fds_.back() < 0) throw IoError("checkpoint: cannot open", paths_.back(), 0, 0, errno);
    }
  }
  ~CheckpointReader() {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // Elements [a, b) of tensor `t`'s state (0 master, 1 m, 2 v) into out[0, b - a).
  void read(int state, std::size_t t, std::size_t a, std::size_t b, float* out) {
    for (std::size_t f = 0; f < manifest_.files.size(); ++f) {
      const auto& file = manifest_.files[f];
      const std::size_t base = static_cast<std::size_t>(state) * file.elements();
      std::size_t prefix = 0;
      for (const auto& r : file.ranges) {
        const std::size_t lo = std::max(a, r.lo), hi = std::min(b, r.hi);
        if (r.tensor == t && lo < hi)
          ckpt::read_at(fds_[f], paths_[f], out + (lo - a), (hi - lo) * sizeof(float),
                        (base + prefix + (lo - r.lo)) * sizeof(float));
        prefix += r.hi - r.lo;
      }
    }
  }

 private:
  const ckpt::Manifest& manifest_;
  std::vector<std::string> paths_;
  std::vector<int> fds_;
};

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
// rank failed, so that no rank goes on to the next collective phase alone.
static void agree(Device& device, Communicator& comm, Stream& stream, const std::exception_ptr& failure,
                  const char* operation) {
  const auto flags = gather_words(device, comm, stream, {failure ? 1u : 0u});
  if (failure) std::rethrow_exception(failure);
  for (std::size_t r = 0; r < flags.size(); ++r)
    if (flags[r])
      throw Error(std::string(operation).append(": rank ").append(std::to_string(r))
                      .append(" failed (its error says why); nothing was changed"));
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
  const std::string target = std::filesystem::path(dir).lexically_normal().string();
  if (target.empty() || std::filesystem::path(target).filename().empty())
    throw Error(std::string(op).append(": '").append(dir).append("' names no directory"));
  const auto pid = gather_words(s.device, s.comm, stream, {static_cast<std::uint32_t>(::getpid())})[0];
  const std::string temp = std::string(target).append(".tmp-").append(std::to_string(pid));

  std::exception_ptr failure;
  if (s.rank == 0) {
    try {
      std::filesystem::remove_all(temp);  // left by a crashed save of an earlier process with this pid
      std::filesystem::create_directories(temp);
    } catch (const std::filesystem::filesystem_error& e) {
      failure = std::make_exception_ptr(IoError(std::string(op).append(": cannot create the directory"), temp, 0, 0,
                                                e.code().value()));
    }
  }
  agree(s.device, s.comm, stream, failure, op);

  // This rank's file: master, m, v of each of its ranges, through the pinned staging.
  std::uint32_t crc = 0;
  std::uint64_t bytes = 0;
  try {
    const auto ranges = ranges_of(s.layout, s.rank, true);
    ckpt::FileWriter writer(join(temp, ckpt::rank_file_name(s.rank)));
    float* staging = s.staging_f32();
    for (int state = 0; state < 3; ++state) {
      const DeviceBuffer& buffer = state == 0 ? s.master : state == 1 ? s.m : s.v;
      for (const auto& r : ranges) {
        const std::size_t at = shard_position(s.layout, s.rank, r.tensor, r.lo);
        for (std::size_t first = 0; first < r.hi - r.lo; first += s.staging_elements) {
          const std::size_t count = std::min(s.staging_elements, r.hi - r.lo - first);
          if (s.offloaded) {
            s.offloaded->read_state(static_cast<engine::OffloadedOptimizer::State>(state), at + first, staging, count);
          } else {
            s.device.copy_async(staging, buffer.as<float>() + at + first, count * sizeof(float), stream);
            stream.synchronize();
          }
          writer.append(staging, count * sizeof(float));
        }
      }
    }
    writer.finish();
    crc = writer.crc32c();
    bytes = writer.bytes();
  } catch (...) {
    failure = std::current_exception();
  }
  const auto files = gather_words(s.device, s.comm, stream,
                                  {failure ? 1u : 0u, crc, static_cast<std::uint32_t>(bytes),
                                   static_cast<std::uint32_t>(bytes >> 32)});
  {
    std::vector<std::uint32_t> flags;
    for (std::size_t r = 0; r < files.size(); r += 4) flags.push_back(files[r]);
    if (failure) std::rethrow_exception(failure);
    for (std::size_t r = 0; r < flags.size(); ++r)
      if (flags[r])
        throw Error(std::string(op).append(": rank ").append(std::to_string(r))
                        .append(" failed to write its file (its error says why); ").append(target).append(" is unchanged"));
  }

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
        const std::size_t w = static_cast<std::size_t>(q) * 4;
        m.files.push_back({ckpt::rank_file_name(q), files[w + 2] | (std::uint64_t{files[w + 3]} << 32), files[w + 1],
                           ranges_of(s.layout, q, true)});
      }
      const std::string text = ckpt::serialize(m);
      ckpt::write_file_synced(join(temp, ckpt::kManifestName), text.data(), text.size());
      ckpt::fsync_directory(temp);
      // Swap the new directory in: atomically where the file system can exchange two names, else
      // the old one is moved aside first (a crash between the two renames leaves it there).
      const std::string aside = std::string(target).append(".old-").append(std::to_string(pid));
      const bool existed = std::filesystem::exists(target);
      if (existed && ::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
        std::filesystem::remove_all(temp);  // now the old checkpoint
      } else {
        if (existed && ::rename(target.c_str(), aside.c_str()) != 0)
          throw IoError(std::string(op).append(": cannot move the previous checkpoint aside"), target, 0, 0, errno);
        if (::rename(temp.c_str(), target.c_str()) != 0)
          throw IoError(std::string(op).append(": cannot rename the new checkpoint into place"), temp, 0, 0, errno);
        if (existed) std::filesystem::remove_all(aside);
      }
      const std::filesystem::path parent = std::filesystem::path(target).parent_path();
      ckpt::fsync_directory(parent.empty() ? std::string(".") : parent.string());
    } catch (const std::filesystem::filesystem_error& e) {
      failure = std::make_exception_ptr(IoError(std::string(op).append(": ").append(e.what()), target, 0, 0,
                                                e.code().value()));
    } catch (...) {
      failure = std::current_exception();
    }
  }
  agree(s.device, s.comm, stream, failure, op);
}

void Engine::load(const std::string& dir) {
  State& s = *state_;
  Stream& stream = *s.comm_stream;
  const char* op = "Engine::load";
  require_between_steps(s.accumulated, s.leases, op);
  stream.synchronize();

  // Everything is read and checked before the engine changes: the manifest against this model, the
  // files' sizes, the CRC32C of every file (whole files: every rank reads every tensor's master
  // weights), then the data into host memory.
  ckpt::Manifest m;
  std::vector<std::vector<float>> master(s.specs.size());
  std::vector<float> moments[2];
  std::exception_ptr failure;
  try {
    const std::string manifest_path = join(dir, ckpt::kManifestName);
    m = ckpt::parse(ckpt::read_whole_file(manifest_path), manifest_path);
    validate(m, s.specs, dir);
    for (const auto& f : m.files) {
      const std::string path = join(dir, f.name);
      const std::uint32_t crc = ckpt::file_crc32c(path, f.bytes);
      if (crc != f.crc32c)
        throw Error(std::string("checkpoint ").append(dir).append(": rank file ").append(path)
                        .append(" has CRC32C ").append(std::to_string(crc)).append(", the manifest says ")
                        .append(std::to_string(f.crc32c)).append(": the file is damaged; load another checkpoint"));
    }
    CheckpointReader reader(m, dir);
    for (std::size_t t = 0; t < s.specs.size(); ++t) {
      master[t].resize(s.specs[t].numel());
      reader.read(0, t, 0, master[t].size(), master[t].data());
    }
    for (int k = 0; k < 2; ++k) {
      moments[k].assign(s.layout.shard_numel(), 0.0f);  // padding stays zero
      for (const auto& r : ranges_of(s.layout, s.rank, false))
        reader.read(k + 1, r.tensor, r.lo, r.hi, moments[k].data() + shard_position(s.layout, s.rank, r.tensor, r.lo));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  agree(s.device, s.comm, stream, failure, op);

  for (std::size_t t = 0; t < s.specs.size(); ++t) set_param(t, master[t].data());
  for (int k = 0; k < 2; ++k) {
    const std::vector<float>& values = moments[k];
    if (s.offloaded) {
      s.offloaded->write_state(k == 0 ? engine::OffloadedOptimizer::State::m : engine::OffloadedOptimizer::State::v, 0,
                               values.data(), values.size());
      continue;
    }
    float* device = (k == 0 ? s.m : s.v).as<float>();
    for (std::size_t first = 0; first < values.size(); first += s.staging_elements) {
      const std::size_t count = std::min(s.staging_elements, values.size() - first);
      std::memcpy(s.staging_f32(), values.data() + first, count * sizeof(float));
      s.device.copy_async(device + first, s.staging_f32(), count * sizeof(float), stream);
      stream.synchronize();
    }
  }
  s.steps = m.steps;
  s.skipped = m.skipped;
  s.scaler.restore(m.loss_scale, m.clean_steps, m.hysteresis_left);
}

}  // namespace zest
