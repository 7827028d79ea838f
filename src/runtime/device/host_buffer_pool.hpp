// HostBufferPool: a fixed set of equal pinned HostBuffers, allocated once from a Device, that the
// offload pipelines cycle through (read next, compute this, write previous) without allocating
// inside a step.
//
// acquire() hands out a Lease, a move-only RAII handle that gives its buffer back when destroyed;
// when every buffer is leased, acquire() blocks until one comes back, which is what bounds how far
// a pipeline runs ahead. Threading: acquire, try_acquire and lease destruction may happen on any
// thread (a lease may be returned by a stream's worker). The pool must outlive its leases.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

#include "zest/device.hpp"

namespace zest {

class HostBufferPool {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    HostBuffer& buffer() const { return *buffer_; }
    void* data() const { return buffer_->data(); }
    template <class T> T* as() const { return buffer_->as<T>(); }
    std::size_t bytes() const { return buffer_->bytes(); }
    // Which of the pool's buffers this is: 0..count()-1.
    std::size_t index() const { return index_; }
    explicit operator bool() const { return pool_ != nullptr; }
    // Gives the buffer back now; the lease becomes empty.
    void reset() noexcept;

   private:
    friend class HostBufferPool;
    Lease(HostBufferPool* pool, HostBuffer* buffer, std::size_t index)
        : pool_(pool), buffer_(buffer), index_(index) {}

    HostBufferPool* pool_ = nullptr;
    HostBuffer* buffer_ = nullptr;
    std::size_t index_ = 0;
  };

  // Allocates `count` pinned buffers of `bytes_each` from `device` now. Throws zest::Error when
  // either is 0 (a pool nobody can lease from would block forever), and what allocate_pinned
  // throws. The device must outlive the pool.
  HostBufferPool(Device& device, std::size_t count, std::size_t bytes_each);
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // Blocks until a buffer is free.
  Lease acquire();
  // An empty Lease when every buffer is leased.
  Lease try_acquire();
  // An empty Lease when none came free within `timeout`.
  Lease try_acquire_for(std::chrono::nanoseconds timeout);

  std::size_t count() const { return buffers_.size(); }
  std::size_t buffer_bytes() const { return bytes_each_; }
  std::size_t available() const;

 private:
  Lease take_locked();
  void give_back(std::size_t index) noexcept;

  std::size_t bytes_each_;
  std::vector<HostBuffer> buffers_;
  mutable std::mutex mutex_;
  std::condition_variable returned_;
  std::vector<std::size_t> free_;  // indices of free buffers; capacity fixed at construction
};

}  // namespace zest
