// IoHandle: the completion of one asynchronous store transfer (Store::write_async/read_async).
//
// wait() blocks until the transfer has finished and rethrows its IoError (on every call); ready()
// says whether it has finished, without blocking. The caller's buffer belongs to the transfer
// until then. A handle dropped without wait() still blocks in its destructor until the transfer
// is over (so a buffer is never reused under a running transfer); its error is then reported by
// the store's flush(). Move-only; wait/ready may be called from any thread, one at a time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

namespace zest::offload {

namespace detail {

// The state a store's worker and the caller's handle share. Stores derive their request type.
class Transfer {
 public:
  virtual ~Transfer() = default;

  // Called once by the worker. `error` null = success.
  void complete(std::exception_ptr error) noexcept;
  void wait() const noexcept;
  bool ready() const noexcept { return done_.load(std::memory_order_acquire); }
  // The transfer's failure, or null. Marks it as seen by the caller.
  std::exception_ptr take_error() noexcept;
  bool failed_unobserved() const noexcept;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable finished_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  std::atomic<bool> observed_{false};
};

}  // namespace detail

class IoHandle {
 public:
  IoHandle() = default;  // an empty handle: ready, wait() returns at once
  explicit IoHandle(std::shared_ptr<detail::Transfer> transfer) : transfer_(std::move(transfer)) {}
  IoHandle(IoHandle&&) noexcept = default;
  IoHandle& operator=(IoHandle&& other) noexcept;
  IoHandle(const IoHandle&) = delete;
  IoHandle& operator=(const IoHandle&) = delete;
  ~IoHandle();

  void wait();
  bool ready() const { return transfer_ == nullptr || transfer_->ready(); }
  explicit operator bool() const { return transfer_ != nullptr; }

 private:
  std::shared_ptr<detail::Transfer> transfer_;
};

}  // namespace zest::offload
