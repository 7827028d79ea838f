#include "engine/optimizer/residency.hpp"

#include <cstring>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "engine/plan/memory_plan.hpp"
#include "zest/error.hpp"

namespace zest::engine {

Residency::Residency(std::size_t pieces, int copies) : copies_(copies), spare_is_current_(pieces, false) {
  if (copies < 1 || copies > 2)
    throw Error(fmt::format("residency: a piece has one or two copies, not {}", copies));
}

void Residency::require_spare(const char* what) const {
  if (copies_ < 2)
    throw Error(std::string("residency: ").append(what).append(" needs two copies of each piece; this one keeps one "
                                                                 "(offload.optimizer.update_ahead makes two)"));
}

PinnedResidency::PinnedResidency(Device& device, HostPurpose purpose, std::size_t bytes, int copies,
                                 std::vector<std::size_t> offsets)
    : Residency(offsets.size(), copies), offsets_(std::move(offsets)) {
  for (int k = 0; k < copies; ++k) {
    arrays_[k] = device.allocate_pinned(bytes, purpose);
    std::memset(arrays_[k].data(), 0, arrays_[k].bytes());
  }
}

char* PinnedResidency::data(std::size_t piece, std::size_t /*slot*/, Copy copy) const {
  return arrays_[index(piece, copy)].as<char>() + offsets_[piece];
}

std::size_t PinnedResidency::pinned_bytes() const { return arrays_[0].bytes() + arrays_[1].bytes(); }

NvmeResidency::NvmeResidency(Device& device, HostPurpose purpose, std::shared_ptr<offload::Store> store,
                             const std::string& owner, const std::vector<std::string>& names,
                             std::span<const std::size_t> bytes, int copies, std::size_t slot_bytes, std::size_t slots)
    : Residency(bytes.size(), copies),
      store_(std::move(store)),
      slot_bytes_(slot_bytes),
      regions_(bytes.size() * static_cast<std::size_t>(copies), 0),
      has_region_(bytes.size(), false) {
  if (store_->alignment() != kNvmeAlignment)
    throw Error(fmt::format("{}: the store's alignment is {} bytes, the memory plan's {}", owner, store_->alignment(),
                            kNvmeAlignment));
  if (slots == 0)
    throw Error(std::string(owner).append(": no staging slot to move its pieces through; give at least one"));
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const std::size_t moved = (bytes[i] + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment;
    if (moved > slot_bytes)
      throw Error(
          fmt::format("{}: piece {} moves {} bytes through a staging slot of {}; the slots must hold the largest piece",
                      owner, i, moved, slot_bytes));
  }
  slots_ = device.allocate_pinned(slots * slot_bytes, purpose);
  std::memset(slots_.data(), 0, slots_.bytes());
  // Zeros (padding included) into every piece's current copy, from each slot in turn, which keeps
  // `slots` writes in flight.
  std::vector<offload::IoHandle> writes(slots);
  for (std::size_t i = 0, written = 0; i < bytes.size(); ++i) {
    if (bytes[i] == 0) continue;
    has_region_[i] = true;
    for (int k = 0; k < copies; ++k)
      regions_[i * static_cast<std::size_t>(copies) + static_cast<std::size_t>(k)] =
          store_->allocate(k == 0 ? names[i] : names[i] + ".spare", bytes[i]);
    offload::IoHandle& previous = writes[written % slots];
    previous.wait();
    previous = store_->write_async(region(i, Copy::current), data(i, written % slots, Copy::current));
    ++written;
  }
  for (offload::IoHandle& w : writes) w.wait();
}

char* NvmeResidency::data(std::size_t /*piece*/, std::size_t slot, Copy /*copy*/) const {
  return slots_.as<char>() + slot * slot_bytes_;
}

offload::IoHandle NvmeResidency::load(std::size_t piece, std::size_t slot, Copy copy) {
  return store_->read_async(region(piece, copy), data(piece, slot, copy));
}

offload::IoHandle NvmeResidency::store(std::size_t piece, std::size_t slot, Copy copy) {
  return store_->write_async(region(piece, copy), data(piece, slot, copy));
}

std::size_t NvmeResidency::nvme_bytes() const {
  std::size_t total = 0;
  for (std::size_t i = 0; i < regions_.size(); ++i)
    if (has_region_[i / static_cast<std::size_t>(copies())]) total += store_->region(regions_[i]).padded_bytes;
  return total;
}

void drain(std::span<offload::IoHandle> handles) noexcept {
  for (offload::IoHandle& h : handles) {
    try {
      h.wait();
    } catch (...) {
    }
    h = offload::IoHandle();
  }
}

}  // namespace zest::engine
