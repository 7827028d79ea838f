// Placement, end to end, under mpirun: each rank's Runtime takes its share of the node's cpus, and
// the threads zest pins for the rank during a real step (the CPU Adam of the optimizer offloaded to
// the host, with optimizer.threads 0; the offload and stream workers) run only there. Under
// `--bind-to none` the shares split the node: with as many cpus as ranks or more they are
// disjoint, so two ranks never run their Adam on the same core; with more ranks than cpus (4 on
// this 2-core machine) they share cpus round-robin. Under `--bind-to core` each rank's share is
// the core mpirun bound it to. Before placement every rank pinned its Adam to the machine's first
// cpu, inside or outside its binding.
#include <dirent.h>
#include <gtest/gtest.h>
#include <hwloc.h>
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bitset>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "zest/zest.hpp"

namespace zest {
namespace {

constexpr std::size_t kMaxCpus = 1024;
using CpuMask = std::bitset<kMaxCpus>;

CpuMask affinity_of(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CpuMask mask;
  if (sched_getaffinity(tid, sizeof set, &set) != 0) return mask;  // the thread ended meanwhile
  for (std::size_t cpu = 0; cpu < kMaxCpus && cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) mask.set(cpu);
  return mask;
}

// Polls every thread of this process and keeps the cpus of those bound otherwise than the process
// was when the sampler started: the threads zest pinned. The main thread is pinned only while it
// takes part in the CPU Adam (PinnedArena::for_each_tile), so its samples are the Adam's. Also
// keeps the cpus of every thread, pinned or not.
class PinnedThreadSampler {
 public:
  PinnedThreadSampler() : process_(affinity_of(0)), thread_([this] { run(); }) {}
  ~PinnedThreadSampler() { stop(); }

  void stop() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Read after stop(), or under seen()'s lock.
  CpuMask pinned() const { return pinned_; }
  CpuMask any_thread() const { return any_thread_; }
  CpuMask adam() const { return adam_; }
  bool seen_adam() {
    const std::lock_guard lock(mutex_);
    return adam_.any();
  }

 private:
  void run() {
    const pid_t main_thread = getpid();
    while (!stopping_) {
      DIR* tasks = opendir("/proc/self/task");
      if (tasks == nullptr) return;
      while (const dirent* entry = readdir(tasks)) {
        const pid_t tid = static_cast<pid_t>(std::atoi(entry->d_name));
        if (tid <= 0) continue;
        const CpuMask mask = affinity_of(tid);
        const std::lock_guard lock(mutex_);
        any_thread_ |= mask;
        if (mask.none() || mask == process_) continue;
        pinned_ |= mask;
        if (tid == main_thread) adam_ |= mask;
      }
      closedir(tasks);
      // Polls leave the cpus to the ranks: a poll takes tens of microseconds, the Adam milliseconds.
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  const CpuMask process_;
  std::mutex mutex_;
  CpuMask pinned_, adam_, any_thread_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;  // last: starts once everything above is initialized
};

// The cpus this process may use at all (a cgroup's cpuset), whatever its binding.
CpuMask allowed_cpus() {
  hwloc_topology_t topology = nullptr;
  CpuMask mask;
  if (hwloc_topology_init(&topology) != 0) return mask;
  if (hwloc_topology_load(topology) == 0) {
    const hwloc_const_cpuset_t allowed = hwloc_topology_get_allowed_cpuset(topology);
    for (int cpu = hwloc_bitmap_first(allowed); cpu != -1; cpu = hwloc_bitmap_next(allowed, cpu))
      if (static_cast<std::size_t>(cpu) < kMaxCpus) mask.set(static_cast<std::size_t>(cpu));
  }
  hwloc_topology_destroy(topology);
  return mask;
}

// "0,1" (the bitset's own text is 1024 digits).
std::string list(const CpuMask& mask) {
  std::string text;
  for (std::size_t cpu = 0; cpu < kMaxCpus; ++cpu)
    if (mask[cpu]) text.append(text.empty() ? "" : ",").append(std::to_string(cpu));
  return text.empty() ? "(none)" : text;
}

CpuMask mask_of(const std::vector<int>& cpus) {
  CpuMask mask;
  for (const int cpu : cpus) mask.set(static_cast<std::size_t>(cpu));
  return mask;
}

std::vector<CpuMask> all_gather(const CpuMask& mine) {
  std::vector<unsigned char> bytes(kMaxCpus);
  for (std::size_t cpu = 0; cpu < kMaxCpus; ++cpu) bytes[cpu] = mine[cpu] ? 1 : 0;
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  std::vector<unsigned char> all(kMaxCpus * static_cast<std::size_t>(ranks));
  MPI_Allgather(bytes.data(), static_cast<int>(kMaxCpus), MPI_UNSIGNED_CHAR, all.data(), static_cast<int>(kMaxCpus),
                MPI_UNSIGNED_CHAR, MPI_COMM_WORLD);
  std::vector<CpuMask> masks(static_cast<std::size_t>(ranks));
  for (std::size_t r = 0; r < masks.size(); ++r)
    for (std::size_t cpu = 0; cpu < kMaxCpus; ++cpu) masks[r][cpu] = all[r * kMaxCpus + cpu] != 0;
  return masks;
}

TEST(Placement, EachRanksAdamRunsOnItsOwnShareOfTheNode) {
  Config config;
  config.stage = 2;
  config.device.memory = std::size_t{256} << 20;
  config.optimizer.threads = 0;  // one per cpu of the rank's share
  config.offload.optimizer.device = OffloadDevice::cpu;
  const CpuMask binding = affinity_of(0);  // as mpirun left this process
  Runtime runtime(config);
  ASSERT_EQ(runtime.local_size(), runtime.world_size()) << "one node: every rank is local";
  const CpuMask own = mask_of(runtime.cpus());
  ASSERT_TRUE(own.any());
  EXPECT_EQ(runtime.device().host_cpus(), runtime.cpus()) << "the device carries the rank's cpus to its threads";
  const bool launcher_bound = binding != allowed_cpus();
  if (launcher_bound) {
    EXPECT_EQ(own, binding) << "the launcher's binding " << list(binding) << " is the rank's placement, not "
                            << list(own);
  }

  // 4 groups of 2^19 parameters: each rank's Adam takes milliseconds per step, long enough to be
  // sampled many times.
  std::vector<ParamSpec> specs;
  for (int g = 0; g < 4; ++g) specs.push_back({std::string("w").append(std::to_string(g)), {std::size_t{1} << 19}, g});
  Engine engine(config, runtime.device(), runtime.comm(), specs);
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const std::vector<float> values(specs[t].numel(), 0.5f);
    engine.set_param(t, values);
  }

  // Steps until every rank has seen its Adam running pinned (a poll may miss a short one); the ranks
  // agree on stopping, so all take the same steps. Bound by the launcher, the Adam runs pinned to
  // the binding itself, indistinguishable from the rest: then 10 steps, in which no thread may
  // leave the binding.
  PinnedThreadSampler sampler;
  for (int step = 0, seen_everywhere = 0; step < (launcher_bound ? 10 : 100) && seen_everywhere == 0; ++step) {
    for (int g = 0; g < engine.group_count(); ++g) auto forward = engine.acquire(g);
    for (int g = engine.group_count() - 1; g >= 0; --g) {
      auto lease = engine.acquire(g);
      auto* grad = lease.grad(static_cast<std::size_t>(g)).as<float>();
      std::fill(grad, grad + specs[static_cast<std::size_t>(g)].numel(), 0.01f);
      engine.grads_ready(g);
    }
    engine.step();
    int seen = sampler.seen_adam() && !launcher_bound ? 1 : 0;
    MPI_Allreduce(&seen, &seen_everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  }
  sampler.stop();

  if (launcher_bound) {
    EXPECT_EQ(sampler.any_thread(), binding) << "a thread ran outside the launcher's binding " << list(binding) << ": "
                                              << list(sampler.any_thread());
  } else {
    EXPECT_TRUE(sampler.adam().any()) << "the Adam was never seen running pinned";
  }
  EXPECT_EQ((sampler.adam() & ~own).count(), 0u)
      << "the Adam ran outside the rank's cpus " << list(own) << ": " << list(sampler.adam());
  EXPECT_EQ((sampler.pinned() & ~own).count(), 0u)
      << "a pinned thread ran outside the rank's cpus " << list(own) << ": " << list(sampler.pinned());

  const std::vector<CpuMask> shares = all_gather(own);
  const std::vector<CpuMask> adams = all_gather(sampler.adam());
  CpuMask node;  // the cpus the launcher let the ranks use: the whole node under --bind-to none
  for (const CpuMask& bound : all_gather(binding)) node |= bound;
  CpuMask covered;
  for (const CpuMask& share : shares) covered |= share;
  EXPECT_EQ(covered, node) << "the ranks' shares " << list(covered) << " leave cpus of " << list(node) << " idle";
  const std::size_t ranks = shares.size();
  for (std::size_t a = 0; a < ranks; ++a) {
    for (std::size_t b = a + 1; b < ranks; ++b) {
      if (ranks <= node.count()) {
        EXPECT_TRUE((shares[a] & shares[b]).none()) << "ranks " << a << " and " << b << " share cpus";
        EXPECT_TRUE((adams[a] & adams[b]).none()) << "ranks " << a << " and " << b << " ran their Adam on one cpu";
      } else {
        // More ranks than cpus: each gets one, round-robin.
        EXPECT_EQ(shares[a].count(), 1u);
        EXPECT_EQ(shares[a] == shares[b], a % node.count() == b % node.count()) << a << ", " << b;
      }
    }
  }
}

}  // namespace
}  // namespace zest
