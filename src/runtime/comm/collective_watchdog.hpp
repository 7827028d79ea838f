// CollectiveWatchdog: turns a collective that never completes into CommError on every rank blocked
// in one, instead of a hang.
//
// A collective blocks forever when a rank skipped it, issued one more than the others, died, or
// hangs elsewhere. MPI cannot tell those apart from a slow peer, so the watchdog bounds the wait:
// wait() polls the request (MPI_Test) until it completes or the operation has been blocked for
// the timeout. Then it asks every other rank, on a communicator of its own, where it is: each
// rank runs a small responder thread that answers with its count of operations per lane, whether
// it is inside one, and which. A rank that does not answer within a grace period is gone (dead,
// or its whole process hangs). The CommError names the operation, its number on each rank and
// which ranks are behind, ahead or gone. The pending request cannot be cancelled (MPI has no
// cancel for collectives), so the watchdog is broken afterwards: every later operation throws at
// once, and the process should end.
//
// Lanes are independent sequences of operations that each run on one thread at a time: the
// communicator's collectives (its stream worker) and its barriers (the host thread).
//
// Threading: begin()/wait()/end() of one lane from one thread at a time; the lanes and the
// responder run concurrently (MPI_THREAD_MULTIPLE). Construction and destruction are collective.
#pragma once

#include <mpi.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace zest {

class CollectiveWatchdog {
 public:
  enum class Lane { collective, barrier };
  static constexpr int kLanes = 2;

  // Whether this watchdog's ranks answer each other's queries. `none` is for a communicator split
  // from another whose processes already run a responder (partition.secondary's host,
  // comm.quantize.grads' ranks across hosts): every responder polls MPI, and with three per
  // process Open MPI's TCP progress stalled collectives for hundreds of milliseconds (two
  // simulated hosts, 4 ranks on 2 cores). Its timeout still raises, naming no peer's state.
  enum class Responder { run, none };

  // Duplicates `comm` for its queries. `timeout` 0 turns the watchdog off: wait() is MPI_Wait and
  // no responder thread runs (every rank must pass the same timeout and responder).
  CollectiveWatchdog(MPI_Comm comm, std::chrono::milliseconds timeout, Responder responder = Responder::run);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // One operation of a lane, from begin to end; `name` must outlive it (a string literal).
  class Operation {
   public:
    ~Operation();
    Operation(const Operation&) = delete;
    Operation& operator=(const Operation&) = delete;
    std::uint64_t number() const { return number_; }

   private:
    friend class CollectiveWatchdog;
    Operation(CollectiveWatchdog& owner, Lane lane, std::uint64_t number)
        : owner_(owner), lane_(lane), number_(number) {}
    CollectiveWatchdog& owner_;
    Lane lane_;
    std::uint64_t number_;
  };

  // Starts operation number n+1 of `lane`. Throws CommError when an earlier operation timed out.
  [[nodiscard]] Operation begin(Lane lane, const char* name);
  // Waits for `request` of `operation`. Throws CommError naming every rank's state when the
  // operation has been blocked for the timeout, or when MPI reports an error (a peer's death).
  void wait(MPI_Request& request, const Operation& operation);

  std::chrono::milliseconds timeout() const { return timeout_; }

  // What one rank reports about one lane; sent as bytes between ranks.
  struct LaneState {
    std::int64_t issued = 0;    // operations begun so far
    std::int64_t active = 0;    // 1 while inside the last one
    std::int64_t waited_ms = 0; // how long it has been inside it
    char name[24] = {};
  };
  struct RankState {
    std::array<LaneState, kLanes> lanes;
    char failed[40] = {};  // the operation that timed out or failed on this rank ("" while none)
  };

 private:
  void end(Lane lane);
  RankState snapshot() const;
  void respond();
  // Asks the other ranks for their state and throws the CommError that describes them all.
  [[noreturn]] void fail(const Operation& operation, const std::string& cause);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  Responder responder_mode_;

  mutable std::mutex mutex_;
  RankState state_;
  std::array<std::chrono::steady_clock::time_point, kLanes> since_{};
  std::string broken_;  // the first failure's message; operations throw it once set
  int queries_ = 0;     // distinct reply tags for each query this rank sends

  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread responder_;  // last: starts once everything above is initialized
};

}  // namespace zest
