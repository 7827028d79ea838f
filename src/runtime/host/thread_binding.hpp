// Pinning threads to cpus with hwloc: the one place that loads the process's topology for binding
// and calls hwloc_set_cpubind, shared by Topology::bind_current_thread (validating, throwing) and
// the CPU Adam's arena (best effort, because pinning there is a speed matter, never fatal).
#pragma once

#include <hwloc.h>

#include <memory>
#include <vector>

namespace zest::detail {

struct HwlocTopologyDeleter {
  void operator()(hwloc_topology* topology) const noexcept { hwloc_topology_destroy(topology); }
};
using HwlocTopology = std::unique_ptr<hwloc_topology, HwlocTopologyDeleter>;

struct HwlocBitmapDeleter {
  void operator()(hwloc_bitmap_s* bitmap) const noexcept { hwloc_bitmap_free(bitmap); }
};
using HwlocBitmap = std::unique_ptr<hwloc_bitmap_s, HwlocBitmapDeleter>;

// A freshly loaded topology of this machine. Throws SystemError when hwloc cannot load it.
HwlocTopology load_topology();

// An empty bitmap. Throws SystemError when out of memory.
HwlocBitmap new_bitmap();

// The indices set in `bitmap`, ascending.
std::vector<int> bitmap_indices(hwloc_const_bitmap_t bitmap);

// The topology every binding uses, loaded on first call (a load costs milliseconds, a binding
// microseconds) and kept until exit. Thread-safe. Throws SystemError when hwloc cannot load it.
hwloc_topology_t process_topology();

// The cpus (OS indices, ascending) this process may run on; hwloc's default topology already
// leaves out those a cgroup cpuset forbids. Throws SystemError when the topology cannot load.
std::vector<int> allowed_cpus();

// Binds the calling thread to `cpus` / `cpu` (OS indices, none negative). Returns false with errno
// set when the OS refuses, memory runs out or the topology cannot load; the binding is then
// unchanged. The kernel silently drops unknown cpus from a mask that has others: callers that must
// not bind elsewhere than asked check `cpus` against allowed_cpus() first.
bool try_bind_current_thread(const std::vector<int>& cpus) noexcept;
bool try_bind_current_thread(int cpu) noexcept;

// Gives the calling thread back every allowed cpu (best effort), e.g. a pool worker leaving work
// for which it was pinned.
void unbind_current_thread() noexcept;

// Binds the calling thread to `cpu` for a scope (best effort) and restores the binding it had
// before. Throws SystemError only when out of memory or the topology cannot load.
class ScopedThreadBinding {
 public:
  explicit ScopedThreadBinding(int cpu);
  ~ScopedThreadBinding();
  ScopedThreadBinding(const ScopedThreadBinding&) = delete;
  ScopedThreadBinding& operator=(const ScopedThreadBinding&) = delete;

 private:
  HwlocBitmap saved_;
  bool saved_ok_ = false;
};

}  // namespace zest::detail
