#include "runtime/device/memory_ledger.hpp"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest {
namespace {

std::size_t index_of(MemoryCategory category) { return static_cast<std::size_t>(category); }

// "1.50 MiB": the short form used inside lists.
std::string short_bytes(std::size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  if (unit == 0)
    std::snprintf(text, sizeof text, "%zu B", bytes);
  else
    std::snprintf(text, sizeof text, "%.2f %s", value, kUnits[unit]);
  return text;
}

}  // namespace

std::string describe_bytes(std::size_t bytes) {
  std::string text = short_bytes(bytes);
  if (bytes >= 1024) text += fmt::format(" ({} bytes)", bytes);
  return text;
}

MemoryLedger::MemoryLedger(std::size_t budget) : budget_(budget) {}

void MemoryLedger::reserve(std::size_t bytes, MemoryCategory category) {
  std::lock_guard lock(mutex_);
  // Written as a subtraction so a huge request cannot wrap the sum around.
  if (budget_ != 0 && (current_total_ > budget_ || bytes > budget_ - current_total_)) {
    throw OutOfDeviceMemory(
        describe_failure_locked(bytes, category, "it would pass the device memory budget"), bytes,
        budget_);
  }
  const std::size_t i = index_of(category);
  current_[i] += bytes;
  current_total_ += bytes;
  peak_[i] = std::max(peak_[i], current_[i]);
  peak_total_ = std::max(peak_total_, current_total_);
}

void MemoryLedger::release(std::size_t bytes, MemoryCategory category) noexcept {
  std::lock_guard lock(mutex_);
  const std::size_t i = index_of(category);
  current_[i] -= bytes;
  current_total_ -= bytes;
}

void MemoryLedger::reserve_host(std::size_t bytes, bool locked, HostLabel label) {
  std::lock_guard lock(mutex_);
  const std::size_t i = index_of(MemoryCategory::buffers);
  current_[i] += bytes;
  current_total_ += bytes;
  peak_[i] = std::max(peak_[i], current_[i]);
  peak_total_ = std::max(peak_total_, current_total_);
  if (locked) locked_ += bytes;
  const std::size_t l = label.index();
  label_current_[l] += bytes;
  label_peak_[l] = std::max(label_peak_[l], label_current_[l]);
}

void MemoryLedger::release_host(std::size_t bytes, bool locked, HostLabel label) noexcept {
  std::lock_guard lock(mutex_);
  const std::size_t i = index_of(MemoryCategory::buffers);
  current_[i] -= bytes;
  current_total_ -= bytes;
  if (locked) locked_ -= bytes;
  label_current_[label.index()] -= bytes;
}

void MemoryLedger::throw_out_of_memory(std::size_t bytes, MemoryCategory category,
                                       const std::string& reason) const {
  std::string message;
  {
    std::lock_guard lock(mutex_);
    message = describe_failure_locked(bytes, category, reason);
  }
  throw OutOfDeviceMemory(message, bytes, budget_);
}

std::string MemoryLedger::describe_failure_locked(std::size_t bytes, MemoryCategory category,
                                                  const std::string& reason) const {
  std::string text =
      fmt::format("out of device memory: cannot allocate {} for {} ({}); budget {}, in use {}", describe_bytes(bytes),
                  category_name(category), reason, budget_ == 0 ? std::string("unbounded") : describe_bytes(budget_),
                  describe_bytes(current_total_));

  // The largest categories first: they are where a higher stage or offload saves the most.
  std::array<std::size_t, kMemoryCategoryCount> order{};
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return current_[a] > current_[b]; });
  bool first = true;
  for (std::size_t i : order) {
    if (current_[i] == 0) continue;
    text.append(first ? "; by category, largest first: " : ", ");
    text.append(category_name(static_cast<MemoryCategory>(i))).append(" ");
    text.append(short_bytes(current_[i]));
    first = false;
  }
  text.append(
      ". Raise device.memory, choose a higher ZeRO stage (stage: 1 shards optimizer states, 2 also "
      "gradients, 3 also parameters), or offload (offload.optimizer.device or offload.param.device: "
      "cpu or nvme).");
  return text;
}

MemoryStats MemoryLedger::stats() const {
  std::lock_guard lock(mutex_);
  MemoryStats stats;
  stats.budget = budget_;
  stats.current = current_;
  stats.peak = peak_;
  stats.current_total = current_total_;
  stats.peak_total = peak_total_;
  return stats;
}

HostMemoryStats MemoryLedger::host_stats() const {
  std::lock_guard lock(mutex_);
  HostMemoryStats stats{current_total_, peak_total_, locked_, label_current_, label_peak_};
  return stats;
}

void MemoryLedger::reset_peak() {
  std::lock_guard lock(mutex_);
  peak_ = current_;
  peak_total_ = current_total_;
  label_peak_ = label_current_;
}

}  // namespace zest
