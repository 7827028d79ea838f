// The cpu backend. Device memory is 256-byte-aligned host memory under the budget; streams are
// CpuStreams (worker threads); copy_async and memset_async run memcpy/memset on the stream's
// worker. Pinned memory is anonymous mmap, pre-faulted and mlock'ed where RLIMIT_MEMLOCK allows.
// make_cpu_device is declared in zest/device.hpp.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "runtime/device/cpu_stream.hpp"
#include "zest/device.hpp"

namespace zest {

class CpuDevice final : public Device {
 public:
  static constexpr std::size_t kAlignment = 256;
  // Pinned blocks at least this large ask for transparent huge pages.
  static constexpr std::size_t kHugePageThreshold = std::size_t{2} << 20;

  // Throws zest::Error when `budget` is 0. `host_cpus`: Device::host_cpus.
  explicit CpuDevice(std::size_t budget, std::vector<int> host_cpus = {});
  ~CpuDevice() override;

  DeviceType type() const override { return DeviceType::cpu; }
  std::string name() const override { return "cpu"; }
  bool host_accessible() const override { return true; }

  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Event> create_event() override;
  // Throw zest::Error when `stream` was not created by this device.
  void copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override;
  void memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override;
  // Drains every live stream this device created; rethrows the first error among them.
  void synchronize() override;

 protected:
  void* allocate_bytes(std::size_t bytes) override;
  void free_bytes(void* data, std::size_t bytes) noexcept override;
  void* allocate_pinned_bytes(std::size_t bytes, bool& locked) override;
  void free_pinned_bytes(void* data, std::size_t bytes) noexcept override;

 private:
  CpuStream& own_stream(Stream& stream, const char* operation) const;

  std::shared_ptr<detail::CpuStreamRegistry> streams_;
};

}  // namespace zest
