#include "offload/host_store.hpp"

#include <cerrno>
#include <cstring>
#include <exception>
#include <utility>

#include "offload/checksum.hpp"
#include "offload/worker_thread.hpp"
#include "zest/error.hpp"

namespace zest::offload {

struct HostStore::Request : TransferRequest {
  char* memory = nullptr;
  std::uint32_t* crc = nullptr;
};

HostStore::HostStore(Device& device, const IoConfig& io, std::vector<int> cpus)
    : Store(4096), device_(device), checksum_(io.checksum) {
  thread_ = start_worker_thread(std::move(cpus), [this] { run(); });
}

HostStore::~HostStore() {
  {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
    stopping_ = true;
  }
  work_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void HostStore::reserve(RegionId id, const Region& region) {
  HostBuffer buffer = device_.allocate_pinned(region.padded_bytes);
  std::lock_guard lock(mutex_);
  if (memory_.size() != id) throw Error("HostStore: regions reserved out of order");
  memory_.push_back(std::move(buffer));
  crcs_.push_back(0);
}

const void* HostStore::region_data(RegionId id) const {
  std::lock_guard lock(mutex_);
  if (id >= memory_.size()) throw Error(std::string("store has no region id ").append(std::to_string(id)));
  return memory_[id].data();
}

IoHandle HostStore::submit(RegionId id, Op op, void* buffer) {
  std::shared_ptr<Request> request = begin_request<Request>(id, op, buffer);
  {
    std::lock_guard lock(mutex_);
    request->memory = static_cast<char*>(memory_[id].data());
    request->crc = &crcs_[id];
    ++running_;
    queued_.push_back(request);
  }
  work_.notify_one();
  return IoHandle(std::move(request));
}

void HostStore::flush() {
  {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return running_ == 0; });
  }
  rethrow_unobserved_failure();
}

void HostStore::run() noexcept {
  for (;;) {
    std::shared_ptr<Request> request;
    {
      std::unique_lock lock(mutex_);
      work_.wait(lock, [this] { return stopping_ || !queued_.empty(); });
      if (queued_.empty()) return;
      request = std::move(queued_.front());
      queued_.pop_front();
    }
    execute(request);
    {
      std::lock_guard lock(mutex_);
      --running_;
    }
    idle_.notify_all();
  }
}

void HostStore::execute(const std::shared_ptr<Request>& owner) {
  Request& request = *owner;
  const std::size_t bytes = request.region.padded_bytes;
  std::exception_ptr error;
  if (request.op == Op::write) {
    std::memcpy(request.memory, request.buffer, bytes);
    if (checksum_) *request.crc = crc32c(request.memory, bytes);
  } else {
    if (checksum_ && crc32c(request.memory, bytes) != *request.crc) {
      error = std::make_exception_ptr(IoError(
          std::string("checksum mismatch reading region '").append(request.region.name)
              .append("': the host copy is not what was written (memory corrupted or overwritten); its data cannot be used"),
          location(), request.region.offset, bytes, EBADMSG));
    } else {
      std::memcpy(request.buffer, request.memory, bytes);
    }
  }
  end_transfer(request.id, request.op, error == nullptr);
  if (error) note_failure(owner);
  request.complete(error);
}

}  // namespace zest::offload
