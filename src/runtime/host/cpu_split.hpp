// How Topology divides cpus among the ranks of one host, as a pure function of the layout so the
// policy is tested on layouts this machine does not have.
#pragma once

#include <vector>

namespace zest::detail {

// `cores` holds each core's PU OS indices, in hwloc's logical order (cores of one NUMA node and
// package are adjacent, so contiguous blocks stay local). Returns, sorted, the PUs of share
// `index` of `count`:
//   count <= cores:         a contiguous block of whole cores (block sizes differ by at most one);
//   cores < count <= PUs:   a contiguous block of PUs in the same order, still disjoint;
//   count > PUs:            PU (index mod PUs): the shares overlap round-robin.
// Every share gets at least one PU when `cores` holds any. Requires 0 <= index < count.
std::vector<int> split_cpus(const std::vector<std::vector<int>>& cores, int index, int count);

// The launcher's placement of this rank: the PUs of `cores` in `bound` (the process's binding,
// e.g. mpirun --bind-to core), sorted, when they are some but not all of them; empty otherwise
// (no binding, or one no narrower than the machine, as under --bind-to none).
std::vector<int> launcher_binding(const std::vector<std::vector<int>>& cores, const std::vector<int>& bound);

// Local rank `index` of `count`'s cpus on the machine `cores`: the launcher's binding when there is
// one (the launcher already divided the machine; splitting it again would leave cores idle or
// stack ranks), else split_cpus(cores, index, count).
std::vector<int> place_rank(const std::vector<std::vector<int>>& cores, const std::vector<int>& bound, int index,
                            int count);

}  // namespace zest::detail
