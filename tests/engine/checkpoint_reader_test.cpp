// checkpoint::Reader on a hand-made checkpoint with 64-byte chunks, so that reads start, end and
// cross chunks in every way: every sub-range of every tensor reads back exactly, a flipped byte is
// reported for the reads that touch its chunk (naming it) and for no other, and a short file or an
// inconsistent manifest is refused.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/reader.hpp"
#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr std::uint64_t kChunk = 64;  // 16 floats

float value(int state, std::size_t tensor, std::size_t j) {
  return static_cast<float>(state * 10000 + static_cast<int>(tensor) * 1000 + static_cast<int>(j));
}

class ReaderTest : public testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/zest-reader-test-XXXXXX";
    ASSERT_NE(::mkdtemp(name), nullptr);
    dir = name;
    // Two ranks; tensor 0 split between them at an element that is not a chunk boundary.
    m.world_size = 2;
    m.chunk_bytes = kChunk;
    m.tensors = {{"a", {10, 10}, 0, 100}, {"b", {37}, 1, 37}};
    m.ranks.resize(2);
    m.ranks[0].ranges = {{0, 0, 61}};
    m.ranks[1].ranges = {{0, 61, 100}, {1, 0, 37}};
    for (int r = 0; r < 2; ++r) {
      for (int k = 0; k < kStates; ++k) {
        const std::string file = state_file_name(r, StateKind(k));
        FileWriter writer((fs::path(dir) / file).string(), kChunk);
        for (const Range& range : m.ranks[static_cast<std::size_t>(r)].ranges)
          for (std::size_t j = range.lo; j < range.hi; ++j) {
            const float x = value(k, range.tensor, j);
            writer.append(&x, sizeof x);
          }
        writer.finish();
        m.ranks[static_cast<std::size_t>(r)].files[static_cast<std::size_t>(k)] = {file, writer.bytes(), writer.chunk_crcs()};
      }
    }
    write_manifest();
  }
  void TearDown() override { fs::remove_all(dir); }

  void write_manifest() {
    const std::string text = serialize(m);
    write_file_synced((fs::path(dir) / kManifestName).string(), text.data(), text.size());
  }

  // Reads [a, b) of (state, tensor); true when it matched, false when the reader refused.
  bool reads_back(Reader& reader, int state, std::size_t tensor, std::size_t a, std::size_t b) {
    std::vector<float> out(b - a, -1.0f);
    try {
      reader.read(StateKind(state), tensor, a, b, out.data());
    } catch (const Error&) {
      return false;
    }
    for (std::size_t j = a; j < b; ++j) EXPECT_EQ(out[j - a], value(state, tensor, j)) << state << ' ' << tensor << ' ' << j;
    return true;
  }

  std::string dir;
  Manifest m;
};

TEST_F(ReaderTest, EverySubRangeReadsBack) {
  Reader reader(dir);
  reader.check_files();
  EXPECT_EQ(reader.manifest().ranks[1].files[0].chunk_crcs.size(), 5u);  // 76 floats = 304 bytes
  for (int k = 0; k < kStates; ++k)
    for (std::size_t t = 0; t < 2; ++t)
      for (std::size_t a = 0; a < m.tensors[t].numel; ++a)
        for (std::size_t b = a + 1; b <= m.tensors[t].numel; ++b) ASSERT_TRUE(reads_back(reader, k, t, a, b));
  EXPECT_TRUE(reader.verify_all().empty());
}

TEST_F(ReaderTest, AFlippedByteFailsOnlyTheReadsOfItsChunk) {
  const fs::path file = fs::path(dir) / "rank1.v.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70);  // chunk 1 (bytes 64..127): rank 1's elements 16..31 = tensor 0's 77..92
    f.put('\x7f');
  }
  Reader reader(dir);
  EXPECT_TRUE(reads_back(reader, 2, 0, 61, 77));   // chunk 0 only
  EXPECT_TRUE(reads_back(reader, 2, 1, 0, 37));    // chunks 2-4
  EXPECT_TRUE(reads_back(reader, 1, 0, 61, 100));  // another state's file
  EXPECT_FALSE(reads_back(reader, 2, 0, 92, 93));
  try {
    std::vector<float> out(1);
    reader.read(StateKind::v, 0, 80, 81, out.data());
    ADD_FAILURE() << "read a damaged chunk";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank1.v.bin chunk 1 (bytes 64 to 128)"), std::string::npos) << e.what();
  }
  const auto problems = reader.verify_all();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("rank1.v.bin chunk 1"), std::string::npos) << problems[0];
}

TEST_F(ReaderTest, ATruncatedFileIsRefusedBeforeReading) {
  fs::resize_file(fs::path(dir) / "rank0.m.bin", 200);
  Reader reader(dir);
  try {
    reader.check_files();
    ADD_FAILURE() << "accepted a truncated file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank0.m.bin has 200 bytes, the manifest says 244"), std::string::npos) << e.what();
  }
  ASSERT_EQ(reader.verify_all().size(), 1u);
}

TEST_F(ReaderTest, AnInconsistentManifestIsRefused) {
  auto refused = [&](const std::string& expected) {
    write_manifest();
    try {
      Reader reader(dir);
      ADD_FAILURE() << "accepted a manifest with " << expected;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  const Manifest good = m;
  m.ranks[1].ranges[0].lo = 62;  // element 61 of tensor 0 is nowhere
  m.ranks[1].files[0].bytes = m.ranks[1].files[1].bytes = m.ranks[1].files[2].bytes = 75 * 4;
  for (auto& f : m.ranks[1].files) f.chunk_crcs.resize(5);
  refused("do not cover it exactly once");
  m = good;
  m.ranks[0].files[1].chunk_crcs.pop_back();
  refused("checksum count");
  m = good;
  m.tensors[1].shape = {36};
  refused("shape does not hold its element count");
  m = good;
  m.ranks.pop_back();
  refused("1 ranks listed for world size 2");
}

}  // namespace
}  // namespace zest::checkpoint
