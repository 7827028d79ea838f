#include "runtime/device/pending_watchdog.hpp"

#include <cstdio>
#include <utility>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest {

PendingWatchdog::PendingWatchdog(std::string who, std::chrono::milliseconds timeout, Health health, Abort abort,
                                 std::chrono::milliseconds poll_interval)
    : who_(std::move(who)),
      timeout_(timeout),
      poll_interval_(poll_interval),
      health_(std::move(health)),
      abort_(std::move(abort)) {
  if (timeout_.count() > 0) thread_ = std::thread([this] { watch(); });
}

PendingWatchdog::~PendingWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::uint64_t PendingWatchdog::track(const char* name, Poll done) {
  std::lock_guard lock(mutex_);
  if (!failure_.empty()) throw CommError(failure_);
  const std::uint64_t number = ++issued_;
  if (timeout_.count() == 0) return number;
  if (pending_.empty()) oldest_since_ = std::chrono::steady_clock::now();
  pending_.push_back({number, name, std::move(done)});
  return number;
}

void PendingWatchdog::check() const {
  std::lock_guard lock(mutex_);
  if (!failure_.empty()) throw CommError(failure_);
}

bool PendingWatchdog::broken() const {
  std::lock_guard lock(mutex_);
  return !failure_.empty();
}

std::string PendingWatchdog::inspect(std::chrono::steady_clock::time_point now) {
  // The polls and the health query run without the lock, so a slow one never blocks track().
  std::unique_lock lock(mutex_);
  while (!pending_.empty()) {
    Poll done = pending_.front().done;
    lock.unlock();
    const bool complete = done();
    lock.lock();
    if (!complete) break;
    pending_.pop_front();
    oldest_since_ = now;
  }
  const auto cause = [&](const Pending& p, const std::string& what) {
    return fmt::format("{} #{} on {}: {}", p.name, p.number, who_, what);
  };
  std::string failure;
  if (!pending_.empty() && now - oldest_since_ >= timeout_) {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%.3g s", static_cast<double>(timeout_.count()) / 1000.0);
    failure = cause(pending_.front(), std::string("not complete after ").append(seconds).append(" (comm.timeout)"));
    failure.append(". A rank skipped a collective, issued one more than the others, died, or hangs "
                   "elsewhere: each live rank's error names its own last collective");
  }
  lock.unlock();
  if (failure.empty()) {
    const std::string reported = health_ ? health_() : std::string();
    if (!reported.empty()) failure = std::string(who_).append(": ").append(reported);
  }
  return failure;
}

void PendingWatchdog::watch() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (wake_.wait_for(lock, poll_interval_, [&] { return stopping_; })) return;
    }
    std::string failure = inspect(std::chrono::steady_clock::now());
    if (failure.empty()) continue;
    failure.append("; the communicator was aborted and refuses every later operation: end the process");
    {
      std::lock_guard lock(mutex_);
      failure_ = failure;
    }
    abort_();
    return;
  }
}

}  // namespace zest
