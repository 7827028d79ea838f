// Work done ahead of the step (offload.optimizer.update_ahead): a thread that updates sub-groups of the
// offloaded optimizer's states while backward goes on, as soon as their gradients are final, and
// remembers which ones it updated and under which assumption, so that step() can commit that work
// where the assumption held and redo the rest.
//
// UpdatesAhead does the I/O and the arithmetic as this thread's UpdateAheadWork (the optimizer's
// residency and its SubGroupAdam); this class decides the order: sub-groups in the order they were
// handed over ("positions", counted from the last restart(), from which the work picks its
// staging slots as the step's pipeline does), states read `reads_ahead` positions ahead, and a
// position's stored result confirmed before its slot is read into again. A group whose gradient
// changes after it was handed over (a micro-batch beyond gradient_accumulation_steps) is
// cancelled: cancel() returns once the thread no longer reads that gradient, and nothing of the
// group counts as done.
//
// Threading: add() and cancel() from any thread (the comm stream runs them as host tasks, in
// stream order after the gradients they concern). settle(), done(), assumption() and restart()
// from the thread that drives the optimizer; between settle() and restart() the thread is idle and
// the work's buffers belong to the caller.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

#include "optim/adam_math.hpp"
#include "optim/cpu_adam.hpp"

namespace zest::engine {

// What a sub-group's update ahead of the step took for granted: the step's arguments (no overflow,
// no clipping) and the optimizer parameter groups' hyper-parameters (one per HyperRun) when its
// gradient became final.
struct Assumption {
  optim::AdamStepArgs args;
  std::vector<optim::AdamHyperParams> hyper;
};

// The work the thread does for each sub-group, in the order it decides: I/O and arithmetic.
class UpdateAheadWork {
 public:
  virtual ~UpdateAheadWork() = default;
  // Starts bringing `sub`'s states into the staging of `position`.
  virtual void read(std::size_t position, std::size_t sub) = 0;
  // Updates `sub` (its states read for `position`) into its second copy and starts storing it.
  virtual void update(std::size_t position, std::size_t sub, const Assumption& assumed) = 0;
  // Waits until what update() started for `position` is stored; throws its IoError. Returns at once
  // for a position that started nothing.
  virtual void confirm(std::size_t position) = 0;
  // Waits for every transfer started; reports nothing (settle() already counted the failures).
  virtual void drain_transfers() noexcept = 0;
};

class UpdateAheadThread {
 public:
  // `subs`: the optimizer's sub-group count; `slots`: its staging slots.
  UpdateAheadThread(UpdateAheadWork& work, std::size_t subs, std::size_t slots, std::size_t reads_ahead);
  ~UpdateAheadThread();
  UpdateAheadThread(const UpdateAheadThread&) = delete;
  UpdateAheadThread& operator=(const UpdateAheadThread&) = delete;

  // Sub-groups [first, end) of `group` have their final gradients: update them. `assumed` stays as
  // it is until restart() (the optimizer keeps one per group, written before the group is handed
  // over and read again only after settle()), so handing over allocates nothing.
  void add(int group, std::size_t first, std::size_t end, const Assumption& assumed);
  // `group`'s gradient is about to change: returns once the thread no longer reads it; its
  // sub-groups are not done.
  void cancel(int group);
  // `finish`: waits until every sub-group handed over is updated and stored; otherwise stops after
  // the update under way. Then the thread is idle until restart().
  void settle(bool finish);
  // After settle(): `sub` was updated ahead, stored, and its group not cancelled.
  bool done(std::size_t sub) const { return done_[sub]; }
  const Assumption& assumption(std::size_t sub) const { return *assumed_[sub]; }
  // Forgets everything handed over; the thread takes new work.
  void restart();

 private:
  struct Item {
    std::size_t sub = 0;
    int group = 0;
  };
  void run();
  // Confirms positions up to `end` (exclusive), marking their sub-groups done. Called by the
  // thread with `lock` held; releases it while waiting.
  void confirm_until(std::size_t end, std::unique_lock<std::mutex>& lock);
  bool cancelled(int group) const;

  UpdateAheadWork& work_;
  const std::size_t slots_, reads_ahead_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Item> items_;                                // reserved: every sub-group once
  std::vector<const Assumption*> assumed_;                 // per sub-group
  std::vector<bool> done_;                                 // per sub-group
  std::vector<bool> readable_;                             // per position: read() started
  std::vector<bool> updated_;                              // per position: update() returned
  std::vector<int> cancelled_;                             // groups, each once; reserved
  std::size_t processed_ = 0, issued_ = 0, confirmed_ = 0;  // positions
  int busy_group_ = -1;  // the group whose gradient the thread is reading now
  // settle() asks for a pause (pause_, finish_); the thread says it is idle (paused_) and waits for
  // restart(), which it tells by restarts_ (a flag could be set again before the thread wakes).
  bool pause_ = false, paused_ = false, finish_ = false, stop_ = false;
  std::size_t restarts_ = 0;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace zest::engine
