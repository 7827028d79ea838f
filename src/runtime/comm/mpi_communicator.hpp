// The MPI communicator: collectives on cpu-device buffers, each one a host task on the caller's
// stream that issues a nonblocking MPI_I* call and waits for it on the stream's worker, so the
// calling thread never blocks and the collectives run in stream order.
//
// Before moving data every collective agrees across ranks (one tiny MPI_Iallreduce) on what is
// being done: collective, count, dtype, reduce op, root, and whether any rank's arguments were
// invalid. On disagreement every rank throws CommError (through Stream::synchronize()) and no data
// moves, so a mismatch is an error rather than a hang, and the communicator stays usable.
//
// Besides the cases in communicator.hpp, reduce_scatter also runs in place when
// recv == send + rank() * recv_count elements (NCCL's convention).
//
// Every collective and barrier runs under a CollectiveWatchdog: one blocked for the timeout (a rank
// skipped or added one, died, or hangs) throws CommError naming each rank's state, and the
// communicator is unusable afterwards (see collective_watchdog.hpp). MPI errors return to zest
// (MPI_ERRORS_RETURN) instead of aborting the job.
//
// Threading: collectives on one communicator must reach MPI in the same order on every rank; issue
// them on one stream, or order the streams with events. barrier() may be called while collectives
// are in flight. Every rank constructs its communicators together (construction is collective);
// a communicator must outlive the work it enqueued (synchronize before destroying it) and be
// destroyed before its MpiSession.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "runtime/comm/collective_call.hpp"
#include "runtime/comm/collective_watchdog.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/base_types.hpp"
#include "zest/communicator.hpp"
#include "zest/mpi.hpp"

namespace zest {

// Over session.world(). Throws CommError when `device` is not host-accessible (MPI moves host
// memory; use nccl on cuda). (Over another MPI communicator: zest/mpi.hpp.) `timeout`: how long a
// collective or barrier may block before it raises (0 = forever).
std::unique_ptr<Communicator> make_mpi_communicator(
    MpiSession& session, Device& device, std::chrono::milliseconds timeout = kDefaultCommTimeout);

class MpiCommunicator final : public Communicator {
 public:
  // MPI counts are int: larger collectives are split into pieces of at most this many elements.
  static constexpr std::size_t kMaxChunkElements = static_cast<std::size_t>(INT_MAX);

  // Collective over `comm` (duplicated: the caller may free `comm` afterwards). MPI must provide
  // MPI_THREAD_MULTIPLE. `max_chunk_elements` (1..kMaxChunkElements) exists so tests can exercise
  // the splitting. `timeout`: see make_mpi_communicator. `responder`: whether its watchdog answers
  // the peers' queries (CollectiveWatchdog::Responder; the splits of this one do not).
  MpiCommunicator(MPI_Comm comm, Device& device,
                  std::size_t max_chunk_elements = kMaxChunkElements,
                  std::chrono::milliseconds timeout = kDefaultCommTimeout,
                  CollectiveWatchdog::Responder responder = CollectiveWatchdog::Responder::run);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "mpi"; }
  int host_of(int rank) const override { return host_in(hosts_, rank); }
  std::unique_ptr<Communicator> split_by_host() override;
  std::unique_ptr<Communicator> split_across_hosts() override;

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  Stream& stream) override;
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op, Stream& stream) override;
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                  Stream& stream) override;
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, Stream& stream) override;
  void broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override;
  void barrier() override;
  void all_reduce_host(std::span<double> values, ReduceOp op) override;
  void all_reduce_host(std::span<std::int64_t> values, ReduceOp op) override;

  // Data-moving MPI calls issued so far (not counting the agreement step): shows the splitting.
  std::uint64_t mpi_calls_issued() const { return mpi_calls_.load(std::memory_order_relaxed); }

 private:
  void enqueue(CollectiveCall call, Stream& stream);
  void run(const CollectiveCall& call, bool stream_failed);
  // Every rank's call must match, and no rank's arguments or stream (`stream_failed`: an earlier
  // task on it threw) may have failed: else every rank throws CommError, and none moves data.
  // Agreed on `comm` under the watchdog's `operation`, in `extremes` (16 values): comm_ and
  // agreement_ for the stream collectives, host_comm_ and host_agreement_ for the host ones.
  void agree(const CollectiveCall& call, bool stream_failed, MPI_Comm comm,
             const CollectiveWatchdog::Operation& operation, std::int64_t* extremes);
  // all_reduce_host: agreed and run on the calling thread, over host_comm_.
  void run_host_all_reduce(const CollectiveCall& call, MPI_Datatype type);
  void run_all_reduce(const CollectiveCall& call);
  void run_reduce_scatter(const CollectiveCall& call);
  void run_all_gather(const CollectiveCall& call);
  void run_broadcast(const CollectiveCall& call);
  void run_all_to_all(const CollectiveCall& call);
  // A communicator over `split` (a split of host_comm_), which it duplicates; frees `split`.
  std::unique_ptr<Communicator> over_split(MPI_Comm split);
  MPI_Datatype mpi_type(DType dtype) const;
  MPI_Op mpi_op(DType dtype, ReduceOp op) const;
  // Waits for a request of the collective running on the stream worker (`collective_`).
  void wait(MPI_Request& request);

  MPI_Comm comm_ = MPI_COMM_NULL;  // collectives issued from stream workers
  // barrier() and all_reduce_host() run on the caller's thread while a stream worker may be inside
  // a collective on comm_; MPI matches collectives by issue order per communicator, so the two
  // must not share one.
  MPI_Comm host_comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> hosts_;  // rank -> host (host_numbers)
  std::size_t max_chunk_;
  Device& device_;                      // split_by_host's, like the timeout
  std::chrono::milliseconds timeout_;
  // User-defined reductions for the 16-bit types: [fp16 sum, fp16 max, bf16 sum, bf16 max].
  MPI_Op half_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  std::atomic<std::uint64_t> mpi_calls_{0};
  std::unique_ptr<CollectiveWatchdog> watchdog_;
  // The collective the stream worker is running (only that thread touches these two).
  const CollectiveWatchdog::Operation* collective_ = nullptr;
  // The agreements' buffers outlive any one collective: after a timeout MPI may still write them.
  // One per thread that agrees (the stream worker; the caller's thread for all_reduce_host).
  std::int64_t agreement_[16] = {};
  std::int64_t host_agreement_[16] = {};
};

}  // namespace zest
