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

// This rank's cpus: where every host thread zest starts for the rank runs (the CPU Adam's arena,
// the offload stores' workers, the cpu device's streams) and how many Adam threads
// `optimizer.threads: 0` means. Runtime establishes them (Topology::cpus_for_rank) when it is
// built and clears them when it goes; until then, and in programs without a Runtime, they are
// allowed_cpus() (the threads that would only inherit a binding, the stores' workers and the
// streams, then keep it: try_bind_current_thread_to_rank_cpus). Process-wide because a process is
// one rank; thread-safe. Throws SystemError when the topology cannot load.
std::vector<int> rank_cpus();
// `cpus` empty: back to allowed_cpus().
void set_rank_cpus(std::vector<int> cpus);

// Binds the calling thread to `cpus` / `cpu` (OS indices, none negative). Returns false with errno
// set when the OS refuses, memory runs out or the topology cannot load; the binding is then
// unchanged. The kernel silently drops unknown cpus from a mask that has others: callers that must
// not bind elsewhere than asked check `cpus` against allowed_cpus() first.
bool try_bind_current_thread(const std::vector<int>& cpus) noexcept;
bool try_bind_current_thread(int cpu) noexcept;

// Binds the calling thread to the cpus a Runtime established (best effort: false, with errno set,
// when refused). Without them it leaves the thread as it is: a thread inherits its creator's
// binding, so a program without a Runtime keeps its launcher's placement (which allowed_cpus(), a
// cgroup's view, would widen).
bool try_bind_current_thread_to_rank_cpus() noexcept;

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
