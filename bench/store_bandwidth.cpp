#include "store_bandwidth.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::bench {
namespace {

constexpr std::size_t kRegionBytes = std::size_t{64} << 20;
constexpr std::size_t kBuffers = 4;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

double store_pass(offload::NvmeStore& store, bool write, const std::vector<offload::RegionId>& regions,
                  std::vector<HostBuffer>& buffers) {
  std::vector<offload::IoHandle> handles(buffers.size());
  std::vector<std::size_t> in_buffer(buffers.size(), 0);
  const auto check = [&](std::size_t k) {
    handles[k].wait();
    if (!write) {
      std::size_t stamp = 0;
      std::memcpy(&stamp, buffers[k].data(), sizeof stamp);
      if (stamp != in_buffer[k])
        throw Error(fmt::format("zest bench: store region {} read back wrong data", in_buffer[k]));
    }
  };
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const std::size_t k = i % buffers.size();
    if (handles[k]) check(k);
    in_buffer[k] = i;
    if (write) {
      std::memcpy(buffers[k].data(), &i, sizeof i);
      handles[k] = store.write_async(regions[i], buffers[k].data());
    } else {
      handles[k] = store.read_async(regions[i], buffers[k].data());
    }
  }
  for (std::size_t k = 0; k < buffers.size(); ++k)
    if (handles[k]) check(k);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

StoreBandwidth measure_store_bandwidth(const std::string& directory, int rank, const std::vector<int>& cpus,
                                       std::size_t bytes, IoConfig io, int reps, bool register_buffers) {
  io.checksum = false;
  const std::size_t region_count = std::max<std::size_t>(bytes / kRegionBytes, 1);
  offload::NvmeStoreOptions options;
  options.directories = {directory};
  options.rank = rank;
  options.io = io;
  options.cpus = cpus;
  offload::NvmeStore store(options);
  std::vector<offload::RegionId> regions;
  for (std::size_t i = 0; i < region_count; ++i)
    regions.push_back(store.allocate(std::string("bandwidth").append(std::to_string(i)), kRegionBytes));

  auto device = make_cpu_device(std::size_t{1} << 20);
  std::vector<HostBuffer> buffers;
  std::vector<std::pair<void*, std::size_t>> registered;
  for (std::size_t k = 0; k < kBuffers; ++k) {
    buffers.push_back(device->allocate_pinned(kRegionBytes));
    std::memset(buffers.back().data(), static_cast<int>(0x5A + k), kRegionBytes);
    registered.emplace_back(buffers.back().data(), kRegionBytes);
  }
  StoreBandwidth result;
  result.bytes = region_count * kRegionBytes;
  result.direct = store.direct();
  if (register_buffers) {
    try {
      store.register_buffers(registered);
      result.fixed_buffers = true;
    } catch (const SystemError&) {
      result.fixed_buffers = false;  // still valid, with per-request page pinning; reported
    }
  }
  std::vector<double> writes, reads;
  for (int rep = 0; rep < reps; ++rep) {
    writes.push_back(static_cast<double>(result.bytes) / store_pass(store, true, regions, buffers));
    store.flush();
    reads.push_back(static_cast<double>(result.bytes) / store_pass(store, false, regions, buffers));
  }
  result.write_bytes_per_s = median(writes);
  result.read_bytes_per_s = median(reads);
  return result;
}

}  // namespace zest::bench
