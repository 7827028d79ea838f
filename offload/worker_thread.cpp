#include "offload/worker_thread.hpp"

#include <utility>

#include "runtime/host/thread_binding.hpp"

namespace zest::offload {

std::thread start_worker_thread(std::vector<int> cpus, std::function<void()> body) {
  return std::thread([cpus = std::move(cpus), body = std::move(body)] {
    // A speed matter, like the CPU Adam's pinning: a refused binding (a container's policy, say)
    // is no reason to fail the store.
    if (!cpus.empty()) static_cast<void>(detail::try_bind_current_thread(cpus));
    body();
  });
}

}  // namespace zest::offload
