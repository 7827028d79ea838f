// A oneTBB arena whose threads run pinned (hwloc) to a given list of CPUs, so the CPU Adam keeps
// its threads on the cores near the device and each thread on its own core.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace zest::optim {

class PinnedArena {
 public:
  // `threads` >= 1. Thread i of the arena runs on cpus[i % cpus.size()]; empty `cpus` means every
  // cpu the process may use (detail::allowed_cpus). Throws zest::Error naming a CPU the process may not use.
  PinnedArena(int threads, std::vector<int> cpus);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  int threads() const;
  const std::vector<int>& cpus() const;

  // Splits [0, count) into `tile`-sized pieces, hands each thread one contiguous run of tiles and
  // calls body(begin, end) for every tile. Blocks until all are done; the calling thread takes
  // part (pinned to cpus[0] meanwhile, its own binding restored afterwards). Exceptions from
  // `body` propagate. One call at a time per arena.
  void for_each_tile(std::size_t count, std::size_t tile,
                     const std::function<void(std::size_t, std::size_t)>& body);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zest::optim
