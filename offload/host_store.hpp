// HostStore: the Store in pinned host memory (offload device "cpu"). Each region is one pinned
// buffer from the Device (counted in its pinned_stats), allocated at allocate(); transfers are
// memcpy on the store's worker thread, in submission order, so the engine's swap pipeline runs
// unchanged on either store. With io.checksum a region's CRC32C is kept on write and checked on
// read, as NvmeStore does per block.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "offload/store.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"

namespace zest::offload {

class HostStore final : public Store {
 public:
  // `device` provides the pinned memory and must outlive the store. `cpus`: pin the worker there
  // (empty = where it was started, see start_worker_thread). Throws SystemError when pinning fails.
  HostStore(Device& device, const IoConfig& io, std::vector<int> cpus = {});
  // Waits for every transfer, then stops the worker and frees the regions.
  ~HostStore() override;

  void flush() override;
  std::string location() const override { return "pinned host memory"; }

  // Where region `id` lives, for tests and for a caller that can use it in place.
  const void* region_data(RegionId id) const;

 private:
  struct Request;

  void reserve(RegionId id, const Region& region) override;
  IoHandle submit(RegionId id, Op op, void* buffer) override;
  void run() noexcept;
  void execute(const std::shared_ptr<Request>& request);

  Device& device_;
  bool checksum_;
  mutable std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::deque<HostBuffer> memory_;          // per region; deque keeps addresses stable
  std::deque<std::uint32_t> crcs_;         // per region (io.checksum)
  std::deque<std::shared_ptr<Request>> queued_;
  std::size_t running_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace zest::offload
