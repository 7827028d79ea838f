#include "offload/nvme_store.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <utility>

#include <fmt/core.h>

#include "base/trace.hpp"
#include "offload/checksum.hpp"
#include "offload/worker_thread.hpp"
#include "zest/error.hpp"

namespace zest::offload {
namespace {

[[noreturn]] void throw_uring(const char* call, int negative_errno) {
  std::string text = fmt::format("{} failed: {} (errno {})", call, std::strerror(-negative_errno), -negative_errno);
  if (negative_errno == -ENOMEM || negative_errno == -EPERM)
    text.append("; io_uring needs locked memory: raise the memlock limit (ulimit -l) or lower io.queue_depth");
  throw SystemError(text);
}

void warn_to_stderr(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
}

NvmeStoreOptions checked(NvmeStoreOptions options) {
  const std::size_t block = options.io.block_size;
  if (block < 4096 || (block & (block - 1)) != 0)
    throw Error(fmt::format("io.block_size must be a power of two of at least 4KiB, got {}", block));
  if (options.io.queue_depth < 1 || options.io.queue_depth > 4096)
    throw Error(fmt::format("io.queue_depth must be between 1 and 4096, got {}", options.io.queue_depth));
  if (options.io.threads < 1 || options.io.threads > 64)
    throw Error(fmt::format("io.threads must be between 1 and 64, got {}", options.io.threads));
  if (options.directories.empty())
    throw Error("NvmeStore needs at least one directory (offload.*.path)");
  // The same directory twice would put two stripes' files on one path: each truncating the other.
  // Each directory looked at, by its index in the list (one that cannot be looked at is skipped).
  std::map<std::pair<dev_t, ino_t>, std::size_t> seen;
  for (std::size_t i = 0; i < options.directories.size(); ++i) {
    struct stat info {};
    if (::stat(options.directories[i].c_str(), &info) != 0) continue;  // SwapFile names the problem
    const auto [at, fresh] = seen.emplace(std::pair<dev_t, ino_t>{info.st_dev, info.st_ino}, i);
    if (!fresh)
      throw Error(
          fmt::format("offload directories '{}' and '{}' are the same directory; list each drive's directory once",
                      options.directories[at->second], options.directories[i]));
  }
  if (!options.warn) options.warn = warn_to_stderr;
  return options;
}

}  // namespace

struct NvmeStore::Request : TransferRequest {
  // One ring's part of the transfer; touched only by that ring's thread.
  struct Share {
    std::size_t next = 0;         // next piece of this ring not yet issued
    std::size_t outstanding = 0;  // its pieces issued and not finished
    bool done = false;
  };
  int fixed_index = -1;                        // registered buffer holding all of `buffer`, or -1
  std::vector<std::uint32_t>* crcs = nullptr;  // the region's piece CRCs (io.checksum)
  std::size_t pieces = 0;
  std::vector<Share> shares;                   // per ring
  std::atomic<std::size_t> lanes_left{0};      // rings whose share is not done; the last finishes
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;                    // the first failure (set once, under error_mutex)
  std::shared_ptr<Request> self;               // keeps the transfer alive while the rings work on it
  trace::Event* span = nullptr;                // --trace: submission to completion
};

struct NvmeStore::Slot {
  Request* request = nullptr;
  std::size_t index = 0;  // the piece's index in the region
  Piece piece;
  std::size_t done = 0;   // bytes already transferred (short transfers resubmit the rest)
};

// One io_uring ring and the thread that submits to it and reaps it.
struct NvmeStore::Lane {
  std::size_t index = 0;
  io_uring ring{};
  bool ring_ready = false;
  std::condition_variable work;                  // the thread waits here when it has nothing in flight
  std::deque<std::shared_ptr<Request>> queued;   // under the store's mutex_: not yet taken by the thread
  // Owned by the thread.
  std::deque<std::shared_ptr<Request>> issuing;  // transfers with pieces of this ring not yet issued
  std::vector<Slot> slots;                       // queue_depth of them
  std::vector<std::size_t> free_slots;
  std::vector<std::size_t> to_prepare;           // slots whose request must go (again) to the kernel
  std::size_t in_flight = 0;
  std::thread thread;

  ~Lane() {
    if (ring_ready) io_uring_queue_exit(&ring);
  }
};

NvmeStore::NvmeStore(NvmeStoreOptions options)
    : Store(4096),
      options_(checked(std::move(options))),
      block_size_(options_.io.block_size),
      queue_depth_(static_cast<std::size_t>(options_.io.queue_depth)) {
  for (const std::string& directory : options_.directories) {
    files_.push_back(std::make_unique<SwapFile>(directory, options_.rank, options_.io.direct, options_.warn));
    if (options_.keep_file) files_.back()->keep();
  }
  file_sizes_.assign(files_.size(), 0);
  stats_.bytes_per_file.assign(files_.size(), 0);
  const auto threads = static_cast<std::size_t>(options_.io.threads);
  stats_.requests_per_ring.assign(threads, 0);
  std::vector<int> fds;
  for (const auto& file : files_) fds.push_back(file->fd());
  try {
    for (std::size_t l = 0; l < threads; ++l) {
      auto lane = std::make_unique<Lane>();
      lane->index = l;
      const int init = io_uring_queue_init(static_cast<unsigned>(queue_depth_), &lane->ring, 0);
      if (init < 0) throw_uring("io_uring_queue_init", init);
      lane->ring_ready = true;
      const int registered = io_uring_register_files(&lane->ring, fds.data(), static_cast<unsigned>(fds.size()));
      if (registered < 0) throw_uring("io_uring_register_files", registered);
      lane->slots.resize(queue_depth_);
      for (std::size_t i = queue_depth_; i-- > 0;) lane->free_slots.push_back(i);
      lane->to_prepare.reserve(queue_depth_);
      lanes_.push_back(std::move(lane));
    }
    for (auto& lane : lanes_) {
      Lane* l = lane.get();
      l->thread = start_worker_thread(options_.cpus, [this, l] { run(*l); });
    }
  } catch (...) {
    stop_lanes();
    throw;
  }
}

NvmeStore::~NvmeStore() {
  {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
  }
  stop_lanes();
}

void NvmeStore::stop_lanes() noexcept {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  for (auto& lane : lanes_) lane->work.notify_all();
  for (auto& lane : lanes_)
    if (lane->thread.joinable()) lane->thread.join();
}

std::string NvmeStore::location() const {
  std::string text;
  for (const auto& file : files_) text.append(text.empty() ? "" : " + ").append(file->path());
  return text;
}

std::vector<std::string> NvmeStore::paths() const {
  std::vector<std::string> out;
  for (const auto& file : files_) out.push_back(file->path());
  return out;
}

bool NvmeStore::direct() const {
  return std::all_of(files_.begin(), files_.end(), [](const auto& file) { return file->direct(); });
}

std::vector<std::size_t> NvmeStore::file_bytes() const {
  std::lock_guard lock(mutex_);
  return file_sizes_;
}

std::size_t NvmeStore::piece_count(const Region& region) const {
  if (files_.size() == 1) return (region.padded_bytes + block_size_ - 1) / block_size_;
  return (region.offset + region.padded_bytes - 1) / block_size_ - region.offset / block_size_ + 1;
}

NvmeStore::Piece NvmeStore::piece(const Region& region, std::size_t index) const {
  Piece p;
  const std::size_t files = files_.size();
  if (files == 1) {
    p.start = index * block_size_;
    p.length = std::min(block_size_, region.padded_bytes - p.start);
    p.file_offset = region.offset + p.start;
    p.lane = index % lanes_.size();
    return p;
  }
  const std::size_t stripe = region.offset / block_size_ + index;
  const std::size_t begin = std::max(region.offset, stripe * block_size_);
  const std::size_t end = std::min(region.offset + region.padded_bytes, (stripe + 1) * block_size_);
  p.start = begin - region.offset;
  p.length = end - begin;
  p.file = stripe % files;
  p.file_offset = stripe / files * block_size_ + (begin - stripe * block_size_);
  p.lane = stripe % lanes_.size();
  return p;
}

void NvmeStore::reserve(RegionId id, const Region& region) {
  // Each file's pieces of the region are contiguous in it: reserve from the first to the last.
  std::vector<std::size_t> lo(files_.size(), SIZE_MAX), hi(files_.size(), 0);
  const std::size_t pieces = piece_count(region);
  for (std::size_t j = 0; j < pieces; ++j) {
    const Piece p = piece(region, j);
    lo[p.file] = std::min(lo[p.file], p.file_offset);
    hi[p.file] = std::max(hi[p.file], p.file_offset + p.length);
  }
  for (std::size_t f = 0; f < files_.size(); ++f)
    if (lo[f] < hi[f]) files_[f]->preallocate(lo[f], hi[f] - lo[f]);
  std::lock_guard lock(mutex_);
  for (std::size_t f = 0; f < files_.size(); ++f) file_sizes_[f] = std::max(file_sizes_[f], hi[f]);
  if (piece_crcs_.size() <= id) piece_crcs_.resize(id + 1);
  if (options_.io.checksum) piece_crcs_[id].assign(pieces, 0);
}

void NvmeStore::register_buffers(const std::vector<std::pair<void*, std::size_t>>& buffers) {
  std::vector<iovec> iovecs;
  iovecs.reserve(buffers.size());
  for (const auto& [data, bytes] : buffers) iovecs.push_back(iovec{data, bytes});
  std::lock_guard lock(mutex_);
  if (running_ > 0)
    throw Error("NvmeStore::register_buffers called while transfers are running; wait for them (flush) first");
  if (!fixed_buffers_.empty()) {
    for (auto& lane : lanes_) {
      const int unregistered = io_uring_unregister_buffers(&lane->ring);
      if (unregistered < 0 && unregistered != -ENXIO) throw_uring("io_uring_unregister_buffers", unregistered);
    }
    fixed_buffers_.clear();
  }
  if (iovecs.empty()) return;
  for (std::size_t l = 0; l < lanes_.size(); ++l) {
    const int registered =
        io_uring_register_buffers(&lanes_[l]->ring, iovecs.data(), static_cast<unsigned>(iovecs.size()));
    if (registered < 0) {
      for (std::size_t k = 0; k < l; ++k) (void)io_uring_unregister_buffers(&lanes_[k]->ring);
      throw_uring("io_uring_register_buffers", registered);
    }
  }
  for (const auto& [data, bytes] : buffers) fixed_buffers_.emplace_back(static_cast<const char*>(data), bytes);
}

int NvmeStore::fixed_buffer_index(const void* buffer, std::size_t bytes) const {
  const auto* p = static_cast<const char*>(buffer);
  for (std::size_t i = 0; i < fixed_buffers_.size(); ++i) {
    const auto& [base, size] = fixed_buffers_[i];
    if (p >= base && p + bytes <= base + size) return static_cast<int>(i);
  }
  return -1;
}

IoHandle NvmeStore::submit(RegionId id, Op op, void* buffer) {
  std::shared_ptr<Request> request = begin_request<Request>(id, op, buffer);
  const Region& region = request->region;
  const std::size_t lanes = lanes_.size();
  request->pieces = piece_count(region);
  const std::size_t busy = std::min(lanes, request->pieces);  // rings with pieces of this transfer
  try {
    request->shares.resize(lanes);
  } catch (...) {
    end_transfer(id, op, false);
    throw;
  }
  // Ring l's pieces are every lanes-th one from the first that falls to it.
  const std::size_t base = piece(region, 0).lane;
  for (std::size_t l = 0; l < lanes; ++l) request->shares[l].next = (l + lanes - base) % lanes;
  request->lanes_left.store(busy, std::memory_order_relaxed);
  request->self = request;
  request->span = trace::begin_transfer(op == Op::read ? "nvme read" : "nvme write",
                                        op == Op::read ? trace::Lane::nvme_read : trace::Lane::nvme_write,
                                        static_cast<std::int64_t>(region.padded_bytes));
  {
    std::lock_guard lock(mutex_);
    request->fixed_index = fixed_buffer_index(buffer, region.padded_bytes);
    if (options_.io.checksum) request->crcs = &piece_crcs_[id];
    ++running_;
    for (std::size_t j = 0; j < busy; ++j) lanes_[piece(region, j).lane]->queued.push_back(request);
  }
  for (std::size_t j = 0; j < busy; ++j) lanes_[piece(region, j).lane]->work.notify_one();
  return IoHandle(std::move(request));
}

void NvmeStore::flush() {
  {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
  }
  for (auto& file : files_) file->sync();
  rethrow_unobserved_failure();
}

NvmeStore::Stats NvmeStore::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

// A ring's thread: moves queued transfers in, keeps up to queue_depth of its pieces in the
// kernel, reaps completions. It blocks in the kernel while requests are in flight (new transfers
// are picked up at the next completion) and on `work` when there are none.
void NvmeStore::run(Lane& lane) noexcept {
  std::vector<std::size_t> unsubmitted;  // slots prepared in the SQ ring, not yet consumed
  unsubmitted.reserve(queue_depth_);
  const std::size_t lanes = lanes_.size();
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (lane.in_flight == 0 && unsubmitted.empty() && lane.issuing.empty() && lane.to_prepare.empty()) {
        lane.work.wait(lock, [&] { return stopping_ || !lane.queued.empty(); });
        if (lane.queued.empty()) return;  // stopping, and nothing left
      }
      while (!lane.queued.empty()) {
        lane.issuing.push_back(std::move(lane.queued.front()));
        lane.queued.pop_front();
      }
    }

    // Resubmissions first: their slots are already taken.
    for (std::size_t index : lane.to_prepare) {
      prepare(lane, lane.slots[index]);
      unsubmitted.push_back(index);
    }
    lane.to_prepare.clear();
    while (!lane.free_slots.empty() && !lane.issuing.empty()) {
      Request& request = *lane.issuing.front();
      Request::Share& share = request.shares[lane.index];
      if (request.failed.load(std::memory_order_acquire) || share.next >= request.pieces) {
        std::shared_ptr<Request> done = std::move(lane.issuing.front());
        lane.issuing.pop_front();
        maybe_finish_share(lane, *done);
        continue;
      }
      const std::size_t index = lane.free_slots.back();
      lane.free_slots.pop_back();
      Slot& slot = lane.slots[index];
      slot.request = &request;
      slot.index = share.next;
      slot.piece = piece(request.region, share.next);
      slot.done = 0;
      share.next += lanes;
      ++share.outstanding;
      prepare(lane, slot);
      unsubmitted.push_back(index);
    }

    if (!unsubmitted.empty()) {
      const int submitted = io_uring_submit(&lane.ring);
      if (submitted > 0) {
        unsubmitted.erase(unsubmitted.begin(), unsubmitted.begin() + submitted);
        lane.in_flight += static_cast<std::size_t>(submitted);
        std::lock_guard lock(mutex_);
        stats_.max_in_flight = std::max(stats_.max_in_flight, lane.in_flight);
      } else if (submitted < 0 && submitted != -EINTR && submitted != -EAGAIN && submitted != -EBUSY) {
        // The ring refuses work (it should not): fail what it did not take; it stays unusable.
        for (std::size_t index : unsubmitted) {
          Slot& slot = lane.slots[index];
          Request& request = *slot.request;
          fail(request, std::make_exception_ptr(IoError("io_uring_submit failed", files_[slot.piece.file]->path(),
                                                        slot.piece.file_offset + slot.done,
                                                        slot.piece.length - slot.done, -submitted)));
          slot.request = nullptr;
          lane.free_slots.push_back(index);
          --request.shares[lane.index].outstanding;
          maybe_finish_share(lane, request);
        }
        unsubmitted.clear();
      }
    }
    if (lane.in_flight == 0) continue;

    io_uring_cqe* cqe = nullptr;
    const int waited = io_uring_wait_cqe(&lane.ring, &cqe);
    if (waited < 0) continue;  // EINTR/EAGAIN; the requests are still in the kernel
    unsigned head = 0;
    unsigned count = 0;
    io_uring_for_each_cqe(&lane.ring, head, cqe) {
      reap(lane, cqe);
      ++count;
    }
    io_uring_cq_advance(&lane.ring, count);
  }
}

void NvmeStore::prepare(Lane& lane, Slot& slot) {
  Request& request = *slot.request;
  io_uring_sqe* sqe = io_uring_get_sqe(&lane.ring);  // never null: at most queue_depth entries pend
  char* data = request.buffer + slot.piece.start + slot.done;
  const auto length = static_cast<unsigned>(slot.piece.length - slot.done);
  const std::size_t offset = slot.piece.file_offset + slot.done;
  const int file = static_cast<int>(slot.piece.file);  // index among the registered files
  const bool write = request.op == Op::write;
  if (request.fixed_index >= 0) {
    if (write) io_uring_prep_write_fixed(sqe, file, data, length, offset, request.fixed_index);
    else io_uring_prep_read_fixed(sqe, file, data, length, offset, request.fixed_index);
  } else {
    if (write) io_uring_prep_write(sqe, file, data, length, offset);
    else io_uring_prep_read(sqe, file, data, length, offset);
  }
  sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, &slot);
}

void NvmeStore::reap(Lane& lane, io_uring_cqe* cqe) {
  auto& slot = *static_cast<Slot*>(io_uring_cqe_get_data(cqe));
  Request& request = *slot.request;
  --lane.in_flight;
  const bool write = request.op == Op::write;
  const std::size_t offset = slot.piece.file_offset + slot.done;
  const std::size_t length = slot.piece.length - slot.done;
  const std::string& path = files_[slot.piece.file]->path();
  int result = cqe->res;
  if (options_.completion_hook)
    result = options_.completion_hook(IoRequestInfo{write, slot.piece.file, offset, length}, result);
  {
    std::lock_guard lock(mutex_);
    ++stats_.requests;
    ++stats_.requests_per_ring[lane.index];
    if (result > 0) stats_.bytes_per_file[slot.piece.file] += static_cast<std::size_t>(result);
    if (request.fixed_index >= 0) ++stats_.fixed_buffer_requests;
    if (result == -EINTR || result == -EAGAIN || (result > 0 && static_cast<std::size_t>(result) < length))
      ++stats_.resubmitted;
  }
  const std::size_t index = static_cast<std::size_t>(&slot - lane.slots.data());
  if (result == -EINTR || result == -EAGAIN) {
    lane.to_prepare.push_back(index);
    return;
  }
  if (result < 0) {
    fail(request,
         std::make_exception_ptr(IoError(write ? "write to the swap file failed" : "read from the swap file failed",
                                         path, offset, length, -result)));
  } else if (result == 0) {
    fail(request,
         std::make_exception_ptr(
             write ? IoError("write to the swap file made no progress", path, offset, length, EIO)
                   : IoError(
                         "read past the end of the swap file: the file is shorter than the region (was it truncated?)",
                         path, offset, length, ENODATA)));
  } else {
    slot.done += static_cast<std::size_t>(result);
    if (slot.done < slot.piece.length) {
      lane.to_prepare.push_back(index);  // short transfer: the rest goes again
      return;
    }
    finish_piece(slot);
  }
  slot.request = nullptr;
  lane.free_slots.push_back(index);
  --request.shares[lane.index].outstanding;
  maybe_finish_share(lane, request);
}

void NvmeStore::finish_piece(Slot& slot) {
  Request& request = *slot.request;
  if (request.crcs == nullptr || request.failed.load(std::memory_order_acquire)) return;
  const std::uint32_t crc = crc32c(request.buffer + slot.piece.start, slot.piece.length);
  std::uint32_t& stored = (*request.crcs)[slot.index];  // each piece has one ring: no race
  if (request.op == Op::write) {
    stored = crc;
  } else if (stored != crc) {
    fail(
        request,
        std::make_exception_ptr(IoError(
            std::string("checksum mismatch reading region '")
                .append(request.region.name)
                .append(
                    "': the block on disk is not what was written (corrupted or overwritten); its data cannot be used"),
            files_[slot.piece.file]->path(), slot.piece.file_offset, slot.piece.length, EBADMSG)));
  }
}

void NvmeStore::fail(Request& request, std::exception_ptr error) {
  std::lock_guard lock(request.error_mutex);
  if (!request.error) request.error = std::move(error);
  request.failed.store(true, std::memory_order_release);
}

// Called by a ring when it may be done with its share of `request`; the last ring done finishes it.
void NvmeStore::maybe_finish_share(Lane& lane, Request& request) {
  Request::Share& share = request.shares[lane.index];
  if (share.done || share.outstanding > 0) return;
  if (!request.failed.load(std::memory_order_acquire) && share.next < request.pieces) return;
  share.done = true;
  if (request.lanes_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::shared_ptr<Request> self = std::move(request.self);
  std::exception_ptr error;
  {
    std::lock_guard lock(request.error_mutex);
    error = request.error;
  }
  end_transfer(request.id, request.op, !error);
  if (error) note_failure(self);
  trace::end_transfer(request.span);
  request.complete(error);
  {
    std::lock_guard lock(mutex_);
    --running_;
  }
  idle_.notify_all();
}

}  // namespace zest::offload
