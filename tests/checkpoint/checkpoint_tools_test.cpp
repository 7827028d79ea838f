// zest/checkpoint.hpp under mpirun with 1 and 4 ranks: a checkpoint saved by a stage-3 Engine
// (tensors split over the ranks) consolidates into a safetensors file whose every tensor holds
// exactly the engine's fp32 master weights (f32), or their round-to-nearest-even bf16/f16; the
// manifest summary and the checksums report what was saved; a flipped byte is reported naming the
// file and the chunk, and makes consolidation fail leaving nothing at OUT. Synthetic checkpoints
// (written through the format's writer, rank 0 only) add what an engine cannot make quickly:
// chunks of a few bytes, values straddling chunks and ranks, names JSON must escape, a full disk.
#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint/synthetic_checkpoint.hpp"
#include "engine/reference_training.hpp"
#include "engine/shared_dir.hpp"
#include "runtime/host/half.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/checkpoint.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace reference_training;
namespace fs = std::filesystem;

using test::rank;
using test::SharedDir;

int world() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void flip_byte(const std::string& path, std::uint64_t offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(static_cast<std::streamoff>(offset));
  const char c = static_cast<char>(file.get() ^ 0x20);
  file.seekp(static_cast<std::streamoff>(offset));
  file.put(c);
}

// Nothing but `keep` in `dir`: no OUT, no OUT.tmp-<pid> left by a failed consolidation.
std::vector<std::string> entries_except(const std::string& dir, const std::string& keep) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != keep) names.push_back(e.path().filename().string());
  return names;
}

std::string shape_json(const std::vector<std::size_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text.append(i ? "," : "").append(std::to_string(shape[i]));
  return text.append("]");
}

// A safetensors file as this test expects consolidate to lay it out: tensors in checkpoint order,
// contiguous from data offset 0.
struct Safetensors {
  std::string header;  // the JSON, padding included
  std::string data;    // everything after it
};

Safetensors parse_layout(const std::string& bytes) {
  Safetensors s;
  std::uint64_t n = 0;
  if (bytes.size() < 8) return s;
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8) return s;
  s.header = bytes.substr(8, n);
  s.data = bytes.substr(8 + n);
  return s;
}

// Checks the header entry of each tensor and returns its bytes, as consolidate in `dtype` must
// have placed them.
std::vector<std::string> tensor_bytes(const Safetensors& file, const std::vector<ParamSpec>& specs,
                                      const std::vector<std::string>& json_names, const char* dtype,
                                      std::size_t width) {
  EXPECT_EQ(file.header.size() % 8, 0u);
  EXPECT_EQ(file.header.rfind("{\"__metadata__\":{\"format\":\"pt\",", 0), 0u) << file.header;
  std::vector<std::string> out;
  std::size_t offset = 0;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const std::size_t end = offset + specs[t].numel() * width;
    const std::string entry = json_names[t] + ":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape_json(specs[t].shape) +
                              ",\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    EXPECT_NE(file.header.find(entry), std::string::npos) << entry << " not in " << file.header;
    out.push_back(file.data.substr(offset, end - offset));
    offset = end;
  }
  EXPECT_EQ(file.data.size(), offset) << "data after the last tensor";
  return out;
}

std::vector<std::string> quoted(const std::vector<ParamSpec>& specs) {
  std::vector<std::string> names;
  for (const ParamSpec& s : specs) names.push_back("\"" + s.name + "\"");
  return names;
}

// Empty when equal, else where the first difference is, for the failure message.
std::string difference(const std::string& got, const std::string& want, std::size_t width) {
  if (got == want) return "";
  if (got.size() != want.size()) return std::to_string(got.size()) + " bytes, expected " + std::to_string(want.size());
  std::size_t i = 0;
  while (got[i] == want[i]) ++i;
  const std::size_t element = i / width;
  auto hex = [&](const std::string& bytes) {
    std::string text = "0x";
    for (std::size_t b = width; b-- > 0;) {  // little-endian: the last byte is the most significant
      char digits[3];
      std::snprintf(digits, sizeof digits, "%02x", static_cast<unsigned char>(bytes[element * width + b]));
      text += digits;
    }
    return text;
  };
  return "element " + std::to_string(element) + " of " + std::to_string(got.size() / width) + " is " + hex(got) +
         ", expected " + hex(want);
}

// `values` as `dtype` would hold them (half.hpp's round to nearest even), as bytes.
std::string encoded(const std::vector<float>& values, DType dtype) {
  std::string bytes(values.size() * dtype_size(dtype), '\0');
  for (std::size_t i = 0; i < values.size(); ++i) store_from_float(bytes.data(), dtype, i, values[i]);
  return bytes;
}

// Each tensor's bytes are `values` encoded as `dtype`.
void expect_encoded(const std::vector<std::string>& got, const std::vector<std::vector<float>>& values, DType dtype) {
  ASSERT_EQ(got.size(), values.size());
  for (std::size_t t = 0; t < got.size(); ++t)
    EXPECT_EQ(difference(got[t], encoded(values[t], dtype), dtype_size(dtype)), "") << "tensor " << t;
}

// Values bf16 must round to nearest even: halfway cases both ways, a subnormal, -0, large and small.
std::vector<float> awkward_values(std::size_t n) {
  const float cycle[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f), 1e-40f, -0.0f, 3.0e38f, 65519.0f,
                         1.0f / 3.0f, -2.71828f, 0x1.fffffep-1f};
  std::vector<float> values(n);
  for (std::size_t j = 0; j < n; ++j)
    values[j] = j < std::size(cycle) ? cycle[j] : std::sin(0.1f * static_cast<float>(j));
  return values;
}

// A stage-3 engine trained two steps, its first tensor then set to awkward_values, saved; params
// holds what Engine::get_param returned after the save. Shared by every test of this suite.
class FromEngine : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new SharedDir;
    MpiSession session;
    const std::unique_ptr<Device> device = make_cpu_device(std::size_t{256} << 20);
    const std::unique_ptr<Communicator> comm = make_mpi_communicator(session, *device);
    Options o;
    o.stage = 3;
    Engine engine(make_config(o), *device, *comm, model());
    for (std::size_t t = 0; t < engine.tensor_count(); ++t) {
      std::vector<float> values(engine.spec(t).numel());
      for (std::size_t j = 0; j < values.size(); ++j) values[j] = static_cast<float>(initial(t, j));
      engine.set_param(t, values);
    }
    for (int step = 1; step <= 2; ++step) train_one_step(engine, step, *comm);
    engine.set_param(0, awkward_values(engine.spec(0).numel()));
    engine.save(checkpoint());
    params_ = new std::vector<std::vector<float>>;
    for (std::size_t t = 0; t < engine.tensor_count(); ++t) {
      params_->emplace_back(engine.spec(t).numel());
      engine.get_param(t, params_->back());
    }
  }
  static void TearDownTestSuite() {
    delete params_;
    delete dir_;
  }

  // Every rank's share of the reference model's gradient for `step`, then the step.
  static void train_one_step(Engine& engine, int step, Communicator& comm) {
    const std::vector<ParamSpec> specs = model();
    const int first = comm.rank() * kExamples / comm.size(), last = (comm.rank() + 1) * kExamples / comm.size();
    for (int g = 0; g < engine.group_count(); ++g) auto forward = engine.acquire(g);
    for (int g = engine.group_count() - 1; g >= 0; --g) {
      auto lease = engine.acquire(g);
      for (std::size_t t = 0; t < specs.size(); ++t) {
        if (specs[t].group != g) continue;
        const float* p = static_cast<const float*>(lease.param(t).data);
        float* grad = static_cast<float*>(lease.grad(t).data);
        for (std::size_t j = 0; j < specs[t].numel(); ++j)
          grad[j] = static_cast<float>(partial_grad(p[j], step, first, last, t, j));
      }
      engine.grads_ready(g);
    }
    engine.step();
  }

  static std::string checkpoint() { return dir_->path() + "/ckpt"; }
  // Rank 0 checks; the others wait for it, so the directory outlives the checks.
  void TearDown() override { MPI_Barrier(MPI_COMM_WORLD); }

  // Consolidates the checkpoint (rank 0) and returns each tensor's bytes.
  std::vector<std::string> consolidated(const std::string& from, DType dtype, const char* name) {
    const std::string out = dir_->path() + "/weights.safetensors";
    consolidate_checkpoint(from, out, dtype);
    return tensor_bytes(parse_layout(read_file(out)), model(), quoted(model()), name, dtype_size(dtype));
  }

  static inline SharedDir* dir_ = nullptr;
  static inline std::vector<std::vector<float>>* params_ = nullptr;
};

// get_param assembles a tensor sharded over ranks without losing a -0's sign (or any other bit).
TEST_F(FromEngine, GetParamReturnsExactlyWhatSetParamGave) {
  const auto given = awkward_values(params_->front().size());
  EXPECT_EQ(0, std::memcmp(given.data(), params_->front().data(), given.size() * sizeof(float)));
}

TEST_F(FromEngine, F32IsExactlyTheEngineWeights) {
  if (rank() != 0) return;
  const auto got = consolidated(checkpoint(), DType::f32, "F32");
  expect_encoded(got, (*params_), DType::f32);
}

TEST_F(FromEngine, Bf16IsTheWeightsRoundedToNearestEven) {
  if (rank() != 0) return;
  const auto got = consolidated(checkpoint(), DType::bf16, "BF16");
  expect_encoded(got, (*params_), DType::bf16);
  // The halfway cases by hand, not by half.hpp: 1 + 2^-8 rounds down to 1.0, 1 + 3 * 2^-8 up to
  // 1 + 2^-6 (both to the even neighbour); a truncating conversion gives 0x3f81 for the second.
  std::uint16_t first[5];
  std::memcpy(first, got[0].data(), sizeof first);
  EXPECT_EQ(first[0], 0x3f80);
  EXPECT_EQ(first[1], 0x3f82);
  EXPECT_EQ(first[2], 0xbf80);
  EXPECT_EQ(first[4], 0x8000);  // -0 keeps its sign
}

TEST_F(FromEngine, F16IsTheWeightsRoundedToNearestEven) {
  if (rank() != 0) return;
  const auto got = consolidated(checkpoint(), DType::f16, "F16");
  expect_encoded(got, (*params_), DType::f16);
}

TEST_F(FromEngine, InfoDescribesTheSavingRun) {
  if (rank() != 0) return;
  const CheckpointInfo info = read_checkpoint_info(checkpoint());
  EXPECT_EQ(info.format_version, 4);
  EXPECT_EQ(info.states, StatesFormat::f32);
  EXPECT_EQ(info.world_size, world());
  EXPECT_EQ(info.stage, 3);
  EXPECT_EQ(info.steps, 2);
  EXPECT_EQ(info.skipped_steps, 0);
  EXPECT_EQ(info.chunk_bytes, std::uint64_t{4} << 20);
  EXPECT_NE(info.config.find("stage=3"), std::string::npos) << info.config;
  const std::vector<ParamSpec> specs = model();
  ASSERT_EQ(info.tensors.size(), specs.size());
  std::size_t values = 0;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    EXPECT_EQ(info.tensors[t].name, specs[t].name);
    EXPECT_EQ(info.tensors[t].shape, specs[t].shape);
    EXPECT_EQ(info.tensors[t].group, specs[t].group);
    values += specs[t].numel();
  }
  ASSERT_EQ(info.files.size(), static_cast<std::size_t>(3 * world()));
  std::uint64_t bytes = 0;
  for (const CheckpointFileInfo& f : info.files) {
    EXPECT_TRUE(fs::exists(checkpoint() + "/" + f.name)) << f.name;
    EXPECT_EQ(fs::file_size(checkpoint() + "/" + f.name), f.bytes) << f.name;
    // Stage 3 gives every rank a share: a small model's share fits one 4 MiB chunk.
    EXPECT_GT(f.bytes, 0u) << f.name;
    EXPECT_EQ(f.chunks, 1u) << f.name;
    bytes += f.bytes;
  }
  EXPECT_EQ(info.files[0].name, "rank0.master.bin");
  EXPECT_EQ(info.files[2].name, "rank0.v.bin");
  EXPECT_EQ(bytes, 3 * values * sizeof(float));  // master, m and v of every value, once
}

TEST_F(FromEngine, AFlippedByteIsReportedByFileAndChunk) {
  if (rank() != 0) return;
  EXPECT_TRUE(verify_checkpoint(checkpoint()).empty());
  const std::string bad = dir_->path() + "/bad", out = dir_->path() + "/out/w.safetensors";
  fs::create_directories(dir_->path() + "/out");
  fs::copy(checkpoint(), bad);
  const std::string master = bad + "/rank" + std::to_string(world() - 1) + ".master.bin";
  flip_byte(master, fs::file_size(master) - 3);

  const std::vector<std::string> problems = verify_checkpoint(bad);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find(master), std::string::npos) << problems[0];
  EXPECT_NE(problems[0].find("chunk 0"), std::string::npos) << problems[0];
  try {
    consolidate_checkpoint(bad, out, DType::f32);
    ADD_FAILURE() << "consolidated a damaged checkpoint";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(master + " chunk 0"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(entries_except(dir_->path() + "/out", "").empty()) << "a failed consolidation left a file";
}

TEST_F(FromEngine, DamagedMomentsDoNotStopTheWeights) {
  if (rank() != 0) return;
  const std::string bad = dir_->path() + "/bad-m";
  fs::copy(checkpoint(), bad);
  flip_byte(bad + "/rank0.m.bin", 0);
  const std::vector<std::string> problems = verify_checkpoint(bad);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find(bad + "/rank0.m.bin chunk 0"), std::string::npos) << problems[0];
  const auto got = consolidated(bad, DType::f32, "F32");  // reads only the master weights
  expect_encoded(got, (*params_), DType::f32);
}

// --- synthetic checkpoints (no engine; rank 0 only)

class Synthetic : public testing::Test {
 protected:
  void SetUp() override {
    if (rank() != 0) GTEST_SKIP() << "rank 0 only";
    char name[] = "/tmp/zest-synthetic-checkpoint-XXXXXX";
    ASSERT_NE(::mkdtemp(name), nullptr);
    dir = name;
  }
  void TearDown() override {
    if (!dir.empty()) fs::remove_all(dir);
  }
  std::vector<std::vector<float>> values_of(const std::vector<ParamSpec>& specs) const {
    std::vector<std::vector<float>> values;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      values.emplace_back(specs[t].numel());
      for (std::size_t j = 0; j < values.back().size(); ++j) values.back()[j] = synthetic_checkpoint::value(t, j);
    }
    return values;
  }
  std::string dir;
};

TEST_F(Synthetic, ChunksOfTenBytesAndThreeRanksReadBack) {
  // 10-byte chunks: most values straddle two chunks, and tensors straddle ranks.
  const std::vector<ParamSpec> specs = {
      {"a", {7, 3}, 0}, {"b \"quoted\" \\ tab\t", {5}, 1}, {"s", {}, 2}, {"c", {40}, 3}};
  synthetic_checkpoint::write(dir + "/ckpt", specs, 3, 10);
  EXPECT_TRUE(verify_checkpoint(dir + "/ckpt").empty());
  consolidate_checkpoint(dir + "/ckpt", dir + "/w.safetensors", DType::bf16);
  const std::vector<std::string> names = {"\"a\"", "\"b \\\"quoted\\\" \\\\ tab\\t\"", "\"s\"", "\"c\""};
  const auto got = tensor_bytes(parse_layout(read_file(dir + "/w.safetensors")), specs, names, "BF16", 2);
  const auto want = values_of(specs);
  expect_encoded(got, want, DType::bf16);
}

TEST_F(Synthetic, ConsolidationReplacesAFileZestWrote) {
  const std::vector<ParamSpec> specs = {{"w", {1000}, 0}};
  synthetic_checkpoint::write(dir + "/ckpt", specs, 2, 64);
  consolidate_checkpoint(dir + "/ckpt", dir + "/w.safetensors", DType::bf16);
  consolidate_checkpoint(dir + "/ckpt", dir + "/w.safetensors", DType::f32);
  const auto got = tensor_bytes(parse_layout(read_file(dir + "/w.safetensors")), specs, {"\"w\""}, "F32", 4);
  EXPECT_TRUE(got[0] == encoded(values_of(specs)[0], DType::f32));
}

// zest never overwrites what it did not write: another program's file at OUT is refused, before
// any work, and left as it was.
TEST_F(Synthetic, ConsolidationRefusesAFileZestDidNotWrite) {
  synthetic_checkpoint::write(dir + "/ckpt", {{"w", {1000}, 0}}, 2, 64);
  std::ofstream(dir + "/w.safetensors") << "an older file";
  try {
    consolidate_checkpoint(dir + "/ckpt", dir + "/w.safetensors", DType::f32);
    ADD_FAILURE() << "replaced a file zest did not write";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exists and is not a safetensors file written by zest"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read_file(dir + "/w.safetensors"), "an older file");
  EXPECT_EQ(entries_except(dir, "ckpt"), std::vector<std::string>{"w.safetensors"});
}

TEST_F(Synthetic, ADamagedChunkIsNamedAndOutIsLeftAsItWas) {
  synthetic_checkpoint::write(dir + "/ckpt", {{"w", {1000}, 0}}, 2, 64);
  const std::string master = dir + "/ckpt/rank1.master.bin";
  flip_byte(master, 3 * 64 + 5);
  const auto problems = verify_checkpoint(dir + "/ckpt");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find(master + " chunk 3 (bytes 192 to 256)"), std::string::npos) << problems[0];
  synthetic_checkpoint::write(dir + "/older", {{"w", {1000}, 0}}, 1, 64);
  consolidate_checkpoint(dir + "/older", dir + "/w.safetensors", DType::bf16);  // an older file zest wrote
  const std::string older = read_file(dir + "/w.safetensors");
  fs::remove_all(dir + "/older");
  EXPECT_THROW(consolidate_checkpoint(dir + "/ckpt", dir + "/w.safetensors", DType::f32), Error);
  EXPECT_EQ(read_file(dir + "/w.safetensors"), older);  // left as it was
  EXPECT_EQ(entries_except(dir, "ckpt"), std::vector<std::string>{"w.safetensors"});  // and no temporary file
}

TEST_F(Synthetic, ATruncatedFileIsRefusedBeforeWriting) {
  synthetic_checkpoint::write(dir + "/ckpt", {{"w", {1000}, 0}}, 2, 64);
  fs::resize_file(dir + "/ckpt/rank1.master.bin", 100);
  const auto problems = verify_checkpoint(dir + "/ckpt");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("rank1.master.bin: 100 bytes, the manifest says 2000"), std::string::npos) << problems[0];
  try {
    consolidate_checkpoint(dir + "/ckpt", dir + "/w.safetensors", DType::f32);
    ADD_FAILURE() << "consolidated a truncated checkpoint";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank1.master.bin has 100 bytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries_except(dir, "ckpt"), std::vector<std::string>{});
}

// A full disk as the file-size limit makes it: write() fails part way (EFBIG). The error names OUT
// and what to do, and neither OUT nor its temporary file is left.
TEST_F(Synthetic, AFailedWriteLeavesNothing) {
  synthetic_checkpoint::write(dir + "/ckpt", {{"w", {100000}, 0}}, 1);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit limit = old;
  limit.rlim_cur = 64 << 10;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // else the signal kills the process
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  std::string message;
  try {
    consolidate_checkpoint(dir + "/ckpt", dir + "/w.safetensors", DType::f32);
  } catch (const IoError& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(message.find("cannot write " + dir + "/w.safetensors (free space"), std::string::npos) << message;
  EXPECT_NE(message.find("File too large"), std::string::npos) << message;
  EXPECT_EQ(entries_except(dir, "ckpt"), std::vector<std::string>{});
}

TEST_F(Synthetic, NamesSafetensorsCannotHoldAreRefused) {
  synthetic_checkpoint::write(dir + "/reserved", {{"w", {4}, 0}, {"__metadata__", {4}, 1}}, 1);
  synthetic_checkpoint::write(dir + "/twice", {{"w", {4}, 0}, {"w", {4}, 1}}, 1);
  synthetic_checkpoint::write(dir + "/latin1", {{"w", {4}, 0}, {"caf\xe9", {4}, 1}}, 1);  // not UTF-8
  // A name the Engine would not take (issue 34: it once did) is refused as the manifest is read.
  const std::pair<const char*, const char*> cases[] = {
      {"reserved", "a tensor name that is safetensors' reserved key __metadata__"},
      {"twice", "a safetensors file cannot hold it"},
      {"latin1", "a tensor name that is not UTF-8 text"},
  };
  for (const auto& [which, expected] : cases) {
    try {
      consolidate_checkpoint(dir + "/" + which, dir + "/w.safetensors", DType::f32);
      ADD_FAILURE() << which;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(dir + "/w.safetensors"));
}

TEST_F(Synthetic, NoCheckpointIsAnIoErrorNamingTheManifest) {
  EXPECT_THROW(read_checkpoint_info(dir + "/none"), IoError);
  try {
    consolidate_checkpoint(dir + "/none", dir + "/w.safetensors", DType::f32);
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_EQ(e.path(), dir + "/none/manifest");
  }
  EXPECT_FALSE(fs::exists(dir + "/w.safetensors"));
}

}  // namespace
}  // namespace zest
