#include "zest/engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/layout.hpp"
#include "engine/loss_scaler.hpp"
#include "optim/cpu_adam.hpp"
#include "runtime/half.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using engine::Layout;

float load_element(const void* data, DType dtype, std::size_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[i];
    case DType::f16: return fp16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
  return 0;
}

void store_element(void* data, DType dtype, std::size_t i, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[i] = value; break;
    case DType::f16: static_cast<std::uint16_t*>(data)[i] = float_to_fp16(value); break;
    case DType::bf16: static_cast<std::uint16_t*>(data)[i] = float_to_bf16(value); break;
  }
}

// dst[i] (+)= src[i] in `dtype`: the first micro-batch of a step copies, later ones add.
void accumulate(void* dst, const void* src, std::size_t count, DType dtype, bool first) {
  if (first) {
    std::memcpy(dst, src, count * dtype_size(dtype));
  } else if (dtype == DType::f32) {
    float* d = static_cast<float*>(dst);
    const float* s = static_cast<const float*>(src);
    for (std::size_t i = 0; i < count; ++i) d[i] += s[i];
  } else {
    for (std::size_t i = 0; i < count; ++i)
      store_element(dst, dtype, i, load_element(dst, dtype, i) + load_element(src, dtype, i));
  }
}

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
};

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
        scaler(c.precision.loss_scale),
        adam(optim::hyper_params_from(c.optimizer), default_threads(c, k)),
        comm_stream(d.create_stream()) {
    if (!device.host_accessible())
      throw Error("Engine: this build's optimizer step runs on host-accessible devices (device.type: "
                  "cpu); the CUDA step is not built yet — use device.type: cpu");
  }

  const Config config;
  Device& device;
  Communicator& comm;
  const std::vector<ParamSpec> specs;
  const int stage;
  const DType dtype;
  const int rank;
  const Layout layout;
  engine::LossScaler scaler;
  optim::CpuAdam adam;
  std::unique_ptr<Stream> comm_stream;

  // Stage 0-2: every segment in full. Stage 3: this rank's shards, plus resident small groups.
  DeviceBuffer full_params;
  DeviceBuffer param_shards;
  std::vector<DeviceBuffer> resident;  // stage 3, per group: the full segment, or empty
  // Accumulated gradient: full segments (stages 0, 1) or this rank's shards (stages 2, 3).
  DeviceBuffer grads;
  // fp32 master weights and Adam moments of this rank's shards (all segments in stage 0).
  DeviceBuffer master, m, v;
  DeviceBuffer scalars;  // two floats reduced across ranks in step()

  std::vector<Slot> staging;      // where backward writes a group's gradients
  std::vector<Slot> gathered;     // stage 3: full parameters of non-resident groups
  std::vector<int> staging_of;    // group -> staging slot or -1
  std::vector<int> gathered_of;   // group -> gathered slot or -1
  std::vector<int> leases;        // group -> live leases
  std::vector<bool> accumulated;  // group -> has a gradient this step

  std::vector<int> order, previous_order;  // stage 3: groups in acquire order
  std::size_t order_position = 0;

  std::int64_t steps = 0, skipped = 0;
  double last_norm = 0;

  bool grads_full() const { return stage <= 1; }
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
    comm.all_gather(at(param_shards, place.shard_offset, dtype), s.buffer.data(), place.shard, dtype,
                    *comm_stream);
    comm_stream->record(*s.free_after);
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
  const std::size_t groups = static_cast<std::size_t>(layout.group_count());
  if (s.params_sharded()) {
    s.param_shards = device.allocate(s.bytes(layout.shard_numel()), MemoryCategory::params);
    s.resident.resize(groups);
    for (int g = 0; g < layout.group_count(); ++g)
      if (s.bytes(layout.group(g).padded) <= config.stage3.persistence_threshold_bytes)
        s.resident[static_cast<std::size_t>(g)] = device.allocate(s.bytes(layout.group(g).padded), MemoryCategory::params);
  } else {
    s.full_params = device.allocate(s.bytes(layout.full_numel()), MemoryCategory::params);
  }
  s.grads = device.allocate(s.bytes(s.grads_full() ? layout.full_numel() : layout.shard_numel()),
                            MemoryCategory::grads);
  const std::size_t states = layout.shard_numel() * sizeof(float);
  s.master = device.allocate(states, MemoryCategory::optimizer_states);
  s.m = device.allocate(states, MemoryCategory::optimizer_states);
  s.v = device.allocate(states, MemoryCategory::optimizer_states);
  std::memset(s.master.data(), 0, states);
  std::memset(s.m.data(), 0, states);
  std::memset(s.v.data(), 0, states);
  s.scalars = device.allocate(2 * sizeof(float), MemoryCategory::buffers);

  // Two staging buffers let backward write one group while the previous one is reduced.
  const std::size_t segment_bytes = s.bytes(layout.largest_segment());
  for (int i = 0; i < 2; ++i)
    s.staging.push_back(Slot{device.allocate(segment_bytes, MemoryCategory::buffers), device.create_event(), -1});
  if (s.params_sharded()) {
    std::size_t sharded_groups = 0;
    for (const DeviceBuffer& r : s.resident) sharded_groups += r ? 0 : 1;
    const std::size_t by_budget = config.stage3.max_live_bytes / segment_bytes;
    const std::size_t count = std::min(sharded_groups, std::max<std::size_t>(2, by_budget));
    for (std::size_t i = 0; i < count; ++i)
      s.gathered.push_back(Slot{device.allocate(segment_bytes, MemoryCategory::buffers), device.create_event(), -1});
  }
  s.staging_of.assign(groups, -1);
  s.gathered_of.assign(groups, -1);
  s.leases.assign(groups, 0);
  s.accumulated.assign(groups, false);
  std::memset(s.grads.data(), 0, s.grads.bytes());
  if (s.full_params) std::memset(s.full_params.data(), 0, s.full_params.bytes());
  if (s.param_shards) std::memset(s.param_shards.data(), 0, s.param_shards.bytes());
  for (DeviceBuffer& r : s.resident)
    if (r) std::memset(r.data(), 0, r.bytes());
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
  // Master weights: the part of the tensor inside this rank's shard of the segment.
  const std::size_t begin = s.shard_begin(t.group), end = begin + g.shard;
  float* master = s.master.as<float>() + g.shard_offset;
  for (std::size_t i = std::max(begin, t.offset); i < std::min(end, t.offset + t.numel); ++i)
    master[i - begin] = values[i - t.offset];
  // Device parameters in the working dtype.
  auto write = [&](char* segment, std::size_t first, std::size_t last, std::size_t base) {
    for (std::size_t i = std::max(first, t.offset); i < std::min(last, t.offset + t.numel); ++i)
      store_element(segment, s.dtype, i - base, values[i - t.offset]);
  };
  if (!s.params_sharded()) {
    write(at(s.full_params, g.full_offset, s.dtype), 0, g.padded, 0);
  } else {
    write(at(s.param_shards, g.shard_offset, s.dtype), begin, end, begin);
    if (s.resident[static_cast<std::size_t>(t.group)])
      write(static_cast<char*>(s.resident[static_cast<std::size_t>(t.group)].data()), 0, g.padded, 0);
  }
}

void Engine::get_param(std::size_t tensor, float* values) {
  State& s = *state_;
  const auto& t = s.layout.tensor(tensor);
  const auto& g = s.layout.group(t.group);
  const std::size_t begin = s.shard_begin(t.group), end = begin + g.shard;
  const float* master = s.master.as<float>() + g.shard_offset;
  if (s.layout.partitions() == 1) {
    std::memcpy(values, master + t.offset, t.numel * sizeof(float));
    return;
  }
  // Each rank fills its part, zeros elsewhere; a sum across ranks assembles the tensor exactly.
  DeviceBuffer assembled = s.device.allocate(t.numel * sizeof(float), MemoryCategory::buffers);
  float* out = assembled.as<float>();
  std::memset(out, 0, t.numel * sizeof(float));
  for (std::size_t i = std::max(begin, t.offset); i < std::min(end, t.offset + t.numel); ++i)
    out[i - t.offset] = master[i - begin];
  s.comm.all_reduce(out, out, t.numel, DType::f32, ReduceOp::sum, *s.comm_stream);
  s.comm_stream->synchronize();
  std::memcpy(values, out, t.numel * sizeof(float));
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
    if (!s.resident[g] && s.gathered_of[g] < 0) s.start_gather(group);
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
  if (slot < 0) {
    slot = s.take_slot(s.staging, group_, "gradient staging");
    // Padding and tensors the trainer leaves unwritten reduce as zeros.
    std::memset(s.staging[static_cast<std::size_t>(slot)].buffer.data(), 0, s.bytes(s.layout.group(group_).padded));
  }
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
  if (s.grads_full()) {
    if (s.comm.size() > 1)
      s.comm.all_reduce(data, data, place.padded, s.dtype, ReduceOp::sum, *s.comm_stream);
    char* dst = at(s.grads, place.full_offset, s.dtype);
    s.comm_stream->host_task([=, &s] { accumulate(dst, data, place.padded, s.dtype, first); });
  } else {
    char* mine = data + s.bytes(s.shard_begin(group));
    s.comm.reduce_scatter(data, mine, place.shard, s.dtype, ReduceOp::sum, *s.comm_stream);
    char* dst = at(s.grads, place.shard_offset, s.dtype);
    s.comm_stream->host_task([=, &s] { accumulate(dst, mine, place.shard, s.dtype, first); });
  }
  s.comm_stream->record(*staging.free_after);
  staging.owner = -1;
  s.staging_of[g] = -1;
  if (!s.config.buckets.overlap_comm) s.comm_stream->synchronize();
}

StepResult Engine::step() {
  State& s = *state_;
  s.comm_stream->synchronize();
  const Layout& layout = s.layout;
  ++s.steps;

  // The gradient each rank updates with: its shard of every segment.
  auto grad_of = [&](int g) {
    const auto& place = layout.group(g);
    const std::size_t offset = s.grads_full() ? place.full_offset + s.shard_begin(g) : place.shard_offset;
    return optim::ConstTensorSpan{at(s.grads, offset, s.dtype), s.dtype, place.shard};
  };
  double sum_squares = 0;
  bool overflow = false;
  for (int g = 0; g < layout.group_count(); ++g) {
    if (!s.accumulated[static_cast<std::size_t>(g)]) continue;
    const optim::GradStats stats = s.adam.grad_stats(grad_of(g));
    sum_squares += stats.sum_squares;
    overflow = overflow || stats.nonfinite;
  }
  if (layout.partitions() > 1) {
    float* scalars = s.scalars.as<float>();
    scalars[0] = overflow ? 0.0f : static_cast<float>(sum_squares);
    scalars[1] = overflow ? 1.0f : 0.0f;
    s.comm.all_reduce(scalars, scalars, 2, DType::f32, ReduceOp::sum, *s.comm_stream);
    s.comm_stream->synchronize();
    sum_squares = scalars[0];
    overflow = scalars[1] > 0;
  }

  const double scale = s.scaler.scale();
  StepResult result;
  result.skipped = overflow || !std::isfinite(sum_squares);
  result.grad_norm = result.skipped ? 0.0 : std::sqrt(sum_squares) / scale;
  s.scaler.update(result.skipped);
  result.loss_scale = s.scaler.scale();
  s.last_norm = result.grad_norm;
  std::fill(s.accumulated.begin(), s.accumulated.end(), false);
  s.previous_order = std::move(s.order);
  s.order.clear();
  s.order_position = 0;
  if (result.skipped) {
    ++s.skipped;
    std::memset(s.grads.data(), 0, s.grads.bytes());
    return result;
  }

  const double max_norm = s.config.gradient_clipping;
  optim::AdamStepArgs args;
  args.step = s.steps - s.skipped;
  args.grad_scale = 1.0 / scale;
  args.clip_coef = max_norm > 0 && result.grad_norm > max_norm ? max_norm / (result.grad_norm + 1e-6) : 1.0;
  for (int g = 0; g < layout.group_count(); ++g) {
    const auto& place = layout.group(g);
    std::span<float> master(s.master.as<float>() + place.shard_offset, place.shard);
    std::span<float> m(s.m.as<float>() + place.shard_offset, place.shard);
    std::span<float> v(s.v.as<float>() + place.shard_offset, place.shard);
    // Where the updated low-precision parameters of this shard go.
    char* out = s.params_sharded() ? at(s.param_shards, place.shard_offset, s.dtype)
                                   : at(s.full_params, place.full_offset + s.shard_begin(g), s.dtype);
    if (s.dtype == DType::f32) {
      s.adam.step(master, m, v, grad_of(g), args);
      std::memcpy(out, master.data(), place.shard * sizeof(float));
    } else {
      s.adam.step(master, m, v, grad_of(g), args, optim::TensorSpan{out, s.dtype, place.shard});
    }
  }
  std::memset(s.grads.data(), 0, s.grads.bytes());

  // Every rank needs the full updated parameters again, except stage 3's gathered-on-use groups.
  for (int g = 0; g < layout.group_count(); ++g) {
    const auto& place = layout.group(g);
    char* full = nullptr;
    if (!s.params_sharded()) {
      full = at(s.full_params, place.full_offset, s.dtype);
    } else if (s.resident[static_cast<std::size_t>(g)]) {
      full = static_cast<char*>(s.resident[static_cast<std::size_t>(g)].data());
      std::memcpy(full + s.bytes(s.shard_begin(g)), at(s.param_shards, place.shard_offset, s.dtype),
                  s.bytes(place.shard));
    }
    if (full && layout.partitions() > 1)
      s.comm.all_gather(full + s.bytes(s.shard_begin(g)), full, place.shard, s.dtype, *s.comm_stream);
  }
  s.comm_stream->synchronize();
  return result;
}

EngineStats Engine::stats() const {
  const State& s = *state_;
  return EngineStats{s.steps, s.skipped, s.scaler.scale(), s.last_norm, s.device.memory_stats()};
}

}  // namespace zest
