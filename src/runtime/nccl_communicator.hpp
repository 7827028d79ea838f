// The NCCL backend of zest::Communicator, for a cuda Device. Plain declarations, so code that picks
// a backend at run time (Runtime) includes it whether or not zest was built with CUDA.
#pragma once

#include <memory>

#include "zest/communicator.hpp"
#include "zest/device.hpp"

namespace zest {

class MpiSession;

// Collective over session.world(): every rank calls it, with its own cuda Device (the caller picks
// the GPU, one per rank). NCCL's unique id travels over MPI from rank 0. Collectives run on the
// CUDA stream of the Stream they are given, which must come from `device`. Throws CommError when
// `device` is not a cuda Device or NCCL cannot start, and SystemError when zest was built without
// CUDA. `session` and `device` must outlive the communicator.
std::unique_ptr<Communicator> make_nccl_communicator(MpiSession& session, Device& device);

}  // namespace zest
