#include "engine/device_optimizer_states.hpp"

#include <algorithm>
#include <cstring>

namespace zest::engine {

DeviceOptimizerStates::DeviceOptimizerStates(Device& device, Stream& stream, DeviceMath& math, const Layout& layout,
                                             const MemoryPlan& plan, DType dtype, HostStaging& staging,
                                             const HyperRuns& runs)
    : device_(device), stream_(stream), math_(math), layout_(layout), dtype_(dtype), staging_(staging), runs_(runs) {
  master_ = device.allocate(plan.optimizer_state, MemoryCategory::optimizer_states);
  m_ = device.allocate(plan.optimizer_state, MemoryCategory::optimizer_states);
  v_ = device.allocate(plan.optimizer_state, MemoryCategory::optimizer_states);
  if (plan.offload_params) update_out_ = device.allocate(plan.update_out, MemoryCategory::buffers);
  shards_.reserve(static_cast<std::size_t>(layout.group_count()) + runs.size());
  // Padding and the moments are read before anything is written.
  for (const DeviceBuffer* b : {&master_, &m_, &v_})
    if (*b) device.memset_async(b->data(), 0, b->bytes(), stream_);
}

void DeviceOptimizerStates::write_master(std::size_t offset, const float* values, std::size_t count) {
  for (std::size_t first = 0; first < count; first += staging_.elements()) {
    const std::size_t n = std::min(staging_.elements(), count - first);
    std::memcpy(staging_.f32(), values + first, n * sizeof(float));
    device_.copy_async(master_.as<float>() + offset + first, staging_.f32(), n * sizeof(float), stream_);
    stream_.synchronize();  // the staging is refilled next
  }
}

void DeviceOptimizerStates::read_master(std::size_t offset, float* values, std::size_t count) {
  for (std::size_t first = 0; first < count; first += staging_.elements()) {
    const std::size_t n = std::min(staging_.elements(), count - first);
    device_.copy_async(staging_.f32(), master_.as<float>() + offset + first, n * sizeof(float), stream_);
    stream_.synchronize();
    std::memcpy(values + first, staging_.f32(), n * sizeof(float));
  }
}

void DeviceOptimizerStates::visit_states(std::size_t offset, std::size_t count, bool write_back,
                                         const StatesVisit& visit) {
  // The three states of a piece side by side in the fp32 staging.
  const std::size_t piece = staging_.elements() / 3;
  float* const host[] = {staging_.f32(), staging_.f32() + piece, staging_.f32() + 2 * piece};
  float* const states[] = {master_.as<float>(), m_.as<float>(), v_.as<float>()};
  for (std::size_t first = 0; first < count; first += piece) {
    const std::size_t n = std::min(piece, count - first);
    for (int k = 0; k < 3; ++k) device_.copy_async(host[k], states[k] + offset + first, n * sizeof(float), stream_);
    stream_.synchronize();
    visit(host[0], host[1], host[2], first, n);
    if (!write_back) continue;
    for (int k = 0; k < 3; ++k) device_.copy_async(states[k] + offset + first, host[k], n * sizeof(float), stream_);
    stream_.synchronize();
  }
}

void DeviceOptimizerStates::add_shard(int g, const void* grad, void* out) {
  const auto& place = layout_.group(g);
  for_each_run(runs_, place.shard_offset, place.shard_offset + place.shard,
               [&](std::size_t lo, std::size_t hi, const optim::AdamHyperParams& hyper) {
                 const std::size_t in = (lo - place.shard_offset) * dtype_size(dtype_);
                 shards_.push_back({master_.as<float>() + lo, m_.as<float>() + lo, v_.as<float>() + lo,
                                    static_cast<const char*>(grad) + in, static_cast<char*>(out) + in, hi - lo, &hyper});
               });
}

void DeviceOptimizerStates::step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args,
                                 HostParamSink* sink) {
  shards_.clear();
  for (int g = 0; g < layout_.group_count(); ++g) {
    const StepGroup& group = groups[static_cast<std::size_t>(g)];
    if (group.device_out) add_shard(g, group.grad, group.device_out);
  }
  math_.adam_step(shards_, dtype_, dtype_, args, stream_);
  if (!sink) return;
  stream_.synchronize();  // the stream has read shards_, refilled below
  // Offloaded parameters: each group's updated shard passes through one device buffer on its way
  // to the host.
  for (int g = 0; g < layout_.group_count(); ++g) {
    const StepGroup& group = groups[static_cast<std::size_t>(g)];
    if (group.device_out) continue;
    shards_.clear();
    add_shard(g, group.grad, update_out_.data());
    math_.adam_step(shards_, dtype_, dtype_, args, stream_);
    device_.copy_async(sink->begin_update(g), update_out_.data(), dtype_size(dtype_) * layout_.group(g).shard, stream_);
    stream_.synchronize();
    sink->end_update(g);
  }
}

}  // namespace zest::engine
