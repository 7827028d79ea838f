#include "engine/offloaded_optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "engine/ahead_updates.hpp"
#include "base/trace.hpp"
#include "runtime/stream_span.hpp"

#include "zest/error.hpp"

namespace zest::engine {

struct OffloadedOptimizer::Impl final : AheadUpdater {
  struct SubGroup {
    int group = 0;
    std::size_t offset = 0;    // in the shard buffer, elements
    std::size_t in_group = 0;  // from the start of the group's shard
    std::size_t count = 0;
    // nvme: master, m and v, one after the other; with overlap a second region, which an update
    // ahead of the step writes and the step's commit makes the current one.
    offload::RegionId regions[2] = {0, 0};
    // Which copy holds the current states: regions[current] (nvme), or states / spare_states (cpu).
    int current = 0;
    bool first_of_group = false;
    bool last_of_group = false;
  };
  // The sub-groups [first, end) of a group, consecutive in `subs`.
  struct GroupSubs {
    std::size_t first = 0, end = 0;
  };

  Impl(const Config& config, Device& d, const OptimizerOffloadPlan& plan, DType t, int threads,
       std::shared_ptr<offload::Store> s, const HyperRuns& r)
      : device(d),
        runs(r),
        range(plan.range),
        dtype(t),
        store(std::move(s)),
        slots(static_cast<std::size_t>(config.offload.optimizer.buffer_count)),
        adam(optim::hyper_params_from(config.optimizer), threads),
        down(d.create_stream()),
        up(d.create_stream()) {
    if (slots < 2)
      throw Error(std::string("offloaded optimizer: offload.optimizer.buffer_count must be at least 2, got ")
                      .append(std::to_string(slots)));
    for (const SubGroupPlace& place : plan.sub_groups) {
      SubGroup sub;
      sub.group = place.group;
      sub.in_group = place.in_group;
      sub.offset = place.offset;
      sub.count = place.count;
      sub.first_of_group = place.first_of_group;
      sub.last_of_group = place.last_of_group;
      subs.push_back(sub);
    }
    largest = plan.largest;
    grad_slot_bytes = plan.grad_slot_bytes;
    grads_on_host = plan.grads_on_host;
    order.reserve(subs.size());
    grad_staging = device.allocate_pinned(plan.grad_staging_bytes, HostPurpose::optimizer_staging);
    out_staging = device.allocate_pinned(plan.staging_bytes, HostPurpose::optimizer_staging);
    for (std::size_t i = 0; i < slots; ++i) {
      grad_ready.push_back(device.create_event());
      out_done.push_back(device.create_event());
    }
    reads.resize(slots);
    writes.resize(slots);
    if (plan.overlap) {
      if (!grads_on_host)
        throw Error("offloaded optimizer: offload.optimizer.overlap needs the gradient shard on the host (stages 2-3, "
                    "the whole optimizer offloaded)");
      updated_params = device.allocate_pinned(plan.updated_params_bytes, HostPurpose::optimizer_staging);
      if (!store) spare_states = device.allocate_pinned(plan.spare_states_bytes, HostPurpose::optimizer_states);
      for (std::size_t i = 0; i < subs.size(); ++i) {
        if (group_subs.size() <= static_cast<std::size_t>(subs[i].group))
          group_subs.resize(static_cast<std::size_t>(subs[i].group) + 1, GroupSubs{i, i});
        group_subs[static_cast<std::size_t>(subs[i].group)].end = i + 1;
      }
      ahead_grads.resize(group_subs.size());
      ahead_assumptions.resize(group_subs.size());
      for (Assumption& a : ahead_assumptions) a.hyper.resize(runs.size());
    }
    if (!store) {
      states = device.allocate_pinned(plan.states_bytes, HostPurpose::optimizer_states);
      std::memset(states.data(), 0, states.bytes());
      if (plan.overlap) start_ahead();
      return;
    }
    if (store->alignment() != kNvmeAlignment)
      throw Error(std::string("offloaded optimizer: the store's alignment is ").append(std::to_string(store->alignment()))
                      .append(" bytes, the memory plan's ").append(std::to_string(kNvmeAlignment)));
    state_slot_bytes = plan.state_slot_bytes;
    state_slots = device.allocate_pinned(plan.state_slots_bytes, HostPurpose::optimizer_swap);
    std::memset(state_slots.data(), 0, state_slots.bytes());
    // Every region starts as zeros (master weights until set, moments, padding), so every read
    // finds data. Writes of zeros from every slot in turn keep `slots` writes in flight.
    for (std::size_t i = 0; i < subs.size(); ++i) {
      const std::string name = std::string("optimizer.subgroup.").append(std::to_string(i));
      subs[i].regions[0] = store->allocate(name, 3 * subs[i].count * sizeof(float));
      // Read only after an update ahead wrote it.
      if (plan.overlap) subs[i].regions[1] = store->allocate(name + ".ahead", 3 * subs[i].count * sizeof(float));
      offload::IoHandle& previous = writes[i % slots];
      previous.wait();
      previous = store->write_async(subs[i].regions[0], state_slot(i % slots));
    }
    for (offload::IoHandle& w : writes) w.wait();
    if (plan.overlap) start_ahead();
  }

  void start_ahead() {
    ahead = std::make_unique<AheadUpdates>(*this, subs.size(), slots, reads_ahead());
  }
  // States are read this many sub-groups ahead, which leaves a slot for the update and one for the
  // write of the previous sub-group.
  std::size_t reads_ahead() const { return std::max<std::size_t>(1, slots - 2); }

  char* grad_slot(std::size_t s) const { return grad_staging.as<char>() + s * grad_slot_bytes; }
  char* out_slot(std::size_t s) const { return out_staging.as<char>() + s * grad_slot_bytes; }
  char* state_slot(std::size_t s) const { return state_slots.as<char>() + s * state_slot_bytes; }
  std::size_t bytes(std::size_t elements) const { return elements * dtype_size(dtype); }

  // The sub-group's master, m and v: in the arrays of the whole range, its current copy or the
  // other one (cpu), or in a slot (nvme).
  float* master_in(const SubGroup& sub, std::size_t slot, int copy) const {
    if (store) return reinterpret_cast<float*>(state_slot(slot));
    return (copy == 0 ? states : spare_states).as<float>() + (sub.offset - range.begin);
  }
  // The distance from a sub-group's master to its m, and from its m to its v.
  std::size_t states_stride(const SubGroup& sub) const { return store ? sub.count : range.count(); }
  float* master_of(const SubGroup& sub, std::size_t slot) const { return master_in(sub, slot, sub.current); }
  float* m_of(const SubGroup& sub, std::size_t slot) const { return master_of(sub, slot) + states_stride(sub); }
  float* v_of(const SubGroup& sub, std::size_t slot) const { return master_of(sub, slot) + 2 * states_stride(sub); }
  offload::RegionId region_of(const SubGroup& sub) const { return sub.regions[sub.current]; }

  void check_usable() const {
    if (!broken_reason.empty())
      throw Error(std::string("offloaded optimizer: unusable after an earlier I/O failure (")
                      .append(broken_reason)
                      .append("); its states are partly updated. Rebuild the engine and set or load its weights again"));
  }

  // Calls visit(master, m, v, first, n) for the states of [offset, offset + count) piece by piece
  // (`first`: the piece's place from `offset`); nvme: with each touched sub-group read into a slot
  // once and, when `write_back`, written again afterwards.
  // Work done ahead (overlap) assumed the states as they were: it is dropped, the step redoes it.
  template <class Visit>
  void visit_states(std::size_t offset, std::size_t count, bool write_back, Visit visit) {
    check_usable();
    if (ahead) ahead->settle(false);
    struct Restart {
      AheadUpdates* ahead;
      ~Restart() {
        if (ahead) ahead->restart();
      }
    } restart{ahead.get()};
    if (!store && !ahead) {
      float* master = states.as<float>() + (offset - range.begin);
      return visit(master, master + range.count(), master + 2 * range.count(), std::size_t{0}, count);
    }
    const std::size_t end = offset + count;
    for (const SubGroup& sub : subs) {
      const std::size_t lo = std::max(offset, sub.offset), hi = std::min(end, sub.offset + sub.count);
      if (lo >= hi) continue;
      try {
        if (store) store->read_async(region_of(sub), state_slot(0)).wait();
        const std::size_t in = lo - sub.offset;
        visit(master_of(sub, 0) + in, m_of(sub, 0) + in, v_of(sub, 0) + in, lo - offset, hi - lo);
        if (store && write_back) store->write_async(region_of(sub), state_slot(0)).wait();
      } catch (const IoError& error) {
        if (write_back) broken_reason = error.what();
        throw;
      }
    }
  }

  void step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args, HostParamSink* sink) {
    check_usable();
    order.clear();
    try {
      if (ahead) {
        ahead->settle(true);  // every group handed over is updated ahead and stored
        commit_ahead(groups, args, sink);
      } else {
        for (std::size_t i = 0; i < subs.size(); ++i) order.push_back(i);
      }
      run(groups, args, sink);
      if (ahead) ahead->restart();
    } catch (const std::exception& error) {
      broken_reason = error.what();
      drain();
      throw;
    }
  }

  // Overlap: each group whose sub-groups were all updated ahead under the arguments and
  // hyper-parameters the step turned out to have takes that work (its second copy becomes the
  // current one, its parameters go out from updated_params); the others go into `order`, for
  // run(). Groups are all or nothing, so a sink sees each group once.
  void commit_ahead(std::span<const StepGroup> groups, const optim::AdamStepArgs& args, HostParamSink* sink) {
    const trace::Span span("commit updates ahead", trace::Lane::host);
    for (std::size_t g = 0; g < group_subs.size(); ++g) {
      const GroupSubs part = group_subs[g];
      if (part.first == part.end) continue;
      bool kept = true;
      for (std::size_t i = part.first; i < part.end && kept; ++i)
        kept = ahead->done(i) && holds(ahead->assumption(i), subs[i], args);
      if (!kept) {
        if (updated_ahead(part)) ++counts.redone;
        for (std::size_t i = part.first; i < part.end; ++i) order.push_back(i);
        continue;
      }
      ++counts.kept;
      for (std::size_t i = part.first; i < part.end; ++i) subs[i].current = 1 - subs[i].current;
      const SubGroup& first = subs[part.first];
      const SubGroup& last = subs[part.end - 1];
      const char* const updated = updated_params.as<char>() + bytes(first.offset - range.begin);
      const std::size_t part_bytes = bytes(last.offset + last.count - first.offset);
      if (void* out = groups[g].device_out) {
        const StreamSpan up_span(*up, "upload parameters", trace::Lane::copy_stream, static_cast<std::int64_t>(g));
        device.copy_async(static_cast<char*>(out) + bytes(first.in_group), updated, part_bytes, *up);
      } else {
        std::memcpy(static_cast<char*>(sink->begin_update(static_cast<int>(g))) + bytes(first.in_group), updated,
                    part_bytes);
        sink->end_update(static_cast<int>(g));
      }
    }
  }

  // The step's arguments and the current hyper-parameters of every run the sub-group touches are
  // those its update ahead assumed.
  bool holds(const Assumption& assumed, const SubGroup& sub, const optim::AdamStepArgs& args) const {
    if (!(assumed.args == args)) return false;
    for (std::size_t r = 0; r < runs.size(); ++r)
      if (runs[r].begin < sub.offset + sub.count && sub.offset < runs[r].end && !(assumed.hyper[r] == *runs[r].hyper))
        return false;
    return true;
  }

  // The step's pipeline over the sub-groups in `order`.
  void run(std::span<const StepGroup> groups, const optim::AdamStepArgs& args, HostParamSink* sink) {
    const std::size_t n = order.size();
    // Gradients run slots - 1 sub-groups ahead; states are read reads_ahead() ahead.
    const std::size_t grads_ahead = slots - 1;
    const std::size_t reads_ahead = this->reads_ahead();
    // j: a position in `order`, which picks the slot. Its sub-group's gradient as the step passed
    // it: on the device, or in the host shard, where the Adam reads it in place.
    auto grad_of = [&](std::size_t j) {
      const SubGroup& sub = subs[order[j]];
      return static_cast<const char*>(groups[static_cast<std::size_t>(sub.group)].grad) + bytes(sub.in_group);
    };
    auto fetch_grad = [&](std::size_t j) {
      if (grads_on_host) return;
      device.copy_async(grad_slot(j % slots), grad_of(j), bytes(subs[order[j]].count), *down);
      down->record(*grad_ready[j % slots]);
    };
    auto read_states = [&](std::size_t j) {
      offload::IoHandle& write = writes[j % slots];
      write.wait();  // the slot's previous sub-group is on disk
      reads[j % slots] = store->read_async(region_of(subs[order[j]]), state_slot(j % slots));
    };
    for (std::size_t j = 0; j < std::min(grads_ahead, n); ++j) fetch_grad(j);
    if (store)
      for (std::size_t j = 0; j < std::min(reads_ahead, n); ++j) read_states(j);
    char* host_group = nullptr;
    for (std::size_t i = 0; i < n; ++i) {
      const SubGroup& sub = subs[order[i]];
      const std::size_t slot = i % slots;
      const trace::Span sub_span("sub-group", trace::Lane::host, static_cast<std::int64_t>(order[i]));
      if (i + grads_ahead < n) fetch_grad(i + grads_ahead);
      if (store && i + reads_ahead < n) read_states(i + reads_ahead);
      if (!grads_on_host) grad_ready[slot]->synchronize();
      const char* const grad_in = grads_on_host ? grad_of(i) : grad_slot(slot);
      if (store) reads[slot].wait();
      float* master = master_of(sub, slot);
      const StepGroup& io = groups[static_cast<std::size_t>(sub.group)];
      const bool upload = io.device_out != nullptr;
      // fp32 parameters on the device are the master weights: uploaded from the whole-shard array
      // where it exists, else copied next to the low-precision outputs.
      char* out = nullptr;
      if (upload) {
        if (store || dtype != DType::f32) {
          out_done[slot]->synchronize();  // the upload of sub-group i - slots is over
          out = out_slot(slot);
        }
      } else {
        if (sub.first_of_group) host_group = static_cast<char*>(sink->begin_update(sub.group));
        out = host_group + bytes(sub.in_group);
      }
      // One update per optimizer parameter group inside the sub-group.
      const trace::Span adam_span("adam update", trace::Lane::host, static_cast<std::int64_t>(order[i]));
      float* const m = m_of(sub, slot);
      float* const v = v_of(sub, slot);
      for_each_run(runs, sub.offset, sub.offset + sub.count,
                   [&](std::size_t lo, std::size_t hi, const optim::AdamHyperParams& hyper) {
                     const std::size_t at = lo - sub.offset, n = hi - lo;
                     adam.set_hyper(hyper);
                     const optim::ConstTensorSpan grad{grad_in + bytes(at), dtype, n};
                     if (dtype == DType::f32)
                       adam.step({master + at, n}, {m + at, n}, {v + at, n}, grad, args);
                     else
                       adam.step({master + at, n}, {m + at, n}, {v + at, n}, grad, args,
                                 optim::TensorSpan{out + bytes(at), dtype, n});
                   });
      if (dtype == DType::f32 && out) std::memcpy(out, master, sub.count * sizeof(float));
      if (store) writes[slot] = store->write_async(region_of(sub), state_slot(slot));
      if (upload) {
        const char* source = out ? out : reinterpret_cast<const char*>(master);
        const StreamSpan up_span(*up, "upload parameters", trace::Lane::copy_stream, static_cast<std::int64_t>(order[i]));
        device.copy_async(static_cast<char*>(io.device_out) + bytes(sub.in_group), source, bytes(sub.count), *up);
        up->record(*out_done[slot]);
      } else if (sub.last_of_group) {
        sink->end_update(sub.group);
      }
    }
    const trace::Span wait_span("wait for uploads and writes", trace::Lane::host);
    up->synchronize();
    for (offload::IoHandle& w : writes) w.wait();
  }

  // Overlap: group g's gradient (its host shard at `grad`) is final once `stream` gets here; hand it
  // to the thread then.
  void speculate(int g, const void* grad, const optim::AdamStepArgs& assumed, Stream& stream) {
    if (!ahead || static_cast<std::size_t>(g) >= group_subs.size()) return;
    const auto group = static_cast<std::size_t>(g);
    ahead_grads[group] = static_cast<const char*>(grad);
    // Rewritten once a step at most (a group is final once), after the last step's settle().
    Assumption& assumption = ahead_assumptions[group];
    assumption.args = assumed;
    for (std::size_t r = 0; r < runs.size(); ++r) assumption.hyper[r] = *runs[r].hyper;
    stream.host_task([this, g] {
      const auto group = static_cast<std::size_t>(g);
      ahead->add(g, group_subs[group].first, group_subs[group].end, ahead_assumptions[group]);
    });
  }
  void retract(int g, Stream& stream) {
    if (ahead) stream.host_task([this, g] { ahead->cancel(g); });
  }
  void skip_step() {
    if (!ahead) return;
    ahead->settle(false);
    for (const GroupSubs& part : group_subs)
      if (updated_ahead(part)) ++counts.redone;
    ahead->restart();
  }
  // After settle(): some sub-group of the group was updated ahead.
  bool updated_ahead(GroupSubs part) const {
    for (std::size_t i = part.first; i < part.end; ++i)
      if (ahead->done(i)) return true;
    return false;
  }

  // AheadUpdater: the update of one sub-group ahead of the step, in the slot of `position`, from
  // its current copy into the other one, with the updated parameters into updated_params.
  void read(std::size_t position, std::size_t i) override {
    if (store) reads[position % slots] = store->read_async(region_of(subs[i]), state_slot(position % slots));
  }
  void update(std::size_t position, std::size_t i, const Assumption& assumed) override {
    const SubGroup& sub = subs[i];
    const std::size_t slot = position % slots;
    const int next = 1 - sub.current;
    // nvme: in place in the slot, which the write then takes to the other region; cpu: from the
    // current array into the other one.
    float* const master = master_in(sub, slot, next);
    const float* const from = master_in(sub, slot, sub.current);
    const std::size_t stride = states_stride(sub);
    if (store) reads[slot].wait();
    const char* const grad_in = ahead_grads[static_cast<std::size_t>(sub.group)] + bytes(sub.in_group);
    char* const out = updated_params.as<char>() + bytes(sub.offset - range.begin);
    for (std::size_t r = 0; r < runs.size(); ++r) {
      const std::size_t lo = std::max(sub.offset, runs[r].begin), hi = std::min(sub.offset + sub.count, runs[r].end);
      if (lo >= hi) continue;
      const std::size_t at = lo - sub.offset, n = hi - lo;
      adam.set_hyper(assumed.hyper[r]);
      const std::span<float> p{master + at, n}, m{master + stride + at, n}, v{master + 2 * stride + at, n};
      const optim::ConstTensorSpan grad{grad_in + bytes(at), dtype, n};
      const optim::TensorSpan low = dtype == DType::f32 ? optim::TensorSpan{} : optim::TensorSpan{out + bytes(at), dtype, n};
      if (store)
        adam.step(p, m, v, grad, assumed.args, low);
      else
        adam.step_from({from + at, from + stride + at, from + 2 * stride + at}, p, m, v, grad, assumed.args, low);
    }
    if (dtype == DType::f32) std::memcpy(out, master, sub.count * sizeof(float));
    if (store) writes[slot] = store->write_async(sub.regions[next], state_slot(slot));
  }
  void confirm(std::size_t position) override { std::exchange(writes[position % slots], offload::IoHandle()).wait(); }

  // After a failure: nothing may still run into the buffers. Errors were already reported.
  void drain() noexcept {
    for (Stream* s : {down.get(), up.get()}) {
      try {
        s->synchronize();
      } catch (...) {
      }
    }
    drain_transfers();
  }
  void drain_transfers() noexcept override {
    for (std::vector<offload::IoHandle>* handles : {&reads, &writes}) {
      for (offload::IoHandle& h : *handles) {
        try {
          h.wait();
        } catch (...) {
        }
        h = offload::IoHandle();
      }
    }
  }

  Device& device;
  const HyperRuns& runs;
  const ShardRange range;  // of the shard buffer: the states this optimizer holds
  const DType dtype;
  std::shared_ptr<offload::Store> store;
  const std::size_t slots;
  optim::CpuAdam adam;
  std::vector<SubGroup> subs;
  std::size_t largest = 0;
  std::size_t grad_slot_bytes = 0;
  bool grads_on_host = false;  // the gradients are read in place: no gradient staging
  std::size_t state_slot_bytes = 0;
  HostBuffer states;       // cpu: master, m, v of the range
  // Overlap: the second copy of the states (cpu), the updated parameters of the range in dtype,
  // each group's sub-groups and gradient shard (on the host).
  HostBuffer spare_states, updated_params;
  std::vector<GroupSubs> group_subs;
  std::vector<const char*> ahead_grads;
  std::vector<Assumption> ahead_assumptions;  // per group: what its update ahead assumes
  std::vector<std::size_t> order;  // the sub-groups step()'s pipeline runs
  AheadCounts counts;
  HostBuffer state_slots;  // nvme: `slots` sub-groups' master, m, v
  HostBuffer grad_staging, out_staging;  // grad_staging: empty with grads_on_host
  std::vector<std::unique_ptr<Event>> grad_ready, out_done;
  std::vector<offload::IoHandle> reads, writes;
  std::string broken_reason;
  // Declared last, destroyed first: their work refers to the buffers above.
  std::unique_ptr<Stream> down, up;
  std::unique_ptr<AheadUpdates> ahead;  // overlap: stopped before anything it uses goes
};

OffloadedOptimizer::OffloadedOptimizer(const Config& config, Device& device, const OptimizerOffloadPlan& plan,
                                       DType dtype, int threads, std::shared_ptr<offload::Store> store,
                                       const HyperRuns& runs)
    : impl_(std::make_unique<Impl>(config, device, plan, dtype, threads, std::move(store), runs)) {}

OffloadedOptimizer::~OffloadedOptimizer() {
  if (!impl_) return;
  impl_->ahead.reset();
  impl_->drain();
}

void OffloadedOptimizer::write_master(std::size_t offset, const float* values, std::size_t count) {
  impl_->visit_states(offset, count, true, [values](float* master, float*, float*, std::size_t first, std::size_t n) {
    std::memcpy(master, values + first, n * sizeof(float));
  });
}

void OffloadedOptimizer::read_master(std::size_t offset, float* values, std::size_t count) {
  impl_->visit_states(offset, count, false, [values](float* master, float*, float*, std::size_t first, std::size_t n) {
    std::memcpy(values + first, master, n * sizeof(float));
  });
}

void OffloadedOptimizer::visit_states(std::size_t offset, std::size_t count, bool write_back, const StatesVisit& visit) {
  impl_->visit_states(offset, count, write_back, visit);
}

void OffloadedOptimizer::step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args,
                              HostParamSink* sink) {
  impl_->step(groups, args, sink);
}

void OffloadedOptimizer::speculate(int group, const void* grad, const optim::AdamStepArgs& assumed, Stream& stream) {
  impl_->speculate(group, grad, assumed, stream);
}
void OffloadedOptimizer::retract(int group, Stream& stream) { impl_->retract(group, stream); }
void OffloadedOptimizer::skip_step() { impl_->skip_step(); }
AheadCounts OffloadedOptimizer::ahead_counts() const { return impl_->counts; }

void OffloadedOptimizer::check_usable() const { impl_->check_usable(); }

std::size_t OffloadedOptimizer::sub_group_count() const { return impl_->subs.size(); }
std::size_t OffloadedOptimizer::sub_group_elements() const { return impl_->largest; }
std::size_t OffloadedOptimizer::nvme_bytes() const {
  if (!impl_->store) return 0;
  std::size_t total = 0;
  for (const auto& sub : impl_->subs) {
    total += impl_->store->region(sub.regions[0]).padded_bytes;
    if (impl_->ahead) total += impl_->store->region(sub.regions[1]).padded_bytes;
  }
  return total;
}
std::size_t OffloadedOptimizer::pinned_bytes() const {
  return impl_->states.bytes() + impl_->state_slots.bytes() + impl_->grad_staging.bytes() + impl_->out_staging.bytes() +
         impl_->spare_states.bytes() + impl_->updated_params.bytes();
}

}  // namespace zest::engine
