// The cpu backend's streams and events: each CpuStream is a real worker thread running its queue
// in order, so asynchronous copies, host tasks and collectives overlap the submitting thread.
//
// Semantics follow CUDA:
// - record() places a mark at the end of the queue; recording the same event again moves the mark.
// - wait() captures the event's mark at the time of the call: work submitted afterwards starts
//   once that mark is reached. Re-recording the event later does not change what was waited for.
//   Waiting on a never-recorded event is a no-op.
// - Errors: the first exception a task throws fails the stream. Later tasks of a failed stream are
//   SKIPPED (they would consume what the failed work did not produce), but marks still complete,
//   carrying the error, so nothing waiting on them hangs. Event::synchronize() on such a mark
//   rethrows it, and a stream that waits on a failed mark fails with the same error (its work
//   depended on the failed work). synchronize() rethrows the error once and then clears it: the
//   error has reached the host, and work submitted afterwards runs normally (a communicator or
//   pipeline may go on after reporting a failure).
//
// Threading: submit from one host thread at a time (the Stream contract); synchronize() and the
// device's synchronize() may run from any thread. The destructor drains the queue, then joins.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "zest/device.hpp"

namespace zest {

namespace detail {

// One recorded point in a stream's queue. Shared by the event, the queue and any waiters, so it
// outlives whichever of them goes first.
class CpuMark {
 public:
  void complete(std::exception_ptr error);
  // Blocks until complete; returns the stream's error at the mark (null when it was healthy).
  std::exception_ptr wait() const;
  bool done() const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class CpuStreamWorker;

// The streams a device created, so Device::synchronize() can drain them all. Holds them weakly:
// a stream that is destroyed has drained already.
class CpuStreamRegistry {
 public:
  void add(const std::shared_ptr<CpuStreamWorker>& worker);
  // Drains every live stream; rethrows the first error found after all have drained.
  void synchronize_all();

 private:
  std::mutex mutex_;
  std::vector<std::weak_ptr<CpuStreamWorker>> workers_;
};

}  // namespace detail

class CpuEvent final : public Event {
 public:
  void synchronize() override;
  bool ready() const override;

  // The current mark; null when never recorded.
  std::shared_ptr<detail::CpuMark> mark() const;
  void set_mark(std::shared_ptr<detail::CpuMark> mark);

 private:
  mutable std::mutex mutex_;
  std::shared_ptr<detail::CpuMark> mark_;
};

class CpuStream final : public Stream {
 public:
  // `registry` (may be null) is the creating device's list of streams. `cpus`: where its worker
  // runs (best effort; empty: it keeps the binding of the thread that creates the stream).
  explicit CpuStream(std::shared_ptr<detail::CpuStreamRegistry> registry = nullptr, std::vector<int> cpus = {});
  ~CpuStream() override;
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  // Throws zest::Error when `event` was not made by a cpu device.
  void record(Event& event) override;
  void wait(const Event& event) override;
  void host_task(std::function<void()> task) override;
  void lockstep_task(std::function<void(bool stream_failed)> task) override;
  void synchronize() override;

  // The device that created this stream (identified by its registry); null for a lone stream.
  const detail::CpuStreamRegistry* registry() const { return registry_.get(); }

 private:
  std::shared_ptr<detail::CpuStreamRegistry> registry_;
  std::shared_ptr<detail::CpuStreamWorker> worker_;
};

// `stream` as a CpuStream, or null when another backend made it.
CpuStream* as_cpu_stream(Stream& stream) noexcept;

}  // namespace zest
