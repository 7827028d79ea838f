// The engine's flat layout: aligned tensors, equal padded shards, and refusals of unusable lists.
#include "engine/layout.hpp"

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
