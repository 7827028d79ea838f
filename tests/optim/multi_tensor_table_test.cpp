// The CUDA Adam's launch packing (plain C++, so it is tested without a GPU): every chunk of every
// tensor lands in exactly one block of one launch, and no table overflows its fixed capacity.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "kernels/multi_tensor.cuh"

namespace zest::kernels::detail {
namespace {

struct FakeTensor {
  int id = 0;
  std::int64_t count = 0;
};

TEST(MultiTensorTable, EveryChunkOnceAcrossLaunches) {
  std::vector<FakeTensor> tensors;
  // Many small tensors (more than one table holds), empty ones, and tensors spanning many chunks
  // (more blocks than one launch holds), including one past 2^31 elements (64-bit offsets).
  for (int i = 0; i < 60; ++i) tensors.push_back({i, 1 + 1000 * static_cast<std::int64_t>(i % 7)});
  tensors.push_back({60, 0});
  tensors.push_back({61, 700 * kChunk + 3});
  tensors.push_back({62, 5});
  tensors.push_back({63, (std::int64_t{1} << 31) + 17});
  std::map<std::pair<int, std::int64_t>, int> seen;
  int launches = 0;
  for_each_launch(tensors.data(), tensors.size(), [&](const TensorTable<FakeTensor>& table, int blocks) {
    ++launches;
    ASSERT_GT(blocks, 0);
    ASSERT_LE(blocks, kMaxBlocks);
    for (int b = 0; b < blocks; ++b) {
      ASSERT_LT(table.block_tensor[b], kMaxTensors);
      const FakeTensor& t = table.tensors[table.block_tensor[b]];
      const std::int64_t chunk = table.block_chunk[b];
      ASSERT_LT(chunk * kChunk, t.count) << "tensor " << t.id;
      ++seen[{t.id, chunk}];
    }
  });
  std::size_t expected = 0;
  for (const FakeTensor& t : tensors) {
    const std::int64_t chunks = (t.count + kChunk - 1) / kChunk;
    expected += static_cast<std::size_t>(chunks);
    for (std::int64_t c = 0; c < chunks; ++c) EXPECT_EQ((seen[{t.id, c}]), 1) << t.id << ":" << c;
  }
  EXPECT_EQ(seen.size(), expected);
  EXPECT_GT(launches, 3);
}

}  // namespace
}  // namespace zest::kernels::detail
