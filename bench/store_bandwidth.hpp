// Sequential bandwidth of the NVMe store, shared by `zest bench io` (which sets it against a
// synchronous loop) and `zest bench step` (which needs the disk-bound limit of an offloaded step).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "offload/nvme_store.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"

namespace zest::bench {

// One pass of the store over every region, cycling through the buffers (each at least a region
// long); seconds taken. A write stamps each region's first 8 bytes with its index and a read checks
// the stamp, so a pass that moved nothing fails with zest::Error.
double store_pass(offload::NvmeStore& store, bool write, const std::vector<offload::RegionId>& regions,
                  std::vector<HostBuffer>& buffers);

struct StoreBandwidth {
  double write_bytes_per_s = 0;  // median over the repetitions
  double read_bytes_per_s = 0;
  std::size_t bytes = 0;         // moved per pass
  bool direct = false;
  bool fixed_buffers = false;
};

// Writes then reads `bytes` (rounded down to 64 MiB regions, at least one) `reps` times through a
// fresh NvmeStore in `directory` (its file named for `rank`, its I/O thread pinned to `cpus`) with the io settings
// given (checksum off: the I/O path alone) through 4 pinned buffers, registered with the ring when `register_buffers`
// (and the kernel allows it); the store's file is removed afterwards. Throws IoError/SystemError/zest::Error.
StoreBandwidth measure_store_bandwidth(const std::string& directory, int rank, const std::vector<int>& cpus,
                                       std::size_t bytes, IoConfig io, int reps, bool register_buffers);

}  // namespace zest::bench
