// The offloaded optimizer's unit of work: a sub-group, the parameters of one group's shard whose
// states fit offload.sub_group_bytes (SubGroupPlace, listed by plan_memory), whose states are one
// Residency piece laid out by optim::StatesLayout ([master | m | v | scales]).
//   SubGroupList   the list, and which of them each layout group has;
//   SubGroupAdam   the one update of a sub-group by the CPU Adam, used by the step's pipeline
//                  (OffloadedOptimizer) and by the updates ahead of it (UpdatesAhead), so the
//                  two compute the same thing, bit for bit.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "optim/cpu_adam.hpp"
#include "optim/states_layout.hpp"
#include "zest/dtype.hpp"

namespace zest::engine {

struct SubGroupList {
  // The sub-groups [first, end) of a group, consecutive in `list`.
  struct OfGroup {
    std::size_t first = 0, end = 0;
  };

  // `list`: plan_memory's, consecutive by group in layout order.
  explicit SubGroupList(std::vector<SubGroupPlace> list);

  const SubGroupPlace& operator[](std::size_t i) const { return list[i]; }
  std::size_t size() const { return list.size(); }
  // Group g's sub-groups; none for a group past the last that has any.
  OfGroup of_group(std::size_t g) const { return g < groups.size() ? groups[g] : OfGroup{}; }

  std::vector<SubGroupPlace> list;
  std::vector<OfGroup> groups;  // up to the last group with sub-groups
};

class SubGroupAdam {
 public:
  // `runs`: the optimizer parameter groups over the shard (kept by the caller). `threads`: the CPU
  // Adam's on `cpus` (0 = one per cpu; the rank's, Device::host_cpus).
  // `states`: the format of m and v and their rounding (kept by the caller).
  SubGroupAdam(const optim::AdamHyperParams& initial, int threads, std::vector<int> cpus, const HyperRuns& runs,
               DType dtype, const StatesOptions& states);

  // One Adam step over `sub`: its states read at `from` and written at `to` (both laid out by
  // layout(sub); the same place: in place), its gradient (dtype) at `grad`, its updated parameters
  // in dtype into `out`, written in the update's pass (none when `out` is null). Each part
  // of the sub-group in one optimizer parameter group is updated with hyper[r] of that run.
  void update(const SubGroupPlace& sub, const char* from, char* to, const char* grad, char* out,
              const optim::AdamStepArgs& args, std::span<const optim::AdamHyperParams> hyper);

  // Where `sub`'s states lie in its piece.
  optim::StatesLayout layout(const SubGroupPlace& sub) const { return {states_.form(), sub.count}; }

  // Every run's hyper-parameters as they are now, into `hyper` (one per run).
  void current_hyper(std::vector<optim::AdamHyperParams>& hyper) const;
  const HyperRuns& runs() const { return runs_; }

 private:
  optim::CpuAdam adam_;
  const HyperRuns& runs_;
  const DType dtype_;
  const StatesOptions& states_;
};

}  // namespace zest::engine
