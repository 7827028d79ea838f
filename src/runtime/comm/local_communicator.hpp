// The communicator of a world of one (builds without MPI): every collective over one rank is the
// identity, so each is at most a copy on the caller's stream (send to recv when they differ). Works
// on any device whose copy_async moves its memory. Arguments are checked as the other backends
// check them (null buffers, overlap that is not in place, a root other than 0), raising CommError.
#pragma once

#include <memory>

#include "zest/communicator.hpp"
#include "zest/device.hpp"

namespace zest {

// `device` must outlive the communicator.
std::unique_ptr<Communicator> make_local_communicator(Device& device);

}  // namespace zest
