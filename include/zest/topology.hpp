// The machine's layout (hwloc): which cores sit near a device, so offload and Adam threads run
// there and allocate there.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "zest/base_types.hpp"

namespace zest {

class Topology {
 public:
  // Loads this machine's topology. Throws SystemError when hwloc cannot.
  static Topology detect();
  Topology(Topology&&) noexcept;
  Topology& operator=(Topology&&) noexcept;
  ~Topology();

  int core_count() const;       // physical cores
  int pu_count() const;         // hardware threads
  int numa_node_count() const;

  // OS indices of the processing units this rank should use. When the calling thread is bound to
  // fewer cpus than the process may use (a launcher's binding: mpirun --bind-to core), those cpus.
  // Otherwise, cpu device: the local ranks split the cores (and NUMA nodes) evenly, so ranks on one
  // host do not fight over cores (more ranks than PUs share them round-robin). cuda device: the
  // cores hwloc reports near GPU `device_ordinal`, split among the local ranks that share it.
  std::vector<int> cpus_for_rank(DeviceType device, int device_ordinal, int local_rank,
                                 int local_size) const;

  // Pins the calling thread to `cpus` (OS indices). Throws SystemError naming the cpus.
  static void bind_current_thread(const std::vector<int>& cpus);

  // One line: "1 NUMA node, 2 cores, 2 PUs".
  std::string describe() const;

 private:
  struct Impl;
  explicit Topology(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zest
