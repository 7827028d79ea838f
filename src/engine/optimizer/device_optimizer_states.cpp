#include "engine/optimizer/device_optimizer_states.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::engine {

DeviceOptimizerStates::DeviceOptimizerStates(Device& device, Stream& stream, DeviceMath& math, const Layout& layout,
                                             const MemoryPlan& plan, DType dtype, HostStaging& staging,
                                             const HyperRuns& runs, const StatesOptions& states,
                                             std::vector<float*> params_shards)
    : device_(device),
      stream_(stream),
      math_(math),
      layout_(layout),
      dtype_(dtype),
      staging_(staging),
      runs_(runs),
      range_(plan.device_states.range),
      options_(states),
      layout_of_states_(states.form(), plan.device_states.range.count(),
                        plan.device_states.master_in_params ? optim::StatesLayout::Master::elsewhere
                                                            : optim::StatesLayout::Master::here),
      params_shards_(std::move(params_shards)) {
  if (plan.device_states.master_in_params != !params_shards_.empty() ||
      (plan.device_states.master_in_params && params_shards_.size() != static_cast<std::size_t>(layout.group_count())))
    throw Error(fmt::format(
        "device optimizer states: the plan {} the master weights in the parameters, but {} parameter "
        "shards were given for {} groups; this is a zest bug",
        plan.device_states.master_in_params ? "keeps" : "does not keep", params_shards_.size(), layout.group_count()));
  if (states.master == DType::bf16 && !device.host_accessible())
    throw Error("a bf16 master (optimizer.master: bf16) on this device is not implemented: its Adam keeps an fp32 "
                "master. Use optimizer.master: fp32 (bf16 or int8 optimizer.states stay compact on the device), or "
                "offload the optimizer (offload.optimizer.device: cpu or nvme, ratio 1)");
  if (!layout_of_states_.form().plain() && !device.host_accessible() &&
      staging_.elements() * sizeof(float) < optim::StatesLayout::bytes(layout_of_states_.form(), optim::kInt8Block))
    throw Error(
        fmt::format("device optimizer states: the engine's staging holds {} floats, less than one block of {} states, "
                    "which pass through it; this is a zest bug: EnginePlan::staging_elements must hold a block",
                    staging_.elements(), states_format_name(states.format)));
  states_ = device.allocate(plan.device_states.bytes, MemoryCategory::optimizer_states);
  if (plan.offload_params) update_out_ = device.allocate(plan.device_states.update_out, MemoryCategory::buffers);
  shards_.reserve(static_cast<std::size_t>(layout.group_count()) + runs.size());
  // Padding and the moments are read before anything is written.
  if (states_) device.memset_async(states_.data(), 0, states_.bytes(), stream_);
}

void DeviceOptimizerStates::check_range(std::size_t offset, std::size_t count) const {
  if (offset < range_.begin || offset > range_.end || count > range_.end - offset)
    throw Error(fmt::format("device optimizer states: elements [{}, {}) outside the states' [{}, {})", offset,
                            offset + count, range_.begin, range_.end));
}

float* DeviceOptimizerStates::at(int k, std::size_t offset) const {
  char* const base = states_.as<char>();
  const std::size_t in_range = offset - range_.begin;
  if (k == 0) return layout_of_states_.master(base) + in_range;
  return reinterpret_cast<float*>(k == 1 ? layout_of_states_.m(base) : layout_of_states_.v(base)) + in_range;
}

float* DeviceOptimizerStates::master_of(int g, std::size_t offset) const {
  if (params_shards_.empty()) return at(0, offset);
  return params_shards_[static_cast<std::size_t>(g)] + (offset - layout_.group(g).shard_offset);
}

void DeviceOptimizerStates::copy(char* device, char* host, std::size_t bytes, bool to_host) {
  if (to_host) device_.copy_async(host, device, bytes, stream_);
  else device_.copy_async(device, host, bytes, stream_);
}

template <class F>
void DeviceOptimizerStates::for_each_master_piece(std::size_t offset, std::size_t count, F f) const {
  if (params_shards_.empty()) {
    if (count > 0) f(at(0, offset), 0, count);
    return;
  }
  for (int g = 0; g < layout_.group_count(); ++g) {
    const auto& place = layout_.group(g);
    const std::size_t lo = std::max(offset, place.shard_offset);
    const std::size_t hi = std::min(offset + count, place.shard_offset + place.shard);
    if (lo < hi) f(master_of(g, lo), lo - offset, hi - lo);
  }
}

void DeviceOptimizerStates::write_master(std::size_t offset, const float* values, std::size_t count) {
  check_range(offset, count);
  if (!layout_of_states_.form().plain()) {
    visit_states(offset, count, true, [values](float* master, float*, float*, std::size_t first, std::size_t n) {
      std::memcpy(master, values + first, n * sizeof(float));
    });
    return;
  }
  for (std::size_t first = 0; first < count; first += staging_.elements()) {
    const std::size_t n = std::min(staging_.elements(), count - first);
    std::memcpy(staging_.f32(), values + first, n * sizeof(float));
    for_each_master_piece(offset + first, n, [&](float* master, std::size_t first_in, std::size_t k) {
      device_.copy_async(master, staging_.f32() + first_in, k * sizeof(float), stream_);
    });
    stream_.synchronize();  // the staging is refilled next
  }
}

void DeviceOptimizerStates::read_master(std::size_t offset, float* values, std::size_t count) {
  check_range(offset, count);
  if (!layout_of_states_.form().plain()) {
    visit_states(offset, count, false, [values](float* master, float*, float*, std::size_t first, std::size_t n) {
      std::memcpy(values + first, master, n * sizeof(float));
    });
    return;
  }
  for (std::size_t first = 0; first < count; first += staging_.elements()) {
    const std::size_t n = std::min(staging_.elements(), count - first);
    for_each_master_piece(offset + first, n, [&](float* master, std::size_t first_in, std::size_t k) {
      device_.copy_async(staging_.f32() + first_in, master, k * sizeof(float), stream_);
    });
    stream_.synchronize();
    std::memcpy(values + first, staging_.f32(), n * sizeof(float));
  }
}

void DeviceOptimizerStates::visit_states(std::size_t offset, std::size_t count, bool write_back,
                                         const StatesVisit& visit) {
  check_range(offset, count);
  if (!layout_of_states_.form().plain()) {
    if (!device_.host_accessible()) return visit_staged(offset - range_.begin, count, write_back, visit);
    // Host memory: visited in place once the stream is idle.
    stream_.synchronize();
    if (params_shards_.empty())
      return visit_laid_out(layout_of_states_, states_.as<char>(), offset - range_.begin, count, 0, write_back, visit,
                            visit_scratch_);
    for_each_master_piece(offset, count, [&](float* master, std::size_t first_in, std::size_t k) {
      visit_laid_out(layout_of_states_, states_.as<char>(), offset + first_in - range_.begin, k, first_in, write_back,
                     visit, visit_scratch_, master);
    });
    return;
  }
  // The three states of a piece side by side in the fp32 staging.
  const std::size_t piece = staging_.elements() / 3;
  float* const host[] = {staging_.f32(), staging_.f32() + piece, staging_.f32() + 2 * piece};
  const auto bytes_of = [](float* f) { return reinterpret_cast<char*>(f); };
  const auto copy_states = [&](std::size_t from, std::size_t n, bool to_host) {
    for_each_master_piece(from, n, [&](float* master, std::size_t first_in, std::size_t k) {
      copy(bytes_of(master), bytes_of(host[0] + first_in), k * sizeof(float), to_host);
    });
    for (int k = 1; k < 3; ++k) copy(bytes_of(at(k, from)), bytes_of(host[k]), n * sizeof(float), to_host);
    stream_.synchronize();
  };
  for (std::size_t first = 0; first < count; first += piece) {
    const std::size_t n = std::min(piece, count - first);
    copy_states(offset + first, n, true);
    visit(host[0], host[1], host[2], first, n);
    if (write_back) copy_states(offset + first, n, false);
  }
}

void DeviceOptimizerStates::visit_staged(std::size_t at, std::size_t count, bool write_back,
                                         const StatesVisit& visit) {
  const optim::StatesForm form = layout_of_states_.form();
  // Whole int8 blocks at a time, so that each is narrowed back with the scale of all its elements.
  const std::size_t chunk = staging_.elements() * sizeof(float) / optim::StatesLayout::bytes(form, optim::kInt8Block) *
                            optim::kInt8Block;
  char* const host = reinterpret_cast<char*>(staging_.f32());
  const std::size_t end = at + count;
  for (std::size_t lo = at / optim::kInt8Block * optim::kInt8Block; lo < end; lo += chunk) {
    const optim::StatesLayout piece(form, std::min(lo + chunk, layout_of_states_.count()) - lo);
    copy_piece(piece, host, lo, true);
    stream_.synchronize();
    const std::size_t from = std::max(lo, at), to = std::min(lo + piece.count(), end);
    visit_laid_out(piece, host, from - lo, to - from, from - at, write_back, visit, visit_scratch_);
    if (!write_back) continue;
    copy_piece(piece, host, lo, false);
    stream_.synchronize();  // the staging is refilled next
  }
}

void DeviceOptimizerStates::copy_piece(const optim::StatesLayout& piece, char* host, std::size_t lo, bool to_host) {
  const optim::StatesLayout& whole = layout_of_states_;
  char* const device = states_.as<char>();
  const std::size_t master = whole.master_here() ? dtype_size(whole.form().master) : 0;
  const std::size_t state = optim::state_bytes(whole.format());
  const std::size_t scales = optim::StatesLayout::blocks(whole.format(), piece.count()) * sizeof(float);
  const auto bytes_of = [](float* f) { return reinterpret_cast<char*>(f); };
  struct Region {
    char* device;
    char* host;
    std::size_t bytes;
  };
  const Region regions[] = {
      {device + lo * master, host, piece.count() * master},
      {whole.m(device) + lo * state, piece.m(host), piece.count() * state},
      {whole.v(device) + lo * state, piece.v(host), piece.count() * state},
      {bytes_of(whole.m_scales(device) + lo / optim::kInt8Block), bytes_of(piece.m_scales(host)), scales},
      {bytes_of(whole.v_scales(device) + lo / optim::kInt8Block), bytes_of(piece.v_scales(host)), scales}};
  for (const Region& r : regions)
    if (r.bytes > 0) copy(r.device, r.host, r.bytes, to_host);
  // A master in the parameters goes to the piece's master in the staging, group by group.
  if (whole.master_here()) return;
  for_each_master_piece(range_.begin + lo, piece.count(), [&](float* on_device, std::size_t first_in, std::size_t k) {
    copy(bytes_of(on_device), bytes_of(piece.master(host) + first_in), k * sizeof(float), to_host);
  });
}

void DeviceOptimizerStates::add_shard(int g, ShardRange part, const char* grad, char* out) {
  for_each_run(runs_, part.begin, part.end, [&](std::size_t lo, std::size_t hi, const optim::AdamHyperParams& hyper) {
    const std::size_t in = (lo - part.begin) * dtype_size(dtype_);
    // A master in the parameters is updated in place: no copy to write.
    AdamShard shard{nullptr, nullptr, nullptr, grad + in, params_shards_.empty() ? out + in : nullptr, hi - lo, &hyper};
    if (layout_of_states_.form().plain()) {
      shard.master = master_of(g, lo);
      shard.m = at(1, lo);
      shard.v = at(2, lo);
    } else {
      char* const base = states_.as<char>();
      shard.compact = layout_of_states_.moments(base, lo - range_.begin, hi - lo);
      shard.rounding = options_.rounding(g, lo - layout_.group(g).shard_offset);
      if (options_.master == DType::bf16)
        shard.bf16_master = layout_of_states_.bf16_master(base) + (lo - range_.begin);
      else
        shard.master = master_of(g, lo);
    }
    shards_.push_back(shard);
  });
}

void DeviceOptimizerStates::step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args,
                                 HostParamSink* sink) {
  // Group g's part in range_, and where that part starts in the group's shard (bytes).
  const auto part = [&](int g) { return group_part(layout_, g, range_); };
  const auto in_group = [&](int g) { return (part(g).begin - layout_.group(g).shard_offset) * dtype_size(dtype_); };
  const auto grad = [&](int g) {
    return static_cast<const char*>(groups[static_cast<std::size_t>(g)].grad) + in_group(g);
  };
  shards_.clear();
  for (int g = 0; g < layout_.group_count(); ++g) {
    char* const out = static_cast<char*>(groups[static_cast<std::size_t>(g)].device_out);
    if (out && part(g).count() > 0) add_shard(g, part(g), grad(g), out + in_group(g));
  }
  math_.adam_step(shards_, dtype_, dtype_, args, stream_);
  if (!sink) return;
  stream_.synchronize();  // the stream has read shards_, refilled below
  // Offloaded parameters: each group's updated part passes through one device buffer on its way to
  // its place in the group's host shard.
  for (int g = 0; g < layout_.group_count(); ++g) {
    if (groups[static_cast<std::size_t>(g)].device_out || part(g).count() == 0) continue;
    shards_.clear();
    add_shard(g, part(g), grad(g), update_out_.as<char>());
    math_.adam_step(shards_, dtype_, dtype_, args, stream_);
    device_.copy_async(static_cast<char*>(sink->begin_update(g)) + in_group(g), update_out_.data(),
                       dtype_size(dtype_) * part(g).count(), stream_);
    stream_.synchronize();
    sink->end_update(g);
  }
}

}  // namespace zest::engine
