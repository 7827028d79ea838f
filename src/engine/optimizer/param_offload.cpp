#include "engine/optimizer/param_offload.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "zest/error.hpp"

namespace zest::engine {

ParamOffload::ParamOffload(Device& device, const Layout& layout, const ParamOffloadPlan& plan, DType dtype,
                           std::shared_ptr<offload::Store> store)
    : device_(device), layout_(layout), dtype_(dtype), offloaded_(plan.offloaded) {
  const std::size_t element = dtype_size(dtype_);
  const auto groups = static_cast<std::size_t>(layout_.group_count());
  if (!store) {
    std::vector<std::size_t> offsets;
    for (int g = 0; g < layout_.group_count(); ++g) offsets.push_back(layout_.group(g).shard_offset * element);
    shards_ = std::make_unique<PinnedResidency>(device_, HostPurpose::param_shards, plan.shards_bytes, 1,
                                                std::move(offsets));
    return;
  }
  if (plan.slot_bytes == 0) return;  // every group is resident
  std::vector<std::string> names(groups);
  std::vector<std::size_t> bytes(groups, 0);  // 0: a resident group, with no region
  for (int g = 0; g < layout_.group_count(); ++g) {
    const auto i = static_cast<std::size_t>(g);
    names[i] = std::string("param.group.").append(std::to_string(g));
    if (offloaded_[i]) bytes[i] = layout_.group(g).shard * element;
  }
  fetch_slots_ = plan.staging_bytes / plan.slot_bytes;
  shards_ = std::make_unique<NvmeResidency>(device_, HostPurpose::param_swap, std::move(store), "offloaded parameters",
                                            names, bytes, 1, plan.slot_bytes, fetch_slots_ + 2);
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

void ParamOffload::check_usable() const {
  if (!broken_reason_.empty())
    throw Error(std::string("offloaded parameters: unusable after an earlier I/O failure (")
                    .append(broken_reason_)
                    .append("); rebuild the engine and set or load its weights again"));
}

void ParamOffload::write(int group, std::size_t offset, const void* values, std::size_t count) {
  check_usable();
  const std::size_t element = dtype_size(dtype_);
  const auto piece = static_cast<std::size_t>(group);
  const std::size_t slot = update_slot(0);
  try {
    for (offload::IoHandle& w : update_writes_) w.wait();  // the slot is free
    shards_->load(piece, slot, Copy::current).wait();
    std::memcpy(shards_->data(piece, slot, Copy::current) + offset * element, values, count * element);
    shards_->store(piece, slot, Copy::current).wait();
  } catch (const IoError& error) {
    broken_reason_ = error.what();
    throw;
  }
}

void ParamOffload::fetch(int group, void* device_dst, std::size_t slot, Stream& stream) {
  check_usable();
  const auto piece = static_cast<std::size_t>(group);
  // nvme: the read runs while the stream works through what was queued before; the stream waits
  // for it (and rethrows its IoError) only where the copy needs the bytes. cpu: nothing to wait for.
  if (offload::IoHandle loading = shards_->load(piece, slot, Copy::current)) {
    auto read = std::make_shared<offload::IoHandle>(std::move(loading));
    stream.host_task([read] { read->wait(); });
  }
  device_.copy_async(device_dst, shards_->data(piece, slot, Copy::current),
                     layout_.group(group).shard * dtype_size(dtype_), stream);
}

void* ParamOffload::begin_update(int group) {
  check_usable();
  current_update_ = next_update_++ % 2;
  try {
    update_writes_[current_update_].wait();  // the group before last is stored
  } catch (const IoError& error) {
    broken_reason_ = error.what();
    throw;
  }
  return shards_->data(static_cast<std::size_t>(group), update_slot(current_update_), Copy::current);
}

void ParamOffload::end_update(int group) {
  update_writes_[current_update_] =
      shards_->store(static_cast<std::size_t>(group), update_slot(current_update_), Copy::current);
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

std::size_t ParamOffload::nvme_bytes() const { return shards_ ? shards_->nvme_bytes() : 0; }

std::size_t ParamOffload::pinned_bytes() const { return shards_ ? shards_->pinned_bytes() : 0; }

}  // namespace zest::engine
