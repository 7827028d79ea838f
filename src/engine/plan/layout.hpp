// Where every parameter lives in the engine's flat buffers. Each group is one segment; tensors sit
// in registration order at aligned offsets; the segment is padded so it splits into `partitions`
// equal, aligned shards (partitions = 1 for stage 0, the world size otherwise). Rank r owns
// [r * shard, (r + 1) * shard) of every segment; its shard buffer is the concatenation of those.
#pragma once

#include <cstddef>
#include <vector>

#include "zest/engine.hpp"

namespace zest::engine {

struct TensorPlace {
  int group = 0;
  std::size_t offset = 0;  // elements from the start of the group's segment
  std::size_t numel = 0;
};

struct GroupPlace {
  std::size_t first_tensor = 0;
  std::size_t end_tensor = 0;
  std::size_t padded = 0;        // elements in the segment, a multiple of partitions * kAlign
  std::size_t shard = 0;         // padded / partitions
  std::size_t full_offset = 0;   // of the segment in the full flat buffer
  std::size_t shard_offset = 0;  // of this group's shard in a rank's shard buffer
};

class Layout {
 public:
  // Elements; keeps every tensor and every shard 256-byte aligned in fp32.
  static constexpr std::size_t kAlign = 64;

  // Throws Error when the list is empty, a tensor has no elements, or a group's tensors are not
  // one contiguous run in registration order.
  Layout(const std::vector<ParamSpec>& params, int partitions);

  int partitions() const { return partitions_; }
  const TensorPlace& tensor(std::size_t i) const { return tensors_[i]; }
  const GroupPlace& group(int g) const { return groups_[static_cast<std::size_t>(g)]; }
  int group_count() const { return static_cast<int>(groups_.size()); }
  std::size_t tensor_count() const { return tensors_.size(); }
  std::size_t numel() const { return numel_; }              // without padding
  std::size_t full_numel() const { return full_numel_; }    // all segments
  std::size_t shard_numel() const { return shard_numel_; }  // one rank's shards of all segments
  std::size_t largest_segment() const { return largest_segment_; }

  // The shard geometry, in one place. Where rank `rank`'s shard of group g begins in the group's
  // segment (elements): 0 with one partition (every rank holds the whole segment), else
  // rank * shard.
  std::size_t shard_begin(int g, int rank) const;
  // The part of tensor t inside rank `rank`'s shard of its group, in segment elements [lo, hi)
  // (empty when lo == hi), with the shard's `begin`: element lo sits at group(g).shard_offset +
  // (lo - begin) of the rank's shard buffer and is the tensor's element lo - tensor(t).offset.
  struct ShardPart {
    std::size_t begin = 0, lo = 0, hi = 0;
    bool empty() const { return lo >= hi; }
  };
  ShardPart shard_part(std::size_t t, int rank) const;

 private:
  int partitions_;
  std::vector<TensorPlace> tensors_;
  std::vector<GroupPlace> groups_;
  std::size_t numel_ = 0;
  std::size_t full_numel_ = 0;
  std::size_t shard_numel_ = 0;
  std::size_t largest_segment_ = 0;
};

}  // namespace zest::engine
