// The Device base: counting and RAII shared by every backend. Backends only move bytes.
#include "zest/device.hpp"

#include <string>
#include <utility>

#include <fmt/core.h>

#include "runtime/device/memory_ledger.hpp"
#include "zest/error.hpp"

namespace zest {

std::string_view category_name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::params: return "params";
    case MemoryCategory::grads: return "grads";
    case MemoryCategory::optimizer_states: return "optimizer_states";
    case MemoryCategory::buffers: return "buffers";
  }
  return "unknown";
}

Device::Device(std::size_t budget, std::vector<int> host_cpus)
    : device_ledger_(std::make_unique<MemoryLedger>(budget)),
      pinned_ledger_(std::make_unique<MemoryLedger>(0)),
      host_cpus_(std::move(host_cpus)) {}

Device::~Device() = default;

std::unique_ptr<Stream> Device::borrow_stream(void* /*native_stream*/) {
  throw Error("Device::borrow_stream: the " + name() +
              " device has no native streams to borrow (its work is ordered by the host); order against it "
              "without a compute stream");
}

// A request of 0 bytes gives an empty buffer: nothing to count, nothing to free.
DeviceBuffer Device::allocate(std::size_t bytes, MemoryCategory category) {
  if (bytes == 0) return DeviceBuffer();
  // Count first: a request past the budget must fail without touching the backend.
  device_ledger_->reserve(bytes, category);
  void* data = nullptr;
  try {
    data = allocate_bytes(bytes);
  } catch (...) {
    device_ledger_->release(bytes, category);
    throw;
  }
  if (data == nullptr) {
    device_ledger_->release(bytes, category);
    device_ledger_->throw_out_of_memory(bytes, category,
                                        "the " + name() + " backend has no memory left for it");
  }
  return DeviceBuffer(this, data, bytes, category);
}

void throw_host_label_out_of_range(std::size_t index) {
  throw Error(
      fmt::format("pinned memory label {} is not below HostLabel::kCount ({}); use one of kCount labels, or none",
                  index, HostLabel::kCount));
}

HostBuffer Device::allocate_pinned(std::size_t bytes, HostLabel label) {
  if (bytes == 0) return HostBuffer();
  bool locked = false;
  void* data = allocate_pinned_bytes(bytes, locked);
  if (data == nullptr) {
    throw SystemError(
        fmt::format("cannot allocate {} of pinned host memory on {}: the system has no memory left; lower "
                    "the offload buffer sizes (offload.sub_group_bytes, offload.*.buffer_count)",
                    describe_bytes(bytes), name()));
  }
  pinned_ledger_->reserve_host(bytes, locked, label);
  return HostBuffer(this, data, bytes, locked, label);
}

void Device::release(DeviceBuffer& buffer) noexcept {
  free_bytes(buffer.data_, buffer.bytes_);
  device_ledger_->release(buffer.bytes_, buffer.category_);
}

void Device::release(HostBuffer& buffer) noexcept {
  free_pinned_bytes(buffer.data_, buffer.bytes_);
  pinned_ledger_->release_host(buffer.bytes_, buffer.locked_, buffer.label_);
}

MemoryStats Device::memory_stats() const {
  MemoryStats stats = device_ledger_->stats();
  add_backend_stats(stats);
  return stats;
}

HostMemoryStats Device::pinned_stats() const { return pinned_ledger_->host_stats(); }

void Device::reset_peak() {
  device_ledger_->reset_peak();
  pinned_ledger_->reset_peak();
}

// --- DeviceBuffer

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      category_(other.category_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    category_ = other.category_;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { reset(); }

void DeviceBuffer::reset() noexcept {
  if (owner_ != nullptr && data_ != nullptr) owner_->release(*this);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

// --- HostBuffer

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      locked_(std::exchange(other.locked_, false)),
      label_(other.label_) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    locked_ = std::exchange(other.locked_, false);
    label_ = other.label_;
  }
  return *this;
}

HostBuffer::~HostBuffer() { reset(); }

void HostBuffer::reset() noexcept {
  if (owner_ != nullptr && data_ != nullptr) owner_->release(*this);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
  locked_ = false;
}

}  // namespace zest
