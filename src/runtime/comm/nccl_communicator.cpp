// NCCL collectives on the caller's CUDA streams; the unique id comes from rank 0 through the
// World's broadcast (MPI, or nothing in a world of one), or the program hands over a communicator
// it made itself (zest/nccl.hpp).
#include "runtime/comm/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <source_location>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "runtime/device/cuda_check.hpp"
#include "runtime/device/cuda_device.hpp"
#include "runtime/comm/nccl_check.hpp"
#include "runtime/device/pending_watchdog.hpp"
#include "zest/error.hpp"
#include "zest/nccl.hpp"

namespace zest {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
  }
  throw CommError(fmt::format("nccl: unknown dtype {}; pass fp32, fp16 or bf16", static_cast<int>(dtype)));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
  }
  throw CommError(fmt::format("nccl: unknown reduce op {}; pass sum or max", static_cast<int>(op)));
}

// What rank 0 broadcasts: the id, or why it has none, so every rank fails together instead of
// the others waiting forever in the broadcast for a rank that threw.
struct Bootstrap {
  ncclUniqueId id;
  int result;
};

// Starts NCCL for `rank` of `size` on cuda:`ordinal`, the id coming from rank 0 via `broadcast`.
ncclComm_t start_nccl(int ordinal, int rank, int size, const BroadcastFromRankZero& broadcast) {
  Bootstrap bootstrap{};
  if (rank == 0) bootstrap.result = static_cast<int>(ncclGetUniqueId(&bootstrap.id));
  broadcast(&bootstrap, sizeof bootstrap);
  if (bootstrap.result != static_cast<int>(ncclSuccess)) {
    const auto code = static_cast<ncclResult_t>(bootstrap.result);
    throw CommError(std::string("ncclGetUniqueId failed on rank 0: ")
                        .append(ncclGetErrorString(code))
                        .append("; check rank 0's network interfaces (NCCL_SOCKET_IFNAME) and "
                                "run with NCCL_DEBUG=WARN for NCCL's reason"));
  }
  // NCCL binds the communicator to the current device.
  ZEST_CUDA_CHECK(cudaSetDevice(ordinal));
  ncclComm_t comm = nullptr;
  try {
    ZEST_NCCL_CHECK(ncclCommInitRank(&comm, size, bootstrap.id, rank));
  } catch (const CommError& error) {
    throw CommError(
        fmt::format("starting NCCL for rank {} of {} on cuda:{}: {}; each rank needs its own GPU (start one "
                    "rank per GPU), and NCCL_DEBUG=INFO shows where the bootstrap stopped",
                    rank, size, ordinal, error.what()));
  }
  return comm;
}

// Host scalars go through NCCL via a few bytes of device memory and a stream of the
// communicator's own, so the trainer's all_reduce_host needs neither (and barrier() is one).
constexpr std::size_t kHostScratchBytes = 1024;

// A CUDA event that ends with the last copy of its handle (the watchdog's poll holds one).
using SharedEvent = std::shared_ptr<CUevent_st>;

// How long the watchdog's abort waits for a collective being enqueued (NCCL may block in the
// enqueue itself, connecting to a peer) before it aborts under it.
constexpr auto kEnqueueGrace = std::chrono::seconds(5);

class NcclCommunicator final : public Communicator {
 public:
  // `owned`: zest made `comm` and ends it; otherwise the program does, after this is destroyed.
  // `timeout` (comm.timeout; 0 = none): a collective not complete after it aborts `comm`.
  // `hosts`: each rank's host, or empty (all on one host).
  NcclCommunicator(ncclComm_t comm, bool owned, int ordinal, std::chrono::milliseconds timeout, std::vector<int> hosts)
      : ordinal_(ordinal), timeout_(timeout), comm_(comm), owned_(owned), hosts_(std::move(hosts)) {
    try {
      ZEST_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
      ZEST_NCCL_CHECK(ncclCommCount(comm_, &size_));
      ZEST_CUDA_CHECK(cudaSetDevice(ordinal_));
      ZEST_CUDA_CHECK(cudaStreamCreateWithFlags(&host_stream_, cudaStreamNonBlocking));
      ZEST_CUDA_CHECK(cudaMalloc(&host_scratch_, kHostScratchBytes));
      watchdog_ = std::make_unique<PendingWatchdog>(
          fmt::format("nccl rank {}", rank_), timeout, [this] { return async_error(); },
          [this] { abort_under_watchdog(); });
    } catch (...) {
      release();
      throw;
    }
  }

  ~NcclCommunicator() override { release(); }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend_name() const override { return "nccl"; }
  int host_of(int rank) const override { return host_in(hosts_, rank); }
  // ncclCommSplit by host: collective over this communicator. Its ranks share one host.
  std::unique_ptr<Communicator> split_by_host() override {
    check_hosts_known("partition.secondary: none");
    return split(host_of(rank_), rank_, {});
  }

  // ncclCommSplit by place on the host, ranked by host: each of its ranks is on a host of its own.
  std::unique_ptr<Communicator> split_across_hosts() override {
    check_hosts_known("comm.quantize.grads: none");
    const int place = place_on_host(rank_);
    // The new communicator's ranks: one per host that has a rank at `place`.
    std::vector<int> ranks_on(static_cast<std::size_t>(size_), 0);
    for (int r = 0; r < size_; ++r) ++ranks_on[static_cast<std::size_t>(host_of(r))];
    std::vector<int> hosts;
    for (const int n : ranks_on)
      if (n > place) hosts.push_back(static_cast<int>(hosts.size()));
    return split(place, host_of(rank_), std::move(hosts));
  }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  Stream& stream) override {
    enqueue("all_reduce", cuda_stream_handle(stream), [&](cudaStream_t handle) {
      ZEST_NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, handle));
    });
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype,
                      ReduceOp op, Stream& stream) override {
    enqueue("reduce_scatter", cuda_stream_handle(stream), [&](cudaStream_t handle) {
      ZEST_NCCL_CHECK(ncclReduceScatter(send, recv, recv_count, nccl_type(dtype), nccl_op(op), comm_, handle));
    });
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                  Stream& stream) override {
    enqueue("all_gather", cuda_stream_handle(stream), [&](cudaStream_t handle) {
      ZEST_NCCL_CHECK(ncclAllGather(send, recv, send_count, nccl_type(dtype), comm_, handle));
    });
  }

  // One group of a send and a receive per peer (and to itself), so NCCL runs them together.
  void all_to_all(const void* send, void* recv, std::size_t count, DType dtype, Stream& stream) override {
    const std::size_t block = count * dtype_size(dtype);
    const std::size_t bytes = static_cast<std::size_t>(size_) * block;
    if (count != 0 && (send == nullptr || recv == nullptr))
      throw CommError(
          fmt::format("all_to_all: a buffer is null while count is {} (pass device buffers, or count 0)", count));
    const auto send0 = reinterpret_cast<std::uintptr_t>(send);
    const auto recv0 = reinterpret_cast<std::uintptr_t>(recv);
    if (bytes != 0 && send0 < recv0 + bytes && recv0 < send0 + bytes)
      throw CommError(
          "all_to_all: send and recv overlap (an all-to-all has no in-place form); pass separate buffers");
    const ncclDataType_t type = nccl_type(dtype);
    enqueue("all_to_all", cuda_stream_handle(stream), [&](cudaStream_t handle) {
      ZEST_NCCL_CHECK(ncclGroupStart());
      // The group ends whatever happens inside it, or NCCL stays in group mode on this thread.
      ncclResult_t posted = ncclSuccess;
      for (int r = 0; r < size_ && posted == ncclSuccess; ++r) {
        const std::size_t at = static_cast<std::size_t>(r) * block;
        posted = ncclSend(static_cast<const unsigned char*>(send) + at, count, type, r, comm_, handle);
        if (posted == ncclSuccess)
          posted = ncclRecv(static_cast<unsigned char*>(recv) + at, count, type, r, comm_, handle);
      }
      const ncclResult_t ended = ncclGroupEnd();
      if (posted != ncclSuccess)
        detail::throw_nccl_error("ncclSend/ncclRecv (all_to_all)", posted, std::source_location::current());
      ZEST_NCCL_CHECK(ended);
    });
  }

  void broadcast(void* buffer, std::size_t count, DType dtype, int root, Stream& stream) override {
    if (root < 0 || root >= size_) {
      throw CommError(
          fmt::format("broadcast: root {} is not a rank of this world of {}; pass a root in [0, size())", root, size_));
    }
    enqueue("broadcast", cuda_stream_handle(stream), [&](cudaStream_t handle) {
      ZEST_NCCL_CHECK(ncclBroadcast(buffer, buffer, count, nccl_type(dtype), root, comm_, handle));
    });
  }

  // No rank gets the result of an all-reduce before every rank has contributed to it.
  void barrier() override {
    std::int64_t token = 0;
    all_reduce_host(std::span<std::int64_t>(&token, 1), ReduceOp::sum);
  }

  void all_reduce_host(std::span<double> values, ReduceOp op) override {
    reduce_host(values.data(), values.size(), sizeof(double), ncclFloat64, op);
  }
  void all_reduce_host(std::span<std::int64_t> values, ReduceOp op) override {
    reduce_host(values.data(), values.size(), sizeof(std::int64_t), ncclInt64, op);
  }

 private:
  // A program's ncclComm_t does not say which ranks share a host; `instead` is the config that
  // needs no split.
  void check_hosts_known(const char* instead) const {
    if (hosts_.empty() && size_ > 1)
      throw CommError(std::string("this nccl communicator was made from the program's ncclComm_t and does not "
                                  "know which ranks share a host; use zest's nccl backend (comm.backend: nccl), or ")
                          .append(instead));
  }

  // ncclCommSplit of this communicator (collective over it) into a zest communicator that owns the
  // new one; `hosts`: its ranks' hosts, as host_of gives them.
  std::unique_ptr<Communicator> split(int color, int key, std::vector<int> hosts) {
    ZEST_CUDA_CHECK(cudaSetDevice(ordinal_));
    ncclComm_t made = nullptr;
    ZEST_NCCL_CHECK(ncclCommSplit(comm_, color, key, &made, nullptr));
    try {
      return std::make_unique<NcclCommunicator>(made, true, ordinal_, timeout_, std::move(hosts));
    } catch (...) {
      static_cast<void>(ncclCommAbort(made));
      throw;
    }
  }

  // Launches one collective on `stream` and has the watchdog track it to completion (an event
  // recorded after it). Refuses once the watchdog aborted the communicator; the lock keeps the
  // abort from freeing the communicator under a collective being enqueued.
  template <class Launch>
  void enqueue(const char* name, cudaStream_t stream, Launch launch) {
    std::unique_lock lock(enqueue_mutex_);
    watchdog_->check();
    check_async_error();
    // NCCL launches its kernels on the current device.
    ZEST_CUDA_CHECK(cudaSetDevice(ordinal_));
    launch(stream);
    if (!watchdog_->bounded()) return;  // comm.timeout 0: no event to record
    cudaEvent_t raw = nullptr;
    ZEST_CUDA_CHECK(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
    const SharedEvent done(raw, [](cudaEvent_t e) { static_cast<void>(cudaEventDestroy(e)); });
    ZEST_CUDA_CHECK(cudaEventRecord(done.get(), stream));
    // A failed query counts as complete: its error reaches the host through the stream.
    watchdog_->track(name, [done] { return cudaEventQuery(done.get()) != cudaErrorNotReady; });
  }

  // The watchdog's abort: ncclCommAbort makes this rank's pending NCCL kernels return, so a host
  // blocked on them (a stream synchronize) goes on and its next collective throws.
  void abort_under_watchdog() {
    std::unique_lock lock(enqueue_mutex_, std::defer_lock);
    static_cast<void>(lock.try_lock_for(kEnqueueGrace));
    static_cast<void>(ncclCommAbort(comm_));
  }

  // Through the scratch buffer in pieces on the communicator's own stream, waited for here.
  void reduce_host(void* values, std::size_t count, std::size_t element, ncclDataType_t type,
                   ReduceOp op) {
    if (count != 0 && values == nullptr) {
      throw CommError(
          fmt::format("all_reduce_host: values is null while count is {} (pass host values, or count 0)", count));
    }
    const std::size_t per_piece = kHostScratchBytes / element;
    auto* bytes = static_cast<unsigned char*>(values);
    for (std::size_t done = 0; done < count;) {
      const std::size_t n = std::min(per_piece, count - done);
      unsigned char* piece = bytes + done * element;
      ZEST_CUDA_CHECK(cudaSetDevice(ordinal_));
      ZEST_CUDA_CHECK(cudaMemcpyAsync(host_scratch_, piece, n * element, cudaMemcpyHostToDevice,
                                      host_stream_));
      enqueue("all_reduce_host", host_stream_, [&](cudaStream_t handle) {
        ZEST_NCCL_CHECK(ncclAllReduce(host_scratch_, host_scratch_, n, type, nccl_op(op), comm_, handle));
      });
      ZEST_CUDA_CHECK(cudaMemcpyAsync(piece, host_scratch_, n * element, cudaMemcpyDeviceToHost,
                                      host_stream_));
      ZEST_CUDA_CHECK(cudaStreamSynchronize(host_stream_));
      watchdog_->check();  // the wait ended because the watchdog aborted: the values are not sums
      done += n;
    }
  }

  // A failure inside NCCL's own threads (a peer died, the network broke) is reported here, before
  // the next collective would wait for it forever.
  void check_async_error() {
    const std::string failure = async_error();
    if (!failure.empty()) throw CommError(fmt::format("rank {}: {}", rank_, failure));
  }

  // NCCL's asynchronous failure ("" while none); the watchdog asks too, from its thread.
  std::string async_error() const {
    ncclResult_t async_error = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &async_error);
    if (queried != ncclSuccess) async_error = queried;
    if (async_error == ncclSuccess || async_error == ncclInProgress) return "";
    return fmt::format(
        "NCCL reported an asynchronous failure: {} ({}); a peer rank or the network failed, see that rank's error, and "
        "rerun with NCCL_DEBUG=WARN",
        ncclGetErrorString(async_error), ncclGetLastError(comm_));
  }

  // Errors are ignored: a destructor (or a constructor that failed) cannot report them.
  void release() noexcept {
    // First the watchdog's thread ends; if it aborted the communicator, that ended it.
    const bool aborted = watchdog_ && watchdog_->broken();
    watchdog_.reset();
    if (aborted) comm_ = nullptr;
    static_cast<void>(cudaSetDevice(ordinal_));
    if (host_scratch_ != nullptr) static_cast<void>(cudaFree(host_scratch_));
    if (host_stream_ != nullptr) static_cast<void>(cudaStreamDestroy(host_stream_));
    host_scratch_ = nullptr;
    host_stream_ = nullptr;
    if (!owned_ || comm_ == nullptr) return;
    ncclResult_t async_error = ncclSuccess;
    const bool broken = ncclCommGetAsyncError(comm_, &async_error) != ncclSuccess ||
                        async_error != ncclSuccess;
    // ncclCommDestroy flushes this rank's outstanding collectives, which never finish when a peer
    // failed or this rank is unwinding from an error between collectives; abort never blocks.
    if (broken || std::uncaught_exceptions() > 0) {
      static_cast<void>(ncclCommAbort(comm_));
    } else {
      static_cast<void>(ncclCommDestroy(comm_));
    }
    comm_ = nullptr;
  }

  int ordinal_;
  std::chrono::milliseconds timeout_;  // the splits'
  ncclComm_t comm_;
  bool owned_;
  std::vector<int> hosts_;
  int rank_ = 0;
  int size_ = 1;
  cudaStream_t host_stream_ = nullptr;
  void* host_scratch_ = nullptr;
  std::timed_mutex enqueue_mutex_;
  std::unique_ptr<PendingWatchdog> watchdog_;  // last: its thread uses the members above
};

int checked_ordinal(const Device& device) {
  const int ordinal = cuda_device_ordinal(device);
  if (ordinal < 0) {
    throw CommError(std::string("the nccl communicator needs a cuda device, but the device is ")
                        .append(device.name())
                        .append("; set device.type: cuda, or comm.backend: mpi (or auto) for a "
                                "cpu device"));
  }
  return ordinal;
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Device& device, int rank, int size,
                                                     const BroadcastFromRankZero& broadcast,
                                                     std::chrono::milliseconds timeout, std::vector<int> hosts) {
  const int ordinal = checked_ordinal(device);
  ncclComm_t comm = start_nccl(ordinal, rank, size, broadcast);
  try {
    return std::make_unique<NcclCommunicator>(comm, true, ordinal, timeout, std::move(hosts));
  } catch (...) {
    static_cast<void>(ncclCommAbort(comm));
    throw;
  }
}

std::unique_ptr<Communicator> make_communicator(ncclComm_t comm, Device& device, std::chrono::milliseconds timeout) {
  if (comm == nullptr) {
    throw CommError(
        "make_communicator: the ncclComm_t is null; pass one made by ncclCommInitRank (or "
        "ncclCommSplit) that is still alive");
  }
  const int ordinal = checked_ordinal(device);
  int comm_device = -1;
  ZEST_NCCL_CHECK(ncclCommCuDevice(comm, &comm_device));
  if (comm_device != ordinal) {
    throw CommError(
        fmt::format("make_communicator: the ncclComm_t runs on cuda:{} but the device is {}; pass the zest "
                    "Device of the GPU the communicator was made on",
                    comm_device, device.name()));
  }
  return std::make_unique<NcclCommunicator>(comm, false, ordinal, timeout, std::vector<int>{});
}

}  // namespace zest
