// The world of one, for builds without MPI: this process is rank 0 of 1.
#include <cstdlib>
#include <memory>
#include <string>

#include <fmt/core.h>

#include "runtime/comm/local_communicator.hpp"
#include "runtime/comm/nccl_communicator.hpp"
#include "runtime/comm/world.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

// What launchers set in each rank's environment (Open MPI, MPICH's Hydra, a Slurm step;
// not SLURM_NTASKS, which a batch script running one process also has). A process
// that finds a size above one here was meant to be one of several ranks.
int launched_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    if (const char* value = std::getenv(name)) {
      const int size = std::atoi(value);
      if (size > 1) return size;
    }
  }
  return 1;
}

class SingleWorld final : public World {
 public:
  SingleWorld() {
    if (const int size = launched_size(); size > 1) {
      throw SystemError(
          fmt::format("this process was started as one of {} ranks, but zest was built without MPI "
                      "(-Dmpi=disabled, or no MPI found), so each rank would train alone; rebuild with "
                      "-Dmpi=enabled on a machine with MPI, or run one process",
                      size));
    }
  }

  int rank() const override { return 0; }
  int size() const override { return 1; }
  int local_rank() const override { return 0; }
  int local_size() const override { return 1; }

  std::unique_ptr<Communicator> make_host_communicator(Device& device, std::chrono::milliseconds /*timeout*/) override {
    if (!device.host_accessible()) {
      throw CommError("the host communicator needs the cpu device, but the device is " +
                      device.name() + ": use comm.backend: nccl with a cuda device");
    }
    return make_local_communicator(device);
  }

  // NCCL over one rank: the id needs no carrying.
  std::unique_ptr<Communicator> make_nccl_communicator(Device& device, std::chrono::milliseconds timeout) override {
    return zest::make_nccl_communicator(device, 0, 1, [](void*, std::size_t) {}, timeout, {});
  }
};

}  // namespace

std::unique_ptr<World> make_world() { return std::make_unique<SingleWorld>(); }

}  // namespace zest
