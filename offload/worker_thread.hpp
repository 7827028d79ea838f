// The stores' worker threads: started pinned to the cores near the rank's device, so a pinning
// failure surfaces in the store's constructor instead of in a thread nobody waits on.
#pragma once

#include <functional>
#include <thread>
#include <vector>

namespace zest::offload {

// Starts a thread that binds itself to `cpus` (empty: left with the binding it inherits from its
// creator; the engine passes the rank's, Device::host_cpus) and then runs `body`. Returns
// once the binding is done; when it fails, joins the thread and rethrows its SystemError.
std::thread start_worker_thread(std::vector<int> cpus, std::function<void()> body);

}  // namespace zest::offload
