// The config layer against real YAML files in tests/config/cases/: every class of problem is
// reported with its file:line:col, key path and a message that says what was expected and what was
// found; all problems of a file come together; valid files resolve to exactly the values written;
// to_yaml reads back to the same Config; configs/reference.yaml is valid and is the defaults.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "zest/config.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

std::string test_data() {
  const char* dir = std::getenv("ZEST_TEST_DATA");
  // tests/meson.build sets it; without it the cases cannot be found, which must fail, not skip.
  if (dir == nullptr) ADD_FAILURE() << "ZEST_TEST_DATA is not set (the tests/ source directory)";
  return dir == nullptr ? std::string(".") : std::string(dir);
}

std::string case_path(const std::string& name) { return test_data() + "/config/cases/" + name; }

std::vector<ConfigProblem> problems_in_text(const std::string& yaml) {
  try {
    parse_config(yaml);
    ADD_FAILURE() << "parse_config accepted:\n" << yaml;
  } catch (const ConfigError& error) {
    return error.problems();
  }
  return {};
}

std::vector<ConfigProblem> problems_in(const std::string& name) {
  const std::string path = case_path(name);
  try {
    load_config(path);
    ADD_FAILURE() << "load_config accepted " << path;
  } catch (const ConfigError& error) {
    return error.problems();
  }
  return {};
}

std::string dump(const std::vector<ConfigProblem>& problems) {
  std::string text;
  for (const ConfigProblem& problem : problems) text.append(problem.to_string()).append("\n");
  return text;
}

// Expects exactly one problem for `key`, at line:column, whose message holds every fragment.
void expect_problem(const std::vector<ConfigProblem>& problems, const std::string& key, int line,
                    int column, const std::vector<std::string>& fragments) {
  const ConfigProblem* match = nullptr;
  int count = 0;
  for (const ConfigProblem& problem : problems) {
    if (problem.key == key) {
      match = &problem;
      ++count;
    }
  }
  ASSERT_EQ(count, 1) << "problems for key '" << key << "' in:\n" << dump(problems);
  EXPECT_EQ(match->line, line) << match->to_string();
  EXPECT_EQ(match->column, column) << match->to_string();
  for (const std::string& fragment : fragments)
    EXPECT_NE(match->message.find(fragment), std::string::npos)
        << "'" << fragment << "' missing from: " << match->to_string();
}

// Field-by-field equality; Config has no operator== in the public header.
void expect_same(const Config& a, const Config& b) {
  EXPECT_EQ(a.source, b.source);
  EXPECT_EQ(a.warnings, b.warnings);
  EXPECT_EQ(a.stage, b.stage);
  EXPECT_EQ(a.device.type, b.device.type);
  EXPECT_EQ(a.device.memory, b.device.memory);
  EXPECT_EQ(a.comm.backend, b.comm.backend);
  EXPECT_EQ(a.comm.timeout, b.comm.timeout);
  EXPECT_EQ(a.buckets.reduce_bytes, b.buckets.reduce_bytes);
  EXPECT_EQ(a.buckets.allgather_bytes, b.buckets.allgather_bytes);
  EXPECT_EQ(a.buckets.overlap_comm, b.buckets.overlap_comm);
  EXPECT_EQ(a.stage3.prefetch_bytes, b.stage3.prefetch_bytes);
  EXPECT_EQ(a.stage3.max_live_bytes, b.stage3.max_live_bytes);
  EXPECT_EQ(a.stage3.persistence_threshold_bytes, b.stage3.persistence_threshold_bytes);
  EXPECT_EQ(a.partition.secondary, b.partition.secondary);
  EXPECT_EQ(a.comm.quantize.params, b.comm.quantize.params);
  EXPECT_EQ(a.comm.quantize.grads, b.comm.quantize.grads);
  EXPECT_EQ(a.optimizer.type, b.optimizer.type);
  EXPECT_EQ(a.optimizer.lr, b.optimizer.lr);
  EXPECT_EQ(a.optimizer.beta1, b.optimizer.beta1);
  EXPECT_EQ(a.optimizer.beta2, b.optimizer.beta2);
  EXPECT_EQ(a.optimizer.eps, b.optimizer.eps);
  EXPECT_EQ(a.optimizer.weight_decay, b.optimizer.weight_decay);
  EXPECT_EQ(a.optimizer.threads, b.optimizer.threads);
  EXPECT_EQ(a.optimizer.states, b.optimizer.states);
  EXPECT_EQ(a.optimizer.master, b.optimizer.master);
  EXPECT_EQ(a.optimizer.seed, b.optimizer.seed);
  EXPECT_EQ(a.precision.dtype, b.precision.dtype);
  const LossScaleConfig& sa = a.precision.loss_scale;
  const LossScaleConfig& sb = b.precision.loss_scale;
  EXPECT_EQ(sa.dynamic, sb.dynamic);
  EXPECT_EQ(sa.static_scale, sb.static_scale);
  EXPECT_EQ(sa.initial_scale_power, sb.initial_scale_power);
  EXPECT_EQ(sa.window, sb.window);
  EXPECT_EQ(sa.hysteresis, sb.hysteresis);
  EXPECT_EQ(sa.min_scale, sb.min_scale);
  EXPECT_EQ(a.gradient_clipping, b.gradient_clipping);
  EXPECT_EQ(a.gradient_accumulation_steps, b.gradient_accumulation_steps);
  for (const auto member : {&OffloadConfig::optimizer, &OffloadConfig::param}) {
    const OffloadTarget& ta = a.offload.*member;
    const OffloadTarget& tb = b.offload.*member;
    EXPECT_EQ(ta.device, tb.device);
    EXPECT_EQ(ta.paths, tb.paths);
    EXPECT_EQ(ta.pinned, tb.pinned);
    EXPECT_EQ(ta.buffer_count, tb.buffer_count);
  }
  EXPECT_EQ(a.offload.optimizer_ratio, b.offload.optimizer_ratio);
  EXPECT_EQ(a.offload.optimizer_update_ahead, b.offload.optimizer_update_ahead);
  EXPECT_EQ(a.offload.sub_group_bytes, b.offload.sub_group_bytes);
  EXPECT_EQ(a.io.block_size, b.io.block_size);
  EXPECT_EQ(a.io.queue_depth, b.io.queue_depth);
  EXPECT_EQ(a.io.threads, b.io.threads);
  EXPECT_EQ(a.io.direct, b.io.direct);
  EXPECT_EQ(a.io.checksum, b.io.checksum);
}

// The defaults a file with no keys resolves to: the struct's.
Config resolved_defaults(const std::string& source) {
  Config config;
  config.source = source;
  return config;
}

// A fresh directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/zest-config-test-XXXXXX";
    const char* made = ::mkdtemp(pattern);
    if (made == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = made == nullptr ? "" : made;
  }
  ~TempDir() {
    for (const std::string& child : children_) ::rmdir(child.c_str());
    ::chmod(path_.c_str(), 0700);
    ::rmdir(path_.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string make_child(const std::string& name) {
    std::string child = path_ + "/" + name;
    if (::mkdir(child.c_str(), 0700) != 0) ADD_FAILURE() << "mkdir " << child;
    children_.push_back(child);
    return child;
  }

 private:
  std::string path_;
  std::vector<std::string> children_;
};

// --- valid files -----------------------------------------------------------------------------

TEST(ConfigValid, EmptyFileIsAllDefaults) {
  const std::string path = case_path("empty.yaml");
  expect_same(load_config(path), resolved_defaults(path));
  expect_same(parse_config(""), resolved_defaults("<string>"));
}

TEST(ConfigValid, CommentsOnlyIsAllDefaults) {
  const std::string path = case_path("comments_only.yaml");
  expect_same(load_config(path), resolved_defaults(path));
}

TEST(ConfigValid, EveryKeyResolvesToTheValueWritten) {
  const std::string path = case_path("full.yaml");
  const Config c = load_config(path);
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.stage, 3);
  EXPECT_EQ(c.device.type, DeviceType::cpu);
  EXPECT_EQ(c.device.memory, std::size_t{4} << 30);
  EXPECT_EQ(c.comm.backend, CommBackend::mpi);
  EXPECT_EQ(c.buckets.reduce_bytes, std::size_t{8} << 20);
  EXPECT_EQ(c.buckets.allgather_bytes, std::size_t{16} << 20);
  EXPECT_FALSE(c.buckets.overlap_comm);
  EXPECT_EQ(c.stage3.prefetch_bytes, std::size_t{10} << 20);
  EXPECT_EQ(c.stage3.max_live_bytes, std::size_t{512} << 20);
  EXPECT_EQ(c.stage3.persistence_threshold_bytes, std::size_t{128} << 10);
  EXPECT_EQ(c.partition.secondary, SecondaryPartition::host);
  EXPECT_EQ(c.comm.quantize.params, QuantizeParams::int8);
  EXPECT_EQ(c.comm.quantize.grads, QuantizeGrads::int4);
  EXPECT_EQ(c.optimizer.type, OptimizerType::adam);
  EXPECT_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);  // an int where a float belongs
  EXPECT_EQ(c.optimizer.threads, 4);
  EXPECT_EQ(c.optimizer.states, StatesFormat::int8);
  EXPECT_EQ(c.optimizer.seed, 7);
  EXPECT_EQ(c.precision.dtype, DType::f16);
  EXPECT_FALSE(c.precision.loss_scale.dynamic);
  EXPECT_EQ(c.precision.loss_scale.static_scale, 128.0);
  EXPECT_EQ(c.precision.loss_scale.initial_scale_power, 12);
  EXPECT_EQ(c.precision.loss_scale.window, 500);
  EXPECT_EQ(c.precision.loss_scale.hysteresis, 3);
  EXPECT_EQ(c.precision.loss_scale.min_scale, 0.5);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.offload.optimizer.device, OffloadDevice::cpu);
  EXPECT_TRUE(c.offload.optimizer.paths.empty());
  EXPECT_FALSE(c.offload.optimizer.pinned);
  EXPECT_EQ(c.offload.optimizer.buffer_count, 3);
  EXPECT_EQ(c.offload.optimizer_ratio, 0.5);
  EXPECT_EQ(c.offload.param.device, OffloadDevice::cpu);
  EXPECT_TRUE(c.offload.param.pinned);
  EXPECT_EQ(c.offload.param.buffer_count, 2);
  EXPECT_EQ(c.offload.sub_group_bytes, std::size_t{64} << 20);
  EXPECT_EQ(c.io.block_size, std::size_t{256} << 10);
  EXPECT_EQ(c.io.queue_depth, 32);
  EXPECT_EQ(c.io.threads, 2);
  EXPECT_FALSE(c.io.direct);
  EXPECT_TRUE(c.io.checksum);
}

// One default for every dtype, as in a Config built in code: fp16 asks for dynamic scaling.
TEST(ConfigValid, LossScalingIsStaticUnlessAskedFor) {
  EXPECT_FALSE(parse_config("precision: {dtype: fp16}").precision.loss_scale.dynamic);
  EXPECT_TRUE(parse_config("precision: {dtype: fp16, loss_scale: {dynamic: true}}")
                  .precision.loss_scale.dynamic);
  EXPECT_FALSE(parse_config("precision: {dtype: bf16}").precision.loss_scale.dynamic);
  EXPECT_FALSE(parse_config("precision: {dtype: fp32}").precision.loss_scale.dynamic);
  EXPECT_FALSE(parse_config("precision: {dtype: fp16, loss_scale: {dynamic: false}}")
                   .precision.loss_scale.dynamic);
  // Saying what the default already is, with bf16, is fine.
  EXPECT_FALSE(parse_config("precision: {dtype: bf16, loss_scale: {dynamic: false, "
                            "static_scale: 1}}")
                   .precision.loss_scale.dynamic);
}

TEST(ConfigValid, CudaWithZeroMemoryMeansWholeGpu) {
  const Config c = parse_config("device: {type: cuda, memory: 0}");
  EXPECT_EQ(c.device.memory, 0u);
}

TEST(ConfigValid, NvmeWithAWritableDirectory) {
  TempDir dir;
  const Config c = parse_config("stage: 3\noffload:\n  optimizer: {device: nvme, path: '" +
                                dir.path() + "'}\n  param: {device: nvme, path: '" + dir.path() +
                                "'}\n");
  EXPECT_EQ(c.offload.optimizer.device, OffloadDevice::nvme);
  EXPECT_EQ(c.offload.optimizer.paths, std::vector<std::string>{dir.path()});
  EXPECT_EQ(c.offload.param.paths, std::vector<std::string>{dir.path()});
}

// One directory per drive: the swap is striped across a list; a single string still works.
TEST(ConfigValid, NvmePathTakesAListOfDirectories) {
  TempDir dir;
  const std::string a = dir.make_child("a"), b = dir.make_child("b");
  const Config c = parse_config("stage: 3\noffload:\n  optimizer: {device: nvme, path: ['" + a + "', '" + b +
                                "']}\n  param:\n    device: nvme\n    path:\n      - '" + a + "'\n      - '" + b +
                                "'\nio: {threads: 2}\n");
  EXPECT_EQ(c.offload.optimizer.paths, (std::vector<std::string>{a, b}));
  EXPECT_EQ(c.offload.param.paths, (std::vector<std::string>{a, b}));
  EXPECT_EQ(c.io.threads, 2);
  expect_same(parse_config(to_yaml(c)), c);
  EXPECT_NE(to_yaml(c).find("path: [\"" + a + "\", \"" + b + "\"]"), std::string::npos) << to_yaml(c);
}

TEST(ConfigCombinations, NvmePathListsAreChecked) {
  TempDir dir;
  const std::string a = dir.make_child("a"), b = dir.make_child("b");
  // An empty list, a missing directory, the same directory twice (under two names).
  const auto empty = problems_in_text("stage: 1\noffload: {optimizer: {device: nvme, path: []}}\n");
  ASSERT_EQ(empty.size(), 1u) << dump(empty);
  expect_problem(empty, "offload.optimizer.path", 2, 43, {"found an empty list", "at least one directory"});

  const auto problems = problems_in_text("stage: 1\noffload:\n  optimizer:\n    device: nvme\n    path:\n      - '" +
                                         a + "'\n      - /nonexistent/zest-config-test\n      - '" + a + "/'\n");
  ASSERT_EQ(problems.size(), 2u) << dump(problems);
  expect_problem(problems, "offload.optimizer.path[1]", 7, 9, {"'/nonexistent/zest-config-test'", "does not exist"});
  expect_problem(problems, "offload.optimizer.path[2]", 8, 9, {"'" + a + "/'", "listed twice", "item 0"});

  // The optimizer and the parameters share one swap only with the same list.
  const auto overlap = problems_in_text("stage: 3\noffload:\n  optimizer: {device: nvme, path: ['" + a + "', '" + b +
                                        "']}\n  param: {device: nvme, path: '" + b + "'}\n");
  ASSERT_EQ(overlap.size(), 1u) << dump(overlap);
  expect_problem(overlap, "offload.param.path", 4, 31, {"'" + b + "' is in both", "not the same list"});
}

TEST(ConfigValid, BoundaryValuesAreAccepted) {
  const Config c = parse_config(
      "stage: 3\noptimizer: {betas: [0, 0.9999999], weight_decay: 0, threads: 0}\n"
      "io: {block_size: 4KiB, queue_depth: 4096}\ngradient_clipping: 0\n"
      "precision: {dtype: fp16, loss_scale: {initial_scale_power: 0, min_scale: 1}}\n"
      "device: {memory: 51MiB}\n");
  EXPECT_EQ(c.optimizer.beta1, 0.0);
  EXPECT_EQ(c.io.block_size, 4096u);
  EXPECT_EQ(c.io.queue_depth, 4096);
  EXPECT_EQ(c.device.memory, std::size_t{51} << 20);  // exactly 25MiB + 25MiB + 1MiB
}

// --- YAML and file problems ------------------------------------------------------------------

TEST(ConfigFile, SyntaxErrorHasItsPosition) {
  const auto problems = problems_in("syntax_error.yaml");
  ASSERT_EQ(problems.size(), 1u) << dump(problems);
  EXPECT_EQ(problems[0].file, case_path("syntax_error.yaml"));
  EXPECT_EQ(problems[0].line, 5);
  EXPECT_EQ(problems[0].column, 8);
  EXPECT_NE(problems[0].message.find("YAML syntax error"), std::string::npos);
  EXPECT_NE(problems[0].message.find("end of sequence flow not found"), std::string::npos);
}

TEST(ConfigFile, MissingFileNamesThePathAndTheOsError) {
  const std::string path = case_path("no_such_file.yaml");
  try {
    load_config(path);
    FAIL() << "load_config accepted a missing file";
  } catch (const ConfigError& error) {
    ASSERT_EQ(error.problems().size(), 1u);
    EXPECT_EQ(error.problems()[0].file, path);
    EXPECT_EQ(error.problems()[0].line, 0);
    EXPECT_NE(error.problems()[0].message.find("No such file or directory"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find(path), std::string::npos);
  }
}

TEST(ConfigFile, DirectoryIsUnreadable) {
  const std::string path = case_path("");
  try {
    load_config(path);
    FAIL() << "load_config accepted a directory";
  } catch (const ConfigError& error) {
    ASSERT_EQ(error.problems().size(), 1u);
    EXPECT_NE(error.problems()[0].message.find("it is a directory, not a regular file"),
              std::string::npos)
        << error.what();
  }
}

// Runs load_config(path) in a child process that is killed after a few seconds (and, outside
// ASan, whose heap is capped), so a reader that blocks or grows without bound fails the test
// instead of hanging it or exhausting the machine. Returns the ConfigError's text.
std::string load_error_in_child(const std::string& path) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(5);
#if !defined(__SANITIZE_ADDRESS__)
    const rlimit heap{std::size_t{256} << 20, std::size_t{256} << 20};
    ::setrlimit(RLIMIT_DATA, &heap);
#endif
    std::string message = "load_config accepted it";
    try {
      load_config(path);
    } catch (const ConfigError& error) {
      message = error.what();
    } catch (const std::exception& error) {
      message = std::string("not a ConfigError: ") + error.what();
    }
    const ssize_t written = ::write(fds[1], message.data(), message.size());
    ::_exit(written < 0 ? 1 : 0);
  }
  ::close(fds[1]);
  std::string text;
  char buffer[4096];
  for (ssize_t got; (got = ::read(fds[0], buffer, sizeof buffer)) > 0;)
    text.append(buffer, static_cast<std::size_t>(got));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status))
    return "load_config did not return: killed by signal " + std::to_string(WTERMSIG(status));
  return text;
}

TEST(ConfigFile, FifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.path() + "/config.yaml";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string error = load_error_in_child(fifo);
  ::unlink(fifo.c_str());
  EXPECT_NE(error.find(fifo + ": cannot read the config file: it is a FIFO, not a regular file"),
            std::string::npos)
      << error;
}

TEST(ConfigFile, DeviceIsRefusedWithoutReading) {
  const std::string error = load_error_in_child("/dev/zero");
  EXPECT_NE(error.find("/dev/zero: cannot read the config file: it is a character device, not a "
                       "regular file"),
            std::string::npos)
      << error;
}

TEST(ConfigFile, FileAboveTheSizeLimitIsRefused) {
  TempDir dir;
  const std::string path = dir.path() + "/huge.yaml";
  {
    const std::string line = "# a comment line that a real config would never repeat this often\n";
    std::string text;
    while (text.size() <= kMaxConfigFileBytes) text += line;
    FILE* file = std::fopen(path.c_str(), "w");
    ASSERT_NE(file, nullptr);
    ASSERT_EQ(std::fwrite(text.data(), 1, text.size(), file), text.size());
    std::fclose(file);
  }
  const std::string error = load_error_in_child(path);
  ::unlink(path.c_str());
  EXPECT_NE(error.find("above the 1MiB limit for a config file"), std::string::npos) << error;
}

// --- one default, from a file and from code ----------------------------------------------------

TEST(ConfigDefaults, AFileAndCodeAgreeOnEveryDefault) {
  const std::string empty = case_path("empty.yaml");
  Config code;
  code.source = empty;
  expect_same(load_config(empty), code);
  // Keys whose default could depend on another key: loss scaling used to follow the dtype in YAML
  // only, so an fp16 Config from code and from a file ran differently.
  for (const auto& [name, dtype] : {std::pair<const char*, DType>{"fp32", DType::f32},
                                    {"fp16", DType::f16}, {"bf16", DType::bf16}}) {
    SCOPED_TRACE(name);
    Config in_code;
    in_code.source = "<string>";
    in_code.precision.dtype = dtype;
    expect_same(parse_config(std::string("precision: {dtype: ") + name + "}"), in_code);
  }
}

// --- a program's own sections ------------------------------------------------------------------

TEST(ConfigProgramSections, ATrainersSectionsAreTheProgramsAndUnchecked) {
  const std::string path = test_data() + "/../configs/train-tiny.yaml";
  std::vector<std::string> sections;
  const Config config = load_config_with_program_sections(path, sections);
  EXPECT_EQ(config.stage, 2);
  EXPECT_EQ(sections, (std::vector<std::string>{"model", "train"}));
  // The library's own loader stays strict: a program names its sections.
  EXPECT_THROW(load_config(path), ConfigError);
  EXPECT_NO_THROW(load_config(path, {"model", "train"}));
}

TEST(ConfigProgramSections, ANearMissOrAMisplacedKeyIsStillAnError) {
  TempDir dir;
  const std::string path = dir.path() + "/typo.yaml";
  FILE* file = std::fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fputs("stgae: 2\nlr: 0.1\nmodel: {layers: 2}\n", file);
  std::fclose(file);
  std::vector<std::string> sections;
  try {
    load_config_with_program_sections(path, sections);
    ADD_FAILURE() << "a typo of 'stage' was taken for a program's section";
  } catch (const ConfigError& error) {
    expect_problem(error.problems(), "stgae", 1, 1, {"did you mean 'stage'?"});
    expect_problem(error.problems(), "lr", 2, 1, {"it belongs at 'optimizer.lr'"});
  }
  ::unlink(path.c_str());
  EXPECT_EQ(sections, std::vector<std::string>{"model"});
}

TEST(ConfigFile, TopLevelMustBeAMap) {
  const auto problems = problems_in("top_level_list.yaml");
  expect_problem(problems, "", 1, 1, {"expected a map of settings at the top level", "a list"});
}

TEST(ConfigFile, OnlyOneDocument) {
  const auto problems = problems_in("two_documents.yaml");
  expect_problem(problems, "", 2, 1, {"2 YAML documents", "one document"});  // at the second's '---'
}

TEST(ConfigFile, DuplicateKeysAreProblems) {
  const auto problems = problems_in("duplicate_key.yaml");
  expect_problem(problems, "stage", 4, 1, {"duplicate key 'stage'", "first set at line 1"});
}

// --- unknown keys ----------------------------------------------------------------------------

TEST(ConfigUnknownKeys, SuggestTheNearestKeyOrListTheValidOnes) {
  const auto problems = problems_in("unknown_keys.yaml");
  EXPECT_EQ(problems.size(), 6u) << dump(problems);
  expect_problem(problems, "stgae", 1, 1, {"unknown key 'stgae'", "did you mean 'stage'?"});
  expect_problem(problems, "optimizer.wieght_decay", 5, 3, {"did you mean 'weight_decay'?"});
  expect_problem(problems, "buckets.overlap_com", 8, 3, {"did you mean 'overlap_comm'?"});
  expect_problem(problems, "offload.optimizer.devce", 11, 5, {"did you mean 'device'?"});
  expect_problem(problems, "optimizer.momentum", 6, 3,
                 {"unknown key 'momentum'",
                  "valid keys here: type, lr, betas, eps, weight_decay, threads"});
}

TEST(ConfigUnknownKeys, AKeyFromAnotherSectionSaysWhereItBelongs) {
  const auto problems = problems_in("unknown_keys.yaml");
  expect_problem(problems, "lr", 2, 1, {"unknown key 'lr'", "belongs at 'optimizer.lr'"});
  // A key valid in two places lists both.
  const auto threads = problems_in_text("threads: 4\n");
  expect_problem(threads, "threads", 1, 1, {"'optimizer.threads' or 'io.threads'"});
}

// --- wrong types -----------------------------------------------------------------------------

TEST(ConfigTypes, EachWrongTypeSaysWhatWasExpectedAndFound) {
  const auto problems = problems_in("wrong_types.yaml");
  EXPECT_EQ(problems.size(), 11u) << dump(problems);
  expect_problem(problems, "stage", 2, 3, {"expected an integer from 0 to 3", "found a map"});
  expect_problem(problems, "device", 3, 9, {"expected a map of settings", "type, memory",
                                            "found 'cuda'"});
  expect_problem(problems, "optimizer.type", 5, 9, {"expected one of adam, adamw", "found 'sgd'"});
  expect_problem(problems, "optimizer.lr", 6, 7, {"expected a number > 0", "found 'fast'"});
  expect_problem(problems, "optimizer.eps", 7, 8, {"found '1e-8'", "quoted string",
                                                   "remove the quotes"});
  expect_problem(problems, "optimizer.threads", 8, 12, {"expected an integer", "found '2.5'"});
  expect_problem(problems, "optimizer.betas", 9, 10, {"a list of two numbers",
                                                      "found a list of 3 items"});
  expect_problem(problems, "buckets.overlap_comm", 11, 17, {"expected true or false",
                                                            "found 'yes'"});
  expect_problem(problems, "buckets.reduce", 12, 11, {"expected a size", "found a list"});
  expect_problem(problems, "gradient_accumulation_steps", 13, 30,
                 {"expected an integer >= 1", "found '1e3'"});
  expect_problem(problems, "precision.dtype", 15, 10,
                 {"expected one of fp32, fp16, bf16", "found 'float16'"});
}

TEST(ConfigTypes, FloatsAcceptIntegersAndExponents) {
  const Config c = parse_config("optimizer: {lr: 1, eps: 1e-3, weight_decay: 2.5E-2}");
  EXPECT_EQ(c.optimizer.lr, 1.0);
  EXPECT_EQ(c.optimizer.eps, 1e-3);
  EXPECT_EQ(c.optimizer.weight_decay, 2.5e-2);
}

TEST(ConfigTypes, NonFiniteNumbersAreRefused) {
  const auto problems = problems_in_text("optimizer: {lr: inf, eps: nan}\ngradient_clipping: .inf\n");
  expect_problem(problems, "optimizer.lr", 1, 17, {"expected a number > 0", "found 'inf'"});
  expect_problem(problems, "optimizer.eps", 1, 27, {"found 'nan'"});
  expect_problem(problems, "gradient_clipping", 2, 20, {"found '.inf'"});
}

TEST(ConfigTypes, EmptyValueIsAProblemButAnEmptySectionKeepsDefaults) {
  const auto problems = problems_in("null_values.yaml");
  ASSERT_EQ(problems.size(), 1u) << dump(problems);
  expect_problem(problems, "io.threads", 4, 3, {"expected an integer from 1 to 64", "found nothing"});
}

// --- out of range ----------------------------------------------------------------------------

TEST(ConfigRanges, EveryOutOfRangeNumberIsReportedTogether) {
  const auto problems = problems_in("out_of_range.yaml");
  ASSERT_EQ(problems.size(), 17u) << dump(problems);
  expect_problem(problems, "stage", 1, 8, {"from 0 to 3", "found '4'"});
  expect_problem(problems, "optimizer.lr", 3, 7, {"> 0", "found '0'"});
  expect_problem(problems, "optimizer.betas[0]", 4, 11, {">= 0 and < 1", "found '1'"});
  expect_problem(problems, "optimizer.betas[1]", 4, 16, {">= 0 and < 1", "found '-0.1'"});
  expect_problem(problems, "optimizer.eps", 5, 8, {"> 0", "found '0'"});
  expect_problem(problems, "optimizer.weight_decay", 6, 17, {">= 0", "found '-0.01'"});
  expect_problem(problems, "optimizer.threads", 7, 12, {"from 0 to 1024", "found '-1'"});
  expect_problem(problems, "precision.loss_scale.initial_scale_power", 11, 26,
                 {"from 0 to 127", "found '128'"});
  expect_problem(problems, "precision.loss_scale.window", 12, 13, {">= 1", "found '0'"});
  expect_problem(problems, "precision.loss_scale.hysteresis", 13, 17, {">= 1", "found '0'"});
  expect_problem(problems, "precision.loss_scale.min_scale", 14, 16, {"> 0", "found '0'"});
  expect_problem(problems, "gradient_clipping", 15, 20, {">= 0", "found '-1'"});
  expect_problem(problems, "gradient_accumulation_steps", 16, 30, {">= 1", "found '0'"});
  expect_problem(problems, "offload.optimizer.buffer_count", 19, 19, {"from 2 to 64", "found '1'"});
  expect_problem(problems, "io.block_size", 21, 15,
                 {"power of two from 4KiB to 1GiB", "found '6KiB'", "6144 bytes"});
  expect_problem(problems, "io.queue_depth", 22, 16, {"from 1 to 4096", "found '4097'"});
  expect_problem(problems, "io.threads", 23, 12, {"from 1 to 64", "found '0'"});
}

TEST(ConfigRanges, ProblemsComeInFileOrderAndTheMessageHoldsThemAll) {
  const std::string path = case_path("out_of_range.yaml");
  try {
    load_config(path);
    FAIL() << "accepted " << path;
  } catch (const ConfigError& error) {
    const auto& problems = error.problems();
    for (std::size_t i = 1; i < problems.size(); ++i) {
      const bool ordered = problems[i - 1].line < problems[i].line ||
                           (problems[i - 1].line == problems[i].line &&
                            problems[i - 1].column < problems[i].column);
      EXPECT_TRUE(ordered) << problems[i - 1].to_string() << " before " << problems[i].to_string();
    }
    const std::string what = error.what();
    for (const ConfigProblem& problem : problems) {
      EXPECT_EQ(problem.file, path);
      EXPECT_NE(what.find(problem.to_string()), std::string::npos) << problem.to_string();
    }
    EXPECT_NE(what.find(path + ":1:8: stage: expected an integer from 0 to 3, found '4'"),
              std::string::npos)
        << what;
  }
}

// --- sizes in configs ------------------------------------------------------------------------

TEST(ConfigSizes, BadSizesSayWhy) {
  const auto problems = problems_in("bad_sizes.yaml");
  ASSERT_EQ(problems.size(), 8u) << dump(problems);
  expect_problem(problems, "device.memory", 2, 11, {"found '-1GiB'", "cannot be negative"});
  expect_problem(problems, "buckets.reduce", 4, 11,
                 {"found '25XB'", "unknown unit 'XB'", "KiB, MiB, GiB, TiB", "MB, GB, TB"});
  expect_problem(problems, "buckets.allgather", 5, 14, {"'0.1KiB'", "not a whole number of bytes"});
  expect_problem(problems, "stage3.prefetch", 7, 13, {"'99999999TiB'", "too large"});
  expect_problem(problems, "stage3.max_live", 8, 13, {"'25mib'", "did you mean 'MiB'"});
  expect_problem(problems, "stage3.persistence_threshold", 9, 26, {"'64K'", "ambiguous"});
  expect_problem(problems, "offload.sub_group", 11, 14, {"at least 768B", "12 bytes each", "found '0B'"});
  expect_problem(problems, "io.block_size", 13, 15, {"power of two from 4KiB", "found '2KiB'"});
}

TEST(ConfigSizes, QuotedAndPlainSizesBothWork) {
  const Config c = parse_config("device: {memory: \"3GiB\"}\nbuckets: {reduce: 4096, allgather: "
                                "'1.5MiB'}\n");
  EXPECT_EQ(c.device.memory, std::size_t{3} << 30);
  EXPECT_EQ(c.buckets.reduce_bytes, 4096u);
  EXPECT_EQ(c.buckets.allgather_bytes, std::size_t{3} << 19);
}

// --- inconsistent combinations ---------------------------------------------------------------

TEST(ConfigCombinations, OffloadNeedsTheStageThatPartitionsIt) {
  const auto problems = problems_in("offload_stage.yaml");
  ASSERT_EQ(problems.size(), 2u) << dump(problems);
  expect_problem(problems, "offload.optimizer.device", 5, 13,
                 {"stage 1 or higher", "stage 0 keeps full optimizer states on every rank"});
  expect_problem(problems, "offload.param.device", 7, 13, {"needs stage 3", "stage is 0"});

  const auto stage2 = problems_in("param_offload_stage2.yaml");
  ASSERT_EQ(stage2.size(), 1u) << dump(stage2);  // the optimizer offload is fine at stage 2
  expect_problem(stage2, "offload.param.device", 6, 13, {"needs stage 3", "stage is 2"});
}

TEST(ConfigCombinations, NvmeNeedsAnExistingDirectory) {
  const auto problems = problems_in("nvme_paths.yaml");
  ASSERT_EQ(problems.size(), 2u) << dump(problems);
  // No path: reported where the device is chosen.
  expect_problem(problems, "offload.optimizer.path", 4, 13, {"nvme needs a path", "writable directory"});
  expect_problem(problems, "offload.param.path", 7, 11,
                 {"'/nonexistent/zest-config-test'", "does not exist"});

  const auto not_dir = problems_in("nvme_not_directory.yaml");
  expect_problem(not_dir, "offload.optimizer.path", 5, 11, {"'/dev/null'", "is not a directory"});
}

TEST(ConfigCombinations, NvmeDirectoryMustBeWritable) {
  TempDir dir;
  std::string locked = dir.make_child("locked");
  ASSERT_EQ(::chmod(locked.c_str(), 0500), 0);
  // root may write a mode 0500 directory; /proc/sys is a directory even root cannot write.
  if (::access(locked.c_str(), W_OK | X_OK) == 0) locked = "/proc/sys";
  if (::access(locked.c_str(), W_OK | X_OK) == 0)
    GTEST_SKIP() << "found no directory this user cannot write";
  const std::string os_reason = std::strerror(errno);
  const auto problems =
      problems_in_text("stage: 1\noffload: {optimizer: {device: nvme, path: '" + locked + "'}}\n");
  expect_problem(problems, "offload.optimizer.path", 2, 43,
                 {"'" + locked + "' is not writable", os_reason});
}

TEST(ConfigCombinations, PathWithoutNvmeWouldBeIgnored) {
  const auto problems = problems_in("path_without_nvme.yaml");
  ASSERT_EQ(problems.size(), 2u) << dump(problems);
  expect_problem(problems, "offload.optimizer.path", 5, 11,
                 {"'/tmp' is set", "offload.optimizer.device is 'cpu'", "only nvme uses a path"});
  expect_problem(problems, "offload.param.path", 7, 11, {"offload.param.device is 'none'"});
}

TEST(ConfigCombinations, BackendMustMatchTheDevice) {
  expect_problem(problems_in("nccl_with_cpu.yaml"), "comm.backend", 4, 12,
                 {"nccl runs collectives on GPUs only", "device.type is cpu", "backend: mpi"});
  expect_problem(problems_in("mpi_with_cuda.yaml"), "comm.backend", 4, 12,
                 {"device.type cuda", "nccl", "backend: nccl"});
}

TEST(ConfigCombinations, CpuBudgetMustHoldTheBuckets) {
  expect_problem(problems_in("memory_too_small.yaml"), "device.memory", 2, 11,
                 {"32MiB", "at least 42MiB", "buckets.reduce 25MiB", "buckets.allgather 16MiB",
                  "1MiB"});
  expect_problem(problems_in("cpu_memory_zero.yaml"), "device.memory", 3, 11,
                 {"0B", "at least 51MiB", "only for cuda"});
  // Budget unset but buckets too large for the default 2GiB: reported at the buckets.
  expect_problem(problems_in_text("buckets:\n  reduce: 1GiB\n  allgather: 1GiB\n"),
                 "device.memory", 2, 11, {"2GiB", "at least 2049MiB"});
}

TEST(ConfigCombinations, LossScalingOnlyForFp16) {
  const auto problems = problems_in("loss_scale_bf16.yaml");
  ASSERT_EQ(problems.size(), 2u) << dump(problems);
  expect_problem(problems, "precision.loss_scale.dynamic", 4, 14,
                 {"fp16 only", "bf16", "need no loss scaling"});
  expect_problem(problems, "precision.loss_scale.static_scale", 5, 19,
                 {"128 would be ignored", "loss scale of 1"});
  expect_problem(problems_in("min_scale_above_initial.yaml"), "precision.loss_scale.min_scale", 6,
                 16, {"32 is above the initial scale 2^4 = 16"});
}

TEST(ConfigCombinations, CompactStatesOnlyWhereAnAdamUpdatesThem) {
  const auto problems = problems_in("compact_states_refused.yaml");
  ASSERT_EQ(problems.size(), 1u) << dump(problems);
  expect_problem(problems, "optimizer.master", 6, 11,
                 {"a bf16 master on a cuda device is not implemented", "optimizer.master: fp32",
                  "optimizer.states bf16 stays compact", "offload.optimizer.device: cpu or nvme"});
  // Kept on the GPU in part (ratio < 1): refused too.
  EXPECT_THROW(parse_config("stage: 2\ndevice:\n  type: cuda\noptimizer:\n  states: int8\n  master: bf16\n"
                            "precision:\n  dtype: bf16\noffload:\n  optimizer:\n    device: cpu\n    ratio: 0.5\n"),
               ConfigError);
  // Offloaded whole, the CPU Adam keeps a bf16 master: accepted.
  EXPECT_NO_THROW(parse_config("stage: 2\ndevice:\n  type: cuda\noptimizer:\n  states: int8\n  master: bf16\n"
                               "precision:\n  dtype: bf16\noffload:\n  optimizer:\n    device: cpu\n"));
  expect_problem(problems_in_text("optimizer:\n  states: bf16\n  master: bf16\n"), "optimizer.master", 3, 11,
                 {"a bf16 master with fp32 parameters gains nothing"});
  EXPECT_THROW(parse_config("optimizer:\n  master: bf16\nprecision:\n  dtype: bf16\n"), ConfigError);  // fp32 states
  EXPECT_THROW(parse_config("optimizer:\n  master: fp16\n  states: bf16\nprecision:\n  dtype: bf16\n"), ConfigError);
  EXPECT_NO_THROW(parse_config("optimizer:\n  master: bf16\n  states: int8\nprecision:\n  dtype: bf16\n"));
  // Compact moments with an fp32 master: the CUDA Adam's compact kernels on a cuda device, whole or
  // in part, the CPU Adam offloaded and on the cpu device.
  EXPECT_NO_THROW(parse_config("device:\n  type: cuda\noptimizer:\n  states: bf16\n"));
  EXPECT_NO_THROW(
      parse_config("stage: 3\ndevice:\n  type: cuda\noptimizer:\n  states: int8\nprecision:\n  dtype: bf16\n"));
  EXPECT_NO_THROW(parse_config("stage: 2\ndevice:\n  type: cuda\noptimizer:\n  states: int8\n"
                               "offload:\n  optimizer:\n    device: cpu\n    ratio: 0.5\n"));
  EXPECT_NO_THROW(parse_config("stage: 2\ndevice:\n  type: cuda\noptimizer:\n  states: int8\n"
                               "offload:\n  optimizer:\n    device: cpu\n"));
  EXPECT_NO_THROW(parse_config("optimizer:\n  states: int8\n"));  // the cpu device's Adam
  EXPECT_THROW(parse_config("optimizer:\n  states: fp8\n"), ConfigError);
}

TEST(ConfigCombinations, AnInvalidValueIsNotJudgedAgain) {
  // stage and device.type are wrong; the offload and backend checks that would depend on them
  // stay silent instead of reporting consequences of the defaults.
  const auto problems = problems_in("no_cascade.yaml");
  ASSERT_EQ(problems.size(), 2u) << dump(problems);
  expect_problem(problems, "stage", 2, 8, {"found 'three'"});
  expect_problem(problems, "device.type", 4, 9, {"found 'gpu'"});
}

// --- deprecated names --------------------------------------------------------------------------

// offload.optimizer.overlap, update_ahead's old name, is read for a release: it sets the same field
// and leaves a warning naming both keys and the removal, which the Engine and `zest config check`
// print; the new name leaves none.
TEST(ConfigDeprecated, OverlapIsReadAsUpdateAheadWithAWarning) {
  for (const bool value : {true, false}) {
    SCOPED_TRACE(value);
    const std::string text =
        std::string("stage: 2\noffload:\n  optimizer: {device: cpu, overlap: ") + (value ? "true" : "false") + "}\n";
    const Config c = parse_config(text, "run.yaml");
    EXPECT_EQ(c.offload.optimizer_update_ahead, value);
    ASSERT_EQ(c.warnings.size(), 1u);
    EXPECT_EQ(c.warnings[0],
              "run.yaml:3:37: offload.optimizer.overlap: deprecated: renamed offload.optimizer.update_ahead; the "
              "old name is read as the new one for now and will be removed in a later release");
  }
  const Config renamed = parse_config("stage: 2\noffload:\n  optimizer: {device: cpu, update_ahead: true}\n");
  EXPECT_TRUE(renamed.offload.optimizer_update_ahead);
  EXPECT_TRUE(renamed.warnings.empty());
  EXPECT_TRUE(parse_config("").warnings.empty());
}

TEST(ConfigDeprecated, TheOldAndTheNewNameTogetherAreAProblemNamingBoth) {
  const auto problems = problems_in_text(
      "stage: 2\noffload:\n  optimizer:\n    device: cpu\n    update_ahead: true\n"
      "    overlap: true\n");
  ASSERT_EQ(problems.size(), 1u) << dump(problems);
  expect_problem(problems, "offload.optimizer.overlap", 6, 14,
                 {"both offload.optimizer.overlap and offload.optimizer.update_ahead are set",
                  "deprecated old name of update_ahead", "keep update_ahead only"});
  // Even when they agree, and whichever comes first.
  EXPECT_EQ(problems_in_text("offload: {optimizer: {overlap: false, update_ahead: false}}").size(), 1u);
}

// The old name is no key to suggest: a typo near it lists the current keys only.
TEST(ConfigDeprecated, TheOldNameIsNotOfferedAsAValidKey) {
  const auto problems = problems_in_text("offload: {optimizer: {overlapp: true}}");
  ASSERT_EQ(problems.size(), 1u) << dump(problems);
  EXPECT_EQ(problems[0].message.find("'overlap'"), std::string::npos) << problems[0].message;
  EXPECT_NE(problems[0].message.find("update_ahead"), std::string::npos) << problems[0].message;
}

// --- to_yaml ---------------------------------------------------------------------------------

TEST(ConfigYaml, RoundTripsEveryKey) {
  const Config original = load_config(case_path("full.yaml"));
  const std::string yaml = to_yaml(original);
  Config again = parse_config(yaml, original.source);
  expect_same(again, original);
  EXPECT_EQ(to_yaml(again), yaml);
  EXPECT_NE(yaml.find("  memory: 4GiB\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  betas: [0.8, 0.95]\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  block_size: 256KiB\n"), std::string::npos) << yaml;
}

TEST(ConfigYaml, RoundTripsDefaultsAndAwkwardValues) {
  expect_same(parse_config(to_yaml(parse_config(""))), parse_config(""));

  TempDir dir;
  const std::string awkward = dir.make_child("a dir: with # and \"quotes\"");
  Config c = resolved_defaults("<string>");
  c.stage = 3;
  c.offload.optimizer.device = OffloadDevice::nvme;
  c.offload.optimizer.paths = {awkward};
  c.offload.param.device = OffloadDevice::nvme;
  c.offload.param.paths = {awkward};
  c.offload.optimizer_update_ahead = true;
  c.optimizer.lr = 0.1 + 0.2;  // 0.30000000000000004: needs all 17 digits
  c.optimizer.beta2 = 1.0 - 1e-12;
  c.optimizer.eps = 5e-324;  // the smallest subnormal
  c.device.memory = 3 * (std::size_t{1} << 30) + 7;  // no binary unit divides it
  c.precision.dtype = DType::f16;
  c.precision.loss_scale.dynamic = true;
  c.precision.loss_scale.min_scale = 1.0 / 3.0;
  expect_same(parse_config(to_yaml(c)), c);
}

// The setting is written under its current name only, whichever name the file used.
TEST(ConfigYaml, WritesUpdateAheadNeverItsOldName) {
  const Config c = parse_config("stage: 2\noffload:\n  optimizer: {device: cpu, overlap: true}\n");
  const std::string yaml = to_yaml(c);
  EXPECT_NE(yaml.find("\n    update_ahead: true\n"), std::string::npos) << yaml;
  EXPECT_EQ(yaml.find("overlap:"), std::string::npos) << yaml;
  const Config again = parse_config(yaml);
  EXPECT_TRUE(again.offload.optimizer_update_ahead);
  EXPECT_TRUE(again.warnings.empty());
  EXPECT_NE(to_yaml(Config{}).find("\n    update_ahead: false\n"), std::string::npos);
}

TEST(ConfigYaml, ACodeBuiltConfigPrintsTheLossScalingInEffect) {
  // The struct's own default (dynamic = true) with fp32 means "static 1"; to_yaml must print a
  // config parse_config accepts.
  const Config built;
  const Config read_back = parse_config(to_yaml(built));
  EXPECT_FALSE(read_back.precision.loss_scale.dynamic);
}

// --- configs/reference.yaml ------------------------------------------------------------------

void collect_keys(const YAML::Node& node, const std::string& prefix, std::set<std::string>& keys) {
  if (!node.IsMap()) return;
  for (const auto& entry : node) {
    const std::string key = prefix.empty() ? entry.first.Scalar() : prefix + "." + entry.first.Scalar();
    keys.insert(key);
    collect_keys(entry.second, key, keys);
  }
}

TEST(ConfigReference, IsValidAndIsTheDefaults) {
  const std::string path = test_data() + "/../configs/reference.yaml";
  const Config reference = load_config(path);
  expect_same(reference, resolved_defaults(path));
}

TEST(ConfigReference, SetsEveryKeyToYamlPrints) {
  const std::string path = test_data() + "/../configs/reference.yaml";
  std::set<std::string> documented;
  std::set<std::string> printed;
  collect_keys(YAML::LoadFile(path), "", documented);
  collect_keys(YAML::Load(to_yaml(Config{})), "", printed);
  EXPECT_EQ(documented, printed);
  EXPECT_EQ(printed.size(), 62u);  // every key of the schema, sections included
}

}  // namespace
}  // namespace zest

namespace zest {
namespace {

TEST(ApplicationSections, AreLeftToTheProgramAndStayErrorsOtherwise) {
  const std::string text = "stage: 2\nmodel:\n  layers: 4\ntrain:\n  steps: 10\n";
  const Config config = parse_config(text, "trainer.yaml", {"model", "train"});
  EXPECT_EQ(config.stage, 2);
  try {
    parse_config(text, "trainer.yaml");
    FAIL() << "a program's section was accepted without being declared";
  } catch (const ConfigError& error) {
    ASSERT_EQ(error.problems().size(), 2u);
    EXPECT_EQ(error.problems()[0].key, "model");
    EXPECT_EQ(error.problems()[0].line, 2);
  }
  // Only top-level sections are skipped: a nested key of that name is still checked.
  EXPECT_THROW(parse_config("optimizer:\n  model: 1\n", "trainer.yaml", {"model"}), ConfigError);
}

// comm.timeout: the collective watchdog's limit, a duration with its unit (0 alone turns it off).
TEST(ConfigDurations, CommTimeoutTakesUnitsAndZeroTurnsItOff) {
  using std::chrono::milliseconds;
  EXPECT_EQ(parse_config("").comm.timeout, std::chrono::minutes(10));
  EXPECT_EQ(parse_config("comm: {timeout: 300s}").comm.timeout, std::chrono::seconds(300));
  EXPECT_EQ(parse_config("comm: {timeout: 5min}").comm.timeout, std::chrono::minutes(5));
  EXPECT_EQ(parse_config("comm: {timeout: 1.5h}").comm.timeout, std::chrono::minutes(90));
  EXPECT_EQ(parse_config("comm: {timeout: 250ms}").comm.timeout, milliseconds(250));
  EXPECT_EQ(parse_config("comm: {timeout: \"2 s\"}").comm.timeout, std::chrono::seconds(2));
  EXPECT_EQ(parse_config("comm: {timeout: 0}").comm.timeout, milliseconds(0));
  Config c = parse_config("");
  for (const milliseconds value : {milliseconds(0), milliseconds(1500), milliseconds(7000),
                                   milliseconds(120000), milliseconds(7200000)}) {
    c.comm.timeout = value;
    EXPECT_EQ(parse_config(to_yaml(c)).comm.timeout, value) << to_yaml(c);
  }
}

TEST(ConfigDurations, BadDurationsSayWhy) {
  expect_problem(problems_in_text("comm: {timeout: 300}"), "comm.timeout", 1, 17,
                 {"expected a duration", "found '300'", "a unit is missing", "ms, s, min, h"});
  expect_problem(problems_in_text("comm: {timeout: 5m}"), "comm.timeout", 1, 17,
                 {"unknown unit 'm'"});
  expect_problem(problems_in_text("comm: {timeout: -1s}"), "comm.timeout", 1, 17,
                 {"a number of at least 0"});
  expect_problem(problems_in_text("comm: {timeout: soon}"), "comm.timeout", 1, 17,
                 {"a number of at least 0"});
  expect_problem(problems_in_text("comm: {timeout: 8000h}"), "comm.timeout", 1, 17,
                 {"longer than a week", "0 to turn the timeout off"});
}

}  // namespace
}  // namespace zest

namespace zest {
namespace {

TEST(ConfigParamGroups, GroupsTakeTheirPatternsAndOnlyTheValuesSet) {
  const Config c = parse_config(
      "optimizer:\n"
      "  lr: 0.001\n"
      "  param_groups:\n"
      "    - {match: ['*.bias', '*norm*'], weight_decay: 0}\n"
      "    - {match: embed, lr: 0.01, betas: [0.8, 0.9]}\n");
  ASSERT_EQ(c.optimizer.param_groups.size(), 2u);
  const auto& a = c.optimizer.param_groups[0];
  EXPECT_EQ(a.match, (std::vector<std::string>{"*.bias", "*norm*"}));
  EXPECT_EQ(a.weight_decay, 0.0);
  EXPECT_FALSE(a.lr.has_value());
  const auto& b = c.optimizer.param_groups[1];
  EXPECT_EQ(b.match, std::vector<std::string>{"embed"});
  EXPECT_EQ(b.lr, 0.01);
  EXPECT_EQ(b.beta1, 0.8);
  EXPECT_EQ(b.beta2, 0.9);
  EXPECT_FALSE(b.weight_decay.has_value());
}

TEST(ConfigParamGroups, AGroupWithoutPatternsOrWithABadValueIsAnError) {
  try {
    parse_config("optimizer:\n  param_groups:\n    - {lr: 0.1}\n    - {match: x, weight_decay: -1, lrr: 2}\n");
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    const std::string text = e.what();
    EXPECT_NE(text.find("optimizer.param_groups[0]"), std::string::npos) << text;
    EXPECT_NE(text.find("needs `match`"), std::string::npos) << text;
    EXPECT_NE(text.find("optimizer.param_groups[1].weight_decay"), std::string::npos) << text;
    EXPECT_NE(text.find("lrr"), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace zest

namespace zest {
namespace {

TEST(ConfigParamGroups, TheResolvedConfigReadsBackToTheSameGroups) {
  const Config c = parse_config(
      "optimizer:\n  param_groups:\n    - {match: ['*.bias', 'a \"b\"'], weight_decay: 0}\n    - {match: x, betas: "
      "[0.5, 0.6], lr: 2}\n");
  const Config again = parse_config(to_yaml(c));
  ASSERT_EQ(again.optimizer.param_groups.size(), 2u);
  EXPECT_EQ(again.optimizer.param_groups[0].match, c.optimizer.param_groups[0].match);
  EXPECT_EQ(again.optimizer.param_groups[0].weight_decay, 0.0);
  EXPECT_FALSE(again.optimizer.param_groups[0].lr.has_value());
  EXPECT_EQ(again.optimizer.param_groups[1].beta2, 0.6);
  EXPECT_EQ(again.optimizer.param_groups[1].lr, 2.0);
}

}  // namespace
}  // namespace zest

namespace zest {
namespace {

// Found by the config fuzz target: yaml-cpp 0.7's LoadAll never returns on these (its parser
// reports a new document at the same place forever): each is a syntax error at the stray ','.
TEST(ConfigFuzzRegressions, AStrayCommaIsASyntaxErrorNotAHang) {
  const std::pair<const char*, const char*> cases[] = {
      {",stage: 3", ":1:1"},        {"# comment\n  , stage: 3", ":2:3"}, {"stage: 1\n---\n,", ":3:1"},
      {"--- ,x", ":1:5"},           {"&a ,", ":1:4"},                    {"!x ,", ":1:4"},
      {"\"x\" ,", ":1:5"},          {"stage: 1\n---\n&x ,", ":3:4"}};
  for (const auto& [text, place] : cases) {
    try {
      parse_config(text, "<string>");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(
          what.find(std::string("<string>") + place + ": YAML syntax error: yaml-cpp cannot read past this point"),
          std::string::npos)
          << text << ": " << what;
    }
  }
  EXPECT_EQ(parse_config("betas_note: [0.9, 0.99]\n", "<string>", {"betas_note"}).stage, 0);  // a ',' later is fine
}

}  // namespace
}  // namespace zest
