// Store: where the offload engines keep what does not fit on the device or in host memory — named
// regions of bytes moved asynchronously between a store and host buffers. NvmeStore (one
// preallocated O_DIRECT file per rank, io_uring; offload device "nvme") implements it; the engine's
// NvmeResidency (src/engine/optimizer/residency.hpp) drives it. Offload device "cpu" needs no store: its
// data stays in pinned host memory and is used in place (PinnedResidency), with nothing to move.
//
// Regions are allocated once, at setup: allocate(name, bytes) gives each a fixed place (NvmeStore:
// a fixed offset in the rank's file, reserved on disk then). A transfer always moves the region's
// padded_bytes (bytes rounded up to alignment()): the host buffer must start at an alignment()
// boundary and hold padded_bytes; the pad is written and read back as it is in the buffer.
//
// Contract of a transfer: the buffer belongs to it until its IoHandle reports completion. A region
// takes one write, or any number of reads, at a time (wait for the write before reading it back).
// A region whose last write failed holds no data: reading it raises IoError, so a failed write
// never passes for data on disk. Errors are IoError naming the store's location, the offset, the
// length and the errno.
// Threading: allocate/find/write_async/read_async/flush may be called from any thread (they take
// a lock); completion happens on the store's own worker thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "offload/io_handle.hpp"

namespace zest::offload {

using RegionId = std::uint32_t;

struct Region {
  std::string name;
  std::size_t offset = 0;        // place in the store (NvmeStore: byte offset in the file)
  std::size_t bytes = 0;         // as asked for
  std::size_t padded_bytes = 0;  // bytes rounded up to alignment(): what a transfer moves
};

class Store {
 public:
  virtual ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Gives `name` a region of `bytes` (> 0) after the last one. Throws zest::Error when the name is
  // taken or bytes is 0; IoError when the backing cannot be reserved (NvmeStore: ENOSPC).
  RegionId allocate(std::string name, std::size_t bytes);
  // Throws zest::Error naming the region when there is none of that name.
  RegionId find(std::string_view name) const;
  Region region(RegionId id) const;
  std::size_t region_count() const;
  // Bytes of the store taken by regions (padded).
  std::size_t used_bytes() const;
  std::size_t alignment() const { return alignment_; }
  // True once a write to the region has succeeded (and no later write failed or is running).
  bool holds_data(RegionId id) const;

  // Copies region `id`'s padded_bytes from `src` into the store.
  IoHandle write_async(RegionId id, const void* src);
  // Copies region `id`'s padded_bytes from the store into `dst`.
  IoHandle read_async(RegionId id, void* dst);
  // Waits for every transfer submitted so far, makes written data durable (NvmeStore: fdatasync),
  // then rethrows the first transfer failure that no IoHandle::wait() has reported.
  virtual void flush() = 0;
  // Where the data lives, for messages: the file path, or "pinned host memory".
  virtual std::string location() const = 0;

 protected:
  explicit Store(std::size_t alignment);

  enum class Op { write, read };

  // What every store's request knows of its transfer; each store derives its own request type.
  struct TransferRequest : detail::Transfer {
    RegionId id = 0;
    Op op = Op::write;
    Region region;
    char* buffer = nullptr;  // a write only reads it; one pointer serves both ways
  };

  // Backing for a new region (NvmeStore: fallocate its range).
  virtual void reserve(RegionId id, const Region& region) = 0;
  // Queues a transfer for write_async/read_async (which pass `buffer` as they got it).
  virtual IoHandle submit(RegionId id, Op op, void* buffer) = 0;

  // begin_transfer, then a new request of type R (derived from TransferRequest) describing the
  // transfer. When the request cannot be allocated the region is released again.
  template <class R>
  std::shared_ptr<R> begin_request(RegionId id, Op op, void* buffer);

  // Checks a transfer before it is queued: the region exists, the buffer is aligned, no write to
  // it is running (nor, for a write, a read), and for a read that it holds data. Marks it busy and
  // returns a copy of the region.
  Region begin_transfer(RegionId id, Op op, const void* buffer);
  // Called by the worker when the transfer is over, before its handle completes.
  void end_transfer(RegionId id, Op op, bool ok) noexcept;

  // Remembers a failed transfer so flush() reports it if no wait() does.
  void note_failure(std::shared_ptr<detail::Transfer> transfer);
  // Rethrows (and forgets) the first failure no wait() observed; forgets the observed ones.
  void rethrow_unobserved_failure();

 private:
  struct State {
    int readers = 0;
    bool writing = false;
    bool has_data = false;
  };

  const std::size_t alignment_;
  mutable std::mutex mutex_;
  std::deque<Region> regions_;  // deque: references stay valid as regions are added
  std::deque<State> states_;
  std::unordered_map<std::string, RegionId> by_name_;
  std::size_t used_ = 0;
  std::vector<std::shared_ptr<detail::Transfer>> failures_;
};

template <class R>
std::shared_ptr<R> Store::begin_request(RegionId id, Op op, void* buffer) {
  const Region region = begin_transfer(id, op, buffer);
  std::shared_ptr<R> request;
  try {
    request = std::make_shared<R>();
  } catch (...) {
    end_transfer(id, op, false);
    throw;
  }
  request->id = id;
  request->op = op;
  request->region = region;
  request->buffer = static_cast<char*>(buffer);
  return request;
}

}  // namespace zest::offload
