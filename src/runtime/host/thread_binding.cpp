#include "runtime/host/thread_binding.hpp"

#include <cerrno>
#include <utility>

#include "runtime/host/sys_check.hpp"
#include "zest/error.hpp"

namespace zest::detail {
namespace {

// The noexcept binders cannot throw what a failed first load throws; they report it as a refusal.
hwloc_topology_t process_topology_or_null() noexcept {
  try {
    return process_topology();
  } catch (...) {
    if (errno == 0) errno = ENOSYS;
    return nullptr;
  }
}

bool bind_current_thread_to(hwloc_topology_t topology, hwloc_const_cpuset_t set) noexcept {
  return hwloc_set_cpubind(topology, set, HWLOC_CPUBIND_THREAD) == 0;
}

// Binds to `set` and frees it, keeping the errno of a refusal for the caller's message.
bool bind_current_thread_to(hwloc_topology_t topology, HwlocBitmap set) noexcept {
  const bool bound = bind_current_thread_to(topology, set.get());
  const int error = errno;
  set.reset();
  errno = error;
  return bound;
}

}  // namespace

HwlocTopology load_topology() {
  hwloc_topology_t topology = nullptr;
  ZEST_SYS_CHECK(hwloc_topology_init(&topology));
  HwlocTopology handle(topology);
  ZEST_SYS_CHECK(hwloc_topology_load(topology));
  return handle;
}

HwlocBitmap new_bitmap() {
  HwlocBitmap bitmap(hwloc_bitmap_alloc());
  if (!bitmap) throw SystemError("hwloc_bitmap_alloc failed: out of memory");
  return bitmap;
}

std::vector<int> bitmap_indices(hwloc_const_bitmap_t bitmap) {
  std::vector<int> indices;
  for (int i = hwloc_bitmap_first(bitmap); i != -1; i = hwloc_bitmap_next(bitmap, i)) {
    indices.push_back(i);
  }
  return indices;
}

hwloc_topology_t process_topology() {
  static const HwlocTopology topology = load_topology();
  return topology.get();
}

std::vector<int> allowed_cpus() {
  return bitmap_indices(hwloc_topology_get_allowed_cpuset(process_topology()));
}

bool try_bind_current_thread(const std::vector<int>& cpus) noexcept {
  hwloc_topology_t topology = process_topology_or_null();
  if (topology == nullptr) return false;
  HwlocBitmap set(hwloc_bitmap_alloc());
  if (!set) {
    errno = ENOMEM;
    return false;
  }
  for (const int cpu : cpus) {
    if (cpu < 0) {
      errno = EINVAL;
      return false;
    }
    if (hwloc_bitmap_set(set.get(), static_cast<unsigned>(cpu)) != 0) {
      errno = ENOMEM;
      return false;
    }
  }
  return bind_current_thread_to(topology, std::move(set));
}

bool try_bind_current_thread(int cpu) noexcept {
  hwloc_topology_t topology = process_topology_or_null();
  if (topology == nullptr) return false;
  if (cpu < 0) {
    errno = EINVAL;
    return false;
  }
  HwlocBitmap set(hwloc_bitmap_alloc());
  if (!set || hwloc_bitmap_only(set.get(), static_cast<unsigned>(cpu)) != 0) {
    errno = ENOMEM;
    return false;
  }
  return bind_current_thread_to(topology, std::move(set));
}

void unbind_current_thread() noexcept {
  hwloc_topology_t topology = process_topology_or_null();
  if (topology != nullptr)
    static_cast<void>(
        bind_current_thread_to(topology, hwloc_topology_get_allowed_cpuset(topology)));
}

ScopedThreadBinding::ScopedThreadBinding(int cpu) : saved_(new_bitmap()) {
  saved_ok_ = hwloc_get_cpubind(process_topology(), saved_.get(), HWLOC_CPUBIND_THREAD) == 0;
  if (saved_ok_) static_cast<void>(try_bind_current_thread(cpu));
}

ScopedThreadBinding::~ScopedThreadBinding() {
  // The topology loaded in the constructor, so this cannot throw.
  if (saved_ok_) static_cast<void>(bind_current_thread_to(process_topology(), saved_.get()));
}

}  // namespace zest::detail
