#include "offload/nvme_store.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <utility>

#include "offload/checksum.hpp"
#include "offload/worker_thread.hpp"
#include "zest/error.hpp"

namespace zest::offload {

struct NvmeStore::Request : TransferRequest {
  int fixed_index = -1;                     // registered buffer holding all of `buffer`, or -1
  std::vector<std::uint32_t>* crcs = nullptr;  // the region's block CRCs (io.checksum)
  std::size_t blocks = 0;
  std::size_t next_block = 0;               // first block not yet issued
  std::size_t outstanding = 0;              // blocks issued and not finished
  bool finished = false;
  std::exception_ptr error;
  std::shared_ptr<Request> self;            // keeps the transfer alive while the thread works on it
};

struct NvmeStore::Slot {
  Request* request = nullptr;
  std::size_t block = 0;
  std::size_t start = 0;   // offset of the block in the region
  std::size_t length = 0;
  std::size_t done = 0;    // bytes already transferred (short transfers resubmit the rest)
};

namespace {

[[noreturn]] void throw_uring(const char* call, int negative_errno) {
  std::string text(call);
  text.append(" failed: ").append(std::strerror(-negative_errno)).append(" (errno ")
      .append(std::to_string(-negative_errno)).append(")");
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
    throw Error(std::string("io.block_size must be a power of two of at least 4KiB, got ").append(std::to_string(block)));
  if (options.io.queue_depth < 1 || options.io.queue_depth > 4096)
    throw Error(std::string("io.queue_depth must be between 1 and 4096, got ").append(std::to_string(options.io.queue_depth)));
  if (!options.warn) options.warn = warn_to_stderr;
  return options;
}

}  // namespace

NvmeStore::NvmeStore(NvmeStoreOptions options)
    : Store(4096),
      options_(checked(std::move(options))),
      block_size_(options_.io.block_size),
      queue_depth_(static_cast<std::size_t>(options_.io.queue_depth)),
      file_(options_.directory, options_.rank, options_.io.direct, options_.warn) {
  if (options_.keep_file) file_.keep();
  const int init = io_uring_queue_init(static_cast<unsigned>(queue_depth_), &ring_, 0);
  if (init < 0) throw_uring("io_uring_queue_init", init);
  ring_ready_ = true;
  const int fd = file_.fd();
  const int registered = io_uring_register_files(&ring_, &fd, 1);
  if (registered < 0) {
    io_uring_queue_exit(&ring_);
    throw_uring("io_uring_register_files", registered);
  }
  slots_.resize(queue_depth_);
  for (std::size_t i = queue_depth_; i-- > 0;) free_slots_.push_back(i);
  to_prepare_.reserve(queue_depth_);

  try {
    thread_ = start_worker_thread(options_.cpus, [this] { run(); });
  } catch (...) {
    io_uring_queue_exit(&ring_);
    throw;
  }
}

NvmeStore::~NvmeStore() {
  {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
    stopping_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (ring_ready_) io_uring_queue_exit(&ring_);
}

void NvmeStore::reserve(RegionId id, const Region& region) {
  file_.preallocate(region.offset, region.padded_bytes);
  std::lock_guard lock(mutex_);
  if (block_crcs_.size() <= id) block_crcs_.resize(id + 1);
  if (options_.io.checksum) block_crcs_[id].assign((region.padded_bytes + block_size_ - 1) / block_size_, 0);
}

void NvmeStore::register_buffers(const std::vector<std::pair<void*, std::size_t>>& buffers) {
  std::vector<iovec> iovecs;
  iovecs.reserve(buffers.size());
  for (const auto& [data, bytes] : buffers) iovecs.push_back(iovec{data, bytes});
  std::lock_guard lock(mutex_);
  if (running_ > 0) throw Error("NvmeStore::register_buffers called while transfers are running; wait for them (flush) first");
  if (!fixed_buffers_.empty()) {
    const int unregistered = io_uring_unregister_buffers(&ring_);
    if (unregistered < 0) throw_uring("io_uring_unregister_buffers", unregistered);
    fixed_buffers_.clear();
  }
  if (iovecs.empty()) return;
  const int registered = io_uring_register_buffers(&ring_, iovecs.data(), static_cast<unsigned>(iovecs.size()));
  if (registered < 0) throw_uring("io_uring_register_buffers", registered);
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
  request->blocks = (region.padded_bytes + block_size_ - 1) / block_size_;
  request->self = request;
  {
    std::lock_guard lock(mutex_);
    request->fixed_index = fixed_buffer_index(buffer, region.padded_bytes);
    if (options_.io.checksum) request->crcs = &block_crcs_[id];
    ++running_;
    queued_.push_back(request);
  }
  work_.notify_one();
  return IoHandle(std::move(request));
}

void NvmeStore::flush() {
  {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
  }
  file_.sync();
  rethrow_unobserved_failure();
}

NvmeStore::Stats NvmeStore::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

// The I/O thread: moves queued transfers in, keeps up to queue_depth requests in the kernel,
// reaps completions. It blocks in the kernel while requests are in flight (new transfers are
// picked up at the next completion) and on `work_` when there are none.
void NvmeStore::run() noexcept {
  std::vector<std::size_t> unsubmitted;  // slots prepared in the SQ ring, not yet consumed
  unsubmitted.reserve(queue_depth_);
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (in_flight_ == 0 && unsubmitted.empty() && issuing_.empty() && to_prepare_.empty()) {
        work_.wait(lock, [this] { return stopping_ || !queued_.empty(); });
        if (queued_.empty()) return;  // stopping, and nothing left
      }
      while (!queued_.empty()) {
        issuing_.push_back(std::move(queued_.front()));
        queued_.pop_front();
      }
    }

    // Resubmissions first: their slots are already taken.
    for (std::size_t index : to_prepare_) {
      prepare(slots_[index]);
      unsubmitted.push_back(index);
    }
    to_prepare_.clear();
    while (!free_slots_.empty() && !issuing_.empty()) {
      Request& request = *issuing_.front();
      if (request.finished || request.error || request.next_block == request.blocks) {
        issuing_.pop_front();
        continue;
      }
      const std::size_t index = free_slots_.back();
      free_slots_.pop_back();
      Slot& slot = slots_[index];
      slot.request = &request;
      slot.block = request.next_block++;
      slot.start = slot.block * block_size_;
      slot.length = std::min(block_size_, request.region.padded_bytes - slot.start);
      slot.done = 0;
      ++request.outstanding;
      prepare(slot);
      unsubmitted.push_back(index);
    }

    if (!unsubmitted.empty()) {
      const int submitted = io_uring_submit(&ring_);
      if (submitted > 0) {
        unsubmitted.erase(unsubmitted.begin(), unsubmitted.begin() + submitted);
        in_flight_ += static_cast<std::size_t>(submitted);
        std::lock_guard lock(mutex_);
        stats_.max_in_flight = std::max(stats_.max_in_flight, in_flight_);
      } else if (submitted < 0 && submitted != -EINTR && submitted != -EAGAIN && submitted != -EBUSY) {
        // The ring refuses work (it should not): fail what it did not take; it stays unusable.
        for (std::size_t index : unsubmitted) {
          Slot& slot = slots_[index];
          Request& request = *slot.request;
          const std::size_t offset = request.region.offset + slot.start + slot.done;
          fail(request, std::make_exception_ptr(IoError("io_uring_submit failed", file_.path(), offset,
                                                        slot.length - slot.done, -submitted)));
          slot.request = nullptr;
          free_slots_.push_back(index);
          --request.outstanding;
          maybe_finish(request);
        }
        unsubmitted.clear();
      }
    }
    if (in_flight_ == 0) continue;

    io_uring_cqe* cqe = nullptr;
    const int waited = io_uring_wait_cqe(&ring_, &cqe);
    if (waited < 0) continue;  // EINTR/EAGAIN; the requests are still in the kernel
    unsigned head = 0;
    unsigned count = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      reap(cqe);
      ++count;
    }
    io_uring_cq_advance(&ring_, count);
  }
}

void NvmeStore::prepare(Slot& slot) {
  Request& request = *slot.request;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // never null: at most queue_depth entries pend
  char* data = request.buffer + slot.start + slot.done;
  const auto length = static_cast<unsigned>(slot.length - slot.done);
  const std::size_t offset = request.region.offset + slot.start + slot.done;
  const bool write = request.op == Op::write;
  if (request.fixed_index >= 0) {
    if (write) io_uring_prep_write_fixed(sqe, 0, data, length, offset, request.fixed_index);
    else io_uring_prep_read_fixed(sqe, 0, data, length, offset, request.fixed_index);
  } else {
    if (write) io_uring_prep_write(sqe, 0, data, length, offset);
    else io_uring_prep_read(sqe, 0, data, length, offset);
  }
  sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, &slot);
}

void NvmeStore::reap(io_uring_cqe* cqe) {
  auto& slot = *static_cast<Slot*>(io_uring_cqe_get_data(cqe));
  Request& request = *slot.request;
  --in_flight_;
  const bool write = request.op == Op::write;
  const std::size_t offset = request.region.offset + slot.start + slot.done;
  const std::size_t length = slot.length - slot.done;
  int result = cqe->res;
  if (options_.completion_hook) result = options_.completion_hook(IoRequestInfo{write, offset, length}, result);
  bool resubmit = false;
  {
    std::lock_guard lock(mutex_);
    ++stats_.requests;
    if (request.fixed_index >= 0) ++stats_.fixed_buffer_requests;
    resubmit = result == -EINTR || result == -EAGAIN ||
               (result > 0 && static_cast<std::size_t>(result) < length);
    if (resubmit) ++stats_.resubmitted;
  }
  const std::size_t index = static_cast<std::size_t>(&slot - slots_.data());
  if (result == -EINTR || result == -EAGAIN) {
    to_prepare_.push_back(index);
    return;
  }
  if (result < 0) {
    fail(request, std::make_exception_ptr(IoError(write ? "write to the swap file failed" : "read from the swap file failed",
                                                  file_.path(), offset, length, -result)));
  } else if (result == 0) {
    fail(request, std::make_exception_ptr(
                      write ? IoError("write to the swap file made no progress", file_.path(), offset, length, EIO)
                            : IoError("read past the end of the swap file: the file is shorter than the region (was it truncated?)",
                                      file_.path(), offset, length, ENODATA)));
  } else {
    slot.done += static_cast<std::size_t>(result);
    if (slot.done < slot.length) {
      to_prepare_.push_back(index);  // short transfer: the rest goes again
      return;
    }
    finish_block(slot);
  }
  slot.request = nullptr;
  free_slots_.push_back(index);
  --request.outstanding;
  maybe_finish(request);
}

void NvmeStore::finish_block(Slot& slot) {
  Request& request = *slot.request;
  if (request.crcs == nullptr || request.error) return;
  const std::uint32_t crc = crc32c(request.buffer + slot.start, slot.length);
  std::uint32_t& stored = (*request.crcs)[slot.block];
  if (request.op == Op::write) {
    stored = crc;
  } else if (stored != crc) {
    fail(request, std::make_exception_ptr(IoError(
                      std::string("checksum mismatch reading region '").append(request.region.name)
                          .append("': the block on disk is not what was written (corrupted or overwritten); its data cannot be used"),
                      file_.path(), request.region.offset + slot.start, slot.length, EBADMSG)));
  }
}

void NvmeStore::fail(Request& request, std::exception_ptr error) {
  if (!request.error) request.error = std::move(error);
}

void NvmeStore::maybe_finish(Request& request) {
  if (request.finished || request.outstanding > 0) return;
  if (!request.error && request.next_block < request.blocks) return;
  request.finished = true;
  std::shared_ptr<Request> self = std::move(request.self);
  end_transfer(request.id, request.op, !request.error);
  if (request.error) note_failure(self);
  request.complete(request.error);
  {
    std::lock_guard lock(mutex_);
    --running_;
  }
  idle_.notify_all();
}

}  // namespace zest::offload
