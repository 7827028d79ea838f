// The NCCL backend of zest::Communicator, for a cuda Device. Plain declarations, so code that picks
// a backend at run time (World) includes it whether or not zest was built with CUDA. (A
// communicator over the program's own ncclComm_t: zest/nccl.hpp.)
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "zest/communicator.hpp"
#include "zest/device.hpp"

namespace zest {

// Blocks until `bytes` at `data` on rank 0 have reached every rank's `data` (MPI_Bcast, or nothing
// in a world of one).
using BroadcastFromRankZero = std::function<void(void* data, std::size_t bytes)>;

// Collective over the `size` ranks: every rank calls it, as `rank`, with its own cuda Device (the
// caller picks the GPU, one per rank). NCCL's unique id travels from rank 0 through `broadcast`.
// Collectives run on the CUDA stream of the Stream they are given, which must come from `device`.
// Throws CommError when `device` is not a cuda Device or NCCL cannot start, and SystemError when
// zest was built without CUDA. `device` must outlive the communicator. `timeout` (comm.timeout;
// 0 = none): a collective not complete after it aborts NCCL on this rank and raises CommError at
// the communicator's next operation (runtime/device/pending_watchdog.hpp). `hosts`: each rank's host
// (Communicator::host_of), or empty where every rank is on one host.
std::unique_ptr<Communicator> make_nccl_communicator(Device& device, int rank, int size,
                                                     const BroadcastFromRankZero& broadcast,
                                                     std::chrono::milliseconds timeout, std::vector<int> hosts);

}  // namespace zest
