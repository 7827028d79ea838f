// A zest Communicator over an NCCL communicator the program already has (its own ncclCommInitRank,
// an ncclCommSplit of it, or the one its framework made), so zest's collectives run among exactly
// those ranks. Only in builds with CUDA (-Dcuda=enabled); includes <nccl.h>.
#pragma once

#include <nccl.h>

#include <chrono>
#include <memory>

#include "zest/communicator.hpp"
#include "zest/device.hpp"

namespace zest {

// Wraps `comm` without owning it: the program keeps `comm` alive until the returned communicator
// is destroyed, and then ends it itself. `device` is the zest cuda Device of the GPU `comm` was
// made on (checked: CommError otherwise, or when `comm` is null). Rank and size are comm's. The
// stream collectives go on the CUDA stream of the zest Stream given; all_reduce_host and barrier
// use a stream and 1 KiB of device memory of the communicator's own. Not collective.
// `timeout` (0, the default: none) bounds each collective as comm.timeout does zest's own NCCL
// communicator: one not complete after it calls ncclCommAbort(comm) and makes every later
// operation throw CommError. Then `comm` is ended: the program must not use or destroy it again.
std::unique_ptr<Communicator> make_communicator(ncclComm_t comm, Device& device,
                                                std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

}  // namespace zest
