// zest::validate on Configs built in code: every value the YAML path refuses is refused in code
// too, with the same key and message (no file:line:col, there being no file), and every value it
// accepts is one the engine can run (10^7 optimizer threads once passed and crashed in TBB).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "zest/config.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

std::vector<ConfigProblem> problems_of(const std::function<void()>& check) {
  try {
    check();
  } catch (const ConfigError& error) {
    return error.problems();
  }
  return {};
}

struct Case {
  const char* name;
  const char* yaml;                      // the problem written in a file
  std::function<void(Config&)> in_code;  // the same problem in a Config built in code
  std::string message;                   // what both say
};

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

const std::string kRatioExpected =
    "expected a number > 0 and <= 1 (the fraction of the optimizer states offloaded; 1 offloads them all), ";

// Stage 2 with the optimizer offloaded to pinned host memory, `ratio` of it.
void partial_offload(Config& c, double ratio) {
  c.stage = 2;
  c.offload.optimizer.device = OffloadDevice::cpu;
  c.offload.optimizer_ratio = ratio;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"stage 9", "stage: 9", [](Config& c) { c.stage = 9; }, "expected an integer from 0 to 3, found '9'"},
      {"10^7 optimizer threads", "optimizer: {threads: 10000000}", [](Config& c) { c.optimizer.threads = 10'000'000; },
       "expected an integer from 0 to 1024, found '10000000'"},
      {"negative io threads", "io: {threads: -2}", [](Config& c) { c.io.threads = -2; },
       "expected an integer from 1 to 64, found '-2'"},
      {"a thousand buffers", "offload: {optimizer: {buffer_count: 1000}}",
       [](Config& c) { c.offload.optimizer.buffer_count = 1000; }, "expected an integer from 2 to 64, found '1000'"},
      // offload.optimizer.ratio: a fraction in (0, 1], and only where something is offloaded.
      {"ratio 0", "stage: 2\noffload: {optimizer: {device: cpu, ratio: 0}}", [](Config& c) { partial_offload(c, 0); },
       kRatioExpected + "found '0'"},
      {"ratio -1", "stage: 2\noffload: {optimizer: {device: cpu, ratio: -1}}",
       [](Config& c) { partial_offload(c, -1); }, kRatioExpected + "found '-1'"},
      {"ratio 1.5", "stage: 2\noffload: {optimizer: {device: cpu, ratio: 1.5}}",
       [](Config& c) { partial_offload(c, 1.5); }, kRatioExpected + "found '1.5'"},
      {"NaN ratio", "stage: 2\noffload: {optimizer: {device: cpu, ratio: nan}}",
       [](Config& c) { partial_offload(c, kNaN); }, kRatioExpected + "found 'nan'"},
      {"ratio without offload", "stage: 2\noffload: {optimizer: {ratio: 0.5}}",
       [](Config& c) {
         c.stage = 2;
         c.offload.optimizer_ratio = 0.5;
       },
       "ratio 0.5 offloads that fraction of the optimizer states, but offload.optimizer.device is 'none', so "
       "nothing is offloaded. Set offload.optimizer.device: cpu or nvme, or remove ratio"},
      {"secondary partition below stage 3", "stage: 2\npartition: {secondary: host}",
       [](Config& c) {
         c.stage = 2;
         c.partition.secondary = SecondaryPartition::host;
       },
       "a secondary partition copies stage 3's parameter shards within each host, but stage is 2: below stage 3 "
       "every rank keeps the full parameters and gathers nothing during backward. Set stage: 3, or "
       "partition.secondary: none"},
      {"quantized parameters below stage 3", "stage: 2\ncomm: {quantize: {params: int8}}",
       [](Config& c) {
         c.stage = 2;
         c.comm.quantize.params = QuantizeParams::int8;
       },
       "quantized parameter all-gathers are stage 3's (each lease gathers the shards), but stage is 2: below "
       "stage 3 every rank keeps full-precision parameters, gathered once after the step, and quantizing them "
       "would leave the ranks' copies different. Set stage: 3, or comm.quantize.params: none"},
      {"quantized gradients at stage 0", "stage: 0\ncomm: {quantize: {grads: int4}}",
       [](Config& c) {
         c.stage = 0;
         c.comm.quantize.grads = QuantizeGrads::int4;
       },
       "a quantized gradient reduction leaves each rank the sum of its shard, but stage 0 all-reduces every "
       "gradient in full. Set stage: 1 or higher, or comm.quantize.grads: none"},
      // offload.optimizer.update_ahead: stages 2-3 with the whole optimizer offloaded.
      {"update_ahead without offload", "stage: 2\noffload: {optimizer: {update_ahead: true}}",
       [](Config& c) {
         c.stage = 2;
         c.offload.optimizer_update_ahead = true;
       },
       "update_ahead updates offloaded states during backward from gradient shards on the host, which needs "
       "stage 2 or 3 with the whole optimizer offloaded (device cpu or nvme, ratio 1), but "
       "offload.optimizer.device is 'none'. Set those, or update_ahead: false"},
      {"update_ahead at stage 1", "stage: 1\noffload: {optimizer: {device: cpu, update_ahead: true}}",
       [](Config& c) {
         partial_offload(c, 1);
         c.stage = 1;
         c.offload.optimizer_update_ahead = true;
       },
       "update_ahead updates offloaded states during backward from gradient shards on the host, which needs "
       "stage 2 or 3 with the whole optimizer offloaded (device cpu or nvme, ratio 1), but stage is 1. Set "
       "those, or update_ahead: false"},
      // Its deprecated old name sets the same field, so the same check names the new key.
      {"update_ahead at stage 1 by its old name", "stage: 1\noffload: {optimizer: {device: cpu, overlap: true}}",
       [](Config& c) {
         partial_offload(c, 1);
         c.stage = 1;
         c.offload.optimizer_update_ahead = true;
       },
       "update_ahead updates offloaded states during backward from gradient shards on the host, which needs "
       "stage 2 or 3 with the whole optimizer offloaded (device cpu or nvme, ratio 1), but stage is 1. Set "
       "those, or update_ahead: false"},
      {"update_ahead of part of the states",
       "stage: 2\noffload: {optimizer: {device: cpu, ratio: 0.5, update_ahead: true}}",
       [](Config& c) {
         partial_offload(c, 0.5);
         c.offload.optimizer_update_ahead = true;
       },
       "update_ahead updates offloaded states during backward from gradient shards on the host, which needs "
       "stage 2 or 3 with the whole optimizer offloaded (device cpu or nvme, ratio 1), but ratio is 0.5. Set "
       "those, or update_ahead: false"},
      {"queue depth 0", "io: {queue_depth: 0}", [](Config& c) { c.io.queue_depth = 0; },
       "expected an integer from 1 to 4096, found '0'"},
      {"block of 2GiB", "io: {block_size: 2GiB}", [](Config& c) { c.io.block_size = std::size_t{2} << 30; },
       "expected a power of two from 4KiB to 1GiB (O_DIRECT moves whole aligned blocks; one read "
       "moves at most 2GiB), found '2GiB' (2147483648 bytes)"},
      {"empty sub-group", "offload: {sub_group: 0}", [](Config& c) { c.offload.sub_group_bytes = 0; },
       "expected a size of at least 768B (e.g. 256MiB): a sub-group holds at least 64 parameters (the shard alignment) "
       "whose master, m and v take 12 bytes each; a smaller one would be rounded up silently, found '0B' (0 bytes)"},
      {"negative accumulation", "gradient_accumulation_steps: -1",
       [](Config& c) { c.gradient_accumulation_steps = -1; }, "expected an integer >= 1, found '-1'"},
      {"NaN loss scale", "precision: {dtype: fp16, loss_scale: {static_scale: nan}}",
       [](Config& c) {
         c.precision.dtype = DType::f16;
         c.precision.loss_scale.static_scale = kNaN;
       },
       "expected a number > 0, found 'nan'"},
      {"infinite min scale", "precision: {dtype: fp16, loss_scale: {min_scale: inf}}",
       [](Config& c) {
         c.precision.dtype = DType::f16;
         c.precision.loss_scale.min_scale = kInf;
       },
       "expected a number > 0, found 'inf'"},
      {"negative lr", "optimizer: {lr: -0.5}", [](Config& c) { c.optimizer.lr = -0.5; },
       "expected a number > 0, found '-0.5'"},
      {"beta2 of 1", "optimizer: {betas: [0.9, 1]}", [](Config& c) { c.optimizer.beta2 = 1; },
       "expected a number >= 0 and < 1, found '1'"},
      {"NaN clipping", "gradient_clipping: nan", [](Config& c) { c.gradient_clipping = kNaN; },
       "expected a number >= 0 (0 turns clipping off), found 'nan'"},
      {"window 0", "precision: {dtype: fp16, loss_scale: {window: 0}}",
       [](Config& c) {
         c.precision.dtype = DType::f16;
         c.precision.loss_scale.window = 0;
       },
       "expected an integer >= 1, found '0'"},
      {"dynamic scaling with bf16", "precision: {dtype: bf16, loss_scale: {dynamic: true}}",
       [](Config& c) {
         c.precision.dtype = DType::bf16;
         c.precision.loss_scale.dynamic = true;
       },
       "dynamic loss scaling is for fp16 only, but dtype is bf16: fp32 and bf16 have fp32's "
       "exponent range, so small gradients do not underflow and need no loss scaling. Remove the "
       "key or set it to false, or use dtype: fp16"},
  };
  return all;
}

TEST(Validate, CodeAndYamlReportTheSameProblemTheSameWay) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<ConfigProblem> from_yaml = problems_of([&] { parse_config(c.yaml); });
    Config config;
    c.in_code(config);
    const std::vector<ConfigProblem> from_code = problems_of([&] { validate(config); });
    ASSERT_EQ(from_yaml.size(), 1u);
    ASSERT_EQ(from_code.size(), 1u) << "validate accepted it";
    EXPECT_EQ(from_yaml[0].message, c.message);
    EXPECT_EQ(from_code[0].message, c.message);
    EXPECT_EQ(from_code[0].key, from_yaml[0].key);
    EXPECT_EQ(from_code[0].line, 0);
    EXPECT_EQ(from_code[0].file, "");
    // No file, so no "file:line:col: " before the key.
    EXPECT_EQ(from_code[0].to_string(), from_code[0].key + ": " + c.message);
  }
}

TEST(Validate, DefaultsAndEveryBoundaryAreAccepted) {
  EXPECT_NO_THROW(validate(Config{}));
  Config edges;
  edges.stage = 3;
  edges.optimizer.threads = 1024;
  edges.io.threads = 64;
  edges.io.queue_depth = 4096;
  edges.io.block_size = std::size_t{1} << 30;
  edges.offload.optimizer.buffer_count = 64;
  edges.offload.param.buffer_count = 2;
  EXPECT_NO_THROW(validate(edges));
}

TEST(Validate, EveryProblemOfAConfigComesTogether) {
  Config config;
  config.stage = -1;
  config.optimizer.eps = 0;
  config.device.type = static_cast<DeviceType>(7);  // a value no enumerator names
  const std::vector<ConfigProblem> problems = problems_of([&] { validate(config); });
  ASSERT_EQ(problems.size(), 3u);
  EXPECT_EQ(problems[0].to_string(), "stage: expected an integer from 0 to 3, found '-1'");
  EXPECT_EQ(problems[1].to_string(), "device.type: expected one of cpu, cuda, found '7'");
  EXPECT_EQ(problems[2].to_string(), "optimizer.eps: expected a number > 0, found '0'");
}

TEST(Validate, AConfigFromAFileNamesItsFile) {
  Config config = parse_config("stage: 2", "run.yaml");
  config.stage = 7;
  const std::vector<ConfigProblem> problems = problems_of([&] { validate(config); });
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].to_string(), "run.yaml: stage: expected an integer from 0 to 3, found '7'");
}

}  // namespace
}  // namespace zest
