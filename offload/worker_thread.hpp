// The stores' worker threads, pinned to the cores near the rank's device.
#pragma once

#include <functional>
#include <thread>
#include <vector>

namespace zest::offload {

// Starts a thread that binds itself to `cpus`, best effort (empty: left with the binding it
// inherits from its creator; the engine passes the rank's, Device::host_cpus), then runs `body`.
std::thread start_worker_thread(std::vector<int> cpus, std::function<void()> body);

}  // namespace zest::offload
