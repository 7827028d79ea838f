// UpdateAheadThread (offload.optimizer.update_ahead's thread) against a recording UpdateAheadWork:
// every sub-group handed over is read, updated and confirmed in order, a slot is read into again
// only after its previous write is confirmed, failures and cancelled groups never count as done,
// cancel() waits for the update under way, and settle(false) stops without finishing the queue.
// Runs under ThreadSanitizer too (suite tsan).
#include "engine/optimizer/update_ahead_thread.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

namespace zest::engine {
namespace {

struct Event {
  enum Kind { read, update, confirm } kind;
  std::size_t position = 0, sub = 0;
};

// Records the calls; throws where told to; can hold one sub-group's update until released.
class RecordingWork final : public UpdateAheadWork {
 public:
  std::set<std::size_t> failing_reads, failing_updates;  // sub-groups
  std::set<std::size_t> failing_confirms;                // positions

  void read(std::size_t position, std::size_t sub) override {
    record({Event::read, position, sub});
    if (failing_reads.count(sub)) throw std::runtime_error("read failed");
  }
  void update(std::size_t position, std::size_t sub, const Assumption&) override {
    record({Event::update, position, sub});
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (sub == held_) {
        holding_ = true;
        changed_.notify_all();
        changed_.wait(lock, [&] { return held_ != sub; });
        holding_ = false;
      }
    }
    if (failing_updates.count(sub)) throw std::runtime_error("update failed");
  }
  void confirm(std::size_t position) override {
    record({Event::confirm, position, 0});
    if (failing_confirms.count(position)) throw std::runtime_error("write failed");
  }
  void drain_transfers() noexcept override { drained_.fetch_add(1); }

  // update() of `sub` waits in the thread until release().
  void hold(std::size_t sub) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_ = sub;
  }
  void wait_until_holding() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return holding_; });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ = kNone;
    }
    changed_.notify_all();
  }
  std::vector<Event> events() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }
  int drains() const { return drained_.load(); }

 private:
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  void record(Event e) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(e);
  }
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Event> events_;
  std::size_t held_ = kNone;
  bool holding_ = false;
  std::atomic<int> drained_{0};
};

Assumption assumption(std::int64_t step) {
  Assumption a;
  a.args.step = step;
  return a;
}

// Where in `events` the first event of `kind` for `position` is; events.size() when there is none.
std::size_t index_of(const std::vector<Event>& events, Event::Kind kind, std::size_t position) {
  for (std::size_t i = 0; i < events.size(); ++i)
    if (events[i].kind == kind && events[i].position == position) return i;
  return events.size();
}

TEST(UpdateAheadThread, EverySubGroupIsReadUpdatedAndConfirmedAndSlotsWaitForTheirWrite) {
  constexpr std::size_t kSubs = 9, kSlots = 3;
  RecordingWork work;
  UpdateAheadThread ahead(work, kSubs, kSlots, 1);
  const auto first = assumption(7), second = assumption(8);
  ahead.add(0, 0, 4, first);
  ahead.add(1, 4, kSubs, second);
  ahead.settle(true);
  for (std::size_t sub = 0; sub < kSubs; ++sub) {
    EXPECT_TRUE(ahead.done(sub)) << sub;
    EXPECT_EQ(&ahead.assumption(sub), sub < 4 ? &first : &second) << sub;
  }
  const std::vector<Event> events = work.events();
  for (std::size_t p = 0; p < kSubs; ++p) {
    SCOPED_TRACE(p);
    const std::size_t read = index_of(events, Event::read, p), update = index_of(events, Event::update, p),
                      confirm = index_of(events, Event::confirm, p);
    ASSERT_LT(confirm, events.size());
    EXPECT_LT(read, update);
    EXPECT_LT(update, confirm);
    EXPECT_EQ(events[update].sub, p);  // positions in the order handed over
    // The slot of position p was last used by p - slots: its write is confirmed before the read.
    if (p >= kSlots) {
      EXPECT_LT(index_of(events, Event::confirm, p - kSlots), read);
    }
  }
  EXPECT_GE(work.drains(), 1);  // before the caller took the buffers
  ahead.restart();
  for (std::size_t sub = 0; sub < kSubs; ++sub) EXPECT_FALSE(ahead.done(sub));
}

TEST(UpdateAheadThread, AFailedReadUpdateOrWriteLeavesItsSubGroupNotDone) {
  RecordingWork work;
  work.failing_reads = {1};
  work.failing_updates = {3};
  work.failing_confirms = {5};  // position 5 is sub-group 5
  UpdateAheadThread ahead(work, 8, 4, 2);
  const Assumption first = assumption(1), second = assumption(2);
  ahead.add(0, 0, 8, first);
  ahead.settle(true);
  for (std::size_t sub = 0; sub < 8; ++sub) EXPECT_EQ(ahead.done(sub), sub != 1 && sub != 3 && sub != 5) << sub;
  // A sub-group whose states could not be read is not updated from whatever the slot held.
  for (const Event& e : work.events()) EXPECT_FALSE(e.kind == Event::update && e.sub == 1);
  ahead.restart();
  // And the thread goes on with the next step.
  work.failing_reads.clear();
  ahead.add(0, 0, 2, second);
  ahead.settle(true);
  EXPECT_TRUE(ahead.done(0));
  EXPECT_TRUE(ahead.done(1));
}

TEST(UpdateAheadThread, CancelWaitsForTheUpdateUnderWayAndNothingOfTheGroupIsDone) {
  RecordingWork work;
  UpdateAheadThread ahead(work, 6, 4, 2);
  work.hold(1);
  const Assumption assumed = assumption(1);
  ahead.add(0, 0, 3, assumed);  // group 0: sub-groups 0..2
  ahead.add(1, 3, 6, assumed);  // group 1: 3..5
  work.wait_until_holding();    // group 0's sub-group 1 is being updated
  std::atomic<bool> cancelled{false};
  std::thread canceller([&] {
    ahead.cancel(0);
    cancelled = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(cancelled.load()) << "cancel() returned while the group's gradient was being read";
  work.release();
  canceller.join();
  EXPECT_TRUE(cancelled.load());
  ahead.settle(true);
  for (std::size_t sub = 0; sub < 3; ++sub) EXPECT_FALSE(ahead.done(sub)) << sub;
  for (std::size_t sub = 3; sub < 6; ++sub) EXPECT_TRUE(ahead.done(sub)) << sub;
  // Sub-group 2 came after the cancel: it was never updated.
  for (const Event& e : work.events()) EXPECT_FALSE(e.kind == Event::update && e.sub == 2);
  ahead.restart();
}

TEST(UpdateAheadThread, SettleWithoutFinishingStopsAfterTheUpdateUnderWay) {
  RecordingWork work;
  UpdateAheadThread ahead(work, 10, 4, 2);
  work.hold(0);
  const Assumption assumed = assumption(1);
  ahead.add(0, 0, 10, assumed);
  work.wait_until_holding();
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    work.release();
  });
  ahead.settle(false);
  releaser.join();
  std::size_t updates = 0;
  for (const Event& e : work.events()) updates += e.kind == Event::update;
  EXPECT_EQ(updates, 1u);  // the one under way, nothing after it
  EXPECT_TRUE(ahead.done(0));
  for (std::size_t sub = 1; sub < 10; ++sub) EXPECT_FALSE(ahead.done(sub)) << sub;
  ahead.restart();
}

}  // namespace
}  // namespace zest::engine
