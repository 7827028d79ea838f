#include "zest/runtime.hpp"

#include "runtime/mpi_communicator.hpp"
#include "runtime/mpi_session.hpp"
#include "runtime/nccl_communicator.hpp"

namespace zest {
namespace {

CommBackend resolve_backend(const Config& config) {
  if (config.comm.backend != CommBackend::auto_select) return config.comm.backend;
  return config.device.type == DeviceType::cuda ? CommBackend::nccl : CommBackend::mpi;
}

}  // namespace

Runtime::Runtime(const Config& config)
    : mpi_(std::make_unique<MpiSession>()), topology_(Topology::detect()) {
  const int ordinal = mpi_->local_rank();
  device_ = config.device.type == DeviceType::cuda ? make_cuda_device(ordinal, config.device.memory)
                                                   : make_cpu_device(config.device.memory);
  comm_ = resolve_backend(config) == CommBackend::nccl ? make_nccl_communicator(*mpi_, *device_)
                                                       : make_mpi_communicator(*mpi_, *device_, config.comm.timeout);
  cpus_ = topology_.cpus_for_rank(config.device.type, ordinal, mpi_->local_rank(),
                                  mpi_->local_size());
}

// The communicator and the device go before MPI is finalized.
Runtime::~Runtime() {
  comm_.reset();
  device_.reset();
}

int Runtime::rank() const { return mpi_->rank(); }
int Runtime::world_size() const { return mpi_->size(); }
int Runtime::local_rank() const { return mpi_->local_rank(); }
int Runtime::local_size() const { return mpi_->local_size(); }

}  // namespace zest
