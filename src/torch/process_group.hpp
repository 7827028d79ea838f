// zest's ranks and collectives over a torch.distributed process group (the World behind
// zest::torch::process_group_world).
//
// The ranks are the group's. Each rank's host is found through the group's store (its hostname and
// network namespace), so local ranks, the wire-bytes split between hosts and hpZ's host groups work
// as under MPI. The collectives:
//   - on the cpu device: ProcessGroupCommunicator, over two groups of zest's own per communicator
//     (one for the stream collectives, one for the host ones, as MPI's communicator keeps two, so
//     zest's traffic never interleaves with the program's own collectives on the group), made by
//     the GroupMaker (the Python package: dist.new_group). They need a cpu backend (gloo).
//   - on a cuda device: zest's own NCCL communicator, its unique id passed from rank 0 through the
//     group's store (a separate NCCL communicator from torch's, as under MPI).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>

#include "runtime/comm/world.hpp"
#include "zest/torch.hpp"

namespace zest::torch::detail {

// Collective over the group's ranks (every rank calls it, in the same order as its other zest
// worlds over the group). `timeout` bounds the wait for every rank's host (0: the store's own).
// `make_group` (empty: splitGroup of `group`) makes zest's groups (zest::torch::GroupMaker).
std::shared_ptr<World> make_process_group_world(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                std::chrono::milliseconds timeout, GroupMaker make_group);

}  // namespace zest::torch::detail
