// World: the process's place among the ranks, and the communicators that span them. With MPI (the
// build found it) the ranks are MPI's, started by mpirun/srun; without MPI the world is this one
// process, so a single-GPU trainer links zest with no MPI installed. Runtime, the tests and the
// tools ask a World, never MPI, which ranks exist.
#pragma once

#include <chrono>
#include <memory>

#include "zest/communicator.hpp"
#include "zest/base_types.hpp"
#include "zest/device.hpp"

namespace zest {

class World {
 public:
  virtual ~World() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const = 0;  // rank among the ranks on this host
  virtual int local_size() const = 0;

  // Collective over the world. Collectives on host-accessible (cpu) device memory: MPI's, or in a
  // world of one without MPI the local communicator's. Throws CommError for a device MPI cannot
  // read (use make_nccl_communicator for cuda). `timeout` (comm.timeout; 0 = forever): how long an
  // MPI collective may block before it raises CommError naming the ranks behind (a world of one
  // never waits).
  virtual std::unique_ptr<Communicator> make_host_communicator(Device& device,
                                                               std::chrono::milliseconds timeout) = 0;
  std::unique_ptr<Communicator> make_host_communicator(Device& device) {
    return make_host_communicator(device, kDefaultCommTimeout);
  }
  // Collective over the world: NCCL on `device` (cuda), its unique id carried over MPI, or made
  // here in a world of one. Throws SystemError in a build without CUDA. `timeout` (comm.timeout;
  // 0 = forever): a collective not complete after it aborts NCCL on this rank, and the
  // communicator's next operation raises CommError naming it.
  virtual std::unique_ptr<Communicator> make_nccl_communicator(Device& device, std::chrono::milliseconds timeout) = 0;
  std::unique_ptr<Communicator> make_nccl_communicator(Device& device) {
    return make_nccl_communicator(device, kDefaultCommTimeout);
  }
};

// The world this build knows: MPI's (initialized unless the program did, finalized with the World
// when it initialized it), else a world of one. Without MPI, throws SystemError when a launcher
// (mpirun, srun) started this process as one of several ranks, since each would train alone.
std::unique_ptr<World> make_world();

}  // namespace zest
