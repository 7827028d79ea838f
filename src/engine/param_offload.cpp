#include "engine/param_offload.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "zest/error.hpp"

namespace zest::engine {

ParamOffload::ParamOffload(Device& device, const Layout& layout, const ParamOffloadPlan& plan, DType dtype,
                           std::shared_ptr<offload::Store> store)
    : device_(device), layout_(layout), dtype_(dtype), offloaded_(plan.offloaded), store_(std::move(store)) {
  const std::size_t element = dtype_size(dtype_);
  if (!store_) {
    shards_ = device_.allocate_pinned(plan.shards_bytes, HostPurpose::param_shards);
    std::memset(shards_.data(), 0, shards_.bytes());
    return;
  }
  if (plan.slot_bytes == 0) return;  // every group is resident
  if (store_->alignment() != kNvmeAlignment)
    throw Error(std::string("offloaded parameters: the store's alignment is ").append(std::to_string(store_->alignment()))
                    .append(" bytes, the memory plan's ").append(std::to_string(kNvmeAlignment)));
  slot_bytes_ = plan.slot_bytes;
  staging_ = device_.allocate_pinned(plan.staging_bytes, HostPurpose::param_swap);
  updates_ = device_.allocate_pinned(plan.updates_bytes, HostPurpose::param_swap);
  std::memset(updates_.data(), 0, updates_.bytes());
  regions_.assign(static_cast<std::size_t>(layout_.group_count()), 0);
  // Zeros (padding included) in every region, so each holds data before set_param fills it.
  for (int g = 0; g < layout_.group_count(); ++g) {
    if (!offloaded_[static_cast<std::size_t>(g)]) continue;
    const std::size_t i = static_cast<std::size_t>(g);
    regions_[i] = store_->allocate(std::string("param.group.").append(std::to_string(g)), layout_.group(g).shard * element);
    offload::IoHandle& previous = update_writes_[i % 2];
    previous.wait();
    previous = store_->write_async(regions_[i], update_buffer(i % 2));
  }
  for (offload::IoHandle& w : update_writes_) w.wait();
}

ParamOffload::~ParamOffload() {
  for (offload::IoHandle& w : update_writes_) {
    try {
      w.wait();
    } catch (...) {
      // Reported by finish_updates, or the engine is being torn down after that error.
    }
  }
}

char* ParamOffload::staging(std::size_t slot) const { return staging_.as<char>() + slot * slot_bytes_; }
char* ParamOffload::update_buffer(std::size_t i) const { return updates_.as<char>() + i * slot_bytes_; }

void ParamOffload::check_usable() const {
  if (!broken_reason_.empty())
    throw Error(std::string("offloaded parameters: unusable after an earlier I/O failure (")
                    .append(broken_reason_)
                    .append("); rebuild the engine and set or load its weights again"));
}

void ParamOffload::write(int group, std::size_t offset, const void* values, std::size_t count) {
  check_usable();
  const std::size_t element = dtype_size(dtype_);
  if (!store_) {
    std::memcpy(shards_.as<char>() + (layout_.group(group).shard_offset + offset) * element, values, count * element);
    return;
  }
  const offload::RegionId region = regions_[static_cast<std::size_t>(group)];
  try {
    for (offload::IoHandle& w : update_writes_) w.wait();
    store_->read_async(region, update_buffer(0)).wait();
    std::memcpy(update_buffer(0) + offset * element, values, count * element);
    store_->write_async(region, update_buffer(0)).wait();
  } catch (const IoError& error) {
    broken_reason_ = error.what();
    throw;
  }
}

void ParamOffload::fetch(int group, void* device_dst, std::size_t slot, Stream& stream) {
  check_usable();
  const std::size_t bytes = layout_.group(group).shard * dtype_size(dtype_);
  if (!store_) {
    device_.copy_async(device_dst, shards_.as<char>() + layout_.group(group).shard_offset * dtype_size(dtype_), bytes,
                       stream);
    return;
  }
  // The read runs while the stream works through what was queued before; the stream waits for it
  // (and rethrows its IoError) only where the copy needs the bytes.
  auto read = std::make_shared<offload::IoHandle>(store_->read_async(regions_[static_cast<std::size_t>(group)], staging(slot)));
  stream.host_task([read] { read->wait(); });
  device_.copy_async(device_dst, staging(slot), bytes, stream);
}

void* ParamOffload::begin_update(int group) {
  check_usable();
  if (!store_) return shards_.as<char>() + layout_.group(group).shard_offset * dtype_size(dtype_);
  current_update_ = next_update_++ % 2;
  try {
    update_writes_[current_update_].wait();  // the group before last is on disk
  } catch (const IoError& error) {
    broken_reason_ = error.what();
    throw;
  }
  return update_buffer(current_update_);
}

void ParamOffload::end_update(int group) {
  if (!store_) return;
  update_writes_[current_update_] = store_->write_async(regions_[static_cast<std::size_t>(group)], update_buffer(current_update_));
}

void ParamOffload::finish_updates() {
  try {
    for (offload::IoHandle& w : update_writes_) w.wait();
  } catch (const IoError& error) {
    broken_reason_ = error.what();
    for (offload::IoHandle& w : update_writes_) {
      try {
        w.wait();
      } catch (...) {
      }
    }
    throw;
  }
}

std::size_t ParamOffload::nvme_bytes() const {
  std::size_t total = 0;
  if (store_)
    for (std::size_t g = 0; g < regions_.size(); ++g)
      if (offloaded_[g]) total += store_->region(regions_[g]).padded_bytes;
  return total;
}

std::size_t ParamOffload::pinned_bytes() const { return shards_.bytes() + staging_.bytes() + updates_.bytes(); }

}  // namespace zest::engine
