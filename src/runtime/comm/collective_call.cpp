#include "runtime/comm/collective_call.hpp"

#include <cstdint>
#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest {
namespace {

const char* op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "max"; }

const std::byte* at(const void* base, std::size_t elements, std::size_t element_size) {
  return static_cast<const std::byte*>(base) + elements * element_size;
}

bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto a0 = reinterpret_cast<std::uintptr_t>(a);
  const auto b0 = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes != 0 && b_bytes != 0 && a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

std::string null_buffer_message(const char* what, std::size_t count) {
  return fmt::format("{}: a buffer is null while count is {} (pass device buffers, or count 0)", what, count);
}

}  // namespace

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::all_to_all: return "all_to_all";
    case CollectiveKind::all_reduce_host_double: return "all_reduce_host(double)";
    case CollectiveKind::all_reduce_host_int64: return "all_reduce_host(int64)";
  }
  return "?";
}

CollectiveCall all_reduce_call(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) {
  CollectiveCall call{CollectiveKind::all_reduce, send, recv, count, dtype, op, 0, {}};
  const std::size_t bytes = count * dtype_size(dtype);
  if (count != 0 && (send == nullptr || recv == nullptr))
    call.invalid = null_buffer_message("all_reduce", count);
  else if (send != recv && overlap(send, bytes, recv, bytes))
    call.invalid =
        "all_reduce: send and recv overlap without being the same buffer; pass send == recv to reduce in place";
  return call;
}

CollectiveCall reduce_scatter_call(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                                   int rank, int size) {
  CollectiveCall call{CollectiveKind::reduce_scatter, send, recv, recv_count, dtype, op, 0, {}};
  if (recv_count == 0) return call;
  const std::size_t element = dtype_size(dtype);
  const std::size_t send_bytes = static_cast<std::size_t>(size) * recv_count * element;
  if (send == nullptr || recv == nullptr)
    call.invalid = null_buffer_message("reduce_scatter", recv_count);
  else if (!reduce_scatter_in_place(call, rank) && overlap(send, send_bytes, recv, recv_count * element))
    call.invalid = "reduce_scatter: recv overlaps send without being this rank's block of it "
                   "(send + rank() * recv_count elements); pass separate buffers or that block";
  return call;
}

CollectiveCall all_gather_call(const void* send, void* recv, std::size_t send_count, DType dtype, int rank,
                               int size) {
  CollectiveCall call{CollectiveKind::all_gather, send, recv, send_count, dtype, ReduceOp::sum, 0, {}};
  if (send_count == 0) return call;
  const std::size_t element = dtype_size(dtype);
  const std::size_t recv_bytes = static_cast<std::size_t>(size) * send_count * element;
  if (send == nullptr || recv == nullptr)
    call.invalid = null_buffer_message("all_gather", send_count);
  else if (!all_gather_in_place(call, rank) && overlap(send, send_count * element, recv, recv_bytes))
    call.invalid = "all_gather: send overlaps recv without being this rank's block of it "
                   "(recv + rank() * send_count elements); pass separate buffers or that block";
  return call;
}

CollectiveCall all_to_all_call(const void* send, void* recv, std::size_t count, DType dtype, int size) {
  CollectiveCall call{CollectiveKind::all_to_all, send, recv, count, dtype, ReduceOp::sum, 0, {}};
  const std::size_t bytes = static_cast<std::size_t>(size) * count * dtype_size(dtype);
  if (count != 0 && (send == nullptr || recv == nullptr))
    call.invalid = null_buffer_message("all_to_all", count);
  else if (overlap(send, bytes, recv, bytes))
    call.invalid = "all_to_all: send and recv overlap (an all-to-all has no in-place form: a rank's block would "
                   "be overwritten before it is sent); pass separate buffers";
  return call;
}

CollectiveCall broadcast_call(void* buffer, std::size_t count, DType dtype, int root, int size) {
  CollectiveCall call{CollectiveKind::broadcast, buffer, buffer, count, dtype, ReduceOp::sum, root, {}};
  if (root < 0 || root >= size)
    call.invalid = fmt::format("broadcast: root {} is not a rank (the communicator has {} ranks)", root, size);
  else if (count != 0 && buffer == nullptr)
    call.invalid = null_buffer_message("broadcast", count);
  return call;
}

CollectiveCall host_all_reduce_call(CollectiveKind kind, void* values, std::size_t count, ReduceOp op) {
  CollectiveCall call{kind, values, values, count, DType::f32, op, 0, {}};
  if (count != 0 && values == nullptr) call.invalid = null_buffer_message(collective_kind_name(kind), count);
  return call;
}

bool reduce_scatter_in_place(const CollectiveCall& call, int rank) {
  return call.recv == at(call.send, static_cast<std::size_t>(rank) * call.count, dtype_size(call.dtype));
}

bool all_gather_in_place(const CollectiveCall& call, int rank) {
  return call.send == at(call.recv, static_cast<std::size_t>(rank) * call.count, dtype_size(call.dtype));
}

namespace {
enum Field { kind_field, count_field, dtype_field, op_field, root_field, invalid_rank, failed_rank, kFields };
static_assert(2 * kFields == kAgreementValues);
}  // namespace

AgreementValues agreement_values(const CollectiveCall& call, int rank, bool stream_failed) {
  const bool reduces = call.kind != CollectiveKind::all_gather && call.kind != CollectiveKind::broadcast &&
                       call.kind != CollectiveKind::all_to_all;
  const std::int64_t signature[kFields] = {
      static_cast<std::int64_t>(call.kind),
      static_cast<std::int64_t>(call.count),
      static_cast<std::int64_t>(call.dtype),
      reduces ? static_cast<std::int64_t>(call.op) : 0,
      call.kind == CollectiveKind::broadcast ? call.root : 0,
      call.invalid.empty() ? -1 : rank,
      stream_failed ? rank : -1,
  };
  AgreementValues values{};
  for (int i = 0; i < kFields; ++i) {
    values[i] = signature[i];
    values[kFields + i] = -signature[i];
  }
  return values;
}

void check_agreement(const CollectiveCall& call, const std::int64_t* reduced) {
  const auto max = [&](Field f) { return reduced[f]; };
  const auto min = [&](Field f) { return -reduced[kFields + f]; };
  const auto disagree = [&](Field f) { return min(f) != max(f); };
  std::string message = collective_kind_name(call.kind);
  if (max(failed_rank) >= 0) {
    // The failed rank's stream keeps its own first error; this one reaches the others.
    throw CommError(
        fmt::format("{}: rank {}'s stream failed before this collective (its own error says why); no rank moved data",
                    message, max(failed_rank)));
  }
  if (!call.invalid.empty()) throw CommError(call.invalid);
  if (max(invalid_rank) >= 0)
    throw CommError(fmt::format("{}: rank {} passed invalid arguments (its own error says which); no rank moved data",
                                message, max(invalid_rank)));
  if (disagree(kind_field))
    throw CommError(
        fmt::format("{}: ranks disagree on the collective: {} on some ranks, {} on others (every rank "
                    "must issue the same collectives in the same order)",
                    message, collective_kind_name(static_cast<CollectiveKind>(min(kind_field))),
                    collective_kind_name(static_cast<CollectiveKind>(max(kind_field)))));
  if (disagree(count_field))
    throw CommError(fmt::format(
        "{}: ranks disagree on count: min {}, max {} (every rank must pass the same count; pad in the caller)", message,
        min(count_field), max(count_field)));
  if (disagree(dtype_field))
    throw CommError(fmt::format(
        "{}: ranks disagree on dtype: {} on some ranks, {} on others (every rank must pass the same dtype)", message,
        dtype_name(static_cast<DType>(min(dtype_field))), dtype_name(static_cast<DType>(max(dtype_field)))));
  if (disagree(op_field))
    throw CommError(fmt::format(
        "{}: ranks disagree on the reduce op: {} on some ranks, {} on others (every rank must pass the same op)",
        message, op_name(static_cast<ReduceOp>(min(op_field))), op_name(static_cast<ReduceOp>(max(op_field)))));
  if (disagree(root_field))
    throw CommError(fmt::format("{}: ranks disagree on root: min {}, max {} (every rank must pass the same root)",
                                message, min(root_field), max(root_field)));
}

}  // namespace zest
