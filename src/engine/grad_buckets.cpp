#include "engine/grad_buckets.hpp"

#include <algorithm>
#include <string>

#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Both buckets are taken only while the trainer holds gradients it has not handed over.
constexpr const char* kRemedy = "call grads_ready(group) once a group's gradients are written, before asking "
                                "for those of more groups";

}  // namespace

GradBuckets::GradBuckets(const Config& config, Device& device, Communicator& comm, Stream& comm_stream,
                         DeviceMath& math, const Layout& layout, const MemoryPlan& plan)
    : device_(device),
      comm_(comm),
      stream_(comm_stream),
      math_(math),
      layout_(layout),
      stage_(config.stage),
      rank_(comm.rank()),
      dtype_(config.precision.dtype),
      overlap_(config.buckets.overlap_comm),
      slots_("gradient bucket", kRemedy) {
  const auto groups = static_cast<std::size_t>(layout.group_count());
  grads_ = device.allocate(plan.grads, MemoryCategory::grads);
  for (std::size_t i = 0; i < MemoryPlan::kStagingSlots; ++i)
    slots_.add(Slot{device.allocate(plan.staging_slot, MemoryCategory::buffers), device.create_event(), -1, {}});
  buckets_.resize(slots_.size());
  for (Bucket& b : buckets_) b.entries.reserve(groups);
  limit_ = plan.bucket_fill;
  smallest_group_ = layout.group(0).padded;
  for (int g = 1; g < layout.group_count(); ++g) smallest_group_ = std::min(smallest_group_, layout.group(g).padded);
  staging_of_.assign(groups, -1);
  staged_at_.assign(groups, 0);
  accumulated_.assign(groups, false);
  summed_.assign(groups, false);
  // Zeros where the step reads before anything is written: unwritten gradients, padding.
  if (grads_) device.memset_async(grads_.data(), 0, grads_.bytes(), stream_);
  for (const Slot& slot : slots_) device.memset_async(slot.buffer.data(), 0, slot.buffer.bytes(), stream_);
}

char* GradBuckets::grad(int g) {
  if (staging_of_[static_cast<std::size_t>(g)] < 0) place(g);
  const Slot& slot = slots_[static_cast<std::size_t>(staging_of_[static_cast<std::size_t>(g)])];
  return static_cast<char*>(slot.buffer.data()) + bytes(staged_at_[static_cast<std::size_t>(g)]);
}

// Appends the group to the open bucket; a group that does not fit seals it and opens another.
void GradBuckets::place(int g) {
  const std::size_t need = layout_.group(g).padded;
  if (open_ >= 0 && buckets_[static_cast<std::size_t>(open_)].used + need > limit_) seal(open_);
  // A free slot is all zeros (zeroed after each reduction, on the comm stream), so padding and
  // tensors the trainer leaves unwritten reduce as zeros.
  if (open_ < 0) open_ = slots_.take(g);
  const int slot = open_;
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  b.entries.push_back({g, b.used});
  staging_of_[static_cast<std::size_t>(g)] = slot;
  staged_at_[static_cast<std::size_t>(g)] = b.used;
  b.used += need;
  ++b.writing;
  // No group fits in what is left: reduce as soon as the groups in it are ready, not at the next
  // grad().
  if (b.used + smallest_group_ > limit_) seal(slot);
}

void GradBuckets::seal(int slot) {
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  b.sealed = true;
  if (open_ == slot) open_ = -1;
  if (b.writing == 0) reduce(slot);
}

void GradBuckets::ready(int g) {
  const int slot = staging_of_[static_cast<std::size_t>(g)];
  staging_of_[static_cast<std::size_t>(g)] = -1;
  accumulated_[static_cast<std::size_t>(g)] = true;
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  if (--b.writing == 0 && b.sealed) reduce(slot);
}

void GradBuckets::flush() {
  for (std::size_t g = 0; g < staging_of_.size(); ++g)
    if (staging_of_[g] >= 0)
      throw Error(std::string("Engine::step: the gradient of group ").append(std::to_string(g))
                      .append(" was requested but grads_ready(").append(std::to_string(g))
                      .append(") was not called; call it once the group's gradients are written"));
  if (open_ >= 0) seal(open_);
}

// One collective over the bucket's used span, then each group added to the accumulated gradient.
// A bucket of one group is reduce-scattered where only the shard is kept. A bucket of several
// groups is all-reduced and each rank takes its shards from the result: a reduce-scatter would need
// the groups' shards packed rank-major, i.e. a second bucket-sized buffer and a copy each way, while
// the all-reduce needs no memory beyond the plan. It moves about twice a reduce-scatter's bytes,
// which matters only for large groups, and those fill a bucket alone: several groups share one only
// when each is smaller than buckets.reduce, where the collective's latency dominates.
void GradBuckets::reduce(int slot) {
  Slot& staging = slots_[static_cast<std::size_t>(slot)];
  Bucket& b = buckets_[static_cast<std::size_t>(slot)];
  char* const data = static_cast<char*>(staging.buffer.data());
  if (!full_grads() && b.entries.size() == 1) {
    const int g = b.entries.front().group;
    comm_.reduce_scatter(data, data + bytes(shard_begin(g)), layout_.group(g).shard, dtype_, ReduceOp::sum, stream_);
  } else if (comm_.size() > 1) {
    comm_.all_reduce(data, data, b.used, dtype_, ReduceOp::sum, stream_);
  }
  for (const Bucket::Entry& e : b.entries) {
    const auto& place = layout_.group(e.group);
    const bool first = !summed_[static_cast<std::size_t>(e.group)];
    summed_[static_cast<std::size_t>(e.group)] = true;
    char* const reduced = data + bytes(e.offset);
    if (full_grads())
      math_.accumulate(grads_.as<char>() + bytes(place.full_offset), reduced, place.padded, dtype_, first, stream_);
    else
      math_.accumulate(grads_.as<char>() + bytes(place.shard_offset), reduced + bytes(shard_begin(e.group)),
                       place.shard, dtype_, first, stream_);
  }
  device_.memset_async(data, 0, bytes(b.used), stream_);
  stream_.record(*staging.free_after);
  slots_.give_back(slot);
  b.entries.clear();
  b.used = 0;
  b.sealed = false;
  if (!overlap_) stream_.synchronize();
}

const char* GradBuckets::reduced(int g) const {
  const auto& place = layout_.group(g);
  return grads_.as<char>() + bytes(full_grads() ? place.full_offset + shard_begin(g) : place.shard_offset);
}

bool GradBuckets::any_grad() const {
  return std::any_of(accumulated_.begin(), accumulated_.end(), [](bool a) { return a; });
}

void GradBuckets::end_step() {
  std::fill(accumulated_.begin(), accumulated_.end(), false);
  std::fill(summed_.begin(), summed_.end(), false);
  device_.memset_async(grads_.data(), 0, grads_.bytes(), stream_);
}

Slot& GradBuckets::borrow(int group) { return slots_[static_cast<std::size_t>(slots_.take(group))]; }

void GradBuckets::give_back(Slot& slot) {
  stream_.record(*slot.free_after);
  slot.owner = -1;
}

}  // namespace zest::engine
