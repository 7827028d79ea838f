// CpuStream and CpuEvent: real asynchrony, stream order, CUDA event semantics, sticky errors.
#include "runtime/device/cpu_stream.hpp"

#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <latch>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/host/thread_binding.hpp"
#include "tests/runtime/watchdog.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::Watchdog;

// Runs `body` and returns the message of the std::exception it throws ("" when none).
template <class Body>
std::string thrown_message(Body body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(CpuStream, HostTaskRunsOnAnotherThreadWithoutBlockingTheSubmitter) {
  Watchdog dog;
  CpuStream stream;
  std::latch gate(1);
  std::atomic<bool> finished{false};
  std::thread::id worker_id;
  // If host_task ran the task inline, this call would block forever on the gate (the watchdog
  // would fail the test).
  stream.host_task([&] {
    worker_id = std::this_thread::get_id();
    gate.wait();
    finished = true;
  });
  EXPECT_FALSE(finished.load());
  gate.count_down();
  stream.synchronize();
  EXPECT_TRUE(finished.load());
  EXPECT_NE(worker_id, std::this_thread::get_id());
}

TEST(CpuStream, TwoStreamsRunConcurrently) {
  Watchdog dog;
  CpuStream a;
  CpuStream b;
  // Each task arrives, then waits for the other to arrive. Run one after the other, the first would
  // time out.
  std::latch both(2);
  std::atomic<int> met{0};
  auto rendezvous = [&] {
    both.count_down();
    if (eventually([&] { return both.try_wait(); }, 5s)) ++met;
  };
  a.host_task(rendezvous);
  b.host_task(rendezvous);
  a.synchronize();
  b.synchronize();
  EXPECT_EQ(met.load(), 2);
}

TEST(CpuStream, RunsTasksInSubmissionOrder) {
  CpuStream stream;
  std::vector<int> seen;  // touched only by the worker until synchronize()
  constexpr int kTasks = 2000;
  for (int i = 0; i < kTasks; ++i) stream.host_task([&seen, i] { seen.push_back(i); });
  stream.synchronize();
  ASSERT_EQ(seen.size(), static_cast<std::size_t>(kTasks));
  for (int i = 0; i < kTasks; ++i) ASSERT_EQ(seen[static_cast<std::size_t>(i)], i);
}

TEST(CpuStream, SynchronizeWaitsForAllSubmittedWork) {
  CpuStream stream;
  std::atomic<int> done{0};
  for (int i = 0; i < 5; ++i) {
    stream.host_task([&] {
      std::this_thread::sleep_for(10ms);
      ++done;
    });
  }
  stream.synchronize();
  EXPECT_EQ(done.load(), 5);
}

TEST(CpuStream, DestructorDrainsQueuedWork) {
  std::atomic<int> done{0};
  {
    CpuStream stream;
    for (int i = 0; i < 5; ++i) {
      stream.host_task([&] {
        std::this_thread::sleep_for(5ms);
        ++done;
      });
    }
  }
  EXPECT_EQ(done.load(), 5);
}

TEST(CpuEvent, RecordAndWaitOrderWorkAcrossStreams) {
  Watchdog dog;
  CpuStream producer;
  CpuStream consumer;
  CpuEvent produced;
  std::latch gate(1);
  int value = 0;  // written on the producer's worker, read on the consumer's: the event orders them
  int seen = -1;
  producer.host_task([&] {
    gate.wait();
    value = 42;
  });
  producer.record(produced);
  consumer.wait(produced);
  consumer.host_task([&] { seen = value; });
  // The consumer is held back by the event, not by anything else: give it time to run wrongly.
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(produced.ready());
  gate.count_down();
  consumer.synchronize();
  EXPECT_EQ(seen, 42);
  EXPECT_TRUE(produced.ready());
}

TEST(CpuEvent, WithoutWaitTheOtherStreamDoesNotWait) {
  // The control for the test above: the consumer really is free to run ahead.
  Watchdog dog;
  CpuStream producer;
  CpuStream consumer;
  std::latch gate(1);
  std::atomic<bool> consumer_ran{false};
  producer.host_task([&] { gate.wait(); });
  consumer.host_task([&] { consumer_ran = true; });
  consumer.synchronize();  // returns while the producer is still blocked
  EXPECT_TRUE(consumer_ran.load());
  gate.count_down();
  producer.synchronize();
}

TEST(CpuEvent, NeverRecordedIsReadyAndWaitingOnItIsANoOp) {
  Watchdog dog;
  CpuStream stream;
  CpuEvent event;
  EXPECT_TRUE(event.ready());
  event.synchronize();
  stream.wait(event);
  bool ran = false;
  stream.host_task([&] { ran = true; });
  stream.synchronize();
  EXPECT_TRUE(ran);
}

TEST(CpuEvent, RecordingAgainMovesTheMark) {
  Watchdog dog;
  CpuStream stream;
  CpuEvent event;
  stream.record(event);
  event.synchronize();
  EXPECT_TRUE(event.ready());

  std::latch gate(1);
  stream.host_task([&] { gate.wait(); });
  stream.record(event);  // the mark now sits behind the blocked task
  std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(event.ready());
  gate.count_down();
  event.synchronize();
  EXPECT_TRUE(event.ready());
}

TEST(CpuEvent, WaitCapturesTheMarkAtTheTimeOfTheCall) {
  Watchdog dog;
  CpuStream producer;
  CpuStream consumer;
  CpuEvent event;
  std::latch first(1);
  std::latch second(1);
  producer.host_task([&] { first.wait(); });
  producer.record(event);
  consumer.wait(event);  // waits for the first mark only
  std::atomic<bool> consumer_ran{false};
  consumer.host_task([&] { consumer_ran = true; });
  producer.host_task([&] { second.wait(); });
  producer.record(event);  // moves the event; the consumer's wait must not follow it

  std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(consumer_ran.load());
  first.count_down();
  consumer.synchronize();  // would hang (watchdog) if the wait had followed the second record
  EXPECT_TRUE(consumer_ran.load());
  EXPECT_FALSE(event.ready());
  second.count_down();
  event.synchronize();
  producer.synchronize();
}

TEST(CpuStream, FirstErrorSurfacesInSynchronizeAndLaterTasksAreSkipped) {
  CpuStream stream;
  CpuEvent before;
  CpuEvent after;
  std::atomic<bool> later_ran{false};
  stream.record(before);
  stream.host_task([] { throw std::runtime_error("first failure"); });
  stream.host_task([] { throw std::runtime_error("second failure"); });
  stream.host_task([&] { later_ran = true; });
  stream.record(after);

  EXPECT_EQ(thrown_message([&] { after.synchronize(); }), "first failure");
  EXPECT_EQ(thrown_message([&] { after.synchronize(); }), "first failure");  // the mark keeps it
  EXPECT_EQ(thrown_message([&] { before.synchronize(); }), "");  // marked before the failure
  EXPECT_EQ(thrown_message([&] { stream.synchronize(); }), "first failure");
  EXPECT_FALSE(later_ran.load());

  // Reported once; the stream then runs new work normally.
  EXPECT_EQ(thrown_message([&] { stream.synchronize(); }), "");
  stream.host_task([&] { later_ran = true; });
  stream.synchronize();
  EXPECT_TRUE(later_ran.load());
  EXPECT_EQ(thrown_message([&] { after.synchronize(); }), "first failure");
}

TEST(CpuStream, LockstepTasksRunAfterAFailureAndAreToldOfIt) {
  CpuStream stream;
  std::vector<int> seen;  // written by the stream's worker only, read after synchronize
  stream.lockstep_task([&](bool failed) { seen.push_back(failed ? 1 : 0); });
  stream.host_task([] { throw std::runtime_error("first failure"); });
  stream.host_task([&] { seen.push_back(9); });  // skipped
  stream.lockstep_task([&](bool failed) {
    seen.push_back(failed ? 1 : 0);
    throw std::runtime_error("a lockstep failure");  // not the stream's first error
  });
  EXPECT_EQ(thrown_message([&] { stream.synchronize(); }), "first failure");
  EXPECT_EQ(seen, (std::vector<int>{0, 1}));
  stream.lockstep_task([&](bool failed) { seen.push_back(failed ? 1 : 0); });
  stream.synchronize();
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 0}));
}

TEST(CpuStream, ErrorPreservesTheExceptionType) {
  CpuStream stream;
  stream.host_task([] { throw CommError("collective mismatch"); });
  EXPECT_THROW(stream.synchronize(), CommError);
}

TEST(CpuStream, AStreamWaitingOnAFailedMarkFailsToo) {
  Watchdog dog;
  CpuStream producer;
  CpuStream consumer;
  CpuEvent event;
  producer.host_task([] { throw std::runtime_error("producer failed"); });
  producer.record(event);
  consumer.wait(event);
  std::atomic<bool> consumer_ran{false};
  consumer.host_task([&] { consumer_ran = true; });
  EXPECT_EQ(thrown_message([&] { consumer.synchronize(); }), "producer failed");
  EXPECT_FALSE(consumer_ran.load());
  EXPECT_EQ(thrown_message([&] { producer.synchronize(); }), "producer failed");
}

TEST(CpuStream, SynchronizeFromItsOwnTaskThrowsInsteadOfDeadlocking) {
  Watchdog dog;
  CpuStream stream;
  std::string message;
  stream.host_task([&] { message = thrown_message([&] { stream.synchronize(); }); });
  stream.synchronize();
  EXPECT_NE(message.find("wait forever"), std::string::npos) << message;
}

class ForeignEvent final : public Event {
 public:
  void synchronize() override {}
  bool ready() const override { return true; }
};

TEST(CpuStream, RejectsEventsOfAnotherBackend) {
  CpuStream stream;
  ForeignEvent foreign;
  EXPECT_NE(thrown_message([&] { stream.record(foreign); }).find("not created by a cpu device"),
            std::string::npos);
  EXPECT_THROW(stream.wait(foreign), Error);
  EXPECT_THROW(stream.host_task(std::function<void()>()), Error);
}

TEST(CpuStream, AsCpuStreamRecognizesOnlyCpuStreams) {
  CpuStream stream;
  Stream& base = stream;
  EXPECT_EQ(as_cpu_stream(base), &stream);
}

std::vector<int> affinity_of_this_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  return cpus;
}

// Where the worker of a stream made with `bind_to` runs.
std::vector<int> stream_worker_affinity(std::vector<int> bind_to = {}) {
  CpuStream stream(nullptr, std::move(bind_to));
  std::vector<int> ran_on;
  stream.host_task([&] { ran_on = affinity_of_this_thread(); });
  stream.synchronize();
  return ran_on;
}

// A stream's worker runs on the cpus its device carries (the rank's, which a Runtime chose: so the
// ranks of a node keep their copies and collectives apart), and otherwise keeps the binding of the
// thread that created it (a launcher's, e.g. mpirun --bind-to core), never widened to the machine.
TEST(CpuStream, WorkerRunsOnTheDevicesCpusElseInheritsItsCreatorsBinding) {
  const std::vector<int> allowed = detail::allowed_cpus();
  std::vector<int> inherited, given, from_device;
  std::thread creator([&] {
    ASSERT_TRUE(detail::try_bind_current_thread(allowed.back()));
    inherited = stream_worker_affinity();
    given = stream_worker_affinity({allowed.front()});
    auto device = make_cpu_device(4096, {allowed.front()});
    auto stream = device->create_stream();
    stream->host_task([&] { from_device = affinity_of_this_thread(); });
    stream->synchronize();
  });
  creator.join();
  EXPECT_EQ(inherited, std::vector<int>{allowed.back()});
  EXPECT_EQ(given, std::vector<int>{allowed.front()});
  EXPECT_EQ(from_device, std::vector<int>{allowed.front()});
}

}  // namespace
}  // namespace zest
