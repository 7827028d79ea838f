// PendingWatchdog: bounds how long an asynchronous collective may stay incomplete, for backends
// whose collectives the host only enqueues (NCCL on a CUDA stream) and then waits for somewhere
// else (a stream or event synchronize), where no timeout can be put.
//
// Each enqueued operation is tracked with a poll that says whether it has completed (a CUDA event
// recorded after it). A thread polls the oldest incomplete operation; once it has been the oldest
// for `timeout` — or the backend reports a failure of its own (NCCL's asynchronous error: a peer
// died, the network broke) — the watchdog is broken: it records why, naming the operation and its
// number on this rank, and calls `abort` once, which must end every pending operation (ncclCommAbort
// makes the hung kernels return, so the host's blocked synchronize returns too). From then on
// check() and track() throw CommError with that message: the communicator is unusable, and the
// process should end.
//
// The clock of an operation starts when it becomes the oldest incomplete one (when it is tracked,
// or when the one before it completes), so work queued on the stream ahead of it counts against it:
// a timeout bounds a hang, it is not a latency target (the default is 10 minutes).
//
// Threading: track() and check() from any thread; polls, `health` and `abort` run on the
// watchdog's thread, never under a lock the callers take.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace zest {

class PendingWatchdog {
 public:
  using Poll = std::function<bool()>;            // true once the operation has completed
  using Health = std::function<std::string()>;   // the backend's own failure, "" while none
  using Abort = std::function<void()>;           // ends every pending operation

  // `who` names this rank's communicator in messages ("nccl rank 3"). `timeout` 0: no thread runs,
  // track() only counts, and nothing is bounded.
  PendingWatchdog(std::string who, std::chrono::milliseconds timeout, Health health, Abort abort,
                  std::chrono::milliseconds poll_interval = std::chrono::milliseconds(100));
  ~PendingWatchdog();
  PendingWatchdog(const PendingWatchdog&) = delete;
  PendingWatchdog& operator=(const PendingWatchdog&) = delete;

  // Tracks operation number n+1 (`name`, a string literal) until `done` says it completed; returns
  // its number. Throws CommError once broken.
  std::uint64_t track(const char* name, Poll done);
  // Throws CommError once broken (the first failure's message).
  void check() const;
  bool broken() const;
  // Whether it bounds anything (timeout > 0): otherwise a poll given to track() is never called.
  bool bounded() const { return timeout_.count() > 0; }

 private:
  struct Pending {
    std::uint64_t number;
    const char* name;
    Poll done;
  };
  void watch();
  // The failure found by one pass over the pending operations ("" while none).
  std::string inspect(std::chrono::steady_clock::time_point now);

  const std::string who_;
  const std::chrono::milliseconds timeout_, poll_interval_;
  const Health health_;
  const Abort abort_;

  mutable std::mutex mutex_;
  std::deque<Pending> pending_;
  std::chrono::steady_clock::time_point oldest_since_{};
  std::uint64_t issued_ = 0;
  std::string failure_;
  bool stopping_ = false;
  std::condition_variable wake_;
  std::thread thread_;  // last: starts once everything above is initialized
};

}  // namespace zest
