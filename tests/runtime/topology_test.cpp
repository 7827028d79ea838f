// Topology against what the OS reports (sysconf, sched_getaffinity, sched_getcpu), the cpu split
// policy on this machine and on layouts it does not have, and thread binding really taking effect.
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/host/cpu_split.hpp"
#include "zest/error.hpp"
#include "zest/topology.hpp"
#include "zest_build_config.h"

namespace zest {
namespace {

std::set<int> affinity_of_this_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  std::set<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.insert(cpu);
  }
  return cpus;
}

std::vector<int> all_cpus(const Topology& topology) {
  return topology.cpus_for_rank(DeviceType::cpu, 0, 0, 1);
}

TEST(Topology, CountsAgreeWithTheOperatingSystem) {
  const Topology topology = Topology::detect();
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  const auto affinity = affinity_of_this_thread();
  ASSERT_GT(online, 0);
  EXPECT_GE(topology.pu_count(), 1);
  EXPECT_LE(topology.pu_count(), online);
  // hwloc counts the PUs this process may use (its cgroup), which includes its affinity mask.
  EXPECT_GE(topology.pu_count(), static_cast<int>(affinity.size()));
  EXPECT_LE(topology.pu_count(), static_cast<int>(std::max<unsigned>(
                                     std::thread::hardware_concurrency(), static_cast<unsigned>(online))));
  EXPECT_GE(topology.core_count(), 1);
  EXPECT_LE(topology.core_count(), topology.pu_count());
  EXPECT_GE(topology.numa_node_count(), 1);

  // One local rank gets every PU, each one a cpu the OS has online.
  const auto cpus = all_cpus(topology);
  EXPECT_EQ(static_cast<int>(cpus.size()), topology.pu_count());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
  for (const int cpu : affinity) {
    EXPECT_TRUE(std::binary_search(cpus.begin(), cpus.end(), cpu)) << "cpu " << cpu;
  }
}

TEST(Topology, DescribeStatesTheCounts) {
  const Topology topology = Topology::detect();
  const auto plural = [](int n, const std::string& word) {
    return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
  };
  EXPECT_EQ(topology.describe(), plural(topology.numa_node_count(), "NUMA node") + ", " +
                                     plural(topology.core_count(), "core") + ", " +
                                     plural(topology.pu_count(), "PU"));
}

// For 1, 2 and 4 local ranks: every rank gets PUs, together they cover the machine, and they are
// disjoint wherever there are PUs enough (with more ranks than PUs, each gets exactly one).
TEST(Topology, LocalRanksSplitTheMachine) {
  const Topology topology = Topology::detect();
  const auto all = all_cpus(topology);
  for (const int ranks : {1, 2, 4}) {
    std::multiset<int> handed_out;
    std::vector<std::size_t> sizes;
    for (int rank = 0; rank < ranks; ++rank) {
      const auto cpus = topology.cpus_for_rank(DeviceType::cpu, 0, rank, ranks);
      ASSERT_FALSE(cpus.empty()) << "rank " << rank << " of " << ranks;
      EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
      for (const int cpu : cpus) {
        EXPECT_TRUE(std::binary_search(all.begin(), all.end(), cpu)) << "cpu " << cpu;
        handed_out.insert(cpu);
      }
      sizes.push_back(cpus.size());
    }
    EXPECT_EQ(std::set<int>(handed_out.begin(), handed_out.end()), std::set<int>(all.begin(), all.end()))
        << ranks << " ranks";
    if (ranks <= topology.pu_count()) {
      EXPECT_EQ(handed_out.size(), all.size()) << ranks << " ranks share a PU";
    } else {
      EXPECT_EQ(*std::max_element(sizes.begin(), sizes.end()), 1u) << ranks << " ranks";
    }
  }
}

// Without a GPU (or without CUDA), a cuda rank's cpus are the cpu split: hwloc knows nothing nearer.
TEST(Topology, CudaRanksWithoutGpuFallBackToTheWholeMachine) {
  const Topology topology = Topology::detect();
  const auto all = all_cpus(topology);
  for (int rank = 0; rank < 2; ++rank) {
    const auto cpus = topology.cpus_for_rank(DeviceType::cuda, rank, rank, 2);
    ASSERT_FALSE(cpus.empty());
    for (const int cpu : cpus) EXPECT_TRUE(std::binary_search(all.begin(), all.end(), cpu));
#if !ZEST_HAVE_CUDA
    EXPECT_EQ(cpus, topology.cpus_for_rank(DeviceType::cpu, rank, rank, 2));
#endif
  }
}

TEST(Topology, RejectsARankOutsideTheHost) {
  const Topology topology = Topology::detect();
  try {
    static_cast<void>(topology.cpus_for_rank(DeviceType::cpu, 0, 4, 4));
    FAIL() << "no SystemError";
  } catch (const SystemError& error) {
    EXPECT_NE(std::string(error.what()).find("local rank 4 of 4"), std::string::npos) << error.what();
  }
  EXPECT_THROW(static_cast<void>(topology.cpus_for_rank(DeviceType::cpu, 0, 0, 0)), SystemError);
  EXPECT_THROW(static_cast<void>(topology.cpus_for_rank(DeviceType::cpu, 0, -1, 2)), SystemError);
}

TEST(Topology, MovedFromKeepsWorkingInItsNewOwner) {
  Topology first = Topology::detect();
  const int pus = first.pu_count();
  Topology second = std::move(first);
  EXPECT_EQ(second.pu_count(), pus);
  first = std::move(second);
  EXPECT_EQ(first.pu_count(), pus);
}

// Binding runs on a thread of its own, so the test process keeps its affinity.
TEST(Topology, BindingChangesTheThreadsAffinity) {
  const Topology topology = Topology::detect();
  const auto all = all_cpus(topology);
  const int target = all.back();
  std::set<int> bound;
  std::set<int> rebound;
  int ran_on = -1;
  std::thread thread([&] {
    Topology::bind_current_thread({target});
    bound = affinity_of_this_thread();
    ran_on = sched_getcpu();  // the kernel migrates the thread before sched_setaffinity returns
    Topology::bind_current_thread(all);
    rebound = affinity_of_this_thread();
  });
  thread.join();
  EXPECT_EQ(bound, std::set<int>{target});
  EXPECT_EQ(ran_on, target);
  EXPECT_EQ(rebound, std::set<int>(all.begin(), all.end()));
}

TEST(Topology, BindingToABadCpuThrowsAndLeavesTheAffinity) {
  const Topology topology = Topology::detect();
  const int first = all_cpus(topology).front();
  std::thread thread([&] {
    const auto before = affinity_of_this_thread();
    try {
      // One good cpu beside the bad one: the kernel alone would quietly drop the bad one.
      Topology::bind_current_thread({first, 100000});
      ADD_FAILURE() << "no SystemError";
    } catch (const SystemError& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("cpus " + std::to_string(first) + ",100000"), std::string::npos) << message;
      EXPECT_NE(message.find("cpu 100000 is not one this process may run on"), std::string::npos) << message;
      EXPECT_NE(message.find("errno 22"), std::string::npos) << message;
    }
    EXPECT_EQ(affinity_of_this_thread(), before);
    EXPECT_THROW(Topology::bind_current_thread({-1}), SystemError);
    EXPECT_THROW(Topology::bind_current_thread({}), SystemError);
    EXPECT_EQ(affinity_of_this_thread(), before);
  });
  thread.join();
}

// The split policy on a layout this machine lacks: 2 packages x 4 cores x 2 hardware threads,
// numbered as Linux does (core c has PUs c and c + 8).
std::vector<std::vector<int>> two_socket_layout() {
  std::vector<std::vector<int>> cores;
  for (int core = 0; core < 8; ++core) cores.push_back({core, core + 8});
  return cores;
}

TEST(CpuSplit, FewRanksGetContiguousBlocksOfWholeCores) {
  const auto cores = two_socket_layout();
  EXPECT_EQ(detail::split_cpus(cores, 0, 1), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
  // Two ranks: one package each.
  EXPECT_EQ(detail::split_cpus(cores, 0, 2), (std::vector<int>{0, 1, 2, 3, 8, 9, 10, 11}));
  EXPECT_EQ(detail::split_cpus(cores, 1, 2), (std::vector<int>{4, 5, 6, 7, 12, 13, 14, 15}));
  // Three ranks: 2, 3 and 3 cores.
  EXPECT_EQ(detail::split_cpus(cores, 0, 3), (std::vector<int>{0, 1, 8, 9}));
  EXPECT_EQ(detail::split_cpus(cores, 1, 3), (std::vector<int>{2, 3, 4, 10, 11, 12}));
  EXPECT_EQ(detail::split_cpus(cores, 2, 3), (std::vector<int>{5, 6, 7, 13, 14, 15}));
  EXPECT_EQ(detail::split_cpus(cores, 7, 8), (std::vector<int>{7, 15}));
}

TEST(CpuSplit, MoreRanksThanCoresSplitHardwareThreadsThenShareThem) {
  const auto cores = two_socket_layout();
  // 12 ranks over 16 PUs in core order (0, 8, 1, 9, ...): blocks of one or two, siblings together.
  EXPECT_EQ(detail::split_cpus(cores, 0, 12), (std::vector<int>{0}));
  EXPECT_EQ(detail::split_cpus(cores, 1, 12), (std::vector<int>{8}));
  EXPECT_EQ(detail::split_cpus(cores, 2, 12), (std::vector<int>{1, 9}));
  EXPECT_EQ(detail::split_cpus(cores, 15, 16), (std::vector<int>{15}));
  EXPECT_EQ(detail::split_cpus(cores, 1, 16), (std::vector<int>{8}));
  // 20 ranks: round-robin over the 16 PUs.
  EXPECT_EQ(detail::split_cpus(cores, 16, 20), (std::vector<int>{0}));
  EXPECT_EQ(detail::split_cpus(cores, 17, 20), (std::vector<int>{8}));
  EXPECT_TRUE(detail::split_cpus({}, 0, 3).empty());
}

TEST(CpuSplit, EveryCountCoversTheMachineDisjointlyWhilePusLast) {
  const auto cores = two_socket_layout();
  for (int count = 1; count <= 40; ++count) {
    std::multiset<int> handed_out;
    std::size_t smallest = 1000;
    std::size_t largest = 0;
    for (int index = 0; index < count; ++index) {
      const auto cpus = detail::split_cpus(cores, index, count);
      ASSERT_FALSE(cpus.empty()) << index << " of " << count;
      handed_out.insert(cpus.begin(), cpus.end());
      smallest = std::min(smallest, cpus.size());
      largest = std::max(largest, cpus.size());
    }
    EXPECT_EQ(std::set<int>(handed_out.begin(), handed_out.end()).size(), 16u) << count;
    if (count <= 16) {
      EXPECT_EQ(handed_out.size(), 16u) << count << " ranks overlap";
    }
    // Shares differ by at most one core (two PUs) while whole cores go round, then by one PU.
    EXPECT_LE(largest - smallest, count <= 8 ? 2u : 1u) << count;
  }
}

// This two-core machine's layout, with more ranks than cores: they share the cores round-robin.
TEST(CpuSplit, FourRanksOnTwoCoresShareThemRoundRobin) {
  const std::vector<std::vector<int>> cores = {{0}, {1}};
  const std::vector<int> unbound = {0, 1};  // mpirun --bind-to none: the whole machine
  EXPECT_EQ(detail::place_rank(cores, unbound, 0, 2), std::vector<int>{0});
  EXPECT_EQ(detail::place_rank(cores, unbound, 1, 2), std::vector<int>{1});
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_EQ(detail::place_rank(cores, unbound, rank, 4), std::vector<int>{rank % 2}) << rank;
  EXPECT_EQ(detail::place_rank(cores, unbound, 0, 1), (std::vector<int>{0, 1})) << "a world of one";
}

// A launcher that bound the process to part of the machine (mpirun --bind-to core or socket)
// already placed the rank: its cpus are the binding, whatever the local rank and count.
TEST(CpuSplit, ALaunchersBindingIsTheRanksPlacement) {
  const auto cores = two_socket_layout();
  EXPECT_EQ(detail::place_rank(cores, {10, 2}, 0, 2), (std::vector<int>{2, 10}));
  EXPECT_EQ(detail::place_rank(cores, {10, 2}, 1, 2), (std::vector<int>{2, 10}));
  EXPECT_EQ(detail::place_rank(cores, {5}, 3, 4), std::vector<int>{5});
  // A socket binding shared by two ranks is not split again (the launcher chose to share it).
  EXPECT_EQ(detail::place_rank(cores, {0, 1, 2, 3, 8, 9, 10, 11}, 1, 4), (std::vector<int>{0, 1, 2, 3, 8, 9, 10, 11}));
  // cpus the machine lacks (or the process may not use) do not count.
  EXPECT_EQ(detail::place_rank(cores, {3, 99}, 0, 2), std::vector<int>{3});
  // No binding, one covering the machine, or one outside it: the local ranks split the machine.
  std::vector<int> everything;
  for (const auto& core : cores) everything.insert(everything.end(), core.begin(), core.end());
  for (const auto& bound : {std::vector<int>{}, everything, std::vector<int>{99}}) {
    EXPECT_EQ(detail::place_rank(cores, bound, 1, 2), detail::split_cpus(cores, 1, 2));
    EXPECT_TRUE(detail::launcher_binding(cores, bound).empty());
  }
}

// The binding cpus_for_rank honours is the calling thread's real one (as mpirun leaves it).
TEST(Topology, ABoundThreadIsPlacedOnItsBinding) {
  const Topology topology = Topology::detect();
  const auto all = all_cpus(topology);
  if (all.size() < 2) GTEST_SKIP() << "needs two cpus to bind to fewer than the machine";
  std::vector<int> placed;
  std::thread thread([&] {
    Topology::bind_current_thread({all.back()});
    placed = topology.cpus_for_rank(DeviceType::cpu, 0, 0, 2);
  });
  thread.join();
  EXPECT_EQ(placed, std::vector<int>{all.back()}) << "rank 0 of 2 unbound would get " << all.front();
}

}  // namespace
}  // namespace zest
