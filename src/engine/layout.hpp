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
