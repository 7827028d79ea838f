#include "engine/collectives/param_gather.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "runtime/host/half.hpp"
#include "runtime/device/stream_span.hpp"
#include "zest/error.hpp"

namespace zest::engine {

ParamGatherOptions param_gather_options(const Config& config) {
  return {config.stage, config.precision.dtype, config.stage3.prefetch_bytes};
}

ParamGather::ParamGather(const ParamGatherOptions& options, Device& device, Communicator& comm, Stream& comm_stream,
                         const Layout& layout, const MemoryPlan& plan, HostStaging& staging,
                         std::shared_ptr<offload::Store> store, Communicator* host_comm, QuantizedGather* quantized)
    : device_(device),
      comm_(comm),
      stream_(comm_stream),
      layout_(layout),
      plan_(plan),
      staging_(staging),
      stage_(options.stage),
      rank_(comm.rank()),
      dtype_(options.dtype),
      prefetch_bytes_(options.prefetch_bytes),
      exact_(comm, options.dtype),
      gather_(sharded() && quantized ? static_cast<ShardGather&>(*quantized) : exact_),
      gathered_("gathered-parameter", "release leases sooner, or raise stage3.max_live") {
  const auto groups = static_cast<std::size_t>(layout.group_count());
  shards_ = device.allocate(plan.params.param_shards, MemoryCategory::params);
  for (std::size_t size : plan.params.resident) resident_.push_back(device.allocate(size, MemoryCategory::params));
  full_params_ = device.allocate(plan.params.full_params, MemoryCategory::params);
  for (std::size_t i = 0; i < plan.gather.gathered_count; ++i)
    gathered_.add(Slot{device.allocate(plan.gather.gathered_slot, MemoryCategory::buffers), device.create_event(), -1,
                       device.allocate(plan.gather.gathered_shard, MemoryCategory::buffers)});
  gather_bucket_ = device.allocate(plan.gather.gather_bucket, MemoryCategory::buffers);
  gathered_of_.assign(groups, -1);
  leases_.assign(groups, 0);
  for (const DeviceBuffer* b : {&full_params_, &shards_})
    if (*b) device.memset_async(b->data(), 0, b->bytes(), stream_);
  for (const DeviceBuffer& r : resident_)
    if (r) device.memset_async(r.data(), 0, r.bytes(), stream_);
  if (plan.offload_params)
    offload_ = std::make_unique<ParamOffload>(device, layout, plan.param_offload, dtype_, std::move(store));
  if (plan.params.secondary_ranks > 0) {
    if (host_comm == nullptr || host_comm->size() != plan.params.secondary_ranks)
      throw Error(fmt::format(
          "Engine: partition.secondary: host planned {} ranks per host, but the host communicator has {}",
          plan.params.secondary_ranks, host_comm ? std::to_string(host_comm->size()) : std::string("none")));
    host_comm_ = host_comm;
    secondary_ = device.allocate(plan.params.secondary_params, MemoryCategory::params);
    secondary_at_.assign(groups, 0);
    secondary_fresh_.assign(groups, false);
    std::size_t at = 0;
    for (std::size_t g = 0; g < groups; ++g) {
      if (plan.params.resident[g] > 0) continue;
      secondary_at_[g] = at;
      at += layout.group(static_cast<int>(g)).padded / static_cast<std::size_t>(plan.params.secondary_ranks);
    }
  }
}

char* ParamGather::full(int g) {
  if (!sharded()) return at(full_params_, layout_.group(g).full_offset);
  const auto i = static_cast<std::size_t>(g);
  if (resident_[i]) return resident_[i].as<char>();
  if (gathered_of_[i] < 0)
    throw Error(fmt::format("Engine: group {} is not gathered", g));
  return gathered_[static_cast<std::size_t>(gathered_of_[i])].buffer.as<char>();
}

void ParamGather::acquire(int g) {
  const auto i = static_cast<std::size_t>(g);
  if (sharded()) {
    order_.push_back(g);
    if (order_position_ < previous_order_.size() && previous_order_[order_position_] == g) ++order_position_;
    if (!resident_[i] && gathered_of_[i] < 0) {
      make_room_for_lease();
      start_gather(g);
    }
    if (!resident_[i]) gathered_[static_cast<std::size_t>(gathered_of_[i])].free_after->synchronize();
    prefetch();
  }
  ++leases_[i];
}

bool ParamGather::release(int g) {
  const auto i = static_cast<std::size_t>(g);
  // Engine's leases release once, from destructors (which must not throw); a release without a
  // lease changes nothing, where it once made the count negative and a later lease look like none.
  if (leases_[i] == 0) return false;
  if (--leases_[i] > 0 || !sharded()) return false;
  const int slot = gathered_of_[i];
  if (slot < 0) return false;
  gathered_.give_back(slot);  // the gather's event already passed
  gathered_of_[i] = -1;
  return true;
}

bool ParamGather::any_leased() const {
  return std::any_of(leases_.begin(), leases_.end(), [](int l) { return l > 0; });
}

void ParamGather::start_gather(int g) {
  const int slot = gathered_.take(g);
  gathered_of_[static_cast<std::size_t>(g)] = slot;
  const auto& place = layout_.group(g);
  Slot& s = gathered_[static_cast<std::size_t>(slot)];
  const void* shard = shards_ ? at(shards_, place.shard_offset) : nullptr;
  // Stage 3: the group's fetch (offload.param) and all-gather for a lease or a prefetch; n: the group.
  const StreamSpan span(stream_, "gather group", trace::Lane::comm_stream, g);
  const std::size_t slice = host_comm_ ? place.padded / static_cast<std::size_t>(host_comm_->size()) : 0;
  char* const secondary = host_comm_ ? at(secondary_, secondary_at_[static_cast<std::size_t>(g)]) : nullptr;
  if (host_comm_ && secondary_fresh_[static_cast<std::size_t>(g)]) {
    // The host's ranks hold the group's slices in rank order: gathered, they are the group.
    host_comm_->all_gather(secondary, s.buffer.data(), slice, dtype_, stream_);
  } else {
    if (offloaded(g)) {
      offload_->fetch(g, s.shard.data(), static_cast<std::size_t>(slot), stream_);
      shard = s.shard.data();
    }
    gather_.all_gather(shard, s.buffer.data(), place.shard, stream_);
    if (host_comm_) {
      device_.copy_async(secondary, s.buffer.as<char>() + bytes(static_cast<std::size_t>(host_comm_->rank()) * slice),
                         bytes(slice), stream_);
      secondary_fresh_[static_cast<std::size_t>(g)] = true;
    }
  }
  stream_.record(*s.free_after);
}

// Before a lease's gather: when prefetching has filled every buffer with groups nobody holds yet
// (the trainer left the previous step's order), gives up the one needed last; it is gathered again
// when its turn comes. Leased buffers are never taken.
void ParamGather::make_room_for_lease() {
  if (gathered_.any_free()) return;
  const auto upcoming = previous_order_.begin() + static_cast<std::ptrdiff_t>(order_position_);
  std::size_t victim = gathered_.size();
  std::ptrdiff_t victim_turn = -1;
  for (std::size_t i = 0; i < gathered_.size(); ++i) {
    const int owner = gathered_[i].owner;
    if (leases_[static_cast<std::size_t>(owner)] > 0) continue;
    const std::ptrdiff_t turn = std::find(upcoming, previous_order_.end(), owner) - upcoming;
    if (turn > victim_turn) {
      victim = i;
      victim_turn = turn;
    }
  }
  if (victim == gathered_.size()) return;  // every buffer is leased: take() says so
  gathered_of_[static_cast<std::size_t>(gathered_[victim].owner)] = -1;
  gathered_.give_back(static_cast<int>(victim));  // take() waits for its gather to finish before reuse
}

// Stage 3: gathers the next groups of the previous step's order, within prefetch_bytes.
void ParamGather::prefetch() {
  std::size_t budget = prefetch_bytes_;
  for (std::size_t i = order_position_; i < previous_order_.size(); ++i) {
    const int g = previous_order_[i];
    const std::size_t size = bytes(layout_.group(g).padded);
    if (resident_[static_cast<std::size_t>(g)] || gathered_of_[static_cast<std::size_t>(g)] >= 0) continue;
    if (size > budget || !gathered_.any_free()) break;
    start_gather(g);
    budget -= size;
  }
}

char* ParamGather::shard_out(int g) const {
  const auto& place = layout_.group(g);
  if (!sharded()) return at(full_params_, place.full_offset + shard_begin(g));
  if (!offload_) return at(shards_, place.shard_offset);
  if (offloaded(g)) return nullptr;
  return resident_[static_cast<std::size_t>(g)].as<char>() + bytes(shard_begin(g));
}

void ParamGather::finish_updates() {
  if (offload_) offload_->finish_updates();
}

void ParamGather::set_tensor(std::size_t tensor, const float* values) {
  const auto& t = layout_.tensor(tensor);
  const auto& g = layout_.group(t.group);
  // This rank's shard of the segment: [begin, end) in segment elements.
  const std::size_t begin = shard_begin(t.group), end = begin + g.shard;
  drop_prefetched();  // a prefetched copy of this group would hold the old values
  for (std::size_t first = 0; first < t.numel; first += staging_.elements()) {
    const std::size_t count = std::min(staging_.elements(), t.numel - first);
    // Through pinned memory; 16-bit parameters cross to the device as 16 bits, converted on the
    // host exactly as the GPU cast would.
    if (dtype_ == DType::f32) std::memcpy(staging_.f32(), values + first, count * sizeof(float));
    else
      for (std::size_t i = 0; i < count; ++i) store_from_float(staging_.param(), dtype_, i, values[first + i]);
    const char* param = static_cast<const char*>(staging_.param());
    // The chunk in segment elements, and its part inside this rank's shard.
    const std::size_t lo = t.offset + first, hi = lo + count;
    const std::size_t mine_lo = std::max(lo, begin), mine_hi = std::min(hi, end);
    const bool has_mine = mine_lo < mine_hi;
    if (!sharded()) {
      device_.copy_async(at(full_params_, g.full_offset + lo), param, bytes(count), stream_);
    } else {
      if (has_mine && offloaded(t.group))
        offload_->write(t.group, mine_lo - begin, param + bytes(mine_lo - lo), mine_hi - mine_lo);
      else if (has_mine && shards_)
        device_.copy_async(at(shards_, g.shard_offset + (mine_lo - begin)), param + bytes(mine_lo - lo),
                           bytes(mine_hi - mine_lo), stream_);
      if (const DeviceBuffer& full = resident_[static_cast<std::size_t>(t.group)])
        device_.copy_async(full.as<char>() + bytes(lo), param, bytes(count), stream_);
    }
    stream_.synchronize();  // the staging is refilled next
  }
}

void ParamGather::write_shard(int g, std::size_t in_shard, const float* values, std::size_t n) {
  for (std::size_t first = 0; first < n; first += staging_.elements()) {
    const std::size_t count = std::min(staging_.elements(), n - first);
    const void* source = values + first;
    if (dtype_ != DType::f32) {
      for (std::size_t i = 0; i < count; ++i) store_from_float(staging_.param(), dtype_, i, values[first + i]);
      source = staging_.param();
    }
    if (offloaded(g)) {
      offload_->write(g, in_shard + first, source, count);
    } else {
      device_.copy_async(shard_out(g) + bytes(in_shard + first), source, bytes(count), stream_);
      stream_.synchronize();
    }
  }
}

void ParamGather::drop_prefetched() {
  std::fill(secondary_fresh_.begin(), secondary_fresh_.end(), false);
  for (std::size_t i = 0; i < gathered_.size(); ++i) {
    const int owner = gathered_[i].owner;
    if (owner < 0 || leases_[static_cast<std::size_t>(owner)] > 0) continue;
    gathered_of_[static_cast<std::size_t>(owner)] = -1;
    gathered_.give_back(static_cast<int>(i));  // take() waits for its gather before reuse
  }
}

void ParamGather::gather_all() {
  // The new shards make every gathered copy stale: one prefetched in the step but not leased in it
  // (the trainer left the recorded order) would otherwise be found by the group's next lease.
  drop_prefetched();
  {
    const StreamSpan span(stream_, "all-gather", trace::Lane::comm_stream);
    for (const GatherRun& run : plan_.gather.gather_runs) {
      if (run.groups.size() == 1) gather_in_place(run.groups.front());
      else gather_through_bucket(run);
    }
  }
  stream_.synchronize();
}

// One group's all-gather straight into its full segment: no copies beyond bringing the updated
// shard to its place in the segment (stage 3 updates a separate shard buffer).
void ParamGather::gather_in_place(int g) {
  const auto& place = layout_.group(g);
  char* const whole = full(g);
  char* const own = whole + bytes(shard_begin(g));
  const char* const updated = shard_out(g);
  if (updated != own) device_.copy_async(own, updated, bytes(place.shard), stream_);
  if (layout_.partitions() > 1) comm_.all_gather(own, whole, place.shard, dtype_, stream_);
}

// Several groups in one all-gather: the bucket holds rank r's shards of the run's groups, one after
// another, at r * run.shard; each group's own shard is copied in, every rank's piece of it copied
// out to its full segment. The copies cost far less than a collective per group, and the runs are
// small (they fit in buckets.allgather), so the bytes copied stay small too.
void ParamGather::gather_through_bucket(const GatherRun& run) {
  char* const bucket = gather_bucket_.as<char>();
  char* const mine = bucket + bytes(static_cast<std::size_t>(rank_) * run.shard);
  std::size_t offset = 0;  // of the group's shard in a rank's piece of the bucket
  for (int g : run.groups) {
    device_.copy_async(mine + bytes(offset), shard_out(g), bytes(layout_.group(g).shard), stream_);
    offset += layout_.group(g).shard;
  }
  comm_.all_gather(mine, bucket, run.shard, dtype_, stream_);
  offset = 0;
  for (int g : run.groups) {
    const std::size_t shard = layout_.group(g).shard;
    char* const whole = full(g);
    const char* const updated = shard_out(g);
    for (std::size_t r = 0; r < static_cast<std::size_t>(layout_.partitions()); ++r) {
      char* const piece = whole + bytes(r * shard);
      if (piece != updated) device_.copy_async(piece, bucket + bytes(r * run.shard + offset), bytes(shard), stream_);
    }
    offset += shard;
  }
}

void ParamGather::end_step() {
  std::swap(previous_order_, order_);  // keeps both vectors' capacity
  order_.clear();
  order_position_ = 0;
}

}  // namespace zest::engine
