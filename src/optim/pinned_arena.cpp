#include "optim/pinned_arena.hpp"

#include <string>
#include <utility>

#include <fmt/core.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

#include "runtime/host/thread_binding.hpp"
#include "zest/error.hpp"

// oneTBB is not built with ThreadSanitizer, so TSan cannot see the synchronization by which a
// task (and the data it reads) passes from the calling thread to a worker and back. These
// annotations state exactly that hand-off, no more; everything else stays checked.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define ZEST_TSAN_ACQUIRE(addr) __tsan_acquire(addr)
#define ZEST_TSAN_RELEASE(addr) __tsan_release(addr)
#else
#define ZEST_TSAN_ACQUIRE(addr) static_cast<void>(addr)
#define ZEST_TSAN_RELEASE(addr) static_cast<void>(addr)
#endif

namespace zest::optim {
namespace {

class PinningObserver : public tbb::task_scheduler_observer {
 public:
  PinningObserver(tbb::task_arena& arena, const std::vector<int>& cpus)
      : tbb::task_scheduler_observer(arena), cpus_(cpus) {
    observe(true);
  }
  ~PinningObserver() override { observe(false); }

  void on_scheduler_entry(bool is_worker) override {
    if (!is_worker) return;  // the calling thread is pinned by for_each_tile
    ZEST_TSAN_ACQUIRE(this);
    // A refused binding only costs speed; the work itself runs correctly anywhere.
    const int slot = tbb::this_task_arena::current_thread_index();
    if (slot >= 0)
      static_cast<void>(
          detail::try_bind_current_thread(cpus_[static_cast<std::size_t>(slot) % cpus_.size()]));
  }

  void on_scheduler_exit(bool is_worker) override {
    // A worker may go on to serve other arenas: give it back every allowed CPU.
    if (is_worker) detail::unbind_current_thread();
  }

 private:
  const std::vector<int>& cpus_;
};

}  // namespace

struct PinnedArena::Impl {
  Impl(int threads, std::vector<int> cpu_list)
      : cpus(std::move(cpu_list)), arena(threads), observer(arena, cpus) {}
  std::vector<int> cpus;
  tbb::task_arena arena;
  PinningObserver observer;
};

PinnedArena::PinnedArena(int threads, std::vector<int> cpus) {
  if (threads < 1)
    throw Error(fmt::format("CPU Adam needs at least one thread, got {}; set optimizer.threads >= 0", threads));
  if (cpus.empty()) cpus = detail::allowed_cpus();
  const std::vector<int> allowed = detail::allowed_cpus();
  for (int cpu : cpus) {
    bool found = false;
    for (int a : allowed) found = found || a == cpu;
    if (!found) {
      std::string list;
      for (int a : allowed) list.append(list.empty() ? "" : ",").append(std::to_string(a));
      throw Error(fmt::format(
          "CPU {} is not available to this process (allowed CPUs: {}); pin the CPU Adam to allowed CPUs", cpu, list));
    }
  }
  impl_ = std::make_unique<Impl>(threads, std::move(cpus));
  ZEST_TSAN_RELEASE(&impl_->observer);
}

PinnedArena::~PinnedArena() = default;

int PinnedArena::threads() const { return impl_->arena.max_concurrency(); }

const std::vector<int>& PinnedArena::cpus() const { return impl_->cpus; }

void PinnedArena::for_each_tile(std::size_t count, std::size_t tile,
                                const std::function<void(std::size_t, std::size_t)>& body) {
  if (count == 0) return;
  const std::size_t tiles = (count + tile - 1) / tile;
  const detail::ScopedThreadBinding pin(impl_->cpus.front());
  char fork = 0, join = 0;
  ZEST_TSAN_RELEASE(&fork);
  impl_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<std::size_t>& r) {
          ZEST_TSAN_ACQUIRE(&fork);
          for (std::size_t t = r.begin(); t != r.end(); ++t) {
            const std::size_t begin = t * tile;
            body(begin, begin + tile < count ? begin + tile : count);
          }
          ZEST_TSAN_RELEASE(&join);
        },
        tbb::static_partitioner());
  });
  ZEST_TSAN_ACQUIRE(&join);
}

}  // namespace zest::optim
