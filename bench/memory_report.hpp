// What `zest bench memory` measured for each configuration, and the ways it is shown: a table on
// the terminal, JSON and CSV files, and an SVG bar chart of memory per rank by category.
#pragma once

#include <array>
#include <cstdint>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "zest/device.hpp"
#include "zest/estimate.hpp"

namespace zest::bench {

struct MemoryRecord {
  std::string name;                 // "stage 2", "stage 3 + offload optimizer=cpu", "torch DDP + AdamW", ...
  // "zest", or the library of a peer measured beside it (bench/memory_peers.py): "torch". A peer's
  // row has no buffers, pinned, NVMe, formula or estimate figures; its categories are counted from
  // its tensors (parameters, gradients, optimizer states) at the step's peak.
  std::string system = "zest";
  std::string error;                // a peer that could not run: why (its figures are then 0)
  int stage = 0;
  std::string offload_optimizer = "none";
  std::string offload_param = "none";
  double offload_ratio = 1;         // offload.optimizer.ratio
  std::string states = "fp32";      // optimizer.states
  int ranks = 1;
  std::size_t params = 0;
  std::size_t peak_params_bytes = 0;  // per rank (the largest rank), by category
  std::size_t peak_grads_bytes = 0;
  std::size_t peak_optimizer_bytes = 0;
  std::size_t peak_buffers_bytes = 0;
  std::size_t peak_device_bytes = 0;  // the peak of the total, not the sum of the peaks
  std::size_t peak_host_pinned_bytes = 0;
  // Pinned host memory by purpose (Device::pinned_stats, each purpose's peak, the largest rank's)
  // and what zest::estimate_memory says the placement needs, purpose by purpose.
  std::array<std::size_t, kHostPurposeCount> peak_pinned_by{};
  std::array<std::size_t, kHostPurposeCount> estimate_pinned_by{};
  std::size_t estimate_pinned_bytes = 0;
  // Peak resident memory of the rank's process during the row (VmHWM, reset before the row; on
  // the cpu backend it holds the device memory too), and what the placement needs in host memory
  // by formula: the estimate's pinned bytes, plus its device bytes where the device is host memory.
  std::size_t peak_host_rss_bytes = 0;
  std::size_t start_host_rss_bytes = 0;  // resident before the row's engine: MPI, libraries, corpus
  std::size_t host_need_bytes = 0;
  std::size_t nvme_bytes = 0;
  std::size_t formula_bytes = 0;      // the ZeRO formula for params + grads + optimizer states
  double ratio_to_ddp = 0;            // peak_device_bytes / stage 0's
  double formula_deviation = 0;       // (params + grads + optimizer states) / formula - 1
  std::size_t estimate_device_bytes = 0;  // what `zest estimate` predicts for peak_device_bytes
  double estimate_deviation = 0;          // peak_device_bytes / estimate - 1
  // Bytes rank 0 sent in the row's last step (EngineStats::wire_last_step), of them to other hosts,
  // and ZeRO's count for the model (estimate_wire_bytes: 2Ψ or 3Ψ times (n-1)/n).
  std::uint64_t wire_bytes = 0;
  std::uint64_t wire_across_bytes = 0;
  std::uint64_t wire_formula_bytes = 0;
  double step_seconds = 0;            // median over the measured steps
  double step_time_ratio_to_ddp = 0;
  double final_loss = 0;
  bool loss_matches_ddp = false;
  // Against the "torch DDP + AdamW" peer's final loss, when it ran: |loss - its| / its, and whether
  // that is within the dtype's tolerance.
  std::optional<double> loss_difference_to_torch_ddp;
  bool loss_matches_torch_ddp = false;
  bool peer() const { return system != "zest"; }
};

struct FitRecord {
  std::string name;
  std::size_t device_budget = 0;
  std::size_t largest_params = 0;  // the largest model that trained within the budget
  std::size_t layers = 0;          // its layer count
  std::string bound;               // what the next larger model was too large for
  bool at_least = false;           // the search stopped at its cap: the largest is at least this
  MemoryEstimate device;           // what the largest model takes per rank (zest's estimate)
};

std::string format_table(const std::vector<MemoryRecord>& records);
// Per row: peak RSS and pinned bytes (by purpose) next to what the placement needs by formula.
std::string format_host_table(const std::vector<MemoryRecord>& records);
std::string format_wire_table(const std::vector<MemoryRecord>& records);
std::string format_fit_table(const std::vector<FitRecord>& fits);
std::string to_json(const std::vector<MemoryRecord>& records, const std::vector<FitRecord>& fits);
std::string to_csv(const std::vector<MemoryRecord>& records);
// Two horizontal bar charts in one SVG: per-rank peak memory per configuration, stacked by category
// (peers in their own colours), and the largest model each searched configuration trains.
std::string to_svg(const std::vector<MemoryRecord>& records, const std::vector<FitRecord>& fits);

}  // namespace zest::bench
