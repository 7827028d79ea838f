// NvmeStore: the Store on NVMe (offload device "nvme"). One file per rank (SwapFile: O_DIRECT,
// preallocated), driven through io_uring by one dedicated thread that submits and reaps:
// - a transfer is cut into io.block_size requests; at most io.queue_depth are in the kernel at
//   once, across all transfers (the rest wait in the store's queue, in submission order);
// - the file is registered with the ring, and so are the host buffers given to register_buffers
//   (their requests use the fixed-buffer opcodes, which skip per-request page pinning);
// - a short read or write is resubmitted for the rest; EINTR/EAGAIN are retried; any other error,
//   a read past the end of the file, or (with io.checksum) a block whose CRC32C differs from what
//   was written fails the transfer with an IoError naming the path, offset, length and errno;
// - the thread is pinned to `cpus` (Topology::cpus_for_rank: the cores near the rank's device).
#pragma once

#include <liburing.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "offload/store.hpp"
#include "offload/swap_file.hpp"
#include "zest/config.hpp"

namespace zest::offload {

// What the test hook sees of one completed request.
struct IoRequestInfo {
  bool write = false;
  std::size_t offset = 0;  // in the file
  std::size_t length = 0;  // bytes the request asked for
};

struct NvmeStoreOptions {
  std::string directory;  // existing, writable (OffloadTarget::path); the file is zest-rank<rank>.swap
  int rank = 0;
  IoConfig io;            // block_size, queue_depth, direct, checksum (threads: one ring, one thread)
  std::vector<int> cpus;  // pin the I/O thread here; empty = the rank's cpus (start_worker_thread)
  bool keep_file = false; // leave the file behind at destruction (default: remove it)
  // Receives the one-line warnings (O_DIRECT refused, no fallocate). Default: stderr.
  std::function<void(const std::string&)> warn;
  // Tests only: sees each completed request's result (bytes, or -errno) and returns the result
  // the store acts on — a short count or an error that real devices rarely produce on demand.
  std::function<int(const IoRequestInfo&, int result)> completion_hook;
};

class NvmeStore final : public Store {
 public:
  struct Stats {
    std::size_t requests = 0;       // requests completed by the kernel (resubmissions included)
    std::size_t resubmitted = 0;    // short transfers and EINTR/EAGAIN resubmitted
    std::size_t max_in_flight = 0;  // most requests in the kernel at once (<= queue_depth)
    std::size_t fixed_buffer_requests = 0;  // requests that used a registered buffer
  };

  // Creates the file and the ring and starts the I/O thread. Throws IoError (path problems),
  // SystemError (io_uring, pinning), zest::Error (invalid io settings).
  explicit NvmeStore(NvmeStoreOptions options);
  // Waits for every transfer, then stops the thread and removes the file (unless keep_file).
  ~NvmeStore() override;

  void flush() override;
  std::string location() const override { return file_.path(); }

  // Registers host buffers (e.g. a HostBufferPool's) with the ring, replacing any registered
  // before. Transfers from/to inside one of them use fixed-buffer requests. Call it with no
  // transfer running; throws zest::Error otherwise, SystemError when the kernel refuses (e.g. the
  // locked-memory limit).
  void register_buffers(const std::vector<std::pair<void*, std::size_t>>& buffers);

  const std::string& path() const { return file_.path(); }
  bool direct() const { return file_.direct(); }
  std::size_t block_size() const { return block_size_; }
  std::size_t queue_depth() const { return queue_depth_; }
  Stats stats() const;

 private:
  struct Request;
  struct Slot;

  void reserve(RegionId id, const Region& region) override;
  IoHandle submit(RegionId id, Op op, void* buffer) override;
  void run() noexcept;
  void fill_queue();
  void prepare(Slot& slot);
  void reap(io_uring_cqe* cqe);
  void finish_block(Slot& slot);
  void fail(Request& request, std::exception_ptr error);
  void maybe_finish(Request& request);
  int fixed_buffer_index(const void* buffer, std::size_t bytes) const;

  NvmeStoreOptions options_;
  std::size_t block_size_;
  std::size_t queue_depth_;
  SwapFile file_;
  io_uring ring_{};
  bool ring_ready_ = false;

  // Per region, CRC32C of each block as last written (io.checksum only). A region's vector is
  // touched only by its one running write, or by its reads after that write finished.
  std::deque<std::vector<std::uint32_t>> block_crcs_;
  std::vector<std::pair<const char*, std::size_t>> fixed_buffers_;

  mutable std::mutex mutex_;
  std::condition_variable work_;      // the I/O thread waits here when it has nothing in flight
  std::condition_variable idle_;      // flush waits here for running_ == 0
  std::deque<std::shared_ptr<Request>> queued_;  // submitted, not yet taken by the I/O thread
  std::size_t running_ = 0;           // transfers submitted and not finished
  bool stopping_ = false;
  Stats stats_;

  // Owned by the I/O thread.
  std::deque<std::shared_ptr<Request>> issuing_;  // transfers with blocks not yet issued
  std::vector<Slot> slots_;                        // queue_depth of them
  std::vector<std::size_t> free_slots_;
  std::vector<std::size_t> to_prepare_;            // slots whose request must go (again) to the kernel
  std::size_t in_flight_ = 0;

  std::thread thread_;
};

}  // namespace zest::offload
