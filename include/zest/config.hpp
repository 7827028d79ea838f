// The configuration of a zest run, parsed from YAML or built in code. A Config that parse_config
// returns is complete and consistent: parsing collects every problem and throws one ConfigError
// listing them all (each with file:line:col, the key path, what was expected and what was found).
// A Config built in code gets the same checks from validate(). Every default is the struct's, from
// YAML and from code alike; configs/reference.yaml documents every key with its default.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "zest/base_types.hpp"
#include "zest/dtype.hpp"

namespace zest {

enum class CommBackend { auto_select, mpi, nccl };
enum class OptimizerType { adam, adamw };
enum class OffloadDevice { none, cpu, nvme };
// partition.secondary: where stage 3 keeps a second copy of its parameter shards (hpZ).
enum class SecondaryPartition { none, host };

// comm.quantize: block-wise quantized collectives (ZeRO++'s qwZ and qgZ): int8 or int4 codes with
// one fp32 scale per 256 elements on the wire instead of the working dtype.
enum class QuantizeParams { none, int8 };
enum class QuantizeGrads { none, int8, int4 };

struct DeviceConfig {
  DeviceType type = DeviceType::cpu;
  // Budget for everything zest places on the device. cpu: default 2GiB. cuda: 0 means "what the
  // GPU has"; a value caps zest's use below that.
  std::size_t memory = std::size_t{2} << 30;
};

struct CommConfig {
  CommBackend backend = CommBackend::auto_select;  // auto: mpi for cpu, nccl for cuda
  // A collective (or barrier) blocked this long raises CommError on every rank still alive,
  // naming the ranks that are behind or gone, instead of hanging; 0 = wait forever. mpi only.
  std::chrono::milliseconds timeout = kDefaultCommTimeout;
  struct Quantize {
    // Stage 3's parameter all-gathers (qwZ): each rank sends its shard as int8 and every rank
    // computes with the decoded parameters (its own shard too, so the ranks agree); the master
    // weights and the step stay exact.
    QuantizeParams params = QuantizeParams::none;
    // Stages 1-3's gradient reduce-scatter (qgZ): an all-to-all of quantized pieces inside each
    // host, the host's sums quantized again and exchanged across hosts, every sum formed in fp32.
    QuantizeGrads grads = QuantizeGrads::none;
  } quantize;
};

struct BucketConfig {
  std::size_t reduce_bytes = std::size_t{25} << 20;
  std::size_t allgather_bytes = std::size_t{25} << 20;
  bool overlap_comm = true;
};

struct Stage3Config {
  std::size_t prefetch_bytes = std::size_t{50} << 20;             // gathered ahead of use
  std::size_t max_live_bytes = std::size_t{1} << 30;              // gathered and alive at once
  std::size_t persistence_threshold_bytes = std::size_t{64} << 10;  // smaller stay resident
};

// partition: hierarchical partitioning. With secondary: host, stage 3 keeps, after a group's first
// all-gather of a step (over every rank), this rank's 1/R of the full group (R: ranks on its host),
// so the step's later gathers of it (backward, further micro-batches) run among the host's ranks
// only, off the slow link between hosts. Costs that copy in device memory (params), planned and
// estimated; bit-identical to stage 3 without it.
struct PartitionConfig {
  SecondaryPartition secondary = SecondaryPartition::none;
};

// An optimizer parameter group (e.g. no weight decay for biases and norms): the tensors whose names
// match one of `match` (shell-style patterns as fnmatch(3) reads them, where `*` also matches '.')
// take these hyper-parameters; an unset one is the optimizer's. A tensor belongs to the first group
// that matches it; tensors no group matches use the optimizer's own values (group 0).
struct OptimizerParamGroup {
  std::vector<std::string> match;
  std::optional<double> lr, beta1, beta2, eps, weight_decay;
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::adamw;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int threads = 0;  // CPU Adam threads; 0 = one per cpu of this rank (Runtime::cpus)
  std::vector<OptimizerParamGroup> param_groups;  // groups 1, 2, ... in this order
  // optimizer.states: how m and v are stored (docs/compact-states.md). fp32 is exact; bf16 (8 bytes
  // per parameter with the fp32 master instead of 12) and int8 (about 6.1) change what the next
  // step remembers, never the arithmetic of a step.
  StatesFormat states = StatesFormat::f32;
  // optimizer.master: the master weights' type: fp32, or bf16 (with bf16 or int8 states and 16-bit
  // parameters), rounded stochastically after each update so small updates are not lost.
  DType master = DType::f32;
  // optimizer.seed: the stochastic rounding's seed (bf16 states); with the step and each element's
  // place in the model, it decides every rounding, so runs repeat bit for bit.
  int seed = 0;
};

struct LossScaleConfig {
  // fp16 only (fp32 and bf16 need no scaling). Off by default, from YAML and from code alike:
  // an fp16 run that wants dynamic scaling says so.
  bool dynamic = false;
  double static_scale = 1.0;       // used when !dynamic
  int initial_scale_power = 16;    // dynamic: start at 2^power
  int window = 1000;               // dynamic: steps without overflow before the scale doubles
  int hysteresis = 2;              // dynamic: overflows tolerated before the scale halves
  double min_scale = 1.0;
};

struct PrecisionConfig {
  DType dtype = DType::f32;  // parameters and gradients on the device; master weights are fp32
  LossScaleConfig loss_scale;
};

struct OffloadTarget {
  OffloadDevice device = OffloadDevice::none;
  // nvme: existing, writable, distinct directories for this rank's swap (YAML `path`: one
  // directory, or a list of them, one per drive: the swap is striped across them).
  std::vector<std::string> paths;
  bool pinned = true;      // cpu: page-locked host memory
  int buffer_count = 4;    // host staging buffers in the swap pipeline
};

struct OffloadConfig {
  OffloadTarget optimizer;
  OffloadTarget param;     // stage 3 only
  std::size_t sub_group_bytes = std::size_t{256} << 20;  // unit of the offloaded step's pipeline
  // offload.optimizer.ratio, in (0, 1]: the fraction of this rank's optimizer states that
  // offload.optimizer.device holds; the rest stays on the device, stepped there at the same time.
  double optimizer_ratio = 1.0;
  // offload.optimizer.update_ahead: update each group's offloaded states as soon as its gradient
  // shard is final (during backward), assuming the step neither overflows nor clips; the step
  // commits that work, or redoes it when the assumption fails. Stages 2-3, the whole optimizer
  // offloaded (ratio 1). Costs a second copy of the states (cpu: pinned host memory; nvme: swap
  // space) and the updated parameter shard in pinned host memory until the step commits. YAML also
  // reads it under its deprecated old name, offload.optimizer.overlap, until a later release.
  bool optimizer_update_ahead = false;
};

struct IoConfig {
  std::size_t block_size = std::size_t{1} << 20;
  int queue_depth = 8;     // requests in flight per ring
  int threads = 1;         // io_uring rings per NVMe store, each with its own I/O thread
  bool direct = true;      // O_DIRECT; falls back to buffered I/O only where the filesystem refuses
  bool checksum = false;   // per-region checksum, verified on read-back
};

struct Config {
  std::string source;  // file the config came from ("<string>" when parsed from text)
  // What parsing noticed that is not an error (a deprecated key), each "file:line:col: key:
  // message". Not a setting: to_yaml and validate ignore it. The Engine prints each on its rank 0
  // as "zest: warning: ...", once per engine; `zest config check` prints them too.
  std::vector<std::string> warnings;
  int stage = 0;       // 0 = plain data parallel (DDP), 1..3 = ZeRO stages
  DeviceConfig device;
  CommConfig comm;
  BucketConfig buckets;
  Stage3Config stage3;
  PartitionConfig partition;
  OptimizerConfig optimizer;
  PrecisionConfig precision;
  double gradient_clipping = 0.0;  // max global grad norm; 0 = off
  int gradient_accumulation_steps = 1;
  OffloadConfig offload;
  IoConfig io;
};

// The largest config file load_config reads (1MiB; a config is a few KiB).
inline constexpr std::size_t kMaxConfigFileBytes = std::size_t{1} << 20;

// Parses and validates. Throws ConfigError listing every problem. `source_name` is used in
// messages. `application_sections` names top-level sections that belong to the program (a
// trainer's "model:", "train:"): zest skips them, and the program validates them itself.
Config parse_config(const std::string& yaml_text, const std::string& source_name = "<string>",
                    const std::vector<std::string>& application_sections = {});
// Reads `path` and parses it. The file must be a regular file of at most kMaxConfigFileBytes: a
// FIFO, a device or a directory is refused without blocking or reading it. Any problem with the
// file is a ConfigError too.
Config load_config(const std::string& path, const std::vector<std::string>& application_sections = {});
// As load_config, for a checker that does not know the program's sections (`zest config check`
// knows the shipped programs' and uses load_config instead, so that it refuses what they refuse):
// every top-level key that is not one of zest's, nor a near miss ("stgae") or a misplacement
// ("lr") of one of zest's keys, is taken as the program's; its name is appended to
// `program_sections`, unchecked.
Config load_config_with_program_sections(const std::string& path,
                                         std::vector<std::string>& program_sections);

// Checks a Config built in code as parse_config checks a file: every value in the range the engine
// runs, the settings consistent. Throws ConfigError listing every problem, with the same messages
// as the YAML path but no line and column (the file is config.source, empty for code).
void validate(const Config& config);

// The resolved config (every default filled in) as YAML that parse_config accepts again.
std::string to_yaml(const Config& config);

// "25MiB", "2GiB", "1.5GB", "4096" -> bytes. Throws std::invalid_argument with a message that
// says what a size looks like.
std::size_t parse_size(const std::string& text);
// 26214400 -> "25MiB" (exact binary units where they fit, else bytes).
std::string format_size(std::size_t bytes);

}  // namespace zest
