#include "zest/runtime.hpp"

#include "runtime/thread_binding.hpp"
#include "runtime/world.hpp"

namespace zest {
namespace {

CommBackend resolve_backend(const Config& config) {
  if (config.comm.backend != CommBackend::auto_select) return config.comm.backend;
  return config.device.type == DeviceType::cuda ? CommBackend::nccl : CommBackend::mpi;
}

}  // namespace

Runtime::Runtime(const Config& config) : world_(make_world()), topology_(Topology::detect()) {
  const int ordinal = world_->local_rank();
  device_ = config.device.type == DeviceType::cuda ? make_cuda_device(ordinal, config.device.memory)
                                                   : make_cpu_device(config.device.memory);
  comm_ = resolve_backend(config) == CommBackend::nccl ? world_->make_nccl_communicator(*device_, config.comm.timeout)
                                                       : world_->make_host_communicator(*device_, config.comm.timeout);
  cpus_ = topology_.cpus_for_rank(config.device.type, ordinal, world_->local_rank(),
                                  world_->local_size());
  // From here on every host thread zest starts for this rank (Adam, offload workers, streams)
  // runs on these cpus, without the engine's interfaces carrying them.
  detail::set_rank_cpus(cpus_);
}

// The communicator and the device go before the world (MPI may be finalized with it).
Runtime::~Runtime() {
  comm_.reset();
  device_.reset();
  detail::set_rank_cpus({});
}

int Runtime::rank() const { return world_->rank(); }
int Runtime::world_size() const { return world_->size(); }
int Runtime::local_rank() const { return world_->local_rank(); }
int Runtime::local_size() const { return world_->local_size(); }

}  // namespace zest
