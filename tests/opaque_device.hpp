// A stand-in for a device whose memory the host may not read (as on cuda), so that the staged paths
// run anywhere: host memory behind a Device that says it is not host-accessible; its streams,
// events and copies are a cpu device's. Counts its copies.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string>

#include "zest/device.hpp"

namespace zest::test {

class OpaqueDevice final : public Device {
 public:
  explicit OpaqueDevice(std::size_t budget) : Device(budget), inner_(make_cpu_device(budget)) {}

  DeviceType type() const override { return DeviceType::cpu; }
  std::string name() const override { return "opaque (test)"; }
  bool host_accessible() const override { return false; }
  std::unique_ptr<Stream> create_stream() override { return inner_->create_stream(); }
  std::unique_ptr<Event> create_event() override { return inner_->create_event(); }
  void copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override {
    copies_.fetch_add(1, std::memory_order_relaxed);
    inner_->copy_async(dst, src, bytes, stream);
  }
  void memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override {
    inner_->memset_async(dst, value, bytes, stream);
  }
  void synchronize() override { inner_->synchronize(); }
  long copies() const { return copies_.load(); }

 protected:
  void* allocate_bytes(std::size_t bytes) override { return std::aligned_alloc(256, round(bytes, 256)); }
  void free_bytes(void* data, std::size_t) noexcept override { std::free(data); }
  void* allocate_pinned_bytes(std::size_t bytes, bool& locked) override {
    locked = false;
    return std::aligned_alloc(4096, round(bytes, 4096));
  }
  void free_pinned_bytes(void* data, std::size_t) noexcept override { std::free(data); }

 private:
  static std::size_t round(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
  std::unique_ptr<Device> inner_;
  std::atomic<long> copies_{0};
};

}  // namespace zest::test
