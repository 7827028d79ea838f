#include "engine/optimizer/update_ahead_thread.hpp"

#include <algorithm>
#include <utility>

#include "base/trace.hpp"

namespace zest::engine {

UpdateAheadThread::UpdateAheadThread(UpdateAheadWork& work, std::size_t subs, std::size_t slots,
                                     std::size_t reads_ahead)
    : work_(work), slots_(slots), reads_ahead_(reads_ahead) {
  items_.reserve(subs);
  assumed_.assign(subs, nullptr);
  cancelled_.reserve(subs);  // a group has at least one sub-group
  done_.assign(subs, false);
  updated_.assign(subs, false);
  readable_.assign(subs, false);
  thread_ = std::thread([this] { run(); });
}

UpdateAheadThread::~UpdateAheadThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
  work_.drain_transfers();
}

void UpdateAheadThread::add(int group, std::size_t first, std::size_t end, const Assumption& assumed) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Each group is handed over once per step, so this holds; a surplus is simply left to step().
    if (items_.size() + (end - first) > items_.capacity()) return;
    for (std::size_t sub = first; sub < end; ++sub) {
      items_.push_back({sub, group});
      assumed_[sub] = &assumed;
    }
  }
  changed_.notify_all();
}

void UpdateAheadThread::cancel(int group) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cancelled(group)) cancelled_.push_back(group);
  changed_.wait(lock, [&] { return busy_group_ != group; });
  for (const Item& item : items_)
    if (item.group == group) done_[item.sub] = false;
}

bool UpdateAheadThread::cancelled(int group) const {
  return std::find(cancelled_.begin(), cancelled_.end(), group) != cancelled_.end();
}

void UpdateAheadThread::settle(bool finish) {
  const trace::Span span("settle updates ahead", trace::Lane::host);
  std::unique_lock<std::mutex> lock(mutex_);
  pause_ = true;
  finish_ = finish;
  changed_.notify_all();
  changed_.wait(lock, [&] { return paused_; });
}

void UpdateAheadThread::restart() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.clear();
    std::fill(done_.begin(), done_.end(), false);
    std::fill(updated_.begin(), updated_.end(), false);
    std::fill(readable_.begin(), readable_.end(), false);
    cancelled_.clear();
    processed_ = issued_ = confirmed_ = 0;
    pause_ = finish_ = paused_ = false;
    ++restarts_;  // wakes the paused thread even if settle() pauses it again before it runs
  }
  changed_.notify_all();
}

void UpdateAheadThread::confirm_until(std::size_t end, std::unique_lock<std::mutex>& lock) {
  while (confirmed_ < end) {
    const std::size_t position = confirmed_++;
    bool stored = updated_[position];
    lock.unlock();
    try {
      const trace::Span span("wait for write", trace::Lane::update_ahead, static_cast<std::int64_t>(position));
      work_.confirm(position);
    } catch (...) {
      stored = false;  // the current states are untouched: step() redoes the sub-group
    }
    lock.lock();
    const Item& item = items_[position];
    if (stored && !cancelled(item.group)) done_[item.sub] = true;
  }
}

void UpdateAheadThread::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stop_ || pause_ || processed_ < items_.size(); });
    if (stop_) return;
    if (pause_ && !(finish_ && processed_ < items_.size())) {
      // Everything started is finished before the caller takes the buffers.
      confirm_until(processed_, lock);
      lock.unlock();
      work_.drain_transfers();
      lock.lock();
      paused_ = true;
      changed_.notify_all();
      const std::size_t restarts = restarts_;
      changed_.wait(lock, [&] { return stop_ || restarts_ != restarts; });
      continue;
    }
    const std::size_t position = processed_;
    // Read ahead into slots whose previous update is stored.
    while (issued_ < items_.size() && issued_ <= position + reads_ahead_) {
      const std::size_t next = issued_++;
      if (next >= slots_) confirm_until(next - slots_ + 1, lock);
      const std::size_t sub = items_[next].sub;
      lock.unlock();
      bool started = true;
      try {
        work_.read(next, sub);
      } catch (...) {
        started = false;  // its update is skipped and left to step()
      }
      lock.lock();
      readable_[next] = started;
    }
    const Item item = items_[position];
    if (readable_[position] && !cancelled(item.group)) {
      busy_group_ = item.group;
      const Assumption* const assumed = assumed_[item.sub];
      lock.unlock();
      bool updated = true;
      try {
        const trace::Span span("update ahead", trace::Lane::update_ahead, static_cast<std::int64_t>(item.sub));
        work_.update(position, item.sub, *assumed);
      } catch (...) {
        updated = false;
      }
      lock.lock();
      busy_group_ = -1;
      updated_[position] = updated;
      changed_.notify_all();
    }
    ++processed_;
  }
}

}  // namespace zest::engine
