#include "engine/plan/memory_plan.hpp"

#include <algorithm>
#include <string>

#include <fmt/core.h>

#include "engine/math/device_math.hpp"
#include "optim/states_layout.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

std::size_t round_up(std::size_t value, std::size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

static_assert(sizeof(GradStatsScalars) <= kScalarsBytes);
// Every boundary in a shard buffer (tensor, shard, sub-group, optimizer group, partial offload) is a
// multiple of kAlign, so int8 states' blocks never straddle one: the same blocks at any world size.
static_assert(Layout::kAlign % optim::kInt8Block == 0);

// The elements at the start of the shard whose optimizer states stay on the device: the first
// (1 - offload.optimizer.ratio) of it. The split is by element, not by group, because groups are
// the trainer's layers (often one for the whole model), so group boundaries could not honour the
// ratio; it is rounded down to Layout::kAlign so the offloaded part starts aligned as every shard
// does, and at least the ratio is offloaded, and never less than kAlign elements (a shard has at
// least that many; a ratio so small that 1 - ratio rounds to 1 would otherwise offload nothing).
// The device part comes first only by convention.
std::size_t device_kept_numel(const Config& config, const Layout& layout) {
  if (config.offload.optimizer.device == OffloadDevice::none) return layout.shard_numel();
  const double ratio = config.offload.optimizer_ratio;
  if (!(ratio > 0 && ratio < 1)) return 0;  // everything offloaded (validate refuses the rest)
  const auto kept = static_cast<std::size_t>((1.0 - ratio) * static_cast<double>(layout.shard_numel()));
  return std::min(kept / Layout::kAlign * Layout::kAlign, layout.shard_numel() - Layout::kAlign);
}

OptimizerOffloadPlan plan_optimizer_offload(const Config& config, const Layout& layout, DType dtype, ShardRange range,
                                            bool grads_on_host, SubGroups list) {
  OptimizerOffloadPlan p;
  p.range = range;
  p.grads_on_host = grads_on_host;
  p.slots = static_cast<std::size_t>(std::max(0, config.offload.optimizer.buffer_count));
  const bool nvme = config.offload.optimizer.device == OffloadDevice::nvme;
  const optim::StatesForm format{config.optimizer.states, config.optimizer.master};
  p.states = format;
  // Master, m and v (and int8's scales) of a block of kAlign parameters: 768 bytes in fp32.
  const std::size_t block_bytes = optim::StatesLayout::bytes(format, Layout::kAlign);
  const std::size_t per = std::max<std::size_t>(1, config.offload.sub_group_bytes / block_bytes) * Layout::kAlign;
  p.sub_group_elements = per;
  // Each group's part splits into full sub-groups of `per` and a last, shorter one: the sizes
  // follow from the two, without visiting every sub-group (a 10^15-parameter estimate at the
  // smallest sub-group would otherwise list 10^13 of them).
  const auto region = [format](std::size_t count) {
    return round_up(optim::StatesLayout::bytes(format, count), kNvmeAlignment);
  };
  for (int g = 0; g < layout.group_count(); ++g) {
    const ShardRange part = group_part(layout, g, range);
    const std::size_t full = part.count() / per, rest = part.count() % per;
    p.sub_group_count += full + (rest > 0 ? 1 : 0);
    p.largest = std::max(p.largest, full > 0 ? per : rest);
    if (nvme) p.nvme_bytes += full * region(per) + (rest > 0 ? region(rest) : 0);
    if (list != SubGroups::listed) continue;
    for (std::size_t first = part.begin; first < part.end; first += per) {
      SubGroupPlace sub;
      sub.group = g;
      sub.offset = first;
      sub.in_group = first - layout.group(g).shard_offset;
      sub.count = std::min(per, part.end - first);
      sub.first_of_group = first == part.begin;
      sub.last_of_group = first + sub.count == part.end;
      p.sub_groups.push_back(sub);
    }
  }
  p.grad_slot_bytes = round_up(p.largest * dtype_size(dtype), kOffloadSlotAlign);
  p.staging_bytes = p.slots * p.grad_slot_bytes;
  p.grad_staging_bytes = grads_on_host ? 0 : p.staging_bytes;
  if (config.offload.optimizer.device == OffloadDevice::nvme) {
    p.state_slot_bytes = region(p.largest);
    p.state_slots_bytes = p.slots * p.state_slot_bytes;
  } else {
    // Each sub-group's states side by side: as every count is a multiple of a block (kAlign =
    // kInt8Block), the sub-groups' bytes add up to those of the range.
    p.states_bytes = optim::StatesLayout::bytes(format, range.count());
  }
  p.update_ahead = config.offload.optimizer_update_ahead;
  if (p.update_ahead) {
    p.spare_states_bytes = p.states_bytes;
    p.nvme_bytes *= 2;
    p.updated_params_bytes = round_up(range.count() * dtype_size(dtype), kOffloadSlotAlign);
  }
  p.pinned_bytes = p.grad_staging_bytes + p.staging_bytes + p.states_bytes + p.state_slots_bytes +
                   p.spare_states_bytes + p.updated_params_bytes;
  return p;
}

// Offloaded parameters (stage 3): the groups that are not resident, and the offload's buffers.
ParamOffloadPlan plan_param_offload(const Config& config, const Layout& layout, DType dtype,
                                    const std::vector<std::size_t>& resident, std::size_t fetch_slots) {
  ParamOffloadPlan p;
  const std::size_t groups = static_cast<std::size_t>(layout.group_count());
  p.offloaded.resize(groups);
  for (std::size_t g = 0; g < groups; ++g) p.offloaded[g] = resident[g] == 0;
  const std::size_t element = dtype_size(dtype);
  if (config.offload.param.device != OffloadDevice::nvme) {
    p.shards_bytes = layout.shard_numel() * element;
    p.pinned_bytes = p.shards_bytes;
    return p;
  }
  std::size_t largest = 0;
  for (int g = 0; g < layout.group_count(); ++g) {
    if (!p.offloaded[static_cast<std::size_t>(g)]) continue;
    largest = std::max(largest, layout.group(g).shard * element);
    p.nvme_bytes += round_up(layout.group(g).shard * element, kNvmeAlignment);
  }
  if (largest == 0) return p;
  p.slot_bytes = round_up(largest, kNvmeAlignment);
  p.staging_bytes = std::max<std::size_t>(1, fetch_slots) * p.slot_bytes;
  p.updates_bytes = 2 * p.slot_bytes;
  p.pinned_bytes = p.staging_bytes + p.updates_bytes;
  return p;
}

// Consecutive gathered groups share a run while the run's gathered bytes (every rank's shards:
// partitions x its shard) fit in buckets.allgather; a larger group is a run of its own. Runs skip
// the groups that are not gathered after a step (stage 3's gathered-on-use ones): which groups
// share a run only decides where they sit in the bucket, not what the gather computes.
void plan_gather_runs(const Config& config, const Layout& layout, DType dtype, const ParamsPlan& params,
                      GatherPlan& p) {
  if (config.stage == 0) return;  // one partition: the full parameters are what the step updated
  const std::size_t element = dtype_size(dtype);
  // One partition gathers nothing, so groups gain nothing from sharing a bucket.
  const std::size_t capacity = layout.partitions() > 1 ? config.buckets.allgather_bytes : 0;
  std::size_t run_bytes = 0;
  for (int g = 0; g < layout.group_count(); ++g) {
    if (config.stage == 3 && params.resident[static_cast<std::size_t>(g)] == 0) continue;
    const auto& place = layout.group(g);
    const std::size_t need = place.padded * element;
    if (p.gather_runs.empty() || run_bytes + need > capacity) {
      p.gather_runs.emplace_back();
      run_bytes = 0;
    }
    GatherRun& run = p.gather_runs.back();
    run.groups.push_back(g);
    run.shard += place.shard;
    run_bytes += need;
    if (run.groups.size() > 1) p.gather_bucket = std::max(p.gather_bucket, run_bytes);
  }
}

}  // namespace

std::optional<optim::QuantBits> quantized_grad_bits(const Config& config) {
  if (config.stage == 0) return std::nullopt;
  switch (config.comm.quantize.grads) {
    case QuantizeGrads::int8: return optim::QuantBits::int8;
    case QuantizeGrads::int4: return optim::QuantBits::int4;
    case QuantizeGrads::none: break;
  }
  return std::nullopt;
}

ShardRange group_part(const Layout& layout, int g, ShardRange range) {
  const auto& place = layout.group(g);
  const std::size_t begin = std::max(range.begin, place.shard_offset);
  const std::size_t end = std::min(range.end, place.shard_offset + place.shard);
  return begin < end ? ShardRange{begin, end} : ShardRange{begin, begin};
}

namespace {

// The ranks on each host (`host_ranks`, 0: every rank on one), which must divide the partitions;
// `fallback` names the key that avoids needing it.
int ranks_per_host(const Layout& layout, int host_ranks, const char* fallback) {
  const int ranks = host_ranks > 0 ? host_ranks : layout.partitions();
  if (layout.partitions() % ranks != 0)
    throw Error(
        fmt::format("this config needs the same number of ranks on every host, and {} per host do not divide {} ranks; "
                    "run as many ranks on every host, or set {}",
                    ranks, layout.partitions(), fallback));
  return ranks;
}

}  // namespace

namespace {

// The device bytes by MemoryCategory, which each step adds its buffers to.
using DeviceBytes = std::array<std::size_t, kMemoryCategoryCount>;

void add(DeviceBytes& device, MemoryCategory c, std::size_t n) { device[static_cast<std::size_t>(c)] += n; }

std::size_t bytes_of(const Config& config, std::size_t elements) {
  return elements * dtype_size(config.precision.dtype);
}

// The parameters on the device: every segment (stages 0-2), or this rank's shards, the resident
// groups' segments and the host's secondary slice (stage 3).
ParamsPlan plan_params(const Config& config, const Layout& layout, int host_ranks, bool offload_params,
                       DeviceBytes& device) {
  ParamsPlan p;
  const std::size_t groups = static_cast<std::size_t>(layout.group_count());
  if (config.stage != 3) {
    p.full_params = bytes_of(config, layout.full_numel());
    add(device, MemoryCategory::params, p.full_params);
    return p;
  }
  if (!offload_params) p.param_shards = bytes_of(config, layout.shard_numel());
  add(device, MemoryCategory::params, p.param_shards);
  p.resident.assign(groups, 0);
  for (std::size_t g = 0; g < groups; ++g) {
    const std::size_t segment = bytes_of(config, layout.group(static_cast<int>(g)).padded);
    if (segment <= config.stage3.persistence_threshold_bytes) p.resident[g] = segment;
    add(device, MemoryCategory::params, p.resident[g]);
  }
  if (config.partition.secondary == SecondaryPartition::host && layout.partitions() > 1) {
    const int ranks = ranks_per_host(layout, host_ranks, "partition.secondary: none");
    p.secondary_ranks = ranks;
    // A segment is a multiple of 64 x partitions elements, so of the host's rank count too.
    for (std::size_t g = 0; g < groups; ++g)
      if (p.resident[g] == 0) p.secondary_params += bytes_of(config, layout.group(static_cast<int>(g)).padded) / ranks;
    add(device, MemoryCategory::params, p.secondary_params);
  }
  return p;
}

// The optimizer states kept on the device, and, with offloaded parameters, the buffer through
// which a group's update leaves the device when its states are there.
DeviceStatesPlan plan_device_states(const Config& config, const Layout& layout, bool offload_optimizer,
                                    bool offload_params, DeviceBytes& device) {
  DeviceStatesPlan p;
  p.range = {0, device_kept_numel(config, layout)};
  const optim::StatesForm form{config.optimizer.states, config.optimizer.master};
  p.master_in_params =
      config.precision.dtype == DType::f32 && form.master == DType::f32 && !offload_optimizer && !offload_params;
  p.bytes = optim::StatesLayout::bytes(
      form, p.range.count(),
      p.master_in_params ? optim::StatesLayout::Master::elsewhere : optim::StatesLayout::Master::here);
  add(device, MemoryCategory::optimizer_states, p.bytes);
  if (offload_params) {
    // The largest part of a group's shard whose states are on the device.
    for (int g = 0; g < layout.group_count(); ++g)
      p.update_out = std::max(p.update_out, bytes_of(config, group_part(layout, g, p.range).count()));
    add(device, MemoryCategory::buffers, p.update_out);
  }
  return p;
}

// The accumulated gradient (on the device, or pinned with grads_on_host) and the reduction's
// buffers: the staging buckets, the pack of a bucket of several groups, the quantized reduction's
// codes and sums, and the landing of a bucket's shard part on the host.
ReducePlan plan_reduce(const Config& config, const Layout& layout, int host_ranks, bool grads_on_host,
                       DeviceBytes& device) {
  ReducePlan p;
  p.grads_on_host = grads_on_host;
  const std::size_t grads = bytes_of(config, config.stage <= 1 ? layout.full_numel() : layout.shard_numel());
  (p.grads_on_host ? p.host_grads : p.grads) = grads;
  add(device, MemoryCategory::grads, p.grads);
  const std::size_t partitions = static_cast<std::size_t>(layout.partitions());
  // A reduce bucket holds consecutive groups up to buckets.reduce (never more than every group
  // together, so a small model does not pay for a large bucket), or one larger group alone.
  p.bucket_fill = std::min(config.buckets.reduce_bytes / dtype_size(config.precision.dtype), layout.full_numel());
  p.bucket_elements = std::max(layout.largest_segment(), p.bucket_fill);
  p.staging_slot = bytes_of(config, p.bucket_elements);
  add(device, MemoryCategory::buffers, ReducePlan::kStagingSlots * p.staging_slot);
  if (config.stage >= 1 && partitions > 1 && layout.group_count() > 1) {
    std::vector<std::size_t> segments;
    for (int g = 0; g < layout.group_count(); ++g) segments.push_back(layout.group(g).padded);
    std::partial_sort(segments.begin(), segments.begin() + 2, segments.end());
    // Two groups share a bucket only where they fit in bucket_fill together; such a bucket never
    // holds more than that.
    if (segments[0] + segments[1] <= p.bucket_fill) p.reduce_pack = bytes_of(config, p.bucket_fill);
  }
  add(device, MemoryCategory::buffers, p.reduce_pack);
  if (const auto bits = quantized_grad_bits(config); bits && partitions > 1) {
    const auto per_host = static_cast<std::size_t>(ranks_per_host(layout, host_ranks, "comm.quantize.grads: none"));
    // A bucket's piece per rank: its groups' shards, at most a bucket (or the largest segment,
    // which fills one alone) over the ranks; segments are multiples of the partitions.
    p.quant_reduce_piece = p.bucket_elements / partitions;
    p.quant_reduce_codes = partitions * optim::quantized_bytes(*bits, p.quant_reduce_piece);
    p.quant_reduce_sums = partitions / per_host * p.quant_reduce_piece * sizeof(float);
    add(device, MemoryCategory::buffers, 2 * p.quant_reduce_codes + p.quant_reduce_sums);
  }
  if (p.grads_on_host) p.grad_landing = bytes_of(config, p.bucket_elements / partitions);
  return p;
}

// Stage 3: the gathered buffers for the groups that are not resident, as many as max_live_bytes
// holds, at least two (one in use, one prefetched), never more than such groups; the quantized
// gather's codes. Then the runs of the gather after each step, and their bucket.
GatherPlan plan_gather(const Config& config, const Layout& layout, const ParamsPlan& params, bool offload_params,
                       DeviceBytes& device) {
  GatherPlan p;
  if (config.stage == 3) {
    const std::size_t partitions = static_cast<std::size_t>(layout.partitions());
    const std::size_t segment_bytes = bytes_of(config, layout.largest_segment());
    const std::size_t sharded_groups =
        static_cast<std::size_t>(std::count(params.resident.begin(), params.resident.end(), 0));
    const std::size_t by_budget = config.stage3.max_live_bytes / segment_bytes;
    p.gathered_count = std::min(sharded_groups, std::max<std::size_t>(2, by_budget));
    p.gathered_slot = segment_bytes;
    if (offload_params) p.gathered_shard = bytes_of(config, layout.largest_segment() / partitions);
    add(device, MemoryCategory::buffers, p.gathered_count * (p.gathered_slot + p.gathered_shard));
    if (config.comm.quantize.params != QuantizeParams::none && partitions > 1 && sharded_groups > 0)
      p.quant_gather_codes =
          partitions * optim::quantized_bytes(optim::QuantBits::int8, layout.largest_segment() / partitions);
    add(device, MemoryCategory::buffers, p.quant_gather_codes);
  }
  plan_gather_runs(config, layout, config.precision.dtype, params, p);
  add(device, MemoryCategory::buffers, p.gather_bucket);
  return p;
}

// The engine's own buffers: the step's scalars on the device; pinned, the scalars, then
// set_param/get_param staging.
EnginePlan plan_engine(const Config& config, const Layout& layout, const DeviceStatesPlan& device_states,
                       DeviceBytes& device) {
  EnginePlan p;
  p.scalars = sizeof(GradStatsScalars);
  add(device, MemoryCategory::buffers, p.scalars);
  std::size_t largest_tensor = 0;
  for (std::size_t t = 0; t < layout.tensor_count(); ++t)
    largest_tensor = std::max(largest_tensor, layout.tensor(t).numel);
  // At least 3: the device-resident states pass through it for checkpoints a third each; compact
  // ones, on a device the host cannot read, a whole int8 block at least at a time.
  const optim::StatesForm form{config.optimizer.states, config.optimizer.master};
  const std::size_t least = form.plain() || device_states.range.count() == 0
                                ? 3
                                : optim::StatesLayout::bytes(form, optim::kInt8Block) / sizeof(float);
  p.staging_elements = std::min(std::max(largest_tensor, least), kStagingElements);
  const std::size_t low_bytes = config.precision.dtype == DType::f32 ? 0 : bytes_of(config, p.staging_elements);
  p.pinned = kScalarsBytes + p.staging_elements * sizeof(float) + low_bytes;
  return p;
}

}  // namespace

MemoryPlan plan_memory(const Config& config, const Layout& layout, SubGroups sub_groups, int host_ranks) {
  MemoryPlan p;
  p.offload_optimizer = config.offload.optimizer.device != OffloadDevice::none;
  p.offload_params = config.stage == 3 && config.offload.param.device != OffloadDevice::none;
  const DType dtype = config.precision.dtype;
  p.params = plan_params(config, layout, host_ranks, p.offload_params, p.device);
  p.device_states = plan_device_states(config, layout, p.offload_optimizer, p.offload_params, p.device);
  // The whole optimizer offloaded at stages 2-3: the gradient shard lives in pinned host memory.
  const bool grads_on_host = config.stage >= 2 && p.offload_optimizer && p.device_states.range.count() == 0;
  p.reduce = plan_reduce(config, layout, host_ranks, grads_on_host, p.device);
  p.gather = plan_gather(config, layout, p.params, p.offload_params, p.device);
  if (p.offload_optimizer)
    p.optimizer_offload = plan_optimizer_offload(
        config, layout, dtype, {p.device_states.range.end, layout.shard_numel()}, p.reduce.grads_on_host, sub_groups);
  if (p.offload_params)
    p.param_offload = plan_param_offload(config, layout, dtype, p.params.resident, p.gather.gathered_count);
  p.engine = plan_engine(config, layout, p.device_states, p.device);

  for (std::size_t n : p.device) p.device_total += n;
  p.pinned_total = p.engine.pinned + p.reduce.host_grads + p.reduce.grad_landing + p.optimizer_offload.pinned_bytes +
                   p.param_offload.pinned_bytes;
  p.nvme_total = p.optimizer_offload.nvme_bytes + p.param_offload.nvme_bytes;
  return p;
}

}  // namespace zest::engine
