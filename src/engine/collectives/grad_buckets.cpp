#include "engine/collectives/grad_buckets.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "optim/adam_math.hpp"
#include "runtime/device/stream_span.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Both buckets are taken only while the trainer holds gradients it has not handed over.
constexpr const char* kRemedy = "call grads_ready(group) once a group's gradients are written, before asking "
                                "for those of more groups";

}  // namespace

BucketState checked_move(BucketState from, BucketState to) {
  static constexpr const char* kNames[] = {"idle", "filling", "sealed"};
  const bool follows = (from == BucketState::idle && to == BucketState::filling) ||
                       (from == BucketState::filling && to == BucketState::sealed) ||
                       (from == BucketState::sealed && to == BucketState::idle);
  if (!follows)
    throw Error(fmt::format("GradBuckets: a bucket went from {} to {}: an internal error of zest's; please report it",
                            kNames[static_cast<int>(from)], kNames[static_cast<int>(to)]));
  return to;
}

GradBucketsOptions grad_buckets_options(const Config& config) {
  return {config.stage, config.precision.dtype, config.buckets.overlap_comm, config.gradient_accumulation_steps,
          config.optimizer.threads};
}

GradBuckets::GradBuckets(const GradBucketsOptions& options, Device& device, Communicator& comm, Stream& comm_stream,
                         DeviceMath& math, const Layout& layout, const ReducePlan& plan, HostStaging& staging,
                         QuantizedReduceScatter* quantized)
    : device_(device),
      comm_(comm),
      stream_(comm_stream),
      math_(math),
      exact_(comm, options.dtype),
      reduce_scatter_(options.stage >= 1 && quantized ? static_cast<ShardReduceScatter&>(*quantized) : exact_),
      staging_(staging),
      layout_(layout),
      stage_(options.stage),
      rank_(comm.rank()),
      dtype_(options.dtype),
      overlap_(options.overlap_comm),
      slots_("gradient bucket", kRemedy),
      micro_batches_(options.micro_batches) {
  const auto groups = static_cast<std::size_t>(layout.group_count());
  grads_ = device.allocate(plan.grads, MemoryCategory::grads);
  if (plan.grads_on_host) {
    host_grads_ = device.allocate_pinned(plan.host_grads, HostPurpose::grad_shards);
    landing_ = device.allocate_pinned(plan.grad_landing, HostPurpose::grad_shards);
    std::memset(host_grads_.data(), 0, host_grads_.bytes());
    // The same arithmetic as the cpu backend's device math (bit for bit the device's add and
    // statistics there); on the cpu backend it is that math.
    if (device.type() == DeviceType::cpu) {
      host_math_ = &math;
    } else {
      // Only its accumulate and statistics run here, so Adam's hyper-parameters are not its concern.
      own_host_math_ = make_cpu_device_math(optim::AdamHyperParams{}, options.host_threads, device.host_cpus());
      host_math_ = own_host_math_.get();
    }
  }
  spans_.reserve(groups);
  for (std::size_t i = 0; i < ReducePlan::kStagingSlots; ++i)
    slots_.add(Slot{device.allocate(plan.staging_slot, MemoryCategory::buffers), device.create_event(), -1, {}});
  buckets_.resize(slots_.size());
  for (Bucket& b : buckets_) b.entries.reserve(groups);
  limit_ = plan.bucket_fill;
  smallest_group_ = layout.group(0).padded;
  for (int g = 1; g < layout.group_count(); ++g) smallest_group_ = std::min(smallest_group_, layout.group(g).padded);
  groups_.resize(groups);
  asked_.assign(layout.tensor_count(), false);
  read_ = device.create_event();
  final_now_.reserve(groups);
  if (host_grads_ || device.host_accessible()) {
    group_stats_math_ = host_grads_ ? host_math_ : &math_;
    group_spans_.resize(groups);
    for (int g = 0; g < layout.group_count(); ++g)
      group_spans_[static_cast<std::size_t>(g)] = {reduced(g), layout.group(g).shard};
    group_stats_.resize(groups);
    stats_order_.reserve(groups);
  }
  // Zeros where the step reads before anything is written: unwritten gradients, padding.
  if (grads_) device.memset_async(grads_.data(), 0, grads_.bytes(), stream_);
  for (const Slot& slot : slots_) device.memset_async(slot.buffer.data(), 0, slot.buffer.bytes(), stream_);
  if (plan.reduce_pack > 0) pack_ = device.allocate(plan.reduce_pack, MemoryCategory::buffers);
  parts_.reserve(groups);
}

char* GradBuckets::grad(std::size_t t) {
  const TensorPlace& tensor = layout_.tensor(t);
  const int g = tensor.group;
  const GroupState& group = groups_[static_cast<std::size_t>(g)];
  if (group.in_place || (group.slot < 0 && writes_in_place(g))) {
    asked_[t] = true;
    return grad_in_place(g) + bytes(tensor.offset);
  }
  if (group.slot < 0) place(g);
  const Slot& slot = slots_[static_cast<std::size_t>(group.slot)];
  return static_cast<char*>(slot.buffer.data()) + bytes(group.staged_at + tensor.offset);
}

char* GradBuckets::grad_in_place(int g) {
  GroupState& group = groups_[static_cast<std::size_t>(g)];
  if (!group.in_place) {
    // The last step may still be reading the accumulated gradient on the comm stream.
    if (!read_waited_) read_->synchronize();
    read_waited_ = true;
    group.in_place = true;
  }
  return accumulated() + bytes(shard_at(g));
}

// Appends the group to the open bucket; a group that does not fit seals it and opens another.
void GradBuckets::place(int g) {
  const std::size_t need = layout_.group(g).padded;
  if (open_ >= 0 && buckets_[static_cast<std::size_t>(open_)].used + need > limit_) seal(open_);
  // A free slot is all zeros (zeroed after each reduction, on the comm stream), so padding and
  // tensors the trainer leaves unwritten reduce as zeros.
  if (open_ < 0) {
    open_ = slots_.take(g);
    Bucket& opened = buckets_[static_cast<std::size_t>(open_)];
    opened.state = checked_move(opened.state, BucketState::filling);
  }
  const int slot = open_;
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  b.entries.push_back({g, b.used});
  groups_[static_cast<std::size_t>(g)].slot = slot;
  groups_[static_cast<std::size_t>(g)].staged_at = b.used;
  b.used += need;
  ++b.writing;
  // No group fits in what is left: reduce as soon as the groups in it are ready, not at the next
  // grad().
  if (b.used + smallest_group_ > limit_) seal(slot);
}

void GradBuckets::seal(int slot) {
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  b.state = checked_move(b.state, BucketState::sealed);
  if (open_ == slot) open_ = -1;
  if (b.writing == 0) reduce(slot);
}

void GradBuckets::ready(int g) {
  GroupState& group = groups_[static_cast<std::size_t>(g)];
  if (group.in_place) return ready_in_place(g);
  const int slot = std::exchange(group.slot, -1);
  group.accumulated = true;
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  if (--b.writing == 0 && b.state == BucketState::sealed) reduce(slot);
}

// What a bucket's reduction would leave in a world of one: the group's sum in the accumulated
// gradient, zeros for the tensors not written (a free bucket is all zeros, and so is the padding,
// which nothing writes).
void GradBuckets::ready_in_place(int g) {
  GroupState& state = groups_[static_cast<std::size_t>(g)];
  state.in_place = false;
  const GroupPlace& group = layout_.group(g);
  for (std::size_t t = group.first_tensor; t < group.end_tensor; ++t) {
    const TensorPlace& tensor = layout_.tensor(t);
    if (!asked_[t]) clear_accumulated(accumulated() + bytes(shard_at(g) + tensor.offset), tensor.numel);
    asked_[t] = false;
  }
  state.accumulated = true;
  state.summed = true;
  if (++state.reductions >= micro_batches_) group_stats(g);
}

// After the group's last reduction of the step (or a further one: a trainer's extra micro-batch
// computes them again), on the stream.
void GradBuckets::group_stats(int g) {
  if (group_stats_math_ == nullptr) return;
  group_stats_math_->grad_stats({&group_spans_[static_cast<std::size_t>(g)], 1}, dtype_,
                                &group_stats_[static_cast<std::size_t>(g)], stream_);
  groups_[static_cast<std::size_t>(g)].stats_done = true;
}

void GradBuckets::flush() {
  for (int g = 0; g < layout_.group_count(); ++g)
    if (requested(g))
      throw Error(
          fmt::format("Engine::step: the gradient of group {} was requested but grads_ready({}) was not called; call "
                      "it once the group's gradients are written",
                      g, g));
  if (open_ >= 0) seal(open_);
  // A group without a gradient this step is stepped with zeros (momentum decays, weight decay
  // applies); what the accumulated gradient holds there is the last step's.
  for (int g = 0; g < layout_.group_count(); ++g)
    if (!groups_[static_cast<std::size_t>(g)].accumulated)
      clear_accumulated(accumulated() + bytes(shard_at(g)), layout_.group(g).shard);
}

// The collective over a bucket: stage 0 all-reduces it (every rank updates every parameter); stages
// 1-3 reduce-scatter it, since each rank updates only its shard (ZeRO's byte count: an all-reduce
// moves twice a reduce-scatter's). A bucket of one group is reduce-scattered in place; several
// groups are packed rank-major first (rank r's shards of each group, one after another), so one
// collective serves them all, and each rank's shards arrive together in its piece of the pack.
// Leaves in `parts_` where this rank's reduced part of each entry is (entry order).
void GradBuckets::collect(const Bucket& b, char* data) {
  parts_.clear();
  // Without a pack (the plan saw no two groups fit a bucket; a group reduced twice in one, past
  // gradient_accumulation_steps) each group is reduce-scattered alone.
  const bool pack = stage_ >= 1 && comm_.size() > 1 && b.entries.size() > 1 && pack_;
  if (!pack) {
    if (stage_ == 0 && comm_.size() > 1) comm_.all_reduce(data, data, b.used, dtype_, ReduceOp::sum, stream_);
    for (const Bucket::Entry& e : b.entries) {
      char* const mine = data + bytes(e.offset + shard_begin(e.group));
      if (stage_ >= 1 && comm_.size() > 1)
        reduce_scatter_.reduce_scatter(data + bytes(e.offset), mine, layout_.group(e.group).shard, stream_);
      parts_.push_back(mine);
    }
    return;
  }
  std::size_t piece = 0;  // a rank's piece of the pack: every entry's shard
  for (const Bucket::Entry& e : b.entries) piece += layout_.group(e.group).shard;
  char* const packed = pack_.as<char>();
  const auto ranks = static_cast<std::size_t>(comm_.size());
  std::size_t at = 0;  // of the entry's shard in a piece
  for (const Bucket::Entry& e : b.entries) {
    const std::size_t shard = layout_.group(e.group).shard;
    for (std::size_t r = 0; r < ranks; ++r)
      device_.copy_async(packed + bytes(r * piece + at), data + bytes(e.offset + r * shard), bytes(shard), stream_);
    parts_.push_back(packed + bytes(static_cast<std::size_t>(rank_) * piece + at));
    at += shard;
  }
  reduce_scatter_.reduce_scatter(packed, packed + bytes(static_cast<std::size_t>(rank_) * piece), piece, stream_);
}


// One collective over the bucket (collect), then each group's part added to the accumulated
// gradient.
void GradBuckets::reduce(int slot) {
  Slot& staging = slots_[static_cast<std::size_t>(slot)];
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  char* const data = static_cast<char*>(staging.buffer.data());
  {
    // On the stream, from the collective to the gradient in its shard; n: the bucket's first group.
    const StreamSpan span(stream_, "reduce", trace::Lane::comm_stream,
                          b.entries.empty() ? -1 : b.entries.front().group);
    collect(b, data);
    std::size_t landed = 0;
    final_now_.clear();
    for (std::size_t i = 0; i < b.entries.size(); ++i) {
      const Bucket::Entry& e = b.entries[i];
      GroupState& group = groups_[static_cast<std::size_t>(e.group)];
      const int reductions = ++group.reductions;
      if (watcher_ && reductions > micro_batches_) watcher_->changing(e.group);
      if (reductions == micro_batches_) final_now_.push_back(e.group);
      const bool first = !std::exchange(group.summed, true);
      accumulate(accumulated() + bytes(shard_at(e.group)), parts_[i], layout_.group(e.group).shard, first, landed);
      if (reductions >= micro_batches_) group_stats(e.group);
    }
  }
  if (watcher_)
    for (int g : final_now_) watcher_->final(g, reduced(g));
  // Ordered after the copies to the host shard: the bucket is reused only once they are done.
  device_.memset_async(data, 0, bytes(b.used), stream_);
  stream_.record(*staging.free_after);
  slots_.give_back(slot);
  b.entries.clear();
  b.used = 0;
  b.state = checked_move(b.state, BucketState::idle);
  if (!overlap_) stream_.synchronize();
}

void GradBuckets::accumulate(char* dst, const char* src, std::size_t count, bool first, std::size_t& landed) {
  if (!host_grads_) return math_.accumulate(dst, src, count, dtype_, first, stream_);
  if (first) return device_.copy_async(dst, src, bytes(count), stream_);
  // The host cannot add from device memory: the part lands in pinned memory first. A bucket's parts
  // take consecutive places, and the next bucket's copies run after these adds (same stream).
  char* const land = landing_.as<char>() + bytes(landed);
  landed += count;
  device_.copy_async(land, src, bytes(count), stream_);
  host_math_->accumulate(dst, land, count, dtype_, false, stream_);
}

const char* GradBuckets::reduced(int g) const { return accumulated() + bytes(shard_at(g)); }

std::size_t GradBuckets::shard_at(int g) const {
  const auto& place = layout_.group(g);
  return full_grads() ? place.full_offset + shard_begin(g) : place.shard_offset;
}

void GradBuckets::grad_stats(GradStatsScalars* out) {
  if (group_stats_math_ == nullptr) {
    spans_.clear();
    for (int g = 0; g < layout_.group_count(); ++g)
      if (groups_[static_cast<std::size_t>(g)].accumulated) spans_.push_back({reduced(g), layout_.group(g).shard});
    return math_.grad_stats(spans_, dtype_, out, stream_);
  }
  // Groups reduced fewer times than gradient_accumulation_steps have none yet.
  stats_order_.clear();
  for (int g = 0; g < layout_.group_count(); ++g) {
    if (!groups_[static_cast<std::size_t>(g)].accumulated) continue;
    if (!groups_[static_cast<std::size_t>(g)].stats_done) group_stats(g);
    stats_order_.push_back(g);
  }
  // A host shard's statistics reach the device's scalars, over which the ranks agree, by a copy.
  auto* const sum = host_grads_ ? static_cast<GradStatsScalars*>(staging_.scalars()) : out;
  stream_.host_task([this, sum] {
    double sum_squares = 0;
    bool nonfinite = false;
    for (int g : stats_order_) {
      sum_squares += group_stats_[static_cast<std::size_t>(g)].sum_squares;
      nonfinite = nonfinite || group_stats_[static_cast<std::size_t>(g)].nonfinite != 0;
    }
    *sum = {{nonfinite ? 0.0f : static_cast<float>(sum_squares), nonfinite ? 1.0f : 0.0f}, sum_squares,
            nonfinite ? 1 : 0};
  });
  if (host_grads_) device_.copy_async(out, sum, sizeof(GradStatsScalars), stream_);
}

bool GradBuckets::any_grad() const {
  return std::any_of(groups_.begin(), groups_.end(), [](const GroupState& g) { return g.accumulated; });
}

// Nothing is cleared: each group's next reduction (or write in place) overwrites its accumulated
// gradient, and flush() clears those of groups that get none.
void GradBuckets::end_step() {
  for (GroupState& g : groups_) {
    g.accumulated = g.summed = g.stats_done = false;
    g.reductions = 0;
  }
  stream_.record(*read_);
  read_waited_ = false;
}

void GradBuckets::clear_accumulated(char* at, std::size_t elements) {
  if (!host_grads_) return device_.memset_async(at, 0, bytes(elements), stream_);
  // Ordered after the step's reads like the device's memset: a host task on the same stream.
  stream_.host_task([at, n = bytes(elements)] { std::memset(at, 0, n); });
}

Slot& GradBuckets::borrow(int group) { return slots_[static_cast<std::size_t>(slots_.take(group))]; }

void GradBuckets::give_back(Slot& slot) {
  stream_.record(*slot.free_after);
  slot.owner = -1;
}

}  // namespace zest::engine
