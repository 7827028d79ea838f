// offload.optimizer.update_ahead: the offloaded optimizer's updates ahead of the step. While
// backward goes on, each group whose gradient shard is final (hand_over(), in comm-stream order) is
// updated by a thread of its own (UpdateAheadThread), through the optimizer's staging slots,
// assuming the step's arguments (adam_step_args without clipping) and the hyper-parameters as they
// are then: from the current copy of its states into the spare one (Residency), its parameters
// into a pinned array of the range (updated()). At the step, the optimizer finish()es the thread
// and take()s each group whose assumption held (its spare copy becomes current); it runs its
// pipeline over the rest. A skipped step, a group whose gradient changes again (retract()) and a
// visit of the states (pause()) drop the work. The current copy is never written ahead, so
// dropping costs nothing but the work, and the results are those of the step without updates
// ahead, bit for bit. A failed transfer ahead only leaves its group to the step.
//
// Built by OffloadedOptimizer only with plan.update_ahead; the engine reaches it through
// OffloadedOptimizer::updates_ahead() and calls hand_over/retract/skip_step/counts, the optimizer
// the rest. Threading: hand_over/retract enqueue on the given stream; everything else from the
// thread that drives the optimizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/residency.hpp"
#include "engine/optimizer/sub_groups.hpp"
#include "engine/optimizer/update_ahead_thread.hpp"
#include "offload/io_handle.hpp"
#include "optim/cpu_adam.hpp"
#include "zest/device.hpp"

namespace zest::engine {

// Updates ahead of the step so far (EngineStats::groups_updated_ahead, groups_redone).
struct AheadCounts {
  std::int64_t kept = 0, redone = 0;
};

class UpdatesAhead final : UpdateAheadWork {
 public:
  // `plan`: its range and updated_params_bytes; needs plan.grads_on_host (throws Error otherwise).
  // `subs`, `residency` (two copies), `adam`: the optimizer's, which outlive this. `slots`: the
  // residency's staging slots, read `reads_ahead` sub-groups ahead.
  UpdatesAhead(Device& device, const OptimizerOffloadPlan& plan, DType dtype, const SubGroupList& subs,
               Residency& residency, SubGroupAdam& adam, std::size_t slots, std::size_t reads_ahead);
  ~UpdatesAhead() override;
  UpdatesAhead(const UpdatesAhead&) = delete;
  UpdatesAhead& operator=(const UpdatesAhead&) = delete;

  // Group g's final gradient shard for this step is complete in host memory at `grad` once `stream`
  // reaches this point: update its sub-groups then, assuming `assumed` and the hyper-parameters as
  // they are now.
  void hand_over(int group, const void* grad, const optim::AdamStepArgs& assumed, Stream& stream);
  // Group g's gradient changes after this point on `stream` (one micro-batch too many): its work
  // ahead is dropped.
  void retract(int group, Stream& stream);
  // The step is skipped (overflow): all the work ahead is dropped.
  void skip_step();
  AheadCounts counts() const { return counts_; }

  // The optimizer's side. finish(): waits until every sub-group handed over is updated and stored;
  // pause(): stops after the update under way. Either way the thread is idle, and the slots and
  // the states belong to the caller, until restart(), which forgets the work not taken.
  void finish();
  void pause();
  void restart();
  // After finish(): whether group g's sub-groups were all updated ahead under `args` and the
  // hyper-parameters as they are now. If so their spare copies become current and updated() holds
  // their parameters; otherwise the step must update the group.
  bool take(std::size_t group, const optim::AdamStepArgs& args);
  // The parameters (dtype) updated ahead of `sub`.
  const char* updated(const SubGroupPlace& sub) const;

  std::size_t pinned_bytes() const { return updated_params_.bytes(); }

 private:
  // UpdateAheadWork: one sub-group's update ahead, in the slot of `position`, from its current copy
  // into its spare one.
  void read(std::size_t position, std::size_t sub) override;
  void update(std::size_t position, std::size_t sub, const Assumption& assumed) override;
  void confirm(std::size_t position) override;
  void drain_transfers() noexcept override;

  // The step's arguments and the current hyper-parameters of every run the sub-group touches are
  // those its update ahead assumed.
  bool holds(const Assumption& assumed, const SubGroupPlace& sub, const optim::AdamStepArgs& args) const;
  // Where `sub`'s parameters updated ahead go in updated_params_.
  char* params_of(const SubGroupPlace& sub) const;
  // After finish() or pause(): some sub-group of the group was updated ahead.
  bool updated_ahead(SubGroupList::OfGroup part) const;

  const SubGroupList& subs_;
  Residency& residency_;
  SubGroupAdam& adam_;
  const ShardRange range_;
  const DType dtype_;
  const std::size_t slots_;
  HostBuffer updated_params_;             // the range in dtype
  std::vector<const char*> grads_;        // per group: its gradient shard (host)
  std::vector<Assumption> assumptions_;   // per group: what its update ahead assumes
  std::vector<offload::IoHandle> reads_, writes_;  // per slot
  AheadCounts counts_;
  std::unique_ptr<UpdateAheadThread> thread_;  // last: stopped before anything it uses goes
};

}  // namespace zest::engine
