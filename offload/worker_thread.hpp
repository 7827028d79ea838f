// The stores' worker threads: started pinned to the cores near the rank's device, so a pinning
// failure surfaces in the store's constructor instead of in a thread nobody waits on.
#pragma once

#include <functional>
#include <thread>
#include <vector>

namespace zest::offload {

// Starts a thread that binds itself to `cpus` (empty: to the rank's cpus when a Runtime established
// them, best effort, so a store built without cpus still keeps off the other ranks' cores; else
// left as created) and then runs `body`. Returns
// once the binding is done; when it fails, joins the thread and rethrows its SystemError.
std::thread start_worker_thread(std::vector<int> cpus, std::function<void()> body);

}  // namespace zest::offload
