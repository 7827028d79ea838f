// Runtime: what a rank needs before the engine exists — its place in the world, its device, its
// communicator and the topology. One per process.
//
//   zest::Config config = zest::load_config("zest.yaml");
//   zest::Runtime runtime(config);        // MPI_Init if needed; a world of one without mpirun
//                                         // (and always in a build without MPI)
//   zest::Device& device = runtime.device();
//   zest::Communicator& comm = runtime.comm();
#pragma once

#include <memory>
#include <vector>

#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/topology.hpp"

namespace zest {

class World;

// What a program may choose for its rank instead of zest (Runtime(config, options)).
struct RuntimeOptions {
  // The cpus this rank's host threads run on (each once, among those the process may use); empty:
  // Topology::cpus_for_rank.
  std::vector<int> cpus;
  // device.type cuda: the GPU (e.g. the one the program's tensors are on); -1: the local rank.
  int cuda_ordinal = -1;
  // device.type cuda: where device memory comes from (zest::torch: torch's caching allocator);
  // null: zest's own cache over cudaMalloc.
  std::shared_ptr<DeviceMemorySource> device_memory;
  // The ranks and their collectives, where the program already has them (zest::torch::
  // process_group_world: a torch.distributed process group); null: MPI's (mpirun), or a world of one.
  std::shared_ptr<World> world;
};

class Runtime {
 public:
  // Without RuntimeOptions::world:
  // initializes MPI (unless the program already did; then it is left to the program to finalize),
  // picks the device by local rank, and builds the communicator the config asks for. In a build
  // without MPI the world is this process alone: comm.backend mpi (or auto on the cpu device) is
  // then the local communicator (collectives over one rank are copies), nccl runs over one rank,
  // and a process that a launcher started as one of several ranks gets SystemError.
  explicit Runtime(const Config& config);
  // The same with this rank's cpus chosen by the program (its own placement) instead of
  // Topology::cpus_for_rank. Throws zest::Error for an empty list.
  Runtime(const Config& config, std::vector<int> cpus);
  // The same with any of RuntimeOptions chosen (an empty cpus list: zest chooses them).
  Runtime(const Config& config, RuntimeOptions options);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const;
  int world_size() const;
  int local_rank() const;   // rank among the ranks on this host
  int local_size() const;

  Device& device() { return *device_; }
  Communicator& comm() { return *comm_; }
  const Topology& topology() const { return topology_; }
  // The cpus this rank's host threads (Adam, offload workers, the cpu device's streams) run on,
  // from Topology::cpus_for_rank unless the program chose them; `optimizer.threads: 0` means one
  // Adam thread per cpu here. The device carries them (Device::host_cpus).
  const std::vector<int>& cpus() const { return cpus_; }

 private:

  std::shared_ptr<World> world_;
  Topology topology_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Communicator> comm_;
  std::vector<int> cpus_;
};

}  // namespace zest
