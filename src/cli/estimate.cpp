// zest estimate: the memory every stage and offload mode needs for a model of N parameters, per
// device, per host and on NVMe, from the engine's own sizing (zest/estimate.hpp), before any run.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "args/args.hpp"
#include "cli/commands.hpp"
#include "zest/config.hpp"
#include "zest/error.hpp"
#include "zest/estimate.hpp"

namespace zest::cli {
namespace {

constexpr const char* kEstimateUsage =
    "usage: zest estimate --params N [--layers L] [--ranks-per-node R] [--nodes K]\n"
    "                     [--dtype bf16|fp16|fp32] [--states fp32|bf16|int8] [--config FILE]\n"
    "\n"
    "Prints the memory zest itself needs for a model of N parameters (7000000000, 7B, 350M, 1.5e9)\n"
    "in L equal layers (default 32) on R ranks per node (default 1) and K nodes (default 1), for\n"
    "every ZeRO stage and offload mode: per device (params, grads, optimizer states, buffers), pinned\n"
    "host memory per node and NVMe swap space per node. Buffers are the two gradient buckets (each\n"
    "max(buckets.reduce, one layer), at most the whole model), the parameter all-gather's bucket (the\n"
    "largest run of consecutive layers that fit in buckets.allgather together; none when no two fit)\n"
    "and, under stage 3, the gathered (live) layers. Bucket, stage-3 and offload settings come from\n"
    "FILE (marked * where its stage and offload match a row; a FILE that offloads part of the\n"
    "optimizer, offload.optimizer.ratio, or updates it ahead of the step during backward,\n"
    "offload.optimizer.update_ahead, adds its own row) or the defaults; --dtype overrides its\n"
    "precision (default: FILE's, else bf16), --states its optimizer.states (default: FILE's, else\n"
    "fp32: 12 bytes per parameter of master, m and v; bf16 8, int8 about 6.1).\n"
    "Activations and framework workspace are not included.\n"
    "\n"
    "Bounds: N up to 1e15, L up to 100000, R and K up to 1000000 each with R x K at most 2147483647\n"
    "(MPI numbers ranks with an int). The work is closed form per layer, never per parameter or per\n"
    "offload sub-group, so time and memory grow with L alone: under 1 s and 100 MiB at every maximum\n"
    "(well under 0.1 s and 20 MiB at L=32). A figure that would not fit in 64 bits is an error naming\n"
    "the input, never a wrapped number.\n";

struct Options {
  std::size_t params = 0;
  int layers = 32;
  std::int64_t ranks_per_node = 1;
  std::int64_t nodes = 1;
  int ranks = 1;  // ranks_per_node x nodes, checked
  bool dtype_given = false;
  DType dtype = DType::bf16;
  std::optional<StatesFormat> states;
  std::string config_path;
};

using args::UsageError;

// 10^15 parameters: far past any model, still exact in a double.
constexpr std::size_t kMaxParams = 1'000'000'000'000'000;
// Planning is linear in the layers (about 6 us and 400 bytes per layer and row): 10^5 layers,
// far past any model's, stay under a second and 100 MiB.
constexpr long long kMaxLayers = 100'000;
constexpr long long kMaxPerFlag = 1'000'000;  // --ranks-per-node, --nodes each
// The engine's world is an MPI communicator, whose ranks are numbered with an int.
constexpr std::int64_t kMaxRanks = INT_MAX;

DType parse_dtype(const std::string& text) {
  if (text == "bf16") return DType::bf16;
  if (text == "fp16") return DType::f16;
  if (text == "fp32") return DType::f32;
  throw UsageError(std::string("--dtype: expected bf16, fp16 or fp32, found '").append(text).append("'"));
}

Options parse(int argc, char** argv) {
  Options o;
  bool params_given = false;
  for (int i = 0; i < argc; ++i) {
    const std::string_view flag = argv[i];
    const bool known = flag == "--params" || flag == "--layers" || flag == "--ranks-per-node" || flag == "--nodes" ||
                       flag == "--dtype" || flag == "--states" || flag == "--config";
    if (!known) throw UsageError(std::string("unknown option '").append(flag).append("'"));
    const std::string_view value = args::value_of(argc, argv, i);
    if (flag == "--params") {
      o.params = args::parse_count(flag, value, 1, kMaxParams);
      params_given = true;
    } else if (flag == "--layers") {
      o.layers = static_cast<int>(args::parse_integer(flag, value, 1, kMaxLayers));
    } else if (flag == "--ranks-per-node" || flag == "--nodes") {
      (flag == "--ranks-per-node" ? o.ranks_per_node : o.nodes) = args::parse_integer(flag, value, 1, kMaxPerFlag);
    } else if (flag == "--dtype") {
      o.dtype = parse_dtype(std::string(value));
      o.dtype_given = true;
    } else if (flag == "--states") {
      o.states = args::parse_states_format(flag, value);
    } else {
      if (value.empty())
        throw UsageError("--config: the path is empty; give a config FILE, or leave --config out for the defaults");
      o.config_path = value;
    }
  }
  if (!params_given) throw UsageError("--params N is required");
  // Both factors are at most 10^6, so the product is exact in 64 bits; the world must fit an int.
  const std::int64_t ranks = o.ranks_per_node * o.nodes;
  if (ranks > kMaxRanks)
    throw UsageError(
        fmt::format("--ranks-per-node {} x --nodes {} = {} ranks, more than the {} an MPI world can "
                    "number; give fewer ranks per node or fewer nodes",
                    o.ranks_per_node, o.nodes, ranks, kMaxRanks));
  o.ranks = static_cast<int>(ranks);
  if (o.params < static_cast<std::size_t>(o.layers))
    throw UsageError(fmt::format("--params {} is fewer than --layers {}: give at least one parameter per layer",
                                 o.params, o.layers));
  return o;
}

// 512 B, 12.0 KiB, 345.6 MiB, 12.34 GiB, 1.20 TiB.
std::string readable(std::size_t bytes) {
  constexpr const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double value = static_cast<double>(bytes);
  int unit = -1;
  while (value >= 1024 && unit < 3) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit >= 2 ? "%.2f %s" : "%.1f %s", value, units[unit]);
  return text;
}

// "7.00B", "350.0M": the parameter count as people say it.
std::string readable_count(std::size_t count) {
  char text[32];
  const double n = static_cast<double>(count);
  if (n >= 1e9) std::snprintf(text, sizeof text, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(text, sizeof text, "%.1fM", n / 1e6);
  else return std::to_string(count);
  return text;
}

struct Row {
  int stage;
  OffloadDevice optimizer;
  OffloadDevice param;
  double ratio = 1;      // offload.optimizer.ratio
  bool update_ahead = false;  // offload.optimizer.update_ahead
  bool secondary = false;  // partition.secondary: host
};

std::string row_name(const Row& r) {
  auto name = [](OffloadDevice d) { return d == OffloadDevice::cpu ? "cpu" : "nvme"; };
  std::string text = fmt::format("stage {}", r.stage);
  if (r.param != OffloadDevice::none && r.param == r.optimizer)
    text.append(", optimizer+params ").append(name(r.param));
  else if (r.optimizer != OffloadDevice::none) text.append(", optimizer ").append(name(r.optimizer));
  if (r.param != OffloadDevice::none && r.param != r.optimizer) text.append(", params ").append(name(r.param));
  if (r.ratio != 1) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, " ratio %g", r.ratio);
    text.append(ratio);
  }
  if (r.update_ahead) text.append(" update_ahead");
  if (r.secondary) text.append(", secondary host");
  return text;
}

// Every configuration the engine accepts: stage 0 plain; stages 1-3 with the optimizer on the
// device, in pinned host memory or on NVMe; stage 3 with its parameters offloaded as well; stage 3
// with a secondary partition (partition.secondary: host); and the config's own when it offloads
// part of the optimizer (offload.optimizer.ratio), updates it ahead of the step during backward
// (offload.optimizer.update_ahead) or adds a secondary partition to an offloading stage 3.
std::vector<Row> rows(const Config& base) {
  std::vector<Row> all{{0, OffloadDevice::none, OffloadDevice::none}};
  for (int stage = 1; stage <= 3; ++stage)
    for (OffloadDevice d : {OffloadDevice::none, OffloadDevice::cpu, OffloadDevice::nvme})
      all.push_back({stage, d, OffloadDevice::none});
  all.push_back({3, OffloadDevice::cpu, OffloadDevice::cpu});
  all.push_back({3, OffloadDevice::nvme, OffloadDevice::nvme});
  all.push_back({3, OffloadDevice::none, OffloadDevice::none, 1, false, true});
  const bool secondary = base.partition.secondary == SecondaryPartition::host;
  if (base.offload.optimizer.device != OffloadDevice::none &&
      (base.offload.optimizer_ratio != 1 || base.offload.optimizer_update_ahead || (secondary && base.stage == 3)))
    all.push_back({base.stage, base.offload.optimizer.device, base.offload.param.device, base.offload.optimizer_ratio,
                   base.offload.optimizer_update_ahead, secondary && base.stage == 3});
  return all;
}

// A node's figure: one rank's times --ranks-per-node, checked.
std::size_t per_node(std::size_t per_rank, const Options& o, const char* what) {
  std::size_t total = 0;
  if (__builtin_mul_overflow(per_rank, static_cast<std::size_t>(o.ranks_per_node), &total))
    throw Error(
        fmt::format("the {} per node ({} bytes per rank x --ranks-per-node {}) does not fit in 64 bits; give "
                    "fewer ranks per node or fewer parameters (--params)",
                    what, per_rank, o.ranks_per_node));
  return total;
}

// The config's comm.quantize where `c`'s stage takes it (params: stage 3; grads: stages 1-3).
void quantize_where_valid(Config& c, const Config& base) {
  c.comm.quantize.params = c.stage == 3 ? base.comm.quantize.params : QuantizeParams::none;
  c.comm.quantize.grads = c.stage >= 1 ? base.comm.quantize.grads : QuantizeGrads::none;
}

// Bytes each rank sends per step, by stage (offload does not change them), with the config's
// comm.quantize where the stage takes it, then stage 3 with hpZ, with ZeRO++'s three (hpZ, int8
// parameters, int4 gradients), and with those two quantized alone: the engine's count
// (estimate_wire_bytes) beside ZeRO's formula, split by where the peer is.
void print_wire_table(const Options& o, const Config& base, const std::vector<ParamSpec>& model) {
  std::printf("\n%-54s %14s %14s %14s %14s %14s\n", "sent per rank per step", "total", "inside a node", "across nodes",
              "ZeRO's formula", "reductions");
  const auto print = [&](const std::string& name, const Config& c) {
    const WireEstimate w = estimate_wire_bytes(c, model, o.ranks, static_cast<int>(o.ranks_per_node));
    std::printf("%-54s %14s %14s %14s %14s %14s\n", name.c_str(), readable(w.total()).c_str(),
                readable(w.inside).c_str(), readable(w.across).c_str(), readable(w.zero_formula).c_str(),
                readable(w.reduce).c_str());
  };
  for (int stage = 0; stage <= 3; ++stage) {
    Config c = base;
    c.stage = stage;
    c.partition.secondary = SecondaryPartition::none;
    quantize_where_valid(c, base);
    print(fmt::format("wire, stage {}", stage), c);
  }
  Config c = base;
  c.stage = 3;
  c.comm.quantize = {};
  c.partition.secondary = SecondaryPartition::host;
  print("wire, stage 3, secondary host", c);
  c.comm.quantize = {QuantizeParams::int8, QuantizeGrads::int4};
  print("wire, stage 3, secondary host, params int8, grads int4", c);
  c.partition.secondary = SecondaryPartition::none;
  print("wire, stage 3, params int8, grads int4", c);
  std::printf("\nsent per rank per step: bytes each rank sends to the others (each rank's block to every other\n"
              "rank, as a ring moves), with gradient_accumulation_steps %d; stage 3 counts a forward and a\n"
              "backward gather of every group above stage3.persistence_threshold (the gathered pool may keep\n"
              "some between them). ZeRO's formula: 2 (stages 0-2) or 3 (stage 3) x the parameters' bytes x\n"
              "(ranks - 1) / ranks. Quantized reductions count each layer's shard as a piece of its own (a\n"
              "bucket of several sends a little less).\n",
              base.gradient_accumulation_steps);
}

void print_table(const Options& o, const Config& base) {
  const int ranks = o.ranks;
  const std::vector<ParamSpec> model = uniform_model(o.params, o.layers);
  std::printf(
      "zest estimate: %s parameters (%zu) in %d layers, %s, %s optimizer states%s; %lld rank%s per node x "
      "%lld node%s = %d rank%s\n",
      readable_count(o.params).c_str(), o.params, o.layers, std::string(dtype_name(base.precision.dtype)).c_str(),
      std::string(states_format_name(base.optimizer.states)).c_str(),
      base.optimizer.master == DType::bf16 ? " with a bf16 master" : "", static_cast<long long>(o.ranks_per_node),
      o.ranks_per_node == 1 ? "" : "s", static_cast<long long>(o.nodes), o.nodes == 1 ? "" : "s", ranks,
      ranks == 1 ? "" : "s");
  std::printf("settings: %s; buckets.reduce %s, stage3.max_live %s, offload.sub_group %s, buffer_count %d\n\n",
              o.config_path.empty() ? "defaults" : o.config_path.c_str(),
              format_size(base.buckets.reduce_bytes).c_str(), format_size(base.stage3.max_live_bytes).c_str(),
              format_size(base.offload.sub_group_bytes).c_str(), base.offload.optimizer.buffer_count);
  // Wide enough for the longest name (a partial offload's), marked.
  int width = 34;
  for (const Row& r : rows(base)) width = std::max(width, static_cast<int>(row_name(r).size()) + 2);
  std::printf("%-*s %12s %12s %12s %12s %12s %16s %12s\n", width, "configuration", "device/rank", "params", "grads",
              "optim states", "buffers", "pinned host/node", "NVMe/node");
  for (const Row& r : rows(base)) {
    Config c = base;
    c.stage = r.stage;
    c.offload.optimizer.device = r.optimizer;
    c.offload.param.device = r.param;
    c.offload.optimizer_ratio = r.ratio;
    c.offload.optimizer_update_ahead = r.update_ahead;
    c.partition.secondary = r.secondary ? SecondaryPartition::host : SecondaryPartition::none;
    quantize_where_valid(c, base);
    const MemoryEstimate e = estimate_memory(c, model, ranks, static_cast<int>(o.ranks_per_node));
    const bool matches = !o.config_path.empty() && base.stage == r.stage &&
                         base.offload.optimizer.device == r.optimizer && base.offload.param.device == r.param &&
                         base.offload.optimizer_ratio == r.ratio &&
                         base.offload.optimizer_update_ahead == r.update_ahead &&
                         (base.partition.secondary == SecondaryPartition::host) == r.secondary;
    const std::string name = row_name(r).append(matches ? " *" : "");
    std::printf("%-*s %12s %12s %12s %12s %12s %16s %12s\n", width, name.c_str(), readable(e.device_total).c_str(),
                readable(e.device_of(MemoryCategory::params)).c_str(),
                readable(e.device_of(MemoryCategory::grads)).c_str(),
                readable(e.device_of(MemoryCategory::optimizer_states)).c_str(),
                readable(e.device_of(MemoryCategory::buffers)).c_str(),
                readable(per_node(e.pinned, o, "pinned host memory")).c_str(),
                readable(per_node(e.nvme, o, "NVMe swap space")).c_str());
  }
  std::printf("\ndevice/rank: zest's allocations on each device (add activations and workspace); pinned host and\n"
              "NVMe per node: %lld rank%s' offload buffers and swap files.\n",
              static_cast<long long>(o.ranks_per_node), o.ranks_per_node == 1 ? "" : "s");
  print_wire_table(o, base, model);
}

}  // namespace

int estimate(int argc, char** argv) {
  if (argc == 1 && (std::strcmp(argv[0], "--help") == 0 || std::strcmp(argv[0], "-h") == 0)) {
    std::fputs(kEstimateUsage, stdout);
    return 0;
  }
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const UsageError& error) {
    std::fprintf(stderr, "zest estimate: %s\n\n%s", error.what(), kEstimateUsage);
    return 2;
  }
  Config config;
  config.precision.dtype = DType::bf16;
  try {
    // The programs' sections are theirs (as `zest config check` takes them): an example config is
    // estimated as it is trained.
    if (!o.config_path.empty()) config = load_config(o.config_path, shipped_program_sections());
  } catch (const ConfigError& error) {
    for (const ConfigProblem& problem : error.problems()) std::fprintf(stderr, "%s\n", problem.to_string().c_str());
    return 2;
  }
  if (o.dtype_given) config.precision.dtype = o.dtype;
  if (o.states) config.optimizer.states = *o.states;
  // The overrides may make a combination the engine refuses.
  if (config.optimizer.master == DType::bf16 &&
      (config.optimizer.states == StatesFormat::f32 || config.precision.dtype == DType::f32)) {
    std::fprintf(stderr,
                 "zest estimate: a bf16 master (optimizer.master in %s) needs compact moments and 16-bit parameters; "
                 "with %s states and %s parameters the engine refuses it. Drop --states fp32 / --dtype fp32\n",
                 o.config_path.c_str(), std::string(states_format_name(config.optimizer.states)).c_str(),
                 std::string(dtype_name(config.precision.dtype)).c_str());
    return 2;
  }
  try {
    print_table(o, config);
  } catch (const Error& error) {
    std::fprintf(stderr, "zest estimate: %s\n", error.what());
    return 1;
  }
  return 0;
}

}  // namespace zest::cli
