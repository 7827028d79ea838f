// Engine::save/load under mpirun with 1, 2 and 4 ranks: training interrupted by a checkpoint and
// resumed in a fresh engine ends with exactly the bits of uninterrupted training (every stage,
// fp16 loss scaling with a skipped step, offloaded optimizer states); a checkpoint loads into
// another stage (3 -> 2 -> 0), and one saved with part of the optimizer offloaded into engines that
// offload all of it or none, and training goes on to the uninterrupted values; and every damaged
// checkpoint is refused with an error naming the problem, leaving the engine as it was. A save
// never deletes or overwrites what zest did not create: it refuses a target that is not a zest
// checkpoint (or holds files zest did not write), saying what is there, and leaves it as it was.
#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <limits>
#include <string>
#include <vector>

#include "checkpoint/reader.hpp"
#include "engine/reference_training.hpp"
#include "engine/shared_dir.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace reference_training;
namespace fs = std::filesystem;

constexpr int kSteps = 8;

using test::rank;
using test::SharedDir;

// Steps [first, last] of the reference model's training on an existing engine (cpu: in place).
void train_steps(Engine& engine, const Options& o, int first, int last, Communicator& comm) {
  const std::vector<ParamSpec> specs = model();
  const int ranks = comm.size(), me = comm.rank();
  const int per_micro = kExamples / o.accumulation;
  for (int step = first; step <= last; ++step) {
    for (int micro = 0; micro < o.accumulation; ++micro) {
      const int base = micro * per_micro;
      const int lo = base + me * per_micro / ranks, hi = base + (me + 1) * per_micro / ranks;
      for (int g = 0; g < engine.group_count(); ++g) auto forward = engine.acquire(g);
      for (int g = engine.group_count() - 1; g >= 0; --g) {
        auto lease = engine.acquire(g);
        for (std::size_t t = 0; t < specs.size(); ++t) {
          if (specs[t].group != g) continue;
          const void* p = lease.param(t).data;
          void* grad = lease.grad(t).data;
          for (std::size_t j = 0; j < specs[t].numel(); ++j) {
            double value = partial_grad(load_as_float(p, o.dtype, j), step, lo, hi, t, j) * engine.loss_scale();
            if (step == o.overflow_at_step && me == ranks - 1 && t == 0 && j == 0)
              value = std::numeric_limits<double>::infinity();
            store_from_float(grad, o.dtype, j, static_cast<float>(value));
          }
        }
        engine.grads_ready(g);
      }
    }
    engine.step();
  }
}

void set_initial(Engine& engine) {
  for (std::size_t t = 0; t < engine.tensor_count(); ++t) {
    std::vector<float> values(engine.spec(t).numel());
    for (std::size_t j = 0; j < values.size(); ++j) values[j] = static_cast<float>(initial(t, j));
    engine.set_param(t, values);
  }
}

struct TrainedRun {
  std::vector<std::vector<float>> params;
  EngineStats stats;
};

void expect_same_bits(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t t = 0; t < want.size(); ++t) {
    ASSERT_EQ(got[t].size(), want[t].size()) << "tensor " << t;
    EXPECT_EQ(0, std::memcmp(got[t].data(), want[t].data(), want[t].size() * sizeof(float))) << "tensor " << t;
  }
}

class Fixture : public testing::Test {
 protected:
  MpiSession session;
  std::unique_ptr<Device> device = make_cpu_device(std::size_t{256} << 20);
  std::unique_ptr<Communicator> comm = make_mpi_communicator(session, *device);

  TrainedRun uninterrupted(const Options& o, int steps = kSteps) {
    Engine engine(make_config(o), *device, *comm, model());
    set_initial(engine);
    train_steps(engine, o, 1, steps, *comm);
    return {params_of(engine), engine.stats()};
  }
};

struct Case {
  const char* name;
  int stage;
  DType dtype;
  int overflow_at_step;
  OffloadDevice offload;
  OffloadDevice offload_param = OffloadDevice::none;
  StatesFormat states = StatesFormat::f32;
  DType master = DType::f32;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class SameWorld : public Fixture, public testing::WithParamInterface<Case> {};

TEST_P(SameWorld, ResumedTrainingIsBitIdenticalToUninterrupted) {
  const Case c = GetParam();
  Options o;
  o.stage = c.stage;
  o.dtype = c.dtype;
  o.overflow_at_step = c.overflow_at_step;
  o.offload_optimizer = c.offload;
  o.offload_param = c.offload_param;
  o.states = c.states;
  o.master = c.master;
  SharedDir swap;
  if (c.offload == OffloadDevice::nvme || c.offload_param == OffloadDevice::nvme) {
    o.nvme_path = swap.path();
    o.sub_group_bytes = 12 * 128;  // many sub-groups: ranges cross them, sub-groups hold several ranges
  }
  const TrainedRun want = uninterrupted(o);
  SharedDir dir;
  const std::string checkpoint = dir.path() + "/ckpt";
  {
    Engine first(make_config(o), *device, *comm, model());
    set_initial(first);
    train_steps(first, o, 1, 3, *comm);
    first.save(checkpoint);
    train_steps(first, o, 4, 4, *comm);
    first.save(checkpoint);  // over an existing checkpoint
  }
  Engine resumed(make_config(o), *device, *comm, model());
  resumed.load(checkpoint);
  EXPECT_EQ(resumed.stats().steps, 4);
  train_steps(resumed, o, 5, kSteps, *comm);
  const TrainedRun got{params_of(resumed), resumed.stats()};
  expect_same_bits(got.params, want.params);
  EXPECT_EQ(got.stats.steps, want.stats.steps);
  EXPECT_EQ(got.stats.skipped_steps, want.stats.skipped_steps);
  EXPECT_EQ(got.stats.loss_scale, want.stats.loss_scale);
  // Only the checkpoint itself is left: no temporary or set-aside directory.
  if (rank() == 0) {
    int entries = 0;
    for (const auto& e : fs::directory_iterator(dir.path())) entries += e.path().filename() == "ckpt" ? 0 : 1;
    EXPECT_EQ(entries, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoint, SameWorld,
    testing::Values(Case{"stage0", 0, DType::f32, -1, OffloadDevice::none},
                    Case{"stage1", 1, DType::f32, -1, OffloadDevice::none},
                    Case{"stage2", 2, DType::f32, -1, OffloadDevice::none},
                    Case{"stage3", 3, DType::f32, -1, OffloadDevice::none},
                    // The loss scaler halves at step 2 and must resume from there, not from its start.
                    Case{"stage2_fp16_skipped_step", 2, DType::f16, 2, OffloadDevice::none},
                    Case{"stage3_bf16", 3, DType::bf16, -1, OffloadDevice::none},
                    Case{"stage2_cpu_offload", 2, DType::f32, -1, OffloadDevice::cpu},
                    Case{"stage3_cpu_offload", 3, DType::f32, -1, OffloadDevice::cpu},
                    // States saved from and loaded into the NVMe swap files through pinned host memory.
                    Case{"stage2_nvme_offload", 2, DType::f32, -1, OffloadDevice::nvme},
                    Case{"stage3_bf16_nvme_offload_params_too", 3, DType::bf16, -1, OffloadDevice::nvme,
                         OffloadDevice::nvme},
                    // Compact states widen to fp32 in the checkpoint and narrow back to the same bits.
                    Case{"stage0_bf16_states", 0, DType::f32, -1, OffloadDevice::none, OffloadDevice::none,
                         StatesFormat::bf16},
                    Case{"stage2_int8_states_cpu_offload", 2, DType::f32, -1, OffloadDevice::cpu,
                         OffloadDevice::none, StatesFormat::int8},
                    Case{"stage3_bf16_states_nvme_offload", 3, DType::bf16, -1, OffloadDevice::nvme,
                         OffloadDevice::none, StatesFormat::bf16},
                    Case{"stage1_int8_states", 1, DType::f32, -1, OffloadDevice::none, OffloadDevice::none,
                         StatesFormat::int8},
                    // A bf16 master is saved widened to fp32 and rounded back to itself.
                    Case{"stage2_int8_states_bf16_master_nvme_offload", 2, DType::bf16, -1, OffloadDevice::nvme,
                         OffloadDevice::none, StatesFormat::int8, DType::bf16},
                    Case{"stage3_bf16_states_bf16_master", 3, DType::bf16, -1, OffloadDevice::none,
                         OffloadDevice::none, StatesFormat::bf16, DType::bf16}),
    [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A checkpoint does not record where the optimizer states lived: one saved with half of them
// offloaded (the boundary inside a group) loads into an engine that offloads them all, and into one
// that offloads none, and both go on to the bits of uninterrupted training.
TEST_F(Fixture, PartialOffloadLoadsWithEveryStateOffloadedOrNone) {
  for (const OffloadDevice where : {OffloadDevice::cpu, OffloadDevice::nvme}) {
    for (const int stage : {2, 3}) {
      SCOPED_TRACE(std::string(where == OffloadDevice::cpu ? "cpu" : "nvme") + ", stage " + std::to_string(stage));
      SharedDir swap, dir;
      Options o;
      o.stage = stage;
      o.offload_optimizer = where;
      o.offload_ratio = 0.5;
      o.nvme_path = swap.path();
      o.sub_group_bytes = 12 * 128;
      const TrainedRun want = uninterrupted(o);
      const std::string checkpoint = dir.path() + "/ckpt";
      {
        Engine first(make_config(o), *device, *comm, model());
        set_initial(first);
        train_steps(first, o, 1, 3, *comm);
        first.save(checkpoint);
      }
      Options all = o, none = o;
      all.offload_ratio = 1;
      none.offload_optimizer = OffloadDevice::none;
      none.offload_ratio = 1;
      for (const Options& next : {all, none}) {
        Engine resumed(make_config(next), *device, *comm, model());
        EXPECT_TRUE(resumed.load(checkpoint).config_changes.empty());
        train_steps(resumed, next, 4, kSteps, *comm);
        expect_same_bits(params_of(resumed), want.params);
      }
    }
  }
}

TEST_F(Fixture, LoadsIntoAnotherStage3To2To0) {
  Options o;
  o.stage = 3;
  const TrainedRun want = uninterrupted(o);
  SharedDir dir;
  {
    Engine engine(make_config(o), *device, *comm, model());
    set_initial(engine);
    train_steps(engine, o, 1, 3, *comm);
    engine.save(dir.path() + "/a");
  }
  {
    Options two = o;
    two.stage = 2;
    Engine engine(make_config(two), *device, *comm, model());
    engine.load(dir.path() + "/a");
    train_steps(engine, two, 4, 5, *comm);
    engine.save(dir.path() + "/b");
  }
  Options zero = o;
  zero.stage = 0;
  Engine engine(make_config(zero), *device, *comm, model());
  engine.load(dir.path() + "/b");
  train_steps(engine, zero, 6, kSteps, *comm);
  const auto got = params_of(engine);
  double worst = 0;
  for (std::size_t t = 0; t < got.size(); ++t)
    for (std::size_t j = 0; j < got[t].size(); ++j)
      worst = std::max(
          worst, std::abs(double(got[t][j]) - want.params[t][j]) / std::max(1.0, std::abs(double(want.params[t][j]))));
  EXPECT_LT(worst, 1e-6);
  EXPECT_EQ(engine.stats().steps, kSteps);
}

// Compact states are saved compact (bf16: 2 bytes per value; int8: a byte per value and a scale per
// 64 of each range) and reshard exactly: a checkpoint of int8 states saved at stage 3, loaded at
// stage 0 (other ranges per rank, another layout of the shard) and saved again holds the same m
// and v, value for value, and both load into a run with bf16 states.
TEST_F(Fixture, CompactStatesAreSavedCompactAndReshardExactly) {
  for (const StatesFormat states : {StatesFormat::bf16, StatesFormat::int8}) {
    SCOPED_TRACE(states_format_name(states));
    Options o;
    o.stage = 3;
    o.states = states;
    SharedDir dir;
    const std::string a = dir.path() + "/a", b = dir.path() + "/b";
    {
      Engine engine(make_config(o), *device, *comm, model());
      set_initial(engine);
      train_steps(engine, o, 1, 3, *comm);
      engine.save(a);
    }
    Options zero = o;
    zero.stage = 0;
    {
      Engine engine(make_config(zero), *device, *comm, model());
      EXPECT_EQ(engine.load(a).config_changes.size(), 1u);  // the stage
      engine.save(b);
    }
    checkpoint::Reader first(a), second(b);
    EXPECT_EQ(first.manifest().states, states);
    for (const checkpoint::RankEntry& rank : first.manifest().ranks) {
      std::uint64_t elements = 0, blocks = 0;
      for (const checkpoint::Range& r : rank.ranges) {
        elements += r.hi - r.lo;
        blocks += (r.hi - r.lo + 63) / 64;
      }
      const std::uint64_t want = states == StatesFormat::bf16 ? 2 * elements : elements + 4 * blocks;
      EXPECT_EQ(rank.files[1].bytes, want);
      EXPECT_EQ(rank.files[2].bytes, want);
      EXPECT_EQ(rank.files[0].bytes, 4 * elements);
    }
    const auto specs = model();
    bool nonzero = false;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      for (const auto kind : {checkpoint::StateKind::m, checkpoint::StateKind::v}) {
        std::vector<float> x(specs[t].numel()), y(specs[t].numel());
        first.read(kind, t, 0, x.size(), x.data());
        second.read(kind, t, 0, y.size(), y.data());
        EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float))) << specs[t].name;
        nonzero = nonzero || std::any_of(x.begin(), x.end(), [](float e) { return e != 0; });
      }
    }
    EXPECT_TRUE(nonzero);
    Options other = o;
    other.states = states == StatesFormat::bf16 ? StatesFormat::int8 : StatesFormat::bf16;
    Engine engine(make_config(other), *device, *comm, model());
    const auto changes = engine.load(b).config_changes;
    EXPECT_TRUE(
        std::any_of(changes.begin(), changes.end(), [](const std::string& c) { return c.rfind("states: ", 0) == 0; }));
    train_steps(engine, other, 4, 5, *comm);
  }
}

TEST_F(Fixture, LoadReportsTheSettingsThatDiffer) {
  Options o;
  o.stage = 2;
  SharedDir dir;
  {
    Engine engine(make_config(o), *device, *comm, model());
    set_initial(engine);
    train_steps(engine, o, 1, 2, *comm);
    engine.save(dir.path() + "/a");
  }
  Engine same(make_config(o), *device, *comm, model());
  const LoadResult unchanged = same.load(dir.path() + "/a");
  EXPECT_EQ(unchanged.steps, 2);
  EXPECT_TRUE(unchanged.config_changes.empty());
  Config changed = make_config(o);
  changed.optimizer.lr = changed.optimizer.lr / 2;
  changed.stage = 3;
  Engine other(changed, *device, *comm, model());
  const LoadResult result = other.load(dir.path() + "/a");
  ASSERT_EQ(result.config_changes.size(), 2u);
  EXPECT_EQ(result.config_changes[0], "stage: 2 in the checkpoint, 3 now");
  EXPECT_EQ(result.config_changes[1].rfind("lr: ", 0), 0u) << result.config_changes[1];
}

// Rank 0 damages a copy of a good checkpoint; every rank must refuse it with `expected` in the
// message, and the engine must keep its weights and step count and train on.
class Damaged : public Fixture {
 protected:
  void SetUp() override {
    Engine engine(make_config(o), *device, *comm, model());
    set_initial(engine);
    train_steps(engine, o, 1, 2, *comm);
    engine.save(good());
  }
  std::string good() const { return dir.path() + "/good"; }

  // `expected` in every rank's error; with `rank0_reads_it`, the damage is in a range only rank 0
  // reads (same world size): the others say that rank 0 failed.
  template <class Damage>
  void expect_refused(Damage damage, const std::string& expected, std::vector<ParamSpec> specs = model(),
                      bool rank0_reads_it = false) {
    const std::string bad = dir.path() + "/bad";
    if (rank() == 0) {
      fs::remove_all(bad);
      fs::copy(good(), bad);
      damage(fs::path(bad));
    }
    MPI_Barrier(MPI_COMM_WORLD);
    Engine engine(make_config(o), *device, *comm, specs);
    set_initial(engine);
    train_steps(engine, o, 1, 1, *comm);
    const auto before = params_of(engine);
    try {
      engine.load(bad);
      ADD_FAILURE() << "loaded a checkpoint damaged to give: " << expected;
    } catch (const Error& e) {
      const std::string message = rank0_reads_it && rank() != 0 ? "rank 0 failed" : expected;
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    EXPECT_EQ(params_of(engine), before);
    EXPECT_EQ(engine.stats().steps, 1);
    train_steps(engine, o, 2, 2, *comm);  // still usable
    EXPECT_EQ(engine.stats().steps, 2);
  }

  Options o = [] {
    Options opt;
    opt.stage = 3;
    return opt;
  }();
  SharedDir dir;
};

void rewrite(const fs::path& file, const std::function<void(std::string&)>& edit) {
  std::string text;
  {
    std::ifstream in(file, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  edit(text);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << text;
}

TEST_F(Damaged, TruncatedRankFile) {
  expect_refused([](const fs::path& d) { fs::resize_file(d / "rank0.m.bin", fs::file_size(d / "rank0.m.bin") - 4); },
                 "truncated");
}

TEST_F(Damaged, FlippedByteInRankFile) {
  expect_refused([](const fs::path& d) { rewrite(d / "rank0.m.bin", [](std::string& t) { t[t.size() / 2] ^= 1; }); },
                 "CRC32C", model(), true);
}

TEST_F(Damaged, MissingRankFile) {
  expect_refused([](const fs::path& d) { fs::remove(d / "rank0.m.bin"); }, "rank file is missing");
}

TEST_F(Damaged, MissingManifest) {
  expect_refused([](const fs::path& d) { fs::remove(d / "manifest"); }, "manifest");
}

TEST_F(Damaged, EditedManifest) {
  expect_refused(
      [](const fs::path& d) {
        rewrite(d / "manifest", [](std::string& t) { t.replace(t.find("steps 2"), 7, "steps 9"); });
      },
      "CRC32C does not match");
}

TEST_F(Damaged, FutureFormatVersion) {
  expect_refused(
      [](const fs::path& d) { rewrite(d / "manifest", [](std::string& t) { t.replace(0, 17, "zest-checkpoint 5"); }); },
      "format version 5");
}

TEST_F(Damaged, AnotherModel) {
  auto specs = model();
  specs[1].shape = {11, 37};
  expect_refused([](const fs::path&) {}, "another model", specs);
}

TEST_F(Fixture, RefusesToSaveInsideAStep) {
  Options o;
  Engine engine(make_config(o), *device, *comm, model());
  auto lease = engine.acquire(0);
  EXPECT_THROW(engine.save("/tmp/never-written"), Error);
  EXPECT_FALSE(fs::exists("/tmp/never-written"));
}

class SaveTarget : public Fixture {
 protected:
  void SetUp() override {
    engine = std::make_unique<Engine>(make_config(o), *device, *comm, model());
    set_initial(*engine);
    train_steps(*engine, o, 1, 1, *comm);
  }

  std::string path(const std::string& name) const { return dir.path() + "/" + name; }

  // Rank 0 runs `make` (the user's files), then every rank's save(target) must throw Error with
  // `expected` in its message (rank 0's own, or that rank 0 failed).
  template <class Make>
  void expect_refused(const std::string& target, const std::string& expected, Make make) {
    if (rank() == 0) make();
    MPI_Barrier(MPI_COMM_WORLD);
    try {
      engine->save(target);
      ADD_FAILURE() << "saved to " << target << ", which should be refused with: " << expected;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(rank() == 0 ? expected : "rank 0 failed"), std::string::npos) << e.what();
    }
  }

  // The names in the shared directory: a refused save leaves no temporary directory behind.
  std::set<std::string> names() const {
    std::set<std::string> result;
    for (const auto& entry : fs::directory_iterator(dir.path())) result.insert(entry.path().filename().string());
    return result;
  }

  Options o;
  SharedDir dir;
  std::unique_ptr<Engine> engine;
};

std::string contents(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST_F(SaveTarget, RefusesADirectoryThatIsNotACheckpoint) {
  expect_refused(path("mine"), "is a directory that is not a zest checkpoint (it has no manifest)", [&] {
    fs::create_directory(path("mine"));
    std::ofstream(path("mine/notes.txt")) << "my notes";
  });
  if (rank() == 0) {
    EXPECT_EQ(contents(path("mine/notes.txt")), "my notes");
    EXPECT_EQ(names(), std::set<std::string>{"mine"});
  }
}

TEST_F(SaveTarget, RefusesARegularFile) {
  expect_refused(path("model.pt"), "is a regular file, not a directory",
                 [&] { std::ofstream(path("model.pt")) << "weights"; });
  if (rank() == 0) {
    EXPECT_EQ(contents(path("model.pt")), "weights");
    EXPECT_EQ(names(), std::set<std::string>{"model.pt"});
  }
}

TEST_F(SaveTarget, RefusesACheckpointThatHoldsFilesZestDidNotWrite) {
  engine->save(path("ckpt"));
  expect_refused(path("ckpt"), "also holds 'notes.txt', which zest did not write",
                 [&] { std::ofstream(path("ckpt/notes.txt")) << "my notes"; });
  if (rank() == 0) {
    EXPECT_EQ(contents(path("ckpt/notes.txt")), "my notes");
  }
  Engine other(make_config(o), *device, *comm, model());
  EXPECT_EQ(other.load(path("ckpt")).steps, 1);  // the checkpoint is intact too
}

TEST_F(SaveTarget, RefusesADirectoryWithAManifestZestCannotRead) {
  expect_refused(path("other"), "is not a checkpoint zest can read", [&] {
    fs::create_directory(path("other"));
    std::ofstream(path("other/manifest")) << "a manifest of another program";
  });
  if (rank() == 0) {
    EXPECT_EQ(contents(path("other/manifest")), "a manifest of another program");
  }
}

TEST_F(SaveTarget, ReplacesAnEmptyDirectoryAndItsOwnCheckpointLeavingNothingElse) {
  if (rank() == 0) fs::create_directory(path("ckpt"));
  MPI_Barrier(MPI_COMM_WORLD);
  engine->save(path("ckpt/"));  // a trailing '/' names the same directory
  train_steps(*engine, o, 2, 2, *comm);
  engine->save(path("ckpt"));
  if (rank() == 0) {
    EXPECT_EQ(names(), std::set<std::string>{"ckpt"});
  }
  Engine other(make_config(o), *device, *comm, model());
  EXPECT_EQ(other.load(path("ckpt")).steps, 2);
}

TEST_F(SaveTarget, NeverRemovesAPathItDidNotCreate) {
  // The names an earlier save used for its temporary and set-aside directories (rank 0's pid):
  // here they are the user's, and must survive saves that create and replace the checkpoint.
  const std::string pid = std::to_string(::getpid());
  int length = static_cast<int>(pid.size());
  MPI_Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::string rank0_pid = pid;
  rank0_pid.resize(static_cast<std::size_t>(length));
  MPI_Bcast(rank0_pid.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string temp = path("ckpt.tmp-" + rank0_pid), aside = path("ckpt.old-" + rank0_pid);
  if (rank() == 0) {
    for (const std::string& d : {temp, aside}) {
      fs::create_directory(d);
      std::ofstream(d + "/keep") << "mine";
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  engine->save(path("ckpt"));
  engine->save(path("ckpt"));
  if (rank() == 0) {
    EXPECT_EQ(contents(temp + "/keep"), "mine");
    EXPECT_EQ(contents(aside + "/keep"), "mine");
    EXPECT_EQ(names(),
              (std::set<std::string>{"ckpt", fs::path(temp).filename().string(), fs::path(aside).filename().string()}));
  }
}

TEST_F(SaveTarget, AFailedWriteKeepsThePreviousCheckpointAndLeavesNoTemporaryDirectory) {
  engine->save(path("ckpt"));
  train_steps(*engine, o, 2, 2, *comm);
  // Rank 0 cannot write a byte (as on a full disk: write fails, EFBIG here); the other ranks'
  // files are written, then removed with rank 0's.
  struct rlimit saved {};
  ::getrlimit(RLIMIT_FSIZE, &saved);
  const auto previous_handler = ::signal(SIGXFSZ, SIG_IGN);
  if (rank() == 0) {
    struct rlimit none = saved;
    none.rlim_cur = 0;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
  }
  std::string error;
  try {
    engine->save(path("ckpt"));
  } catch (const Error& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, previous_handler);
  EXPECT_NE(error.find(rank() == 0 ? "File too large" : "rank 0 failed"), std::string::npos) << error;
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) {
    EXPECT_EQ(names(), std::set<std::string>{"ckpt"});
  }
  Engine other(make_config(o), *device, *comm, model());
  EXPECT_EQ(other.load(path("ckpt")).steps, 1);
}

TEST_F(SaveTarget, RefusesNamesThatAreNoDirectory) {
  const fs::path before = fs::current_path();
  fs::current_path(dir.path());  // relative names resolve here
  for (const std::string name : {"", ".", "..", "sub/..", "./"}) {
    try {
      engine->save(name);
      ADD_FAILURE() << "saved to '" << name << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("names no directory a save can create"), std::string::npos) << e.what();
    }
  }
  fs::current_path(before);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) {
    EXPECT_TRUE(names().empty());
    for (const auto& entry : fs::directory_iterator(fs::path(dir.path()).parent_path()))
      EXPECT_NE(entry.path().filename().string().rfind("..tmp-", 0), 0u) << entry.path();
  }
}

TEST_F(Damaged, FifoManifestIsRefusedWithoutBlocking) {
  expect_refused([](const fs::path& d) {
    fs::remove(d / "manifest");
    ::mkfifo((d / "manifest").c_str(), 0644);
  }, "is a FIFO, not a regular file");
}

}  // namespace
}  // namespace zest
