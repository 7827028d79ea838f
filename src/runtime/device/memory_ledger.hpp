// MemoryLedger: what a Device has handed out, by category, against a budget. Device keeps one for
// device memory (with the budget) and one for pinned host memory (unbounded, with the locked bytes).
//
// Threading: every member may be called from any thread; one mutex keeps the per-category figures
// and the peak of the total consistent with each other (allocation is not a hot path).
#pragma once

#include <array>
#include <cstddef>
#include <mutex>
#include <string>

#include "zest/device.hpp"

namespace zest {

class MemoryLedger {
 public:
  // `budget` 0 means unbounded (the pinned-host ledger).
  explicit MemoryLedger(std::size_t budget);

  // Counts `bytes` under `category`. Throws OutOfDeviceMemory, counting nothing, when the total
  // would pass the budget.
  void reserve(std::size_t bytes, MemoryCategory category);
  void release(std::size_t bytes, MemoryCategory category) noexcept;

  // Pinned host memory: counted under `buffers`, also as locked when `locked`, and under its
  // label (host_stats' figures by label).
  void reserve_host(std::size_t bytes, bool locked, HostLabel label);
  void release_host(std::size_t bytes, bool locked, HostLabel label) noexcept;

  // Throws OutOfDeviceMemory for a request of `bytes` under `category` that failed for `reason`,
  // with the ledger's figures in the message (also used when the backend itself runs out).
  [[noreturn]] void throw_out_of_memory(std::size_t bytes, MemoryCategory category,
                                        const std::string& reason) const;

  MemoryStats stats() const;
  HostMemoryStats host_stats() const;
  void reset_peak();
  std::size_t budget() const { return budget_; }

 private:
  std::string describe_failure_locked(std::size_t bytes, MemoryCategory category,
                                      const std::string& reason) const;

  const std::size_t budget_;
  mutable std::mutex mutex_;
  std::array<std::size_t, kMemoryCategoryCount> current_{};
  std::array<std::size_t, kMemoryCategoryCount> peak_{};
  std::size_t current_total_ = 0;
  std::size_t peak_total_ = 0;
  std::size_t locked_ = 0;
  std::array<std::size_t, HostLabel::kCount> label_current_{};
  std::array<std::size_t, HostLabel::kCount> label_peak_{};
};

// "1.50 MiB (1572864 bytes)": how the ledger's messages print sizes.
std::string describe_bytes(std::size_t bytes);

}  // namespace zest
