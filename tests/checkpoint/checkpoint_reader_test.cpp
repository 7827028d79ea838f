// checkpoint::Reader on a hand-made checkpoint with 64-byte chunks, so that reads start, end and
// cross chunks in every way: every sub-range of every tensor reads back exactly, a flipped byte is
// reported for the reads that touch its chunk (naming it) and for no other, and a short file or an
// inconsistent manifest is refused. The reader is bounded: a FIFO or an oversized file is refused
// without blocking or reading it, and a manifest whose checksum was recomputed after an edit that
// makes a count, size or shape huge (or overflow) is refused before anything is allocated for it.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/safetensors_header.hpp"
#include "offload/checksum.hpp"
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
        m.ranks[static_cast<std::size_t>(r)].files[static_cast<std::size_t>(k)] = {file, writer.bytes(),
                                                                                   writer.chunk_crcs()};
      }
    }
    write_manifest();
  }
  void TearDown() override { fs::remove_all(dir); }

  void write_manifest() { write_manifest_text(serialize(m)); }
  void write_manifest_text(const std::string& text) {
    fs::remove(fs::path(dir) / kManifestName);  // writers create their file exclusively
    write_file_synced((fs::path(dir) / kManifestName).string(), text.data(), text.size());
  }

  // The manifest with `from` replaced by `to` and its closing checksum recomputed, as a
  // deliberate edit (or a fuzzer) would make it: only the checks behind the checksum stop it.
  void write_edited_manifest(const std::string& from, const std::string& to) {
    std::string text = serialize(m);
    const std::size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    text.erase(text.rfind("end "));
    const std::uint32_t crc = offload::crc32c(text.data(), text.size());
    text.append("end ").append(std::to_string(crc)).append("\n");
    write_manifest_text(text);
  }

  // Constructing a Reader (and verifying all) throws Error with `expected`, and nothing else.
  void expect_refused(const std::string& expected) {
    try {
      Reader reader(dir);
      reader.verify_all();
      ADD_FAILURE() << "accepted a manifest that should fail with: " << expected;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }

  // Reads [a, b) of (state, tensor); true when it matched, false when the reader refused.
  bool reads_back(Reader& reader, int state, std::size_t tensor, std::size_t a, std::size_t b) {
    std::vector<float> out(b - a, -1.0f);
    try {
      reader.read(StateKind(state), tensor, a, b, out.data());
    } catch (const Error&) {
      return false;
    }
    for (std::size_t j = a; j < b; ++j)
      EXPECT_EQ(out[j - a], value(state, tensor, j)) << state << ' ' << tensor << ' ' << j;
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

// Values no save writes, with every checksum recomputed after the edit (issue 34 item 2): the
// reader refuses them where it reads them and verify_all (zest checkpoint inspect) reports them,
// naming the file, the tensor and the element, instead of a resume that trains to NaN.
class TamperedValues : public ReaderTest {
 protected:
  // Rewrites `rank`'s file of `state` with element `at` of the file (in range order) set to x,
  // through the format's writer (fresh chunk checksums) and into the manifest.
  void reseal(int rank, StateKind state, std::size_t at, float x) {
    std::string bytes = read_regular_file((fs::path(dir) / state_file_name(rank, state)).string(), 1 << 20, "test");
    std::memcpy(bytes.data() + at * sizeof(float), &x, sizeof x);
    rewrite(rank, state, bytes);
    write_manifest();
  }
  // `rank`'s file of `state` replaced by `bytes`, with fresh chunk checksums in the manifest (unwritten).
  void rewrite(int rank, StateKind state, const std::string& bytes) {
    const std::string name = state_file_name(rank, state), path = (fs::path(dir) / name).string();
    fs::remove(path);
    FileWriter writer(path, kChunk);
    writer.append(bytes.data(), bytes.size());
    writer.finish();
    m.ranks[static_cast<std::size_t>(rank)].files[static_cast<std::size_t>(state)] = {name, writer.bytes(),
                                                                                      writer.chunk_crcs()};
  }
  void expect_refused_value(const std::string& words) {
    Reader reader(dir);
    std::vector<float> out(100);
    try {
      for (int k = 0; k < kStates; ++k)
        for (std::size_t t = 0; t < 2; ++t) reader.read(StateKind(k), t, 0, m.tensors[t].numel, out.data());
      ADD_FAILURE() << "read a value no save writes: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    const auto problems = Reader(dir).verify_all();
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_NE(problems[0].find(words), std::string::npos) << problems[0];
  }
};

TEST_F(TamperedValues, ANanMasterWeightIsRefused) {
  reseal(1, StateKind::master, 40, std::nanf(""));  // rank 1's element 40: tensor 1's element 1
  expect_refused_value("rank1.master.bin holds master = nan for element 1 of tensor 'b'");
}

TEST_F(TamperedValues, AnInfiniteMomentIsRefused) {
  reseal(0, StateKind::m, 5, -INFINITY);
  expect_refused_value("rank0.m.bin holds m = -inf for element 5 of tensor 'a'");
}

TEST_F(TamperedValues, ANegativeSecondMomentIsRefused) {
  reseal(1, StateKind::v, 0, -2.0f);
  expect_refused_value(
      "rank1.v.bin holds v = -2 for element 61 of tensor 'a', which no save writes (v is finite and not "
      "negative)");
}

// int8 moments: each block's scale is its largest magnitude, so never negative nor non-finite.
class TamperedInt8 : public TamperedValues {
 protected:
  void SetUp() override {
    ReaderTest::SetUp();
    m.states = StatesFormat::int8;
    for (int r = 0; r < 2; ++r)
      for (const StateKind k : {StateKind::m, StateKind::v}) {
        const auto& ranges = m.ranks[static_cast<std::size_t>(r)].ranges;
        std::string bytes;
        for (const Range& range : ranges) bytes.append(range.hi - range.lo, '\0');  // code 0: value 0
        for (const Range& range : ranges)
          for (std::uint64_t b = 0; b < int8_blocks(range.hi - range.lo); ++b) {
            const float scale = 1.0f;
            bytes.append(reinterpret_cast<const char*>(&scale), sizeof scale);
          }
        ASSERT_EQ(bytes.size(), state_file_bytes(m.states, k, ranges));
        rewrite(r, k, bytes);
      }
    write_manifest();
  }
};

TEST_F(TamperedInt8, ANegativeOrNonFiniteScaleIsRefused) {
  ASSERT_TRUE(Reader(dir).verify_all().empty());
  // Rank 1's files hold 76 codes, then a scale for tensor 0's elements 61.. (float 19 of the file).
  reseal(1, StateKind::v, 19, -1.0f);
  expect_refused_value("rank1.v.bin holds the int8 scale -1 for elements from 61 of tensor 'a'");
  reseal(1, StateKind::v, 19, 1.0f);
  reseal(1, StateKind::m, 19, std::nanf(""));
  expect_refused_value("rank1.m.bin holds the int8 scale nan for elements from 61 of tensor 'a'");
}

TEST_F(TamperedValues, ASubnormalLossScaleIsRefused) {
  write_edited_manifest("loss_scaler 0x1p+0", "loss_scaler 0x1p-1074");
  expect_refused("loss scale");
}

TEST_F(ReaderTest, ATruncatedFileIsRefusedBeforeReading) {
  fs::resize_file(fs::path(dir) / "rank0.m.bin", 200);
  Reader reader(dir);
  try {
    reader.check_files();
    ADD_FAILURE() << "accepted a truncated file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank0.m.bin has 200 bytes, the manifest says 244"), std::string::npos)
        << e.what();
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

TEST_F(ReaderTest, AFifoManifestIsRefusedWithoutBlocking) {
  fs::remove(fs::path(dir) / kManifestName);
  ASSERT_EQ(::mkfifo((fs::path(dir) / kManifestName).c_str(), 0644), 0);
  expect_refused("is a FIFO, not a regular file");
}

TEST_F(ReaderTest, AFifoRankFileIsRefusedWithoutBlocking) {
  fs::remove(fs::path(dir) / "rank0.m.bin");
  ASSERT_EQ(::mkfifo((fs::path(dir) / "rank0.m.bin").c_str(), 0644), 0);
  Reader reader(dir);
  std::vector<float> out(10);
  EXPECT_THROW(reader.read(StateKind::m, 0, 0, 10, out.data()), Error);
  EXPECT_THROW(reader.check_files(), Error);
}

TEST_F(ReaderTest, AFileLargerThanTheLimitIsRefusedBeforeReadingIt) {
  const std::string path = (fs::path(dir) / kManifestName).string();
  EXPECT_NO_THROW(read_regular_file(path, fs::file_size(path), "manifest"));
  try {
    read_regular_file(path, fs::file_size(path) - 1, "manifest");
    ADD_FAILURE() << "read a file past its limit";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than the"), std::string::npos) << e.what();
  }
}

TEST_F(ReaderTest, AHugeDimensionCountIsRefusedBeforeAllocating) {
  write_edited_manifest("tensor 0 100 2 10 10 a", "tensor 0 100 4611686018427387904 10 10 a");
  expect_refused("more dimensions than the line holds");
}

TEST_F(ReaderTest, AHugeChunkCountIsRefusedBeforeAllocating) {
  write_edited_manifest("file rank0.master.bin 244 4 ", "file rank0.master.bin 244 1152921504606846976 ");
  expect_refused("checksum count that does not fit its size");
}

TEST_F(ReaderTest, AHugeChunkSizeIsRefused) {
  // A consistent manifest (each file one chunk, its checksum right) whose chunk a reader would
  // hold in memory: 2^62 bytes, which verify_all allocated before the size was limited.
  m.chunk_bytes = std::uint64_t{1} << 62;
  for (RankEntry& rank : m.ranks)
    for (StateFile& file : rank.files) {
      std::ifstream in(fs::path(dir) / file.name, std::ios::binary);
      const std::string bytes(std::istreambuf_iterator<char>(in), {});
      file.chunk_crcs = {offload::crc32c(bytes.data(), bytes.size())};
    }
  write_manifest();
  expect_refused("a chunk size of 4611686018427387904 bytes");
}

TEST_F(ReaderTest, AShapeWhoseProductOverflowsIsRefused) {
  // 2 * (2^63 + 50) wraps to 100, the element count: accepted, and written into safetensors
  // headers, before the product was checked.
  write_edited_manifest("tensor 0 100 2 10 10 a", "tensor 0 100 2 2 9223372036854775858 a");
  expect_refused("overflows 64-bit byte sizes");
}

TEST_F(ReaderTest, ElementCountsWhoseBytesOverflowAreRefused) {
  // 2^62 elements: the count fits 64 bits, its fp32 bytes do not.
  write_edited_manifest("tensor 1 37 1 37 b", "tensor 1 4611686018427387904 1 4611686018427387904 b");
  expect_refused("overflows 64-bit byte sizes");
}

// Resealed with a valid checksum, a manifest whose fields mean nothing a saving engine writes is
// refused before any training, naming the field and the value (each was loaded before).
TEST_F(ReaderTest, OutOfRangeFieldsAreRefusedByNameDespiteAValidChecksum) {
  m.stage = 3;
  m.steps = 7;
  m.skipped = 1;
  m.loss_scale = 256;
  const auto edited = [&](const std::string& from, const std::string& to, const std::string& expected) {
    write_edited_manifest(from, to);
    expect_refused(expected);
  };
  edited("stage 3", "stage 9", "stage 9 is out of range (0 to 3)");
  edited("steps 7", "steps -5", "steps -5 is out of range");
  edited("skipped 1", "skipped 8", "skipped 8 is out of range (0 to steps)");
  edited("loss_scaler 0x1p+8 0 0", "loss_scaler nan 0 0", "loss scale nan is out of range");
  edited("loss_scaler 0x1p+8 0 0", "loss_scaler 0x1p+8 0 -1", "loss scaler hysteresis -1 is out of range");
  edited("file rank0.m.bin", "file rank0.master.bin",
         "rank 0's file 'rank0.master.bin' where its own 'rank0.m.bin' belongs");
  edited("file rank1.v.bin", "file rank0.v.bin", "rank 1's file 'rank0.v.bin' where its own 'rank1.v.bin' belongs");
  edited("tensor 1 37 1 37 b", "tensor -1 37 1 37 b", "tensor group -1 is out of range");
}

TEST_F(ReaderTest, AWorldSizeBelowOneIsRefused) {
  write_edited_manifest("world_size 2", "world_size -1");
  expect_refused("a world size below 1");
}

TEST(SafetensorsHeader, RefusesShapesThatDoNotMultiplyToTheirCountOrOverflow) {
  Manifest m;
  m.tensors = {{"a", {2, 9223372036854775858ull}, 0, 100}};
  EXPECT_THROW(safetensors_header(m, DType::f32, "ckpt"), Error);
  m.tensors = {{"a", {3, 3}, 0, 10}};
  EXPECT_THROW(safetensors_header(m, DType::f32, "ckpt"), Error);
  m.tensors = {{"a", {4611686018427387904ull}, 0, 4611686018427387904ull}};
  EXPECT_THROW(safetensors_header(m, DType::f32, "ckpt"), Error);  // 2^64 bytes
  m.tensors = {{"a", {3, 3}, 0, 9}};
  const std::string header = safetensors_header(m, DType::bf16, "ckpt");
  EXPECT_EQ(header.rfind(kZestHeaderStart, 0), 0u) << header;
  EXPECT_EQ(header.size() % 8, 0u);
  EXPECT_NE(header.find(R"("a":{"dtype":"BF16","shape":[3,3],"data_offsets":[0,18]})"), std::string::npos) << header;
}

}  // namespace
}  // namespace zest::checkpoint
