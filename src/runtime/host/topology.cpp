// zest::Topology over hwloc 2. hwloc's default topology already leaves out the PUs this process may
// not use (a cgroup cpuset), so every count and every cpu handed out is one the rank may run on.
#include "zest/topology.hpp"

#include <fmt/core.h>
#include <hwloc.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/host/cpu_split.hpp"
#include "runtime/host/thread_binding.hpp"
#include "zest/error.hpp"
#include "zest_build_config.h"

#if ZEST_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <hwloc/cudart.h>
#endif

namespace zest {
namespace {

using detail::bitmap_indices;
using detail::new_bitmap;
using Bitmap = detail::HwlocBitmap;

// "0-3,8,10-11": short enough for an error message even on a 256-thread machine.
std::string cpu_list(const std::vector<int>& cpus) {
  std::vector<int> sorted = cpus;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::string text;
  for (std::size_t i = 0; i < sorted.size();) {
    std::size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    if (!text.empty()) text.append(",");
    text.append(std::to_string(sorted[i]));
    if (j > i) text.append("-").append(std::to_string(sorted[j]));
    i = j + 1;
  }
  return text;
}

std::string counted(int count, const char* singular, const char* plural) {
  return fmt::format("{} {}", count, count == 1 ? singular : plural);
}

}  // namespace

namespace detail {

std::vector<int> split_cpus(const std::vector<std::vector<int>>& cores, int index, int count) {
  const auto shares = static_cast<std::size_t>(count);
  const auto share = static_cast<std::size_t>(index);
  std::vector<int> cpus;
  if (shares <= cores.size()) {
    const std::size_t begin = share * cores.size() / shares;
    const std::size_t end = (share + 1) * cores.size() / shares;
    for (std::size_t c = begin; c < end; ++c) cpus.insert(cpus.end(), cores[c].begin(), cores[c].end());
  } else {
    std::vector<int> pus;
    for (const auto& core : cores) pus.insert(pus.end(), core.begin(), core.end());
    if (pus.empty()) return cpus;
    if (shares <= pus.size()) {
      const std::size_t begin = share * pus.size() / shares;
      const std::size_t end = (share + 1) * pus.size() / shares;
      cpus.assign(pus.begin() + static_cast<std::ptrdiff_t>(begin),
                  pus.begin() + static_cast<std::ptrdiff_t>(end));
    } else {
      cpus.push_back(pus[share % pus.size()]);
    }
  }
  std::sort(cpus.begin(), cpus.end());
  return cpus;
}

std::vector<int> launcher_binding(const std::vector<std::vector<int>>& cores, const std::vector<int>& bound) {
  std::vector<int> pus;
  for (const auto& core : cores) pus.insert(pus.end(), core.begin(), core.end());
  std::sort(pus.begin(), pus.end());
  std::vector<int> sorted_bound = bound;
  std::sort(sorted_bound.begin(), sorted_bound.end());
  std::vector<int> inside;
  std::set_intersection(pus.begin(), pus.end(), sorted_bound.begin(), sorted_bound.end(), std::back_inserter(inside));
  if (inside.size() == pus.size()) inside.clear();
  return inside;
}

std::vector<int> place_rank(const std::vector<std::vector<int>>& cores, const std::vector<int>& bound, int index,
                            int count) {
  std::vector<int> cpus = launcher_binding(cores, bound);
  return cpus.empty() ? split_cpus(cores, index, count) : cpus;
}

}  // namespace detail

struct Topology::Impl {
  detail::HwlocTopology topology;

  int count_of(hwloc_obj_type_t type) const {
    return std::max(0, hwloc_get_nbobjs_by_type(topology.get(), type));
  }

  // Each core's PUs inside `set`, cores in logical order; cores with none left out.
  std::vector<std::vector<int>> cores_within(hwloc_const_cpuset_t set) const {
    // Some virtual machines expose no Core objects; then every PU counts as a core.
    const hwloc_obj_type_t unit = count_of(HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
    std::vector<std::vector<int>> cores;
    const Bitmap inside = new_bitmap();
    for (hwloc_obj_t core = hwloc_get_next_obj_by_type(topology.get(), unit, nullptr);
         core != nullptr; core = hwloc_get_next_obj_by_type(topology.get(), unit, core)) {
      if (core->cpuset == nullptr) continue;
      hwloc_bitmap_and(inside.get(), core->cpuset, set);
      std::vector<int> pus = bitmap_indices(inside.get());
      if (!pus.empty()) cores.push_back(std::move(pus));
    }
    return cores;
  }

  hwloc_const_cpuset_t allowed() const { return hwloc_topology_get_allowed_cpuset(topology.get()); }

  // The calling thread's binding: under mpirun it carries the launcher's placement of the process
  // (the thread that builds the Runtime is the one mpirun started). Empty when it cannot be read.
  std::vector<int> current_binding() const {
    const Bitmap bound = new_bitmap();
    if (hwloc_get_cpubind(topology.get(), bound.get(), HWLOC_CPUBIND_THREAD) != 0) return {};
    return bitmap_indices(bound.get());
  }

#if ZEST_HAVE_CUDA
  // The allowed cpus hwloc reports near visible GPU `gpu`; empty when it knows nothing.
  Bitmap near_gpu(int gpu) const {
    Bitmap near = new_bitmap();
    if (hwloc_cudart_get_device_cpuset(topology.get(), gpu, near.get()) != 0) {
      static_cast<void>(cudaGetLastError());  // not the caller's error to find later
      hwloc_bitmap_zero(near.get());
    }
    hwloc_bitmap_and(near.get(), near.get(), allowed());
    return near;
  }

  // The cpus near this rank's GPU, and which share of them is this rank's. Assumes Runtime's
  // mapping (local rank r drives GPU r mod visible GPUs): the local ranks whose GPUs sit near the
  // same cpus (one GPU shared, or several GPUs on one socket) divide those cpus between them.
  // Empty when there is no GPU or hwloc knows nothing about it.
  Bitmap near_rank_gpu(int ordinal, int local_rank, int local_size, int& share,
                       int& shares) const {
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus <= 0) {
      static_cast<void>(cudaGetLastError());
      return new_bitmap();
    }
    const int gpu = ordinal % gpus;
    Bitmap near = near_gpu(gpu);
    share = 0;
    shares = 1;
    if (hwloc_bitmap_iszero(near.get()) || local_rank % gpus != gpu) return near;  // own mapping
    std::vector<Bitmap> near_by_gpu(static_cast<std::size_t>(std::min(gpus, local_size)));
    shares = 0;
    for (int rank = 0; rank < local_size; ++rank) {
      Bitmap& other = near_by_gpu[static_cast<std::size_t>(rank % gpus)];
      if (!other) other = near_gpu(rank % gpus);
      if (hwloc_bitmap_isequal(other.get(), near.get()) == 0) continue;
      if (rank == local_rank) share = shares;
      ++shares;
    }
    return near;
  }
#endif
};

Topology::Topology(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Topology::Topology(Topology&&) noexcept = default;
Topology& Topology::operator=(Topology&&) noexcept = default;
Topology::~Topology() = default;

Topology Topology::detect() {
  auto impl = std::make_unique<Impl>();
  impl->topology = detail::load_topology();
  return Topology(std::move(impl));
}

int Topology::core_count() const {
  const int cores = impl_->count_of(HWLOC_OBJ_CORE);
  return cores > 0 ? cores : pu_count();
}

int Topology::pu_count() const { return std::max(1, impl_->count_of(HWLOC_OBJ_PU)); }

int Topology::numa_node_count() const { return std::max(1, impl_->count_of(HWLOC_OBJ_NUMANODE)); }

std::vector<int> Topology::cpus_for_rank(DeviceType device, int device_ordinal, int local_rank,
                                         int local_size) const {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size) {
    throw SystemError(
        fmt::format("cpus_for_rank: local rank {} of {} is not a rank of this host; pass 0 <= local_rank < local_size",
                    local_rank, local_size));
  }
  const auto cores = impl_->cores_within(impl_->allowed());
  const std::vector<int> bound = impl_->current_binding();
#if ZEST_HAVE_CUDA
  // A launcher's binding wins over hwloc's idea of nearness: the launcher placed the rank.
  if (device == DeviceType::cuda && device_ordinal >= 0 && detail::launcher_binding(cores, bound).empty()) {
    int share = 0;
    int shares = 1;
    const Bitmap near =
        impl_->near_rank_gpu(device_ordinal, local_rank, local_size, share, shares);
    const auto near_cores = impl_->cores_within(near.get());
    if (!near_cores.empty()) return detail::split_cpus(near_cores, share, shares);
  }
#else
  static_cast<void>(device);
  static_cast<void>(device_ordinal);
#endif
  // cpu devices, and GPUs hwloc knows nothing about: the local ranks divide the whole machine.
  return detail::place_rank(cores, bound, local_rank, local_size);
}

void Topology::bind_current_thread(const std::vector<int>& cpus) {
  const auto failure = [&cpus](const std::string& reason, int error_number) {
    return SystemError(fmt::format(
        "binding the thread to cpus {} failed: {}: {} (errno {}); pass cpus from Topology::cpus_for_rank",
        cpus.empty() ? std::string("(none)") : cpu_list(cpus), reason, std::strerror(error_number), error_number));
  };
  if (cpus.empty()) throw failure("no cpus given", EINVAL);
  const std::vector<int> allowed = detail::allowed_cpus();
  for (const int cpu : cpus) {
    // Checked here because the kernel silently drops unknown cpus from a mask that has others.
    if (!std::binary_search(allowed.begin(), allowed.end(), cpu)) {
      throw failure(fmt::format("cpu {} is not one this process may run on (allowed: {})", cpu, cpu_list(allowed)),
                    EINVAL);
    }
  }
  if (!detail::try_bind_current_thread(cpus)) throw failure("hwloc_set_cpubind", errno);
}

std::string Topology::describe() const {
  return fmt::format("{}, {}, {}", counted(numa_node_count(), "NUMA node", "NUMA nodes"),
                     counted(core_count(), "core", "cores"), counted(pu_count(), "PU", "PUs"));
}

}  // namespace zest
