// PendingWatchdog, the NCCL communicator's bound on a collective that never completes, with
// operations whose completion the test controls (no GPU needed): an operation still pending after
// the timeout breaks the watchdog, aborts once and names itself; completed operations never do; an
// operation's clock starts when it becomes the oldest; the backend's own failure aborts at once;
// timeout 0 bounds nothing. Timeouts here are 10x the poll interval or more, so a loaded machine
// delays a verdict but does not change it.
#include "runtime/device/pending_watchdog.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "runtime/watchdog.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace std::chrono_literals;

struct Probe {
  std::atomic<int> aborts{0};
  std::atomic<bool> unhealthy{false};
};

std::unique_ptr<PendingWatchdog> make(Probe& probe, std::chrono::milliseconds timeout) {
  return std::make_unique<PendingWatchdog>(
      "nccl rank 1", timeout,
      [&probe] { return probe.unhealthy ? std::string("NCCL reports: remote process exited") : std::string(); },
      [&probe] { ++probe.aborts; }, 10ms);
}

// Waits (at most 10 s) until the watchdog is broken.
bool becomes_broken(const PendingWatchdog& watchdog) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!watchdog.broken() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  return watchdog.broken();
}

std::string error_of(const PendingWatchdog& watchdog) {
  try {
    watchdog.check();
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

TEST(PendingWatchdog, AnOperationPendingPastTheTimeoutAbortsOnceAndNamesItself) {
  test::Watchdog guard;
  Probe probe;
  auto watchdog = make(probe, 200ms);
  watchdog->track("all_reduce", [] { return true; });
  std::atomic<bool> hung_done{false};
  EXPECT_EQ(watchdog->track("reduce_scatter", [&] { return hung_done.load(); }), 2u);
  ASSERT_TRUE(becomes_broken(*watchdog));
  std::this_thread::sleep_for(100ms);  // the thread has ended: no second abort
  EXPECT_EQ(probe.aborts, 1);
  const std::string error = error_of(*watchdog);
  EXPECT_NE(error.find("reduce_scatter #2 on nccl rank 1: not complete after 0.2 s (comm.timeout)"), std::string::npos)
      << error;
  EXPECT_NE(error.find("refuses every later operation"), std::string::npos) << error;
  EXPECT_THROW(watchdog->track("all_gather", [] { return true; }), CommError);
}

TEST(PendingWatchdog, CompletedOperationsNeverBreakIt) {
  test::Watchdog guard;
  Probe probe;
  auto watchdog = make(probe, 100ms);
  for (int i = 0; i < 1000; ++i) watchdog->track("all_reduce", [] { return true; });
  std::this_thread::sleep_for(400ms);
  EXPECT_FALSE(watchdog->broken());
  EXPECT_EQ(probe.aborts, 0);
  EXPECT_NO_THROW(watchdog->check());
}

TEST(PendingWatchdog, AnOperationsClockStartsWhenItBecomesTheOldest) {
  // Two operations tracked at once, each taking 0.7 of the timeout after the one before: the
  // second is pending 1.4x the timeout in all, but never the oldest for longer than 0.7x.
  test::Watchdog guard;
  Probe probe;
  auto watchdog = make(probe, 1000ms);
  const auto start = std::chrono::steady_clock::now();
  watchdog->track("all_reduce", [&] { return std::chrono::steady_clock::now() - start >= 700ms; });
  std::atomic<bool> second_done{false};
  watchdog->track("all_gather", [&] { return second_done.load(); });
  std::this_thread::sleep_until(start + 1400ms);
  second_done = true;
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(watchdog->broken()) << error_of(*watchdog);
  EXPECT_EQ(probe.aborts, 0);
}

TEST(PendingWatchdog, TheBackendsOwnFailureAbortsWithoutWaitingForTheTimeout) {
  test::Watchdog guard;
  Probe probe;
  auto watchdog = make(probe, std::chrono::minutes(10));
  std::atomic<bool> done{false};
  watchdog->track("broadcast", [&] { return done.load(); });
  probe.unhealthy = true;
  ASSERT_TRUE(becomes_broken(*watchdog));
  EXPECT_EQ(probe.aborts, 1);
  const std::string error = error_of(*watchdog);
  EXPECT_NE(error.find("nccl rank 1: NCCL reports: remote process exited"), std::string::npos) << error;
}

TEST(PendingWatchdog, TimeoutZeroBoundsNothing) {
  test::Watchdog guard;
  Probe probe;
  probe.unhealthy = true;
  auto watchdog = make(probe, 0ms);
  EXPECT_EQ(watchdog->track("all_reduce", [] { return false; }), 1u);
  EXPECT_EQ(watchdog->track("all_reduce", [] { return false; }), 2u);
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(watchdog->broken());
  EXPECT_EQ(probe.aborts, 0);
}

TEST(PendingWatchdog, DestroyedWithAPendingOperationItReturnsAtOnce) {
  test::Watchdog guard(2s);
  Probe probe;
  auto watchdog = make(probe, std::chrono::minutes(10));
  watchdog->track("all_reduce", [] { return false; });
  watchdog.reset();
  EXPECT_EQ(probe.aborts, 0);
}

}  // namespace
}  // namespace zest
