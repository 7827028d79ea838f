#include "zest/runtime.hpp"

#include <algorithm>
#include <set>
#include <string>

#include <fmt/core.h>

#include "runtime/host/thread_binding.hpp"
#include "runtime/comm/world.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

CommBackend resolve_backend(const Config& config) {
  if (config.comm.backend != CommBackend::auto_select) return config.comm.backend;
  return config.device.type == DeviceType::cuda ? CommBackend::nccl : CommBackend::mpi;
}

// A program's own list of the rank's cpus: each one this process may run on, once.
void check_rank_cpus(const std::vector<int>& cpus) {
  const std::string named = "Runtime(config, cpus): ";
  if (cpus.empty()) throw Error(named + "the list of this rank's cpus is empty; give at least one, or let zest choose");
  const std::vector<int> allowed = detail::allowed_cpus();
  std::set<int> seen;
  for (const int cpu : cpus) {
    if (std::find(allowed.begin(), allowed.end(), cpu) == allowed.end())
      throw Error(fmt::format(
          "{}cpu {} is not one this process may run on ({} allowed, from {} to {}); give cpus of its affinity mask",
          named, cpu, allowed.size(), allowed.front(), allowed.back()));
    if (!seen.insert(cpu).second) throw Error(fmt::format("{}cpu {} is listed twice; list each once", named, cpu));
  }
}

}  // namespace

Runtime::Runtime(const Config& config) : Runtime(config, RuntimeOptions{}) {}

Runtime::Runtime(const Config& config, std::vector<int> cpus)
    : Runtime(config, (check_rank_cpus(cpus), RuntimeOptions{std::move(cpus), -1, nullptr, nullptr})) {}

Runtime::Runtime(const Config& config, RuntimeOptions options)
    : world_(options.world ? std::move(options.world) : make_world()), topology_(Topology::detect()) {
  const int ordinal = options.cuda_ordinal >= 0 ? options.cuda_ordinal : world_->local_rank();
  if (!options.cpus.empty()) check_rank_cpus(options.cpus);
  cpus_ = !options.cpus.empty()
              ? std::move(options.cpus)
              : topology_.cpus_for_rank(config.device.type, ordinal, world_->local_rank(), world_->local_size());
  // The device carries the rank's cpus to every host thread zest starts for it (its streams, and
  // the engine's CPU Adam and offload workers: Device::host_cpus).
  device_ = config.device.type == DeviceType::cuda
                ? make_cuda_device(ordinal, config.device.memory, cpus_, std::move(options.device_memory))
                : make_cpu_device(config.device.memory, cpus_);
  comm_ = resolve_backend(config) == CommBackend::nccl ? world_->make_nccl_communicator(*device_, config.comm.timeout)
                                                       : world_->make_host_communicator(*device_, config.comm.timeout);
}

// The communicator and the device go before the world (MPI may be finalized with it).
Runtime::~Runtime() {
  comm_.reset();
  device_.reset();
}

int Runtime::rank() const { return world_->rank(); }
int Runtime::world_size() const { return world_->size(); }
int Runtime::local_rank() const { return world_->local_rank(); }
int Runtime::local_size() const { return world_->local_size(); }

}  // namespace zest
