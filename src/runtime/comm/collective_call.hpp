// CollectiveCall: one collective as a host-memory backend (MPI, a torch.distributed gloo group) sees
// it, with the checks every such backend makes before moving data.
//
// Argument checks (null buffers, overlaps other than the in-place forms) are this rank's own; the
// agreement then makes every rank see the same outcome: before moving data the ranks all-reduce
// (max) agreement_values() of their calls, and check_agreement() throws the same CommError on every
// rank when any rank's arguments were invalid, any rank's stream had already failed, or the ranks
// disagree on the collective, count, dtype, reduce op or root. A mismatch is an error, not a hang or
// silently mixed data, and the communicator stays usable.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "zest/communicator.hpp"
#include "zest/dtype.hpp"

namespace zest {

enum class CollectiveKind : std::int64_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  all_to_all,
  all_reduce_host_double,
  all_reduce_host_int64
};
const char* collective_kind_name(CollectiveKind kind);

struct CollectiveCall {
  CollectiveKind kind;
  const void* send;
  void* recv;
  std::size_t count;
  DType dtype;
  ReduceOp op;
  int root;
  std::string invalid;  // why this rank's arguments are unusable; empty when they are fine
};

// The calls as communicator.hpp defines them, on `rank` of `size`, their arguments checked.
CollectiveCall all_reduce_call(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op);
CollectiveCall reduce_scatter_call(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                                   int rank, int size);
CollectiveCall all_gather_call(const void* send, void* recv, std::size_t send_count, DType dtype, int rank,
                               int size);
CollectiveCall all_to_all_call(const void* send, void* recv, std::size_t count, DType dtype, int size);
CollectiveCall broadcast_call(void* buffer, std::size_t count, DType dtype, int root, int size);
// all_reduce_host over `count` values at `values` (kind: one of the two host kinds).
CollectiveCall host_all_reduce_call(CollectiveKind kind, void* values, std::size_t count, ReduceOp op);

// Whether the call is in place by communicator.hpp's conventions (reduce_scatter: recv is this
// rank's block of send; all_gather: send is this rank's block of recv).
bool reduce_scatter_in_place(const CollectiveCall& call, int rank);
bool all_gather_in_place(const CollectiveCall& call, int rank);

// What a rank contributes to the agreement: its call's fields and their negations, so one max over
// ranks gives every field's max and (negated) min.
inline constexpr std::size_t kAgreementValues = 14;
using AgreementValues = std::array<std::int64_t, kAgreementValues>;
AgreementValues agreement_values(const CollectiveCall& call, int rank, bool stream_failed);
// Throws CommError, the same on every rank, unless every rank's call (`reduced`: the max over ranks
// of agreement_values) matched this one and no rank's arguments or stream had failed.
void check_agreement(const CollectiveCall& call, const std::int64_t* reduced);

}  // namespace zest
