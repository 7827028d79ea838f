// Built in place of the cuda backend when zest is built without CUDA: the entry points exist, so
// the rest of zest links unchanged, and say how to get the real thing.
#include <memory>

#include "runtime/comm/nccl_communicator.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

constexpr const char* kRebuildHint =
    "zest was built without CUDA; rebuild with -Dcuda=enabled on a machine with the CUDA toolkit, "
    "or set device.type: cpu";

}  // namespace

std::unique_ptr<Device> make_cuda_device(int /*ordinal*/, std::size_t /*budget*/, std::vector<int> /*host_cpus*/,
                                         std::shared_ptr<DeviceMemorySource> /*memory*/) {
  throw SystemError(kRebuildHint);
}

bool cuda_device_available() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(Device& /*device*/, int /*rank*/,
                                                     int /*size*/,
                                                     const BroadcastFromRankZero& /*broadcast*/,
                                                     std::chrono::milliseconds /*timeout*/,
                                                     std::vector<int> /*hosts*/) {
  throw SystemError(
      "the nccl communicator needs CUDA, but zest was built without CUDA; rebuild with "
      "-Dcuda=enabled on a machine with the CUDA toolkit, or set device.type: cpu and "
      "comm.backend: mpi (or auto)");
}

}  // namespace zest
