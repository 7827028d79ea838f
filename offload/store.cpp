#include "offload/store.hpp"

#include <cerrno>
#include <cstdint>
#include <exception>
#include <utility>

#include <fmt/core.h>

#include "base/text.hpp"
#include "zest/error.hpp"

namespace zest::offload {

Store::Store(std::size_t alignment) : alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw Error(fmt::format("store alignment must be a power of two, got {}", alignment));
}

Store::~Store() = default;

RegionId Store::allocate(std::string name, std::size_t bytes) {
  if (bytes == 0)
    throw Error(std::string("store region ").append(in_quotes(name)).append(" has 0 bytes; give it at least 1"));
  std::lock_guard lock(mutex_);
  if (by_name_.contains(name))
    throw Error(
        std::string("store region ").append(in_quotes(name)).append(" exists already; region names must be unique"));
  Region region;
  region.name = std::move(name);
  region.offset = used_;
  region.bytes = bytes;
  region.padded_bytes = (bytes + alignment_ - 1) / alignment_ * alignment_;
  const auto id = static_cast<RegionId>(regions_.size());
  reserve(id, region);  // throws before anything is recorded
  used_ += region.padded_bytes;
  by_name_.emplace(region.name, id);
  regions_.push_back(std::move(region));
  states_.emplace_back();
  return id;
}

RegionId Store::find(std::string_view name) const {
  std::lock_guard lock(mutex_);
  auto it = by_name_.find(std::string(name));
  if (it == by_name_.end())
    throw Error(std::string("store has no region ").append(in_quotes(name)).append(" (allocate it first)"));
  return it->second;
}

Region Store::region(RegionId id) const {
  std::lock_guard lock(mutex_);
  if (id >= regions_.size()) throw Error(fmt::format("store has no region id {}", id));
  return regions_[id];
}

std::size_t Store::region_count() const {
  std::lock_guard lock(mutex_);
  return regions_.size();
}

std::size_t Store::used_bytes() const {
  std::lock_guard lock(mutex_);
  return used_;
}

bool Store::holds_data(RegionId id) const {
  std::lock_guard lock(mutex_);
  return id < states_.size() && states_[id].has_data;
}

IoHandle Store::write_async(RegionId id, const void* src) {
  // The store only reads `src` for a write; the request holds one pointer for both ways.
  return submit(id, Op::write, const_cast<void*>(src));
}

IoHandle Store::read_async(RegionId id, void* dst) { return submit(id, Op::read, dst); }

Region Store::begin_transfer(RegionId id, Op op, const void* buffer) {
  std::lock_guard lock(mutex_);
  if (id >= regions_.size()) throw Error(fmt::format("store has no region id {}", id));
  const Region& region = regions_[id];
  const char* verb = op == Op::write ? "write" : "read";
  if (buffer == nullptr || reinterpret_cast<std::uintptr_t>(buffer) % alignment_ != 0)
    throw Error(fmt::format(
        "store {} of region {}: the host buffer must be aligned to {} bytes (use Device::allocate_pinned or a "
        "HostBufferPool)",
        verb, in_quotes(region.name), alignment_));
  State& state = states_[id];
  if (state.writing || (op == Op::write && state.readers > 0))
    throw Error(fmt::format(
        "store {} of region {} while another transfer of it is running; wait for that transfer's handle first", verb,
        in_quotes(region.name)));
  if (op == Op::read && !state.has_data)
    throw IoError(std::string("cannot read region ").append(in_quotes(region.name))
                      .append(": it holds no data (never written, or its last write failed)"),
                  location(), region.offset, region.padded_bytes, ENODATA);
  if (op == Op::write) {
    state.writing = true;
    state.has_data = false;  // until this write succeeds
  } else {
    ++state.readers;
  }
  return region;
}

void Store::end_transfer(RegionId id, Op op, bool ok) noexcept {
  std::lock_guard lock(mutex_);
  State& state = states_[id];
  if (op == Op::write) {
    state.writing = false;
    state.has_data = ok;
  } else {
    --state.readers;
  }
}

void Store::note_failure(std::shared_ptr<detail::Transfer> transfer) {
  std::lock_guard lock(mutex_);
  failures_.push_back(std::move(transfer));
}

void Store::rethrow_unobserved_failure() {
  std::vector<std::shared_ptr<detail::Transfer>> failures;
  {
    std::lock_guard lock(mutex_);
    failures.swap(failures_);
  }
  std::exception_ptr first;
  for (auto& transfer : failures) {
    if (!transfer->failed_unobserved()) continue;
    if (!first) {
      first = transfer->take_error();
    } else {
      std::lock_guard lock(mutex_);  // reported by the next flush, not dropped
      failures_.push_back(transfer);
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace zest::offload
