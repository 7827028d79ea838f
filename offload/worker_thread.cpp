#include "offload/worker_thread.hpp"

#include <exception>
#include <future>
#include <utility>

#include "zest/topology.hpp"

namespace zest::offload {

std::thread start_worker_thread(std::vector<int> cpus, std::function<void()> body) {
  std::promise<void> started;
  std::future<void> started_future = started.get_future();
  std::thread thread([&started, cpus = std::move(cpus), body = std::move(body)] {
    try {
      if (!cpus.empty()) Topology::bind_current_thread(cpus);
      started.set_value();  // `started` is not touched after this: the caller may return
    } catch (...) {
      started.set_exception(std::current_exception());
      return;
    }
    body();
  });
  try {
    started_future.get();
  } catch (...) {
    thread.join();
    throw;
  }
  return thread;
}

}  // namespace zest::offload
