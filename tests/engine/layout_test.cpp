// The engine's flat layout: aligned tensors, equal padded shards, each tensor's part of each
// rank's shard, and refusals of unusable lists.
#include "engine/plan/layout.hpp"

#include <gtest/gtest.h>

#include "zest/error.hpp"

namespace zest::engine {
namespace {

std::vector<ParamSpec> three_groups() {
  return {{"embed", {13, 5}, 0}, {"w1", {7, 3}, 1}, {"b1", {7}, 1}, {"out", {1}, 2}};
}

TEST(Layout, TensorsAreAlignedAndGroupsSplitIntoEqualShards) {
  for (int partitions : {1, 2, 3, 4}) {
    const Layout layout(three_groups(), partitions);
    EXPECT_EQ(layout.numel(), 65u + 21u + 7u + 1u);
    ASSERT_EQ(layout.group_count(), 3);
    std::size_t full = 0, shards = 0;
    for (int g = 0; g < 3; ++g) {
      const GroupPlace& place = layout.group(g);
      EXPECT_EQ(place.padded % (Layout::kAlign * static_cast<std::size_t>(partitions)), 0u);
      EXPECT_EQ(place.shard * static_cast<std::size_t>(partitions), place.padded);
      EXPECT_EQ(place.full_offset, full);
      EXPECT_EQ(place.shard_offset, shards);
      full += place.padded;
      shards += place.shard;
    }
    EXPECT_EQ(layout.full_numel(), full);
    EXPECT_EQ(layout.shard_numel(), shards);
    // w1 and b1 share group 1; b1 starts at the next aligned offset after w1.
    EXPECT_EQ(layout.tensor(1).offset, 0u);
    EXPECT_EQ(layout.tensor(2).offset, Layout::kAlign);
    EXPECT_LE(layout.tensor(2).offset + 7, layout.group(1).padded);
  }
}

// Every element of every tensor lies in exactly one rank's shard part (with one partition, the
// only shard is the whole segment), within that rank's shard of the group.
TEST(Layout, ShardPartsTileEachTensorOnce) {
  const std::vector<ParamSpec> params = {{"a", {300}, 0}, {"b", {5}, 0}, {"c", {129}, 0}, {"d", {1}, 1}};
  for (int partitions : {1, 2, 3, 4}) {
    const Layout layout(params, partitions);
    for (std::size_t t = 0; t < params.size(); ++t) {
      const TensorPlace& place = layout.tensor(t);
      const GroupPlace& group = layout.group(place.group);
      std::vector<int> holders(place.numel, 0);
      for (int rank = 0; rank < partitions; ++rank) {
        const auto part = layout.shard_part(t, rank);
        EXPECT_EQ(part.begin, layout.shard_begin(place.group, rank));
        EXPECT_EQ(part.begin, partitions == 1 ? 0 : static_cast<std::size_t>(rank) * group.shard);
        if (part.empty()) continue;
        EXPECT_GE(part.lo, place.offset);
        EXPECT_LE(part.hi, place.offset + place.numel);
        EXPECT_GE(part.lo, part.begin);
        EXPECT_LE(part.hi, part.begin + group.shard);
        for (std::size_t e = part.lo; e < part.hi; ++e) ++holders[e - place.offset];
      }
      for (std::size_t e = 0; e < place.numel; ++e) ASSERT_EQ(holders[e], 1) << "tensor " << t << " element " << e;
    }
  }
}

TEST(Layout, RefusesEmptyListsEmptyTensorsAndSplitGroups) {
  EXPECT_THROW(Layout({}, 1), Error);
  EXPECT_THROW(Layout({{"w", {3, 0}, 0}}, 1), Error);
  try {
    Layout({{"a", {2}, 0}, {"b", {2}, 1}, {"c", {2}, 0}}, 2);
    FAIL() << "a group split in two runs was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("contiguous"), std::string::npos) << error.what();
  }
  try {
    Layout({{"a", {2}, 1}}, 2);
    FAIL() << "groups not numbered from 0 were accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("numbered 0, 1, 2"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace zest::engine
