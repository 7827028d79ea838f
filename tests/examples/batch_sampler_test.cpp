#include "examples/charlm/batch_sampler.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "zest/error.hpp"

namespace zest::charlm {
namespace {

// Token i at position i: a window's content says where it came from.
std::vector<Token> positional_corpus(std::size_t n) {
  std::vector<Token> tokens(n);
  std::iota(tokens.begin(), tokens.end(), 0);
  return tokens;
}

std::vector<Token> gather(const BatchSampler& sampler, const std::vector<Token>& corpus,
                          std::uint64_t step, ExampleRange range) {
  std::vector<Token> out(range.count * sampler.window());
  sampler.gather(corpus, step, range, out);
  return out;
}

TEST(BatchSampler, WindowsAreCorpusSubstringsAtTheirPositions) {
  const auto corpus = positional_corpus(1000);
  const BatchSampler sampler(corpus.size(), 7, 16, 42);
  const auto batch = gather(sampler, corpus, 3, {0, 16});
  for (std::size_t i = 0; i < 16; ++i) {
    const std::size_t start = sampler.position(3, i);
    ASSERT_LE(start + 8, corpus.size());
    for (std::size_t k = 0; k < 8; ++k) {
      EXPECT_EQ(batch[i * 8 + k], static_cast<Token>(start + k));
    }
  }
}

TEST(BatchSampler, UnionOfRankSlicesIsTheGlobalBatch) {
  const auto corpus = positional_corpus(500);
  for (const std::size_t global_batch : {1u, 3u, 10u, 12u}) {
    const BatchSampler sampler(corpus.size(), 5, global_batch, 7);
    const auto whole = gather(sampler, corpus, 11, {0, global_batch});
    for (int world = 1; world <= 4; ++world) {
      std::vector<Token> joined;
      std::size_t next = 0;
      for (int rank = 0; rank < world; ++rank) {
        const ExampleRange slice = rank_slice(global_batch, rank, world);
        EXPECT_EQ(slice.first, next) << "slices are contiguous and in rank order";
        next = slice.first + slice.count;
        // Sizes differ by at most one: floor(B/N) or ceil(B/N).
        EXPECT_GE(slice.count, global_batch / static_cast<std::size_t>(world));
        EXPECT_LE(slice.count, (global_batch + world - 1) / static_cast<std::size_t>(world));
        const auto part = gather(sampler, corpus, 11, slice);
        joined.insert(joined.end(), part.begin(), part.end());
      }
      EXPECT_EQ(next, global_batch);
      EXPECT_EQ(joined, whole) << "B=" << global_batch << " N=" << world;
    }
  }
}

TEST(BatchSampler, RemainderIsSpreadNotPiledOnTheLastRank) {
  // B = 10 over 4 ranks: floor(r*10/4) = 0, 2, 5, 7, 10.
  const std::vector<std::size_t> expected{2, 3, 2, 3};
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(rank_slice(10, rank, 4).count, expected[rank]);
  // More ranks than examples: some ranks get none.
  EXPECT_EQ(rank_slice(2, 0, 4).count, 0u);
  EXPECT_EQ(rank_slice(2, 1, 4).count, 1u);
}

TEST(BatchSampler, SameSeedAndStepGiveTheSameBatch) {
  const auto corpus = positional_corpus(300);
  const BatchSampler a(corpus.size(), 4, 8, 99);
  const BatchSampler b(corpus.size(), 4, 8, 99);
  (void)gather(a, corpus, 0, {0, 8});  // no hidden state: earlier calls change nothing
  EXPECT_EQ(gather(a, corpus, 5, {0, 8}), gather(b, corpus, 5, {0, 8}));
}

TEST(BatchSampler, DifferentStepOrSeedGivesADifferentBatch) {
  const auto corpus = positional_corpus(10000);
  const BatchSampler a(corpus.size(), 4, 8, 99);
  const BatchSampler other_seed(corpus.size(), 4, 8, 100);
  EXPECT_NE(gather(a, corpus, 5, {0, 8}), gather(a, corpus, 6, {0, 8}));
  EXPECT_NE(gather(a, corpus, 5, {0, 8}), gather(other_seed, corpus, 5, {0, 8}));
}

TEST(BatchSampler, PositionsCoverEveryStart) {
  // 50 tokens, windows of 5: starts 0..45. 4000 draws hit each about 87 times.
  const BatchSampler sampler(50, 4, 4000, 1);
  std::vector<int> hits(46, 0);
  for (std::size_t i = 0; i < 4000; ++i) {
    const std::size_t start = sampler.position(0, i);
    ASSERT_LT(start, hits.size());
    ++hits[start];
  }
  for (std::size_t s = 0; s < hits.size(); ++s) {
    EXPECT_GT(hits[s], 40) << "start " << s;
    EXPECT_LT(hits[s], 140) << "start " << s;
  }
}

TEST(BatchSampler, ErrorsSayWhatIsWrong) {
  auto message_of = [](auto&& action) -> std::string {
    try {
      action();
    } catch (const Error& error) {
      return error.what();
    }
    return "no error";
  };
  EXPECT_NE(message_of([] { BatchSampler(8, 8, 4, 0); }).find("corpus of 8 tokens"),
            std::string::npos);
  EXPECT_NE(message_of([] { BatchSampler(100, 4, 0, 0); }).find("global batch size is 0"),
            std::string::npos);
  const auto corpus = positional_corpus(100);
  const BatchSampler sampler(corpus.size(), 4, 8, 0);
  std::vector<Token> small(5);
  EXPECT_NE(message_of([&] { sampler.gather(corpus, 0, {0, 2}, small); }).find("need 10"),
            std::string::npos);
  std::vector<Token> out(10);
  EXPECT_NE(message_of([&] { sampler.gather(corpus, 0, {7, 2}, out); }).find("[7, 9)"),
            std::string::npos);
  EXPECT_NE(message_of([&] { sampler.gather(std::span<const Token>(corpus).first(50), 0, {0, 2}, out); })
                .find("given one of 50"),
            std::string::npos);
  EXPECT_NE(message_of([] { (void)rank_slice(8, 4, 4); }).find("rank 4 of world 4"),
            std::string::npos);
  EXPECT_NE(message_of([] { (void)rank_slice(8, 0, 0); }).find("world 0"), std::string::npos);
}

}  // namespace
}  // namespace zest::charlm
