#include "engine/grad_buckets.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "optim/adam_math.hpp"
#include "runtime/stream_span.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Both buckets are taken only while the trainer holds gradients it has not handed over.
constexpr const char* kRemedy = "call grads_ready(group) once a group's gradients are written, before asking "
                                "for those of more groups";

}  // namespace

GradBucketsOptions grad_buckets_options(const Config& config) {
  return {config.stage, config.precision.dtype, config.buckets.overlap_comm, config.gradient_accumulation_steps,
          config.optimizer.threads};
}

GradBuckets::GradBuckets(const GradBucketsOptions& options, Device& device, Communicator& comm, Stream& comm_stream,
                         DeviceMath& math, const Layout& layout, const MemoryPlan& plan, HostStaging& staging)
    : device_(device),
      comm_(comm),
      stream_(comm_stream),
      math_(math),
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
  reductions_.assign(groups, 0);
  final_now_.reserve(groups);
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
  {
    // On the stream, from the collective to the gradient in its shard; n: the bucket's first group.
    const StreamSpan span(stream_, "reduce", trace::Lane::comm_stream,
                          b.entries.empty() ? -1 : b.entries.front().group);
    if (!full_grads() && b.entries.size() == 1) {
      const int g = b.entries.front().group;
      comm_.reduce_scatter(data, data + bytes(shard_begin(g)), layout_.group(g).shard, dtype_, ReduceOp::sum, stream_);
    } else if (comm_.size() > 1) {
      comm_.all_reduce(data, data, b.used, dtype_, ReduceOp::sum, stream_);
    }
    std::size_t landed = 0;
    final_now_.clear();
    for (const Bucket::Entry& e : b.entries) {
      const int reductions = ++reductions_[static_cast<std::size_t>(e.group)];
      if (watcher_ && reductions > micro_batches_) watcher_->changing(e.group);
      if (reductions == micro_batches_) final_now_.push_back(e.group);
      const auto& place = layout_.group(e.group);
      const bool first = !summed_[static_cast<std::size_t>(e.group)];
      summed_[static_cast<std::size_t>(e.group)] = true;
      char* const reduced = data + bytes(e.offset);
      if (full_grads())
        accumulate(accumulated() + bytes(place.full_offset), reduced, place.padded, first, landed);
      else
        accumulate(accumulated() + bytes(place.shard_offset), reduced + bytes(shard_begin(e.group)), place.shard, first,
                   landed);
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
  b.sealed = false;
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

const char* GradBuckets::reduced(int g) const {
  const auto& place = layout_.group(g);
  return accumulated() + bytes(full_grads() ? place.full_offset + shard_begin(g) : place.shard_offset);
}

void GradBuckets::grad_stats(GradStatsScalars* out) {
  spans_.clear();
  for (int g = 0; g < layout_.group_count(); ++g)
    if (accumulated_[static_cast<std::size_t>(g)]) spans_.push_back({reduced(g), layout_.group(g).shard});
  if (!host_grads_) return math_.grad_stats(spans_, dtype_, out, stream_);
  // The ranks agree on the statistics with a collective over device memory: the host's result
  // joins the device's scalars.
  auto* host = static_cast<GradStatsScalars*>(staging_.scalars());
  host_math_->grad_stats(spans_, dtype_, host, stream_);
  device_.copy_async(out, host, sizeof(GradStatsScalars), stream_);
}

bool GradBuckets::any_grad() const {
  return std::any_of(accumulated_.begin(), accumulated_.end(), [](bool a) { return a; });
}

void GradBuckets::end_step() {
  std::fill(accumulated_.begin(), accumulated_.end(), false);
  std::fill(summed_.begin(), summed_.end(), false);
  std::fill(reductions_.begin(), reductions_.end(), 0);
  if (!host_grads_) return device_.memset_async(grads_.data(), 0, grads_.bytes(), stream_);
  // Ordered after the step's reads like the device's memset: a host task on the same stream.
  stream_.host_task([data = host_grads_.data(), n = host_grads_.bytes()] { std::memset(data, 0, n); });
}

Slot& GradBuckets::borrow(int group) { return slots_[static_cast<std::size_t>(slots_.take(group))]; }

void GradBuckets::give_back(Slot& slot) {
  stream_.record(*slot.free_after);
  slot.owner = -1;
}

}  // namespace zest::engine
