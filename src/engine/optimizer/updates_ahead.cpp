#include "engine/optimizer/updates_ahead.hpp"

#include <utility>

#include "zest/error.hpp"

namespace zest::engine {

UpdatesAhead::UpdatesAhead(Device& device, const OptimizerOffloadPlan& plan, DType dtype, const SubGroupList& subs,
                           Residency& residency, SubGroupAdam& adam, std::size_t slots, std::size_t reads_ahead)
    : subs_(subs), residency_(residency), adam_(adam), range_(plan.range), dtype_(dtype), slots_(slots) {
  if (!plan.grads_on_host)
    throw Error("offloaded optimizer: offload.optimizer.update_ahead needs the gradient shard on the host (stages 2-3, "
                "the whole optimizer offloaded)");
  updated_params_ = device.allocate_pinned(plan.updated_params_bytes, HostPurpose::optimizer_staging);
  grads_.resize(subs.groups.size());
  assumptions_.resize(subs.groups.size());
  for (Assumption& a : assumptions_) a.hyper.resize(adam.runs().size());
  reads_.resize(slots);
  writes_.resize(slots);
  thread_ = std::make_unique<UpdateAheadThread>(static_cast<UpdateAheadWork&>(*this), subs.size(), slots, reads_ahead);
}

UpdatesAhead::~UpdatesAhead() = default;

void UpdatesAhead::hand_over(int g, const void* grad, const optim::AdamStepArgs& assumed, Stream& stream) {
  const auto group = static_cast<std::size_t>(g);
  if (group >= subs_.groups.size()) return;
  grads_[group] = static_cast<const char*>(grad);
  // Rewritten once a step at most (a group is final once), after the last step's settle.
  Assumption& assumption = assumptions_[group];
  assumption.args = assumed;
  adam_.current_hyper(assumption.hyper);
  stream.host_task([this, g] {
    const SubGroupList::OfGroup part = subs_.of_group(static_cast<std::size_t>(g));
    thread_->add(g, part.first, part.end, assumptions_[static_cast<std::size_t>(g)]);
  });
}

void UpdatesAhead::retract(int g, Stream& stream) {
  stream.host_task([this, g] { thread_->cancel(g); });
}

void UpdatesAhead::skip_step() {
  thread_->settle(false);
  for (const SubGroupList::OfGroup& part : subs_.groups)
    if (updated_ahead(part)) ++counts_.redone;
  thread_->restart();
}

void UpdatesAhead::finish() { thread_->settle(true); }
void UpdatesAhead::pause() { thread_->settle(false); }
void UpdatesAhead::restart() { thread_->restart(); }

bool UpdatesAhead::take(std::size_t group, const optim::AdamStepArgs& args) {
  const SubGroupList::OfGroup part = subs_.of_group(group);
  bool kept = part.first < part.end;
  for (std::size_t i = part.first; i < part.end && kept; ++i)
    kept = thread_->done(i) && holds(thread_->assumption(i), subs_[i], args);
  if (!kept) {
    if (updated_ahead(part)) ++counts_.redone;
    return false;
  }
  ++counts_.kept;
  for (std::size_t i = part.first; i < part.end; ++i) residency_.promote(i);
  return true;
}

const char* UpdatesAhead::updated(const SubGroupPlace& sub) const { return params_of(sub); }

char* UpdatesAhead::params_of(const SubGroupPlace& sub) const {
  return updated_params_.as<char>() + (sub.offset - range_.begin) * dtype_size(dtype_);
}

bool UpdatesAhead::holds(const Assumption& assumed, const SubGroupPlace& sub, const optim::AdamStepArgs& args) const {
  if (!(assumed.args == args)) return false;
  const HyperRuns& runs = adam_.runs();
  for (std::size_t r = 0; r < runs.size(); ++r)
    if (runs[r].begin < sub.offset + sub.count && sub.offset < runs[r].end && !(assumed.hyper[r] == *runs[r].hyper))
      return false;
  return true;
}

bool UpdatesAhead::updated_ahead(SubGroupList::OfGroup part) const {
  for (std::size_t i = part.first; i < part.end; ++i)
    if (thread_->done(i)) return true;
  return false;
}

void UpdatesAhead::read(std::size_t position, std::size_t i) {
  offload::IoHandle& slot_read = reads_[position % slots_];
  // The slot's previous read is over before this one starts: that of a sub-group whose group was
  // cancelled is never waited for by update(), and two reads in flight into one slot may finish
  // in either order (the older one's data would win).
  slot_read = offload::IoHandle();
  slot_read = residency_.load(i, position % slots_, Copy::current);
}

void UpdatesAhead::update(std::size_t position, std::size_t i, const Assumption& assumed) {
  const SubGroupPlace& sub = subs_[i];
  const std::size_t slot = position % slots_;
  reads_[slot].wait();
  // nvme: in place in the slot, which the store then takes to the spare region; cpu: from the
  // current array into the spare one.
  const char* const grad = grads_[static_cast<std::size_t>(sub.group)] + sub.in_group * dtype_size(dtype_);
  adam_.update(sub, residency_.data(i, slot, Copy::current), residency_.data(i, slot, Copy::spare), grad,
               params_of(sub), assumed.args, assumed.hyper);
  writes_[slot] = residency_.store(i, slot, Copy::spare);
}

void UpdatesAhead::confirm(std::size_t position) {
  std::exchange(writes_[position % slots_], offload::IoHandle()).wait();
}

void UpdatesAhead::drain_transfers() noexcept {
  drain(reads_);
  drain(writes_);
}

}  // namespace zest::engine
