#include "runtime/mpi_communicator.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "runtime/half.hpp"
#include "runtime/mpi_check.hpp"
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

const char* op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "max"; }

std::byte* at(void* base, std::size_t elements, std::size_t element_size) {
  return static_cast<std::byte*>(base) + elements * element_size;
}
const std::byte* at(const void* base, std::size_t elements, std::size_t element_size) {
  return static_cast<const std::byte*>(base) + elements * element_size;
}

bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto a0 = reinterpret_cast<std::uintptr_t>(a);
  const auto b0 = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes != 0 && b_bytes != 0 && a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

std::string null_buffer_message(const char* what, std::size_t count) {
  std::string message(what);
  message.append(": a buffer is null while count is ").append(std::to_string(count));
  message.append(" (pass device buffers, or count 0)");
  return message;
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
    throw CommError("mpi communicator: the timeout is negative (" +
                    std::to_string(timeout.count()) + " ms); pass 0 to wait forever");
  }
  if (max_chunk_ == 0 || max_chunk_ > kMaxChunkElements) {
    std::string message = "mpi communicator: chunk limit ";
    message.append(std::to_string(max_chunk_)).append(" is outside 1..INT_MAX elements");
    throw CommError(message);
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

const char* MpiCommunicator::kind_name(Kind kind) {
  switch (kind) {
    case Kind::all_reduce:
      return "all_reduce";
    case Kind::reduce_scatter:
      return "reduce_scatter";
    case Kind::all_gather:
      return "all_gather";
    case Kind::broadcast:
      return "broadcast";
    case Kind::all_to_all:
      return "all_to_all";
    case Kind::all_reduce_host_double:
      return "all_reduce_host(double)";
    case Kind::all_reduce_host_int64:
      return "all_reduce_host(int64)";
  }
  return "?";
}

void MpiCommunicator::all_reduce(const void* send, void* recv, std::size_t count, DType dtype,
                                 ReduceOp op, Stream& stream) {
  Call call{Kind::all_reduce, send, recv, count, dtype, op, 0, {}};
  const std::size_t bytes = count * dtype_size(dtype);
  if (count != 0 && (send == nullptr || recv == nullptr))
    call.invalid = null_buffer_message("all_reduce", count);
  else if (send != recv && overlap(send, bytes, recv, bytes))
    call.invalid =
        "all_reduce: send and recv overlap without being the same buffer; pass "
        "send == recv to reduce in place";
  enqueue(std::move(call), stream);
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                     DType dtype, ReduceOp op, Stream& stream) {
  Call call{Kind::reduce_scatter, send, recv, recv_count, dtype, op, 0, {}};
  const std::size_t element = dtype_size(dtype);
  if (recv_count != 0) {
    const std::size_t send_bytes = static_cast<std::size_t>(size_) * recv_count * element;
    if (send == nullptr || recv == nullptr)
      call.invalid = null_buffer_message("reduce_scatter", recv_count);
    else if (recv != at(send, static_cast<std::size_t>(rank_) * recv_count, element) &&
             overlap(send, send_bytes, recv, recv_count * element))
      call.invalid =
          "reduce_scatter: recv overlaps send without being this rank's block of it "
          "(send + rank() * recv_count elements); pass separate buffers or that block";
  }
  enqueue(std::move(call), stream);
}

void MpiCommunicator::all_gather(const void* send, void* recv, std::size_t send_count, DType dtype,
                                 Stream& stream) {
  Call call{Kind::all_gather, send, recv, send_count, dtype, ReduceOp::sum, 0, {}};
  const std::size_t element = dtype_size(dtype);
  if (send_count != 0) {
    const std::size_t recv_bytes = static_cast<std::size_t>(size_) * send_count * element;
    if (send == nullptr || recv == nullptr)
      call.invalid = null_buffer_message("all_gather", send_count);
    else if (send != at(recv, static_cast<std::size_t>(rank_) * send_count, element) &&
             overlap(send, send_count * element, recv, recv_bytes))
      call.invalid =
          "all_gather: send overlaps recv without being this rank's block of it "
          "(recv + rank() * send_count elements); pass separate buffers or that block";
  }
  enqueue(std::move(call), stream);
}

void MpiCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType dtype,
                                 Stream& stream) {
  Call call{Kind::all_to_all, send, recv, count, dtype, ReduceOp::sum, 0, {}};
  const std::size_t bytes = static_cast<std::size_t>(size_) * count * dtype_size(dtype);
  if (count != 0 && (send == nullptr || recv == nullptr))
    call.invalid = null_buffer_message("all_to_all", count);
  else if (overlap(send, bytes, recv, bytes))
    call.invalid =
        "all_to_all: send and recv overlap (an all-to-all has no in-place form: a rank's block would "
        "be overwritten before it is sent); pass separate buffers";
  enqueue(std::move(call), stream);
}

void MpiCommunicator::broadcast(void* buffer, std::size_t count, DType dtype, int root,
                                Stream& stream) {
  Call call{Kind::broadcast, buffer, buffer, count, dtype, ReduceOp::sum, root, {}};
  if (root < 0 || root >= size_) {
    call.invalid = "broadcast: root ";
    call.invalid.append(std::to_string(root)).append(" is not a rank (the communicator has ");
    call.invalid.append(std::to_string(size_)).append(" ranks)");
  } else if (count != 0 && buffer == nullptr) {
    call.invalid = null_buffer_message("broadcast", count);
  }
  enqueue(std::move(call), stream);
}

void MpiCommunicator::barrier() {
  const CollectiveWatchdog::Operation operation =
      watchdog_->begin(CollectiveWatchdog::Lane::barrier, "barrier");
  MPI_Request request = MPI_REQUEST_NULL;
  ZEST_MPI_CHECK(MPI_Ibarrier(host_comm_, &request));
  watchdog_->wait(request, operation);
}

void MpiCommunicator::all_reduce_host(std::span<double> values, ReduceOp op) {
  run_host_all_reduce({Kind::all_reduce_host_double, values.data(), values.data(), values.size(),
                       DType::f32, op, 0, {}},
                      MPI_DOUBLE);
}

void MpiCommunicator::all_reduce_host(std::span<std::int64_t> values, ReduceOp op) {
  run_host_all_reduce({Kind::all_reduce_host_int64, values.data(), values.data(), values.size(),
                       DType::f32, op, 0, {}},
                      MPI_INT64_T);
}

void MpiCommunicator::run_host_all_reduce(Call call, MPI_Datatype type) {
  if (call.count != 0 && call.recv == nullptr)
    call.invalid = null_buffer_message(kind_name(call.kind), call.count);
  // On the caller's thread, as barrier(): bounded by the watchdog in the same lane.
  const CollectiveWatchdog::Operation operation =
      watchdog_->begin(CollectiveWatchdog::Lane::barrier, kind_name(call.kind));
  agree(call, false, host_comm_, operation, host_agreement_);
  const int element = type == MPI_DOUBLE ? sizeof(double) : sizeof(std::int64_t);
  const MPI_Op op = call.op == ReduceOp::max ? MPI_MAX : MPI_SUM;
  for_each_chunk(call.count, max_chunk_, [&](std::size_t offset, int n) {
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, at(call.recv, offset, element), n, type, op, host_comm_, &request));
    watchdog_->wait(request, operation);
  });
}

void MpiCommunicator::enqueue(Call call, Stream& stream) {
  // In lockstep: a rank whose stream already failed still reaches the agreement, so that every
  // rank raises instead of waiting for it.
  stream.lockstep_task([this, call = std::move(call)](bool stream_failed) { run(call, stream_failed); });
}

void MpiCommunicator::run(const Call& call, bool stream_failed) {
  const CollectiveWatchdog::Operation operation =
      watchdog_->begin(CollectiveWatchdog::Lane::collective, kind_name(call.kind));
  collective_ = &operation;
  // collective_ points into this frame: cleared on every way out, so it never dangles.
  struct Clear {
    const CollectiveWatchdog::Operation*& current;
    ~Clear() { current = nullptr; }
  } clear{collective_};
  agree(call, stream_failed, comm_, operation, agreement_);
  if (call.count == 0) return;
  switch (call.kind) {
    case Kind::all_reduce:
      run_all_reduce(call);
      break;
    case Kind::reduce_scatter:
      run_reduce_scatter(call);
      break;
    case Kind::all_gather:
      run_all_gather(call);
      break;
    case Kind::broadcast:
      run_broadcast(call);
      break;
    case Kind::all_to_all:
      run_all_to_all(call);
      break;
    case Kind::all_reduce_host_double:
    case Kind::all_reduce_host_int64:
      break;  // never enqueued: run on the caller's thread by run_host_all_reduce
  }
}

// One MPI_MAX over the signature and its negation gives every rank the max and the min of each
// field; equal min and max means every rank asked for the same thing.
void MpiCommunicator::agree(const Call& call, bool stream_failed, MPI_Comm comm,
                            const CollectiveWatchdog::Operation& operation, std::int64_t* extremes) {
  enum Field { kind, count, dtype, op, root, invalid_rank, failed_rank, kFields };
  const bool reduces =
      call.kind != Kind::all_gather && call.kind != Kind::broadcast && call.kind != Kind::all_to_all;
  std::int64_t signature[kFields] = {
      static_cast<std::int64_t>(call.kind),
      static_cast<std::int64_t>(call.count),
      static_cast<std::int64_t>(call.dtype),
      reduces ? static_cast<std::int64_t>(call.op) : 0,
      call.kind == Kind::broadcast ? call.root : 0,
      call.invalid.empty() ? -1 : rank_,
      stream_failed ? rank_ : -1,
  };
  static_assert(2 * kFields <= sizeof agreement_ / sizeof agreement_[0]);
  for (int i = 0; i < kFields; ++i) {
    extremes[i] = signature[i];
    extremes[kFields + i] = -signature[i];
  }
  MPI_Request request = MPI_REQUEST_NULL;
  ZEST_MPI_CHECK(
      MPI_Iallreduce(MPI_IN_PLACE, extremes, 2 * kFields, MPI_INT64_T, MPI_MAX, comm, &request));
  watchdog_->wait(request, operation);
  const auto max = [&](Field f) { return extremes[f]; };
  const auto min = [&](Field f) { return -extremes[kFields + f]; };

  std::string message = kind_name(call.kind);
  if (max(failed_rank) >= 0) {
    // The failed rank's stream keeps its own first error; this one reaches the others.
    message.append(": rank ").append(std::to_string(max(failed_rank)));
    message.append("'s stream failed before this collective (its own error says why); no rank moved data");
    throw CommError(message);
  }
  if (!call.invalid.empty()) throw CommError(call.invalid);
  if (max(invalid_rank) >= 0) {
    message.append(": rank ").append(std::to_string(max(invalid_rank)));
    message.append(" passed invalid arguments (its own error says which); no rank moved data");
    throw CommError(message);
  }
  if (min(kind) != max(kind)) {
    message.append(": ranks disagree on the collective: ");
    message.append(kind_name(static_cast<Kind>(min(kind)))).append(" on some ranks, ");
    message.append(kind_name(static_cast<Kind>(max(kind)))).append(" on others");
    message.append(" (every rank must issue the same collectives in the same order)");
    throw CommError(message);
  }
  if (min(count) != max(count)) {
    message.append(": ranks disagree on count: min ").append(std::to_string(min(count)));
    message.append(", max ").append(std::to_string(max(count)));
    message.append(" (every rank must pass the same count; pad in the caller)");
    throw CommError(message);
  }
  if (min(dtype) != max(dtype)) {
    message.append(": ranks disagree on dtype: ");
    message.append(dtype_name(static_cast<DType>(min(dtype)))).append(" on some ranks, ");
    message.append(dtype_name(static_cast<DType>(max(dtype)))).append(" on others");
    message.append(" (every rank must pass the same dtype)");
    throw CommError(message);
  }
  if (min(op) != max(op)) {
    message.append(": ranks disagree on the reduce op: ");
    message.append(op_name(static_cast<ReduceOp>(min(op)))).append(" on some ranks, ");
    message.append(op_name(static_cast<ReduceOp>(max(op)))).append(" on others");
    message.append(" (every rank must pass the same op)");
    throw CommError(message);
  }
  if (min(root) != max(root)) {
    message.append(": ranks disagree on root: min ").append(std::to_string(min(root)));
    message.append(", max ").append(std::to_string(max(root)));
    message.append(" (every rank must pass the same root)");
    throw CommError(message);
  }
}

void MpiCommunicator::run_all_reduce(const Call& call) {
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

void MpiCommunicator::run_reduce_scatter(const Call& call) {
  const std::size_t element = dtype_size(call.dtype);
  const std::size_t count = call.count;
  const bool in_place =
      call.recv == at(call.send, static_cast<std::size_t>(rank_) * count, element);
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

void MpiCommunicator::run_all_gather(const Call& call) {
  const std::size_t element = dtype_size(call.dtype);
  const std::size_t count = call.count;
  std::byte* own_block = at(call.recv, static_cast<std::size_t>(rank_) * count, element);
  const bool in_place = call.send == own_block;
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

void MpiCommunicator::run_broadcast(const Call& call) {
  const std::size_t element = dtype_size(call.dtype);
  const MPI_Datatype type = mpi_type(call.dtype);
  for_each_chunk(call.count, max_chunk_, [&](std::size_t offset, int n) {
    MPI_Request request = MPI_REQUEST_NULL;
    ZEST_MPI_CHECK(MPI_Ibcast(at(call.recv, offset, element), n, type, call.root, comm_, &request));
    mpi_calls_.fetch_add(1, std::memory_order_relaxed);
    wait(request);
  });
}

void MpiCommunicator::run_all_to_all(const Call& call) {
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
