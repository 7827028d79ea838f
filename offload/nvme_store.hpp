// NvmeStore: the Store on NVMe (offload device "nvme"). One file per rank in each of its
// directories (SwapFile: O_DIRECT, preallocated), driven through io_uring by io.threads dedicated
// threads, each with its own ring, that submit and reap:
// - a transfer is cut into requests of at most io.block_size bytes; each ring keeps at most
//   io.queue_depth of them in the kernel, across all transfers (the rest wait in the store's
//   queue, in submission order);
// - with several directories (one per drive) the rank's swap is striped: the store's address
//   space is cut into stripes of io.block_size bytes, stripe k lives in directory k % D at offset
//   (k / D) * block_size of that directory's file. Fixed stripes of the request size (rather than
//   one contiguous range per directory) keep every transfer of D or more blocks spread over all
//   the drives at once, each request inside one stripe, so requests stay as large and as aligned
//   as with one directory (a region's first and last request may be shorter: regions are
//   4 KiB-aligned, stripes block-aligned). With one directory nothing is cut at stripes: requests
//   are the region's blocks, as before;
// - requests are shared among the rings by stripe (one directory: by block): ring k % io.threads,
//   so with one thread per directory each ring drives one drive;
// - every ring registers every file, and the host buffers given to register_buffers (their
//   requests use the fixed-buffer opcodes, which skip per-request page pinning);
// - a short read or write is resubmitted for the rest; EINTR/EAGAIN are retried; any other error,
//   a read past the end of a file, or (with io.checksum) a request whose CRC32C differs from what
//   was written fails the transfer with an IoError naming the file's path, the offset in it, the
//   length and the errno;
// - the threads are pinned to `cpus` (Topology::cpus_for_rank: the cores near the rank's device).
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
  std::size_t file = 0;    // which directory's file (index into NvmeStoreOptions::directories)
  std::size_t offset = 0;  // in that file
  std::size_t length = 0;  // bytes the request asked for
};

struct NvmeStoreOptions {
  // Existing, writable, distinct directories (OffloadTarget::paths), at least one; the file in
  // each is zest-rank<rank>.swap. Several: the swap is striped across them (see above).
  std::vector<std::string> directories;
  int rank = 0;
  IoConfig io;            // block_size, queue_depth (per ring), threads (rings), direct, checksum
  std::vector<int> cpus;  // pin the I/O threads here; empty = where they were started (start_worker_thread)
  bool keep_file = false; // leave the files behind at destruction (default: remove them)
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
    std::size_t max_in_flight = 0;  // most requests in one ring at once (<= queue_depth)
    std::size_t fixed_buffer_requests = 0;  // requests that used a registered buffer
    std::vector<std::size_t> requests_per_ring;  // completed requests, per ring (io.threads)
    std::vector<std::size_t> bytes_per_file;     // bytes moved, per directory's file
  };

  // Creates the files and the rings and starts the I/O threads. Throws IoError (path problems),
  // SystemError (io_uring, pinning), zest::Error (invalid io settings, no directory, the same
  // directory twice).
  explicit NvmeStore(NvmeStoreOptions options);
  // Waits for every transfer, then stops the threads and removes the files (unless keep_file).
  ~NvmeStore() override;

  void flush() override;
  // The file's path; with several directories, every file's, joined by " + ".
  std::string location() const override;

  // Registers host buffers (e.g. a HostBufferPool's) with every ring, replacing any registered
  // before. Transfers from/to inside one of them use fixed-buffer requests. Call it with no
  // transfer running; throws zest::Error otherwise, SystemError when the kernel refuses (e.g. the
  // locked-memory limit).
  void register_buffers(const std::vector<std::pair<void*, std::size_t>>& buffers);

  const std::string& path() const { return files_.front()->path(); }  // the first directory's file
  std::vector<std::string> paths() const;  // one file per directory, in the options' order
  bool direct() const;                     // every file is O_DIRECT
  std::size_t block_size() const { return block_size_; }
  std::size_t queue_depth() const { return queue_depth_; }
  std::size_t rings() const { return lanes_.size(); }
  // Bytes of each directory's file that regions take (preallocated), in the options' order.
  std::vector<std::size_t> file_bytes() const;
  Stats stats() const;

 private:
  struct Request;
  struct Slot;
  struct Lane;
  // One request's place: [start, start + length) of the region, in file `file` at `file_offset`,
  // issued by ring `lane`.
  struct Piece {
    std::size_t start = 0;
    std::size_t length = 0;
    std::size_t file = 0;
    std::size_t file_offset = 0;
    std::size_t lane = 0;
  };

  void reserve(RegionId id, const Region& region) override;
  IoHandle submit(RegionId id, Op op, void* buffer) override;
  std::size_t piece_count(const Region& region) const;
  Piece piece(const Region& region, std::size_t index) const;
  void run(Lane& lane) noexcept;
  void prepare(Lane& lane, Slot& slot);
  void reap(Lane& lane, io_uring_cqe* cqe);
  void finish_piece(Slot& slot);
  void fail(Request& request, std::exception_ptr error);
  void maybe_finish_share(Lane& lane, Request& request);
  int fixed_buffer_index(const void* buffer, std::size_t bytes) const;
  void stop_lanes() noexcept;

  NvmeStoreOptions options_;
  std::size_t block_size_;
  std::size_t queue_depth_;
  std::vector<std::unique_ptr<SwapFile>> files_;
  std::vector<std::size_t> file_sizes_;  // preallocated end of each file

  // Per region, CRC32C of each request-sized piece as last written (io.checksum only). A region's
  // vector is touched only by its one running write, or by its reads after that write finished.
  std::deque<std::vector<std::uint32_t>> piece_crcs_;
  std::vector<std::pair<const char*, std::size_t>> fixed_buffers_;

  mutable std::mutex mutex_;
  std::condition_variable idle_;      // flush waits here for running_ == 0
  std::size_t running_ = 0;           // transfers submitted and not finished
  bool stopping_ = false;
  Stats stats_;

  std::vector<std::unique_ptr<Lane>> lanes_;  // io.threads rings, each with its thread
};

}  // namespace zest::offload
