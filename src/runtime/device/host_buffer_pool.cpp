#include "runtime/device/host_buffer_pool.hpp"

#include <string>
#include <utility>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest {

HostBufferPool::Lease::Lease(Lease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      buffer_(std::exchange(other.buffer_, nullptr)),
      index_(std::exchange(other.index_, 0)) {}

HostBufferPool::Lease& HostBufferPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    buffer_ = std::exchange(other.buffer_, nullptr);
    index_ = std::exchange(other.index_, 0);
  }
  return *this;
}

void HostBufferPool::Lease::reset() noexcept {
  if (pool_ != nullptr) pool_->give_back(index_);
  pool_ = nullptr;
  buffer_ = nullptr;
  index_ = 0;
}

HostBufferPool::HostBufferPool(Device& device, std::size_t count, std::size_t bytes_each)
    : bytes_each_(bytes_each) {
  if (count == 0 || bytes_each == 0) {
    throw Error(
        fmt::format("host buffer pool: {} buffers of {} bytes is empty; a pool needs at least one buffer of at "
                    "least one byte (check offload.*.buffer_count and offload.sub_group_bytes)",
                    count, bytes_each));
  }
  buffers_.reserve(count);
  free_.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    buffers_.push_back(device.allocate_pinned(bytes_each));
    // Handed out lowest index first (the back of free_), so leases come out in a stable order.
    free_.push_back(count - 1 - i);
  }
}

HostBufferPool::Lease HostBufferPool::acquire() {
  std::unique_lock lock(mutex_);
  returned_.wait(lock, [&] { return !free_.empty(); });
  return take_locked();
}

HostBufferPool::Lease HostBufferPool::try_acquire() {
  std::lock_guard lock(mutex_);
  if (free_.empty()) return Lease();
  return take_locked();
}

HostBufferPool::Lease HostBufferPool::try_acquire_for(std::chrono::nanoseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!returned_.wait_for(lock, timeout, [&] { return !free_.empty(); })) return Lease();
  return take_locked();
}

std::size_t HostBufferPool::available() const {
  std::lock_guard lock(mutex_);
  return free_.size();
}

HostBufferPool::Lease HostBufferPool::take_locked() {
  const std::size_t index = free_.back();
  free_.pop_back();
  return Lease(this, &buffers_[index], index);
}

void HostBufferPool::give_back(std::size_t index) noexcept {
  {
    std::lock_guard lock(mutex_);
    free_.push_back(index);  // never reallocates: capacity is the pool's size
  }
  returned_.notify_one();
}

}  // namespace zest
