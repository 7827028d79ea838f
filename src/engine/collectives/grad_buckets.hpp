// Gradient buckets (config buckets.reduce): where backward writes gradients, and their reduction
// across ranks into the accumulated gradient the step reads.
//
// Groups are placed in the open bucket in the order the trainer asks for their gradients (backward
// order), as long as they fit in buckets.reduce (a larger group fills a bucket alone), so many small
// layers cost one collective instead of one each: per-collective latency, not bandwidth, dominates
// small messages. A bucket is sealed when the next group does not fit, when no group could fit in
// what is left, or at step(); a sealed bucket whose groups are all ready is reduced at once on the
// comm stream (while backward goes on), added to the accumulated gradient (the first reduction of
// a step overwrites it) and zeroed for its next use. Stage 0 all-reduces and accumulates every group
// in full; stages 1-3 reduce-scatter and accumulate this rank's shard (stage 1 at its place in a
// full-sized gradient, ZeRO-1's memory; stages 2-3 in a shard-sized one). Two buckets exist
// (ReducePlan::kStagingSlots). A world of one has nothing to reduce: a step's first contribution of
// each group is written straight into the accumulated gradient, and only later micro-batches take
// buckets.
//
// With the whole optimizer offloaded at stages 2-3 (ReducePlan::grads_on_host) the accumulated
// shard lives in pinned host memory, where the CPU Adam reads it: after each bucket's reduction its
// shard parts go device -> host on the comm stream (a second micro-batch's through a landing
// buffer, added by the cpu math's host task, the same arithmetic as the device's add), before the
// bucket is zeroed and freed, so the device holds only the buckets in flight. The step asks this
// class for the statistics instead of asking where the gradients are.
//
// Stages 1-3 reduce-scatter through a ShardReduceScatter: the communicator's (ExactReduceScatter),
// or with comm.quantize.grads the QuantizedReduceScatter given (codes on the wire, sums in fp32).
// Threading: the engine's host thread; the work runs on the comm stream.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "engine/math/device_math.hpp"
#include "engine/plan/host_staging.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/collectives/quantized_collectives.hpp"
#include "engine/plan/slot_pool.hpp"
#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"

namespace zest::engine {

// Told, on the host thread, about the host gradient shard (plan.grads_on_host) as reductions are
// enqueued on the comm stream: final(g, shard) once group g's gradient_accumulation_steps-th
// reduction of the step is (work enqueued on the stream after the call runs after its shard is
// complete at `shard`); changing(g) before a further one is (its shard changes after that point).
class ShardWatcher {
 public:
  virtual ~ShardWatcher() = default;
  virtual void final(int g, const char* shard) = 0;
  virtual void changing(int g) = 0;
};

// A bucket's life: idle (free, all zeros) -> filling (grad() places groups in it) -> sealed (takes
// no more groups; reduced as soon as none is being written) -> idle (the reduction frees it).
enum class BucketState { idle, filling, sealed };
// `to`, where it follows `from`; otherwise throws Error (an internal error of zest's).
BucketState checked_move(BucketState from, BucketState to);

// What GradBuckets takes from the config.
struct GradBucketsOptions {
  int stage = 0;
  DType dtype = DType::f32;            // precision.dtype: of the gradients and their reductions
  bool overlap_comm = true;            // buckets.overlap_comm
  int micro_batches = 1;               // gradient_accumulation_steps
  int host_threads = 0;                // optimizer.threads: the host math's, for a host shard on a GPU
};
GradBucketsOptions grad_buckets_options(const Config& config);

class GradBuckets {
 public:
  // Allocates the accumulated gradient (plan.grads on the device, or plan.host_grads and
  // plan.grad_landing pinned) and the buckets (plan.staging_slot each), zeroed. `staging`: its
  // scalars are where the host computes the statistics of a host shard. `quantized` (null: exact)
  // must outlive this.
  GradBuckets(const GradBucketsOptions& options, Device& device, Communicator& comm, Stream& comm_stream,
              DeviceMath& math, const Layout& layout, const ReducePlan& plan, HostStaging& staging,
              QuantizedReduceScatter* quantized = nullptr);

  // Where tensor t's gradient of this micro-batch is written (overwrite it), at its place in its
  // group's segment: in the open bucket, taken on the group's first call after its last ready();
  // or, in a world of one, for the group's first contribution of a step, in the accumulated
  // gradient itself (there is nothing to reduce: no bucket, no copy out of it, no clearing of it).
  // Either way a tensor of the group not asked for before ready() counts as a zero gradient.
  char* grad(std::size_t t);
  bool requested(int g) const { return groups_[static_cast<std::size_t>(g)].being_written(); }
  // The group's gradient is complete: its bucket is reduced once every group in it is.
  void ready(int g);
  // step(): throws Error when a group's gradient was requested and not marked ready; otherwise the
  // open bucket is sealed (and reduced).
  void flush();

  // After flush(), on the comm stream: group g's reduced, accumulated gradient of this rank's shard,
  // in device memory or, with plan.grads_on_host, pinned host memory (complete once the stream is).
  const char* reduced(int g) const;
  bool any_grad() const;
  // After flush(): the statistics of this step's gradients into `out` (device memory), on the comm
  // stream, computed where the gradients are (a host shard: by the host, then copied to `out`).
  // Where the host reads them (the cpu backend, a host shard) each group's statistics are computed
  // as soon as its last reduction of the step is (while backward goes on, its gradient still in
  // cache), and this only adds them up, in group order (the same sum as reading them all here).
  void grad_stats(GradStatsScalars* out);
  std::size_t pinned_bytes() const { return host_grads_.bytes() + landing_.bytes(); }
  // Forgets this step's gradients, after the step's reads of them are enqueued: the next reduction
  // (or write in place) of each group overwrites its accumulated gradient.
  void end_step();

  // Watches the host shard from now on (null: nobody); plan.grads_on_host only.
  void watch(ShardWatcher* watcher) { watcher_ = host_grads_ ? watcher : nullptr; }

  // Borrows a free, all-zero bucket (get_param assembles a tensor there) and gives it back (zero
  // again, its event recorded after its last use).
  Slot& borrow(int group);
  void give_back(Slot& slot);

 private:
  bool full_grads() const { return stage_ <= 1; }
  // Where this rank's shard of group g starts in the group's segment, elements.
  std::size_t shard_begin(int g) const { return layout_.shard_begin(g, rank_); }
  std::size_t bytes(std::size_t elements) const { return elements * dtype_size(dtype_); }
  // Where group g's reduced shard is kept in the accumulated gradient, elements.
  std::size_t shard_at(int g) const;
  void place(int g);
  // grad()'s in a world of one: the group's first contribution of a step goes to its accumulated
  // gradient. Not for a host shard (plan.grads_on_host): the trainer writes device memory, which a
  // bucket carries to the host.
  bool writes_in_place(int g) const {
    return comm_.size() == 1 && !host_grads_ && !groups_[static_cast<std::size_t>(g)].summed;
  }
  char* grad_in_place(int g);
  void ready_in_place(int g);
  // Zeroes `elements` of the accumulated gradient at `at`, on the comm stream.
  void clear_accumulated(char* at, std::size_t elements);
  // Where the host reads the gradients: group g's statistics, on the stream (grad_stats).
  void group_stats(int g);
  void seal(int slot);
  void reduce(int slot);
  // Adds (or, when `first`, copies) `count` reduced elements at `src` in a bucket to the
  // accumulated gradient at `dst`, on the comm stream; `landed`: what of the landing buffer this
  // bucket took so far (host shard).
  void accumulate(char* dst, const char* src, std::size_t count, bool first, std::size_t& landed);
  char* accumulated() const { return host_grads_ ? host_grads_.as<char>() : grads_.as<char>(); }

  // A group's gradient in this step: where this micro-batch's is being written, and what of it the
  // accumulated gradient holds.
  struct GroupState {
    int slot = -1;              // the bucket it is being written to, or -1
    std::size_t staged_at = 0;  // its offset in that bucket, elements
    bool in_place = false;      // being written in the accumulated gradient (grad_in_place)
    bool accumulated = false;   // has a gradient this step
    bool summed = false;        // the accumulated gradient holds its reduced sum: the next one adds to it
    int reductions = 0;         // reductions enqueued this step
    bool stats_done = false;    // group_stats_ holds this step's
    bool being_written() const { return slot >= 0 || in_place; }
  };

  // The groups whose gradients share one bucket and are reduced by one collective.
  struct Bucket {
    struct Entry {
      int group = 0;
      std::size_t offset = 0;  // of the group's padded segment in the bucket, elements
    };
    std::vector<Entry> entries;  // in the order grad() placed them; a group twice for two micro-batches
    std::size_t used = 0;        // elements
    int writing = 0;             // entries whose ready() has not come yet
    BucketState state = BucketState::idle;
  };
  // Runs the bucket's collective; parts_ then holds where this rank's reduced part of each entry is.
  void collect(const Bucket& b, char* data);

  Device& device_;
  Communicator& comm_;
  Stream& stream_;
  DeviceMath& math_;
  ExactReduceScatter exact_;
  ShardReduceScatter& reduce_scatter_;  // exact_, or comm.quantize.grads' quantized one
  HostStaging& staging_;
  const Layout& layout_;
  const int stage_;
  const int rank_;
  const DType dtype_;
  const bool overlap_;
  DeviceBuffer grads_;  // full segments (stages 0, 1) or this rank's shards (stages 2, 3)
  HostBuffer host_grads_;  // instead of grads_, with plan.grads_on_host
  HostBuffer landing_;     // a bucket's shard parts that are added to host_grads_
  // The math over host_grads_: the cpu math (the engine's own on the cpu backend), whose host tasks
  // run in stream order after the copies they read.
  std::unique_ptr<DeviceMath> own_host_math_;
  DeviceMath* host_math_ = nullptr;
  std::vector<GradSpan> spans_;  // grad_stats's, reserved
  SlotPool slots_;      // all zero while free
  std::vector<Bucket> buckets_;  // per slot
  DeviceBuffer pack_;            // plan.reduce_pack: a multi-group bucket packed rank-major
  std::vector<const char*> parts_;  // collect()'s: this rank's reduced part of each entry, reserved
  int open_ = -1;                // the slot grad() places the next group in, or -1
  std::size_t limit_ = 0;        // elements: buckets.reduce; a larger group fills a bucket alone
  std::size_t smallest_group_ = 0;  // elements: a bucket with less room left is full
  std::vector<GroupState> groups_;  // per group
  std::vector<bool> asked_;         // tensor -> grad() asked for it since its group's grad_in_place
  std::unique_ptr<Event> read_;     // recorded after the last step's reads of the accumulated gradient
  bool read_waited_ = false;        // grad_in_place waited for read_ since then
  const int micro_batches_;         // gradient_accumulation_steps
  ShardWatcher* watcher_ = nullptr;
  std::vector<int> final_now_;      // reduce()'s: the groups the bucket made final, reserved

  // Where the host reads the gradients: the math that computes their statistics group by group.
  DeviceMath* group_stats_math_ = nullptr;
  std::vector<GradSpan> group_spans_;          // group -> its reduced shard, for that math's tasks
  std::vector<GradStatsScalars> group_stats_;  // group -> its statistics, written on the stream
  std::vector<int> stats_order_;               // grad_stats's: the groups summed, reserved
};

}  // namespace zest::engine
