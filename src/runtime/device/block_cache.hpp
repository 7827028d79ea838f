// Freed device blocks, kept by rounded size for the next allocation of that size. cudaMalloc and
// cudaFree synchronize the whole GPU, so without a cache every buffer freed and allocated again
// inside a step would stall all streams. Plain C++ (no CUDA) so its policy is tested without a GPU.
// Not thread-safe: the owning Device locks around it.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <limits>
#include <unordered_map>
#include <vector>

namespace zest {

class BlockCache {
 public:
  static constexpr std::size_t kMinGranularity = 512;
  static constexpr std::size_t kMaxGranularity = std::size_t{2} << 20;

  // The size a request of `bytes` is allocated with. The granularity is 1/16 of the request's
  // power of two, between 512 bytes and 2 MiB: at most 6.25% (and at most 2 MiB) is wasted, and
  // requests of similar size share a bin. Zero bytes still get a block, so a valid pointer.
  static constexpr std::size_t rounded_size(std::size_t bytes) {
    if (bytes == 0) return kMinGranularity;
    const std::size_t granularity =
        std::clamp(std::bit_floor(bytes) / 16, kMinGranularity, kMaxGranularity);
    // A request this close to SIZE_MAX cannot be satisfied anyway; let the allocator refuse it.
    if (bytes > std::numeric_limits<std::size_t>::max() - granularity) return bytes;
    return (bytes + granularity - 1) / granularity * granularity;
  }

  // A cached block of exactly `rounded` bytes (now owned by the caller), or nullptr.
  void* take(std::size_t rounded) {
    const auto bin = free_.find(rounded);
    if (bin == free_.end() || bin->second.empty()) return nullptr;
    void* block = bin->second.back();
    bin->second.pop_back();
    cached_bytes_ -= rounded;
    --cached_blocks_;
    return block;
  }

  // Keeps `block` of `rounded` bytes. May throw std::bad_alloc, leaving the cache unchanged.
  void put(void* block, std::size_t rounded) {
    free_[rounded].push_back(block);
    cached_bytes_ += rounded;
    ++cached_blocks_;
  }

  // Hands every cached block to release(block, rounded) and empties the cache.
  template <class Release>
  void drain(Release&& release) {
    for (auto& [rounded, blocks] : free_) {
      for (void* block : blocks) release(block, rounded);
    }
    free_.clear();
    cached_bytes_ = 0;
    cached_blocks_ = 0;
  }

  std::size_t cached_bytes() const { return cached_bytes_; }
  std::size_t cached_blocks() const { return cached_blocks_; }

 private:
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  std::size_t cached_bytes_ = 0;
  std::size_t cached_blocks_ = 0;
};

}  // namespace zest
