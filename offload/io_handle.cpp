#include "offload/io_handle.hpp"

#include <utility>

namespace zest::offload {
namespace detail {

void Transfer::complete(std::exception_ptr error) noexcept {
  {
    std::lock_guard lock(mutex_);
    error_ = std::move(error);
    done_.store(true, std::memory_order_release);
  }
  finished_.notify_all();
}

void Transfer::wait() const noexcept {
  if (ready()) return;
  std::unique_lock lock(mutex_);
  finished_.wait(lock, [this] { return done_.load(std::memory_order_acquire); });
}

std::exception_ptr Transfer::take_error() noexcept {
  std::lock_guard lock(mutex_);
  if (error_) observed_.store(true, std::memory_order_release);
  return error_;
}

bool Transfer::failed_unobserved() const noexcept {
  std::lock_guard lock(mutex_);
  return error_ != nullptr && !observed_.load(std::memory_order_acquire);
}

}  // namespace detail

IoHandle& IoHandle::operator=(IoHandle&& other) noexcept {
  if (this != &other) {
    if (transfer_) transfer_->wait();
    transfer_ = std::move(other.transfer_);
  }
  return *this;
}

IoHandle::~IoHandle() {
  if (transfer_) transfer_->wait();
}

void IoHandle::wait() {
  if (!transfer_) return;
  transfer_->wait();
  if (std::exception_ptr error = transfer_->take_error()) std::rethrow_exception(error);
}

}  // namespace zest::offload
