#include "engine/optimizer/offloaded_optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "base/trace.hpp"
#include "engine/optimizer/residency.hpp"
#include "engine/optimizer/sub_groups.hpp"
#include "runtime/device/stream_span.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// cpu: the whole range in one pinned array (a second with update_ahead), each sub-group's states
// (optim::StatesLayout) after those of the sub-groups before it.
std::unique_ptr<Residency> pinned_states(Device& device, const OptimizerOffloadPlan& plan, const SubGroupList& subs) {
  std::vector<std::size_t> offsets;
  offsets.reserve(subs.size());
  for (const SubGroupPlace& sub : subs.list)
    offsets.push_back(optim::StatesLayout::bytes(plan.states, sub.offset - plan.range.begin));
  return std::make_unique<PinnedResidency>(device, HostPurpose::optimizer_states, plan.states_bytes,
                                           plan.update_ahead ? 2 : 1, std::move(offsets));
}

// nvme: a region per sub-group (a second with update_ahead) and `slots` pinned slots.
std::unique_ptr<Residency> swapped_states(Device& device, const OptimizerOffloadPlan& plan, const SubGroupList& subs,
                                          std::shared_ptr<offload::Store> store, std::size_t slots) {
  std::vector<std::string> names;
  std::vector<std::size_t> bytes;
  for (std::size_t i = 0; i < subs.size(); ++i) {
    names.push_back(std::string("optimizer.subgroup.").append(std::to_string(i)));
    bytes.push_back(optim::StatesLayout::bytes(plan.states, subs[i].count));
  }
  return std::make_unique<NvmeResidency>(device, HostPurpose::optimizer_swap, std::move(store), "offloaded optimizer",
                                         names, bytes, plan.update_ahead ? 2 : 1, plan.state_slot_bytes, slots);
}

const optim::AdamHyperParams& first_hyper(const HyperRuns& runs) {
  if (runs.empty()) throw Error("offloaded optimizer: no optimizer parameter group covers the shard; pass its runs");
  return *runs.front().hyper;
}

std::size_t checked_slots(const OptimizerOffloadPlan& plan) {
  if (plan.slots < 2)
    throw Error(
        fmt::format("offloaded optimizer: offload.optimizer.buffer_count must be at least 2, got {}", plan.slots));
  return plan.slots;
}

}  // namespace

struct OffloadedOptimizer::Impl {
  Impl(Device& d, const OptimizerOffloadPlan& plan, DType t, int threads,
       std::shared_ptr<offload::Store> store, const HyperRuns& runs, const StatesOptions& states_options)
      : device(d),
        dtype(t),
        slots(checked_slots(plan)),
        subs(plan.sub_groups),
        largest(plan.largest),
        grad_slot_bytes(plan.grad_slot_bytes),
        grads_on_host(plan.grads_on_host),
        adam(first_hyper(runs), threads, d.host_cpus(), runs, t, states_options),
        down(d.create_stream()),
        up(d.create_stream()) {
    order.reserve(subs.size());
    grad_staging = device.allocate_pinned(plan.grad_staging_bytes, HostPurpose::optimizer_staging);
    out_staging = device.allocate_pinned(plan.staging_bytes, HostPurpose::optimizer_staging);
    for (std::size_t i = 0; i < slots; ++i) {
      grad_ready.push_back(device.create_event());
      out_done.push_back(device.create_event());
    }
    reads.resize(slots);
    writes.resize(slots);
    adam.current_hyper(hyper);
    states = store ? swapped_states(device, plan, subs, std::move(store), slots) : pinned_states(device, plan, subs);
    if (plan.update_ahead)
      ahead = std::make_unique<UpdatesAhead>(device, plan, dtype, subs, *states, adam, slots, reads_ahead());
  }

  // States are read this many sub-groups ahead, which leaves a slot for the update and one for the
  // write of the previous sub-group.
  std::size_t reads_ahead() const { return std::max<std::size_t>(1, slots - 2); }

  char* grad_slot(std::size_t s) const { return grad_staging.as<char>() + s * grad_slot_bytes; }
  char* out_slot(std::size_t s) const { return out_staging.as<char>() + s * grad_slot_bytes; }
  std::size_t bytes(std::size_t elements) const { return elements * dtype_size(dtype); }
  // Sub-group i's current states while `slot` holds them (laid out by adam.layout).
  char* states_of(std::size_t i, std::size_t slot) const { return states->data(i, slot, Copy::current); }

  void check_usable() const {
    if (!broken_reason.empty())
      throw Error(
          std::string("offloaded optimizer: unusable after an earlier I/O failure (")
              .append(broken_reason)
              .append("); its states are partly updated. Rebuild the engine and set or load its weights again"));
  }

  // Calls visit(master, m, v, first, n) for the states of [offset, offset + count) sub-group by
  // sub-group (`first`: the piece's place from `offset`), each loaded into slot 0 and, when
  // `write_back`, stored again afterwards.
  // Work done ahead (update_ahead) assumed the states as they were: it is dropped, the step redoes it.
  void visit_states(std::size_t offset, std::size_t count, bool write_back, const StatesVisit& visit) {
    check_usable();
    if (ahead) ahead->pause();
    struct Restart {
      UpdatesAhead* ahead;
      ~Restart() {
        if (ahead) ahead->restart();
      }
    } restart{ahead.get()};
    const std::size_t end = offset + count;
    for (std::size_t i = 0; i < subs.size(); ++i) {
      const SubGroupPlace& sub = subs[i];
      const std::size_t lo = std::max(offset, sub.offset), hi = std::min(end, sub.offset + sub.count);
      if (lo >= hi) continue;
      try {
        states->load(i, 0, Copy::current).wait();
        visit_laid_out(adam.layout(sub), states_of(i, 0), lo - sub.offset, hi - lo, lo - offset, write_back, visit,
                       visit_scratch);
        if (write_back) states->store(i, 0, Copy::current).wait();
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
      adam.current_hyper(hyper);
      if (ahead) ahead->finish();  // every group handed over is updated ahead and stored
      // Groups are all or nothing, so a sink sees each group once.
      std::optional<trace::Span> commit_span;
      if (ahead) commit_span.emplace("commit updates ahead", trace::Lane::host);
      for (std::size_t g = 0; g < subs.groups.size(); ++g) {
        const SubGroupList::OfGroup part = subs.of_group(g);
        if (ahead && ahead->take(g, args)) {
          send_ahead(g, part, groups[g], sink);
          continue;
        }
        for (std::size_t i = part.first; i < part.end; ++i) order.push_back(i);
      }
      commit_span.reset();
      run(groups, args, sink);
      if (ahead) ahead->restart();
    } catch (const std::exception& error) {
      broken_reason = error.what();
      drain();
      throw;
    }
  }

  // update_ahead: group g's parameters updated ahead go where the step's would.
  void send_ahead(std::size_t g, SubGroupList::OfGroup part, const StepGroup& io, HostParamSink* sink) {
    const SubGroupPlace& first = subs[part.first];
    const SubGroupPlace& last = subs[part.end - 1];
    const char* const updated = ahead->updated(first);
    const std::size_t part_bytes = bytes(last.offset + last.count - first.offset);
    if (void* out = io.device_out) {
      const StreamSpan up_span(*up, "upload parameters", trace::Lane::copy_stream, static_cast<std::int64_t>(g));
      device.copy_async(static_cast<char*>(out) + bytes(first.in_group), updated, part_bytes, *up);
    } else {
      std::memcpy(static_cast<char*>(sink->begin_update(static_cast<int>(g))) + bytes(first.in_group), updated,
                  part_bytes);
      sink->end_update(static_cast<int>(g));
    }
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
      const SubGroupPlace& sub = subs[order[j]];
      return static_cast<const char*>(groups[static_cast<std::size_t>(sub.group)].grad) + bytes(sub.in_group);
    };
    auto fetch_grad = [&](std::size_t j) {
      if (grads_on_host) return;
      device.copy_async(grad_slot(j % slots), grad_of(j), bytes(subs[order[j]].count), *down);
      down->record(*grad_ready[j % slots]);
    };
    auto read_states = [&](std::size_t j) {
      offload::IoHandle& write = writes[j % slots];
      write.wait();  // the slot's previous sub-group is stored
      reads[j % slots] = states->load(order[j], j % slots, Copy::current);
    };
    for (std::size_t j = 0; j < std::min(grads_ahead, n); ++j) fetch_grad(j);
    for (std::size_t j = 0; j < std::min(reads_ahead, n); ++j) read_states(j);
    char* host_group = nullptr;
    for (std::size_t i = 0; i < n; ++i) {
      const SubGroupPlace& sub = subs[order[i]];
      const std::size_t slot = i % slots;
      const trace::Span sub_span("sub-group", trace::Lane::host, static_cast<std::int64_t>(order[i]));
      if (i + grads_ahead < n) fetch_grad(i + grads_ahead);
      if (i + reads_ahead < n) read_states(i + reads_ahead);
      if (!grads_on_host) grad_ready[slot]->synchronize();
      const char* const grad_in = grads_on_host ? grad_of(i) : grad_slot(slot);
      reads[slot].wait();
      char* const piece = states_of(order[i], slot);
      const StepGroup& io = groups[static_cast<std::size_t>(sub.group)];
      const bool upload = io.device_out != nullptr;
      // fp32 parameters on the device are the master weights: uploaded from where the states
      // stay (in place), else copied next to the low-precision outputs.
      char* out = nullptr;
      if (upload) {
        if (!states->in_place() || dtype != DType::f32) {
          out_done[slot]->synchronize();  // the upload of sub-group i - slots is over
          out = out_slot(slot);
        }
      } else {
        if (sub.first_of_group) host_group = static_cast<char*>(sink->begin_update(sub.group));
        out = host_group + bytes(sub.in_group);
      }
      {
        const trace::Span adam_span("adam update", trace::Lane::host, static_cast<std::int64_t>(order[i]));
        adam.update(sub, piece, piece, grad_in, out, args, hyper);
      }
      writes[slot] = states->store(order[i], slot, Copy::current);
      if (upload) {
        const char* source = out ? out : piece;  // fp32 in place: the master weights open the piece
        const StreamSpan up_span(*up, "upload parameters", trace::Lane::copy_stream,
                                 static_cast<std::int64_t>(order[i]));
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

  // After a failure: nothing may still run into the buffers. Errors were already reported.
  void drain() noexcept {
    for (Stream* s : {down.get(), up.get()}) {
      try {
        s->synchronize();
      } catch (...) {
      }
    }
    engine::drain(reads);
    engine::drain(writes);
  }

  Device& device;
  const DType dtype;
  const std::size_t slots;
  const SubGroupList subs;
  const std::size_t largest;  // elements of the largest sub-group
  const std::size_t grad_slot_bytes;
  const bool grads_on_host;  // the gradients are read in place: no gradient staging
  SubGroupAdam adam;
  std::vector<optim::AdamHyperParams> hyper;  // per run, as the step found them
  std::vector<std::size_t> order;             // the sub-groups step()'s pipeline runs
  std::vector<float> visit_scratch;           // compact states' m and v widened for visit_states
  HostBuffer grad_staging, out_staging;       // grad_staging: empty with grads_on_host
  std::vector<std::unique_ptr<Event>> grad_ready, out_done;
  std::string broken_reason;
  std::unique_ptr<Residency> states;
  // Declared after what they move, destroyed before it: their work refers to the buffers above.
  std::vector<offload::IoHandle> reads, writes;  // per slot
  std::unique_ptr<Stream> down, up;
  std::unique_ptr<UpdatesAhead> ahead;  // update_ahead only: stopped before anything it uses goes
};

OffloadedOptimizer::OffloadedOptimizer(Device& device, const OptimizerOffloadPlan& plan,
                                       DType dtype, int threads, std::shared_ptr<offload::Store> store,
                                       const HyperRuns& runs, const StatesOptions& states)
    : impl_(std::make_unique<Impl>(device, plan, dtype, threads, std::move(store), runs, states)) {}

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

void OffloadedOptimizer::visit_states(std::size_t offset, std::size_t count, bool write_back,
                                      const StatesVisit& visit) {
  impl_->visit_states(offset, count, write_back, visit);
}

void OffloadedOptimizer::step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args,
                              HostParamSink* sink) {
  impl_->step(groups, args, sink);
}

UpdatesAhead* OffloadedOptimizer::updates_ahead() { return impl_->ahead.get(); }

void OffloadedOptimizer::check_usable() const { impl_->check_usable(); }

std::size_t OffloadedOptimizer::sub_group_count() const { return impl_->subs.size(); }
std::size_t OffloadedOptimizer::sub_group_elements() const { return impl_->largest; }
std::size_t OffloadedOptimizer::nvme_bytes() const { return impl_->states->nvme_bytes(); }
std::size_t OffloadedOptimizer::pinned_bytes() const {
  return impl_->states->pinned_bytes() + impl_->grad_staging.bytes() + impl_->out_staging.bytes() +
         (impl_->ahead ? impl_->ahead->pinned_bytes() : 0);
}

}  // namespace zest::engine
