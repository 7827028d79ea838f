#include "runtime/comm/mpi_communicator.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "runtime/comm/collective_call.hpp"
#include "runtime/host/half.hpp"
#include "runtime/comm/mpi_check.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

// MPI reduces 16-bit floats through these: widen each pair to float, combine, round back. The
// result is what a float accumulator rounded after every step gives, as NCCL does for half types.
template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float), bool kMax>
void reduce_16bit(void* in, void* inout, int* length, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  const int n = *length;
  for (int i = 0; i < n; ++i) {
    const float x = ToFloat(a[i]);
    const float y = ToFloat(b[i]);
    float r;
    if constexpr (kMax) {
      r = (x > y || std::isnan(x)) ? x : y;  // NaN wins whichever side it is on: commutative
    } else {
      r = x + y;
    }
    b[i] = FromFloat(r);
  }
}

std::byte* at(void* base, std::size_t elements, std::size_t element_size) {
  return static_cast<std::byte*>(base) + elements * element_size;
}
const std::byte* at(const void* base, std::size_t elements, std::size_t element_size) {
  return static_cast<const std::byte*>(base) + elements * element_size;
}

// Calls f(offset, n) over [0, count) in pieces of at most max_chunk elements.
template <class F>
void for_each_chunk(std::size_t count, std::size_t max_chunk, F&& f) {
  for (std::size_t offset = 0; offset < count;) {
    const std::size_t n = std::min(max_chunk, count - offset);
    f(offset, static_cast<int>(n));
    offset += n;
  }
}

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MpiSession& session, Device& device,
                                                    std::chrono::milliseconds timeout) {
  return std::make_unique<MpiCommunicator>(session.world(), device, MpiCommunicator::kMaxChunkElements, timeout);
}

std::unique_ptr<Communicator> make_communicator(MPI_Comm comm, Device& device) {
  return std::make_unique<MpiCommunicator>(comm, device);
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, Device& device, std::size_t max_chunk_elements,
                                 std::chrono::milliseconds timeout, CollectiveWatchdog::Responder responder)
    : max_chunk_(max_chunk_elements), device_(device), timeout_(timeout) {
  int initialized = 0;
  ZEST_MPI_CHECK(MPI_Initialized(&initialized));
  int provided = MPI_THREAD_SINGLE;
  if (initialized) ZEST_MPI_CHECK(MPI_Query_thread(&provided));
  // Stream workers issue collectives while the host thread runs; a lesser level would be undefined
  // behaviour rather than a slowdown.
  if (!initialized || provided < MPI_THREAD_MULTIPLE) {
    throw CommError(
        "the mpi communicator needs MPI initialized with MPI_THREAD_MULTIPLE (zest's streams issue "
        "collectives from worker threads); call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
        "first, or let zest::Runtime initialize MPI");
  }
  if (comm == MPI_COMM_NULL) {
    throw CommError(
        "the mpi communicator was given MPI_COMM_NULL (a rank left out of an MPI_Comm_split gets "
        "that); make zest's communicator only on the ranks that belong to one");
  }
  if (!device.host_accessible()) {
    std::string message =
        "the mpi communicator needs the cpu device (MPI moves host memory), "
        "but the device is ";
    message.append(device.name()).append(": use comm.backend: nccl with a cuda device");
    throw CommError(message);
  }
  if (timeout.count() < 0) {
    throw CommError(
        fmt::format("mpi communicator: the timeout is negative ({} ms); pass 0 to wait forever", timeout.count()));
  }
  if (max_chunk_ == 0 || max_chunk_ > kMaxChunkElements) {
    throw CommError(fmt::format("mpi communicator: chunk limit {} is outside 1..INT_MAX elements", max_chunk_));
  }
  // A communicator of its own, so its traffic never matches collectives other code issues on the
  // given one (the NCCL bootstrap, the program).
  ZEST_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  try {
    ZEST_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    ZEST_MPI_CHECK(MPI_Comm_dup(comm_, &host_comm_));
    watchdog_ = std::make_unique<CollectiveWatchdog>(comm_, timeout, responder);
    ZEST_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    ZEST_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    hosts_ = host_numbers(comm_);
    ZEST_MPI_CHECK(
        MPI_Op_create(&reduce_16bit<fp16_to_float, float_to_fp16, false>, 1, &half_ops_[0]));
    ZEST_MPI_CHECK(
        MPI_Op_create(&reduce_16bit<fp16_to_float, float_to_fp16, true>, 1, &half_ops_[1]));
    ZEST_MPI_CHECK(
        MPI_Op_create(&reduce_16bit<bf16_to_float, float_to_bf16, false>, 1, &half_ops_[2]));
    ZEST_MPI_CHECK(
        MPI_Op_create(&reduce_16bit<bf16_to_float, float_to_bf16, true>, 1, &half_ops_[3]));
  } catch (...) {
    watchdog_.reset();
    for (MPI_Op& op : half_ops_)
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
    if (host_comm_ != MPI_COMM_NULL) MPI_Comm_free(&host_comm_);
    MPI_Comm_free(&comm_);
    throw;
  }
}

// The splits run on the caller's thread's duplicate: the stream worker may be in a collective on
// comm_.
std::unique_ptr<Communicator> MpiCommunicator::split_by_host() {
  MPI_Comm host = MPI_COMM_NULL;
  ZEST_MPI_CHECK(MPI_Comm_split_type(host_comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &host));
  return over_split(host);
}

std::unique_ptr<Communicator> MpiCommunicator::split_across_hosts() {
  MPI_Comm across = MPI_COMM_NULL;
  ZEST_MPI_CHECK(MPI_Comm_split(host_comm_, place_on_host(rank_), host_of(rank_), &across));
  return over_split(across);
}

std::unique_ptr<Communicator> MpiCommunicator::over_split(MPI_Comm split) {
  try {
    // Its watchdog answers no queries: this one's responder already polls MPI for the process.
    auto made = std::make_unique<MpiCommunicator>(split, device_, max_chunk_, timeout_,
                                                  CollectiveWatchdog::Responder::none);  // duplicates `split`
    MPI_Comm_free(&split);
    return made;
  } catch (...) {
    MPI_Comm_free(&split);
    throw;
  }
}

// Errors are ignored: a destructor cannot report them, and MPI_ERRORS_RETURN keeps them from
// aborting the job.
MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  watchdog_.reset();  // its responder thread calls MPI
  for (MPI_Op& op : half_ops_)
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  if (host_comm_ != MPI_COMM_NULL) MPI_Comm_free(&host_comm_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                                 ReduceOp op, Stream& stream) {
  enqueue(all_reduce_call(send, recv, count, dtype, op), stream);
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                     DType dtype, ReduceOp op, Stream& stream) {
  enqueue(reduce_scatter_call(send, recv, recv_count, dtype, op, rank_, size_), stream);
}

void MpiCommunicator::all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                                 Stream& stream) {
  enqueue(all_gather_call(send, recv, send_count, dtype, rank_, size_), stream);
}

void MpiCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                                 Stream& stream) {
  enqueue(all_to_all_call(send, recv, count, dtype, size_), stream);
}

void MpiCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root,
                                Stream& stream) {
  enqueue(broadcast_call(buffer, count, dtype, root, size_), stream);
}

void MpiCommunicator::barrier() {
  const CollectiveWatchdog::Operation operation =
      watchdog_->begin(CollectiveWatchdog::Lane::barrier, "barrier");
  MPI_Request request = MPI_REQUEST_NULL;
  ZEST_MPI_CHECK(MPI_Ibarrier(host_comm_, &request));
  watchdog_->wait(request, operation);
}

void MpiCommunicator::all_reduce_host(std::span<double> values, ReduceOp op) {
  run_host_all_reduce(
      host_all_reduce_call(CollectiveKind::all_reduce_host_double, values.data(), values.size(), op), MPI_DOUBLE);
}

void MpiCommunicator::all_reduce_host(std::span<std::int64_t> values, ReduceOp op) {
  run_host_all_reduce(
      host_all_reduce_call(CollectiveKind::all_reduce_host_int64, values.data(), values.size(), op), MPI_INT64_T);
}

void MpiCommunicator::run_host_all_reduce(const CollectiveCall& call, MPI_Datatype type) {
  // On the caller's thread, as barrier(): bounded by the watchdog in the same lane.
  const CollectiveWatchdog::Operation operation =
      watchdog_->begin(CollectiveWatchdog::Lane::barrier, collective_kind_name(call.kind));
  agree(call, false, host_comm_, operation, host_agreement_);
  const int element = type == MPI_DOUBLE ? sizeof(double) : sizeof(std::int64_t);
  const MPI_Op op = call.op == ReduceOp::max ? MPI_MAX : MPI_SUM;
  for_each_chunk(call.count, max_chunk_, [&](std::size_t offset, int n) {
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, at(call.recv, offset, element), n, type, op, host_comm_, &request));
    watchdog_->wait(request, operation);
  });
}

void MpiCommunicator::enqueue(CollectiveCall call, Stream& stream) {
  // In lockstep: a rank whose stream already failed still reaches the agreement, so that every
  // rank raises instead of waiting for it.
  stream.lockstep_task([this, call = std::move(call)](bool stream_failed) { run(call, stream_failed); });
}

void MpiCommunicator::run(const CollectiveCall& call, bool stream_failed) {
  const CollectiveWatchdog::Operation operation =
      watchdog_->begin(CollectiveWatchdog::Lane::collective, collective_kind_name(call.kind));
  collective_ = &operation;
  // collective_ points into this frame: cleared on every way out, so it never dangles.
  struct Clear {
    const CollectiveWatchdog::Operation*& current;
    ~Clear() { current = nullptr; }
  } clear{collective_};
  agree(call, stream_failed, comm_, operation, agreement_);
  if (call.count == 0) return;
  switch (call.kind) {
    case CollectiveKind::all_reduce:
      run_all_reduce(call);
      break;
    case CollectiveKind::reduce_scatter:
      run_reduce_scatter(call);
      break;
    case CollectiveKind::all_gather:
      run_all_gather(call);
      break;
    case CollectiveKind::broadcast:
      run_broadcast(call);
      break;
    case CollectiveKind::all_to_all:
      run_all_to_all(call);
      break;
    case CollectiveKind::all_reduce_host_double:
    case CollectiveKind::all_reduce_host_int64:
      break;  // never enqueued: run on the caller's thread by run_host_all_reduce
  }
}

void MpiCommunicator::agree(const CollectiveCall& call, bool stream_failed, MPI_Comm comm,
                            const CollectiveWatchdog::Operation& operation, std::int64_t* extremes) {
  const AgreementValues values = agreement_values(call, rank_, stream_failed);
  std::copy(values.begin(), values.end(), extremes);
  MPI_Request request = MPI_REQUEST_NULL;
  ZEST_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, extremes, static_cast<int>(values.size()), MPI_INT64_T, MPI_MAX,
                                comm, &request));
  watchdog_->wait(request, operation);
  check_agreement(call, extremes);
}

void MpiCommunicator::run_all_reduce(const CollectiveCall& call) {
  const std::size_t element = dtype_size(call.dtype);
  const bool in_place = call.send == call.recv;
  const MPI_Datatype type = mpi_type(call.dtype);
  const MPI_Op op = mpi_op(call.dtype, call.op);
  for_each_chunk(call.count, max_chunk_, [&](std::size_t offset, int n) {
    const void* send = in_place ? MPI_IN_PLACE : at(call.send, offset, element);
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(
        MPI_Iallreduce(send, at(call.recv, offset, element), n, type, op, comm_, &request));
    mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    wait(request);
  });
}

void MpiCommunicator::run_reduce_scatter(const CollectiveCall& call) {
  const std::size_t element = dtype_size(call.dtype);
  const std::size_t count = call.count;
  const bool in_place = reduce_scatter_in_place(call, rank_);
  const MPI_Datatype type = mpi_type(call.dtype);
  const MPI_Op op = mpi_op(call.dtype, call.op);
  if (!in_place && count <= max_chunk_) {
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(MPI_Ireduce_scatter_block(call.send, call.recv, static_cast<int>(count), type,
                                             op, comm_, &request));
    mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    wait(request);
    return;
  }
  // A piece of every block is not contiguous in send (and MPI's in-place reduce_scatter wants a
  // different layout), so reduce each block's piece to its owner. MPI_IN_PLACE at the root takes
  // its input from recv, which in place is the root's own block of send.
  std::vector<MPI_Request> requests(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  for_each_chunk(count, max_chunk_, [&](std::size_t offset, int n) {
    for (int r = 0; r < size_; ++r) {
      const bool mine = r == rank_;
      const void* send = (mine && in_place)
                             ? MPI_IN_PLACE
                             : at(call.send, static_cast<std::size_t>(r) * count + offset, element);
      void* recv = mine ? at(call.recv, offset, element) : nullptr;
      ZEST_MPI_CHECK(
          MPI_Ireduce(send, recv, n, type, op, r, comm_, &requests[static_cast<std::size_t>(r)]));
      mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    }
    for (MPI_Request& request : requests) wait(request);
  });
}

void MpiCommunicator::run_all_gather(const CollectiveCall& call) {
  const std::size_t element = dtype_size(call.dtype);
  const std::size_t count = call.count;
  std::byte* own_block = at(call.recv, static_cast<std::size_t>(rank_) * count, element);
  const bool in_place = all_gather_in_place(call, rank_);
  const MPI_Datatype type = mpi_type(call.dtype);
  if (count <= max_chunk_) {
    const void* send = in_place ? MPI_IN_PLACE : call.send;
    const int n = static_cast<int>(count);
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(MPI_Iallgather(send, n, type, call.recv, n, type, comm_, &request));
    mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    wait(request);
    return;
  }
  // A piece of every block is not contiguous in recv: place this rank's block, then each owner
  // broadcasts its pieces.
  if (!in_place) std::memcpy(own_block, call.send, count * element);
  std::vector<MPI_Request> requests(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  for_each_chunk(count, max_chunk_, [&](std::size_t offset, int n) {
    for (int r = 0; r < size_; ++r) {
      void* piece = at(call.recv, static_cast<std::size_t>(r) * count + offset, element);
      ZEST_MPI_CHECK(MPI_Ibcast(piece, n, type, r, comm_, &requests[static_cast<std::size_t>(r)]));
      mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    }
    for (MPI_Request& request : requests) wait(request);
  });
}

void MpiCommunicator::run_broadcast(const CollectiveCall& call) {
  const std::size_t element = dtype_size(call.dtype);
  const MPI_Datatype type = mpi_type(call.dtype);
  for_each_chunk(call.count, max_chunk_, [&](std::size_t offset, int n) {
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(MPI_Ibcast(at(call.recv, offset, element), n, type, call.root, comm_, &request));
    mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    wait(request);
  });
}

void MpiCommunicator::run_all_to_all(const CollectiveCall& call) {
  const std::size_t element = dtype_size(call.dtype);
  const std::size_t count = call.count;
  const MPI_Datatype type = mpi_type(call.dtype);
  if (count <= max_chunk_) {
    const int n = static_cast<int>(count);
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(MPI_Ialltoall(call.send, n, type, call.recv, n, type, comm_, &request));
    mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    wait(request);
    return;
  }
  // MPI_Ialltoall's count is per block, so a piece of every block would need a strided datatype;
  // instead each piece goes straight to its peer (a receive and a send per peer), and this rank's
  // own block is a copy. Every rank posts the same pieces in the same order, and messages between
  // two ranks on one communicator and tag arrive in the order sent, so the pieces match.
  const auto me = static_cast<std::size_t>(rank_);
  std::memcpy(at(call.recv, me * count, element), at(call.send, me * count, element), count * element);
  std::vector<MPI_Request> requests(2 * static_cast<std::size_t>(size_ - 1), MPI_REQUEST_NULL);
  constexpr int kTag = 0;  // comm_ carries no other point-to-point traffic
  for_each_chunk(count, max_chunk_, [&](std::size_t offset, int n) {
    std::size_t next = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const std::size_t piece = static_cast<std::size_t>(r) * count + offset;
      ZEST_MPI_CHECK(MPI_Irecv(at(call.recv, piece, element), n, type, r, kTag, comm_, &requests[next++]));
      ZEST_MPI_CHECK(MPI_Isend(at(call.send, piece, element), n, type, r, kTag, comm_, &requests[next++]));
      mpi_calls_.fetch_add(2, std::memory_order_relaxed);
    }
    for (MPI_Request& request : requests) wait(request);
  });
}

MPI_Datatype MpiCommunicator::mpi_type(DType dtype) const {
  return dtype == DType::f32 ? MPI_FLOAT : MPI_UINT16_T;
}

MPI_Op MpiCommunicator::mpi_op(DType dtype, ReduceOp op) const {
  const int max = op == ReduceOp::max ? 1 : 0;
  switch (dtype) {
    case DType::f32:
      return max ? MPI_MAX : MPI_SUM;
    case DType::f16:
      return half_ops_[max];
    case DType::bf16:
      return half_ops_[2 + max];
  }
  return MPI_OP_NULL;
}

void MpiCommunicator::wait(MPI_Request& request) { watchdog_->wait(request, *collective_); }

}  // namespace zest
