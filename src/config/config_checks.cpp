// Ranges first, then combinations: a value out of range is reported once, and is left out of the
// combinations it would otherwise spoil.
#include "config/config_checks.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "config/config_names.hpp"
#include "base/text.hpp"

namespace zest::detail {
namespace {

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
// Working space the device needs beyond the two buckets (scalars, norms, flags).
constexpr std::size_t kDeviceHeadroom = kMiB;
// One io_uring read or write moves at most 2GiB - 4KiB (Linux's MAX_RW_COUNT); the largest power
// of two below that is 1GiB.
constexpr std::size_t kMaxIoBlock = kGiB;

std::string found(std::string_view expected, std::string_view value) {
  return fmt::format("expected {}, found {}", expected, in_quotes(value));
}

void check_int(ProblemSink& sink, const std::string& key, int value, IntRange range) {
  if (!sink.valid(key) || (value >= range.lo && value <= range.hi)) return;
  sink.report(key, found(expected_integer(range), std::to_string(value)));
}

void check_number(ProblemSink& sink, const std::string& key, double value, const NumberRule& rule) {
  if (!sink.valid(key) || (std::isfinite(value) && rule.accepts(value))) return;
  sink.report(key, found(rule.expected, number_text(value)));
}

void check_size(ProblemSink& sink, const std::string& key, std::size_t bytes, SizeRule rule) {
  const bool ok = rule == SizeRule::any || (rule == SizeRule::positive && bytes > 0) ||
                  (rule == SizeRule::bucket && bytes >= kMinBucketBytes) ||
                  (rule == SizeRule::sub_group && bytes >= kMinSubGroupBytes) ||
                  (rule == SizeRule::io_block && bytes >= 4 * kKiB && bytes <= kMaxIoBlock &&
                   (bytes & (bytes - 1)) == 0);
  if (!sink.valid(key) || ok) return;
  std::string message = found(expected_size(rule), format_size(bytes));
  sink.report(key, fmt::format("{} ({} bytes)", message, bytes));
}

// A Config built in code can hold any value of an enum's underlying type.
template <typename Enum, std::size_t N>
void check_choice(ProblemSink& sink, const std::string& key,
                  const std::array<EnumName<Enum>, N>& names, Enum value) {
  for (const EnumName<Enum>& entry : names)
    if (entry.value == value) return;
  if (!sink.valid(key)) return;
  sink.report(key, found(expected_choice(names), std::to_string(static_cast<int>(value))));
}

void check_ranges(const Config& c, ProblemSink& sink) {
  check_int(sink, "stage", c.stage, kStageRange);
  check_choice(sink, "device.type", kDeviceTypeNames, c.device.type);
  check_choice(sink, "comm.backend", kCommBackendNames, c.comm.backend);
  check_choice(sink, "partition.secondary", kSecondaryPartitionNames, c.partition.secondary);
  check_choice(sink, "comm.quantize.params", kQuantizeParamsNames, c.comm.quantize.params);
  check_choice(sink, "comm.quantize.grads", kQuantizeGradsNames, c.comm.quantize.grads);
  check_size(sink, "buckets.reduce", c.buckets.reduce_bytes, SizeRule::bucket);
  check_size(sink, "buckets.allgather", c.buckets.allgather_bytes, SizeRule::bucket);
  check_size(sink, "stage3.max_live", c.stage3.max_live_bytes, SizeRule::positive);
  check_choice(sink, "optimizer.type", kOptimizerTypeNames, c.optimizer.type);
  check_number(sink, "optimizer.lr", c.optimizer.lr, kPositive);
  check_number(sink, "optimizer.betas[0]", c.optimizer.beta1, kUnitInterval);
  check_number(sink, "optimizer.betas[1]", c.optimizer.beta2, kUnitInterval);
  check_number(sink, "optimizer.eps", c.optimizer.eps, kPositive);
  check_number(sink, "optimizer.weight_decay", c.optimizer.weight_decay, kNonNegative);
  check_int(sink, "optimizer.threads", c.optimizer.threads, kOptimizerThreadsRange);
  check_choice(sink, "optimizer.states", kStatesFormatNames, c.optimizer.states);
  check_choice(sink, "optimizer.master", kDTypeNames, c.optimizer.master);
  check_int(sink, "optimizer.seed", c.optimizer.seed, kSeedRange);
  for (std::size_t i = 0; i < c.optimizer.param_groups.size(); ++i) {
    const OptimizerParamGroup& g = c.optimizer.param_groups[i];
    const std::string key = std::string("optimizer.param_groups[").append(std::to_string(i)).append("]");
    if (g.match.empty() && sink.valid(key))
      sink.report(key,
                  "a parameter group needs `match`: the tensor-name patterns it takes (e.g. ['*.bias', '*norm*'])");
    const auto check = [&](const char* name, const std::optional<double>& v, const NumberRule& rule) {
      if (v) check_number(sink, std::string(key).append(".").append(name), *v, rule);
    };
    check("lr", g.lr, kPositive);
    check("betas[0]", g.beta1, kUnitInterval);
    check("betas[1]", g.beta2, kUnitInterval);
    check("eps", g.eps, kPositive);
    check("weight_decay", g.weight_decay, kNonNegative);
  }
  check_choice(sink, "precision.dtype", kDTypeNames, c.precision.dtype);
  const LossScaleConfig& scale = c.precision.loss_scale;
  check_number(sink, "precision.loss_scale.static_scale", scale.static_scale, kPositive);
  check_int(sink, "precision.loss_scale.initial_scale_power", scale.initial_scale_power,
            kInitialScalePowerRange);
  check_int(sink, "precision.loss_scale.window", scale.window, kAtLeastOne);
  check_int(sink, "precision.loss_scale.hysteresis", scale.hysteresis, kAtLeastOne);
  check_number(sink, "precision.loss_scale.min_scale", scale.min_scale, kPositive);
  check_number(sink, "gradient_clipping", c.gradient_clipping, kClipping);
  check_int(sink, "gradient_accumulation_steps", c.gradient_accumulation_steps, kAtLeastOne);
  for (const auto& [prefix, target] :
       {std::pair<std::string, const OffloadTarget*>{"offload.optimizer", &c.offload.optimizer},
        {"offload.param", &c.offload.param}}) {
    check_choice(sink, prefix + ".device", kOffloadDeviceNames, target->device);
    check_int(sink, prefix + ".buffer_count", target->buffer_count, kBufferCountRange);
  }
  check_number(sink, "offload.optimizer.ratio", c.offload.optimizer_ratio, kOffloadRatio);
  check_size(sink, "offload.sub_group", c.offload.sub_group_bytes, SizeRule::sub_group);
  check_size(sink, "io.block_size", c.io.block_size, SizeRule::io_block);
  check_int(sink, "io.queue_depth", c.io.queue_depth, kQueueDepthRange);
  check_int(sink, "io.threads", c.io.threads, kIoThreadsRange);
}

void check_directory(const std::string& key, const std::string& directory, ProblemSink& sink) {
  std::string message = "nvme path ";
  message.append(in_quotes(directory));
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0) {
    const int error = errno;
    if (error == ENOENT)
      message.append(" does not exist; create the directory, or point path at an existing one");
    else
      message.append(" cannot be inspected: ").append(std::strerror(error));
    return sink.report(key, std::move(message));
  }
  if (!S_ISDIR(info.st_mode))
    return sink.report(key, message.append(" is not a directory; point path at a directory"));
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    const int error = errno;
    message.append(" is not writable (").append(std::strerror(error));
    message.append("); zest creates its swap files there, so choose a directory this user can "
                   "write");
    return sink.report(key, std::move(message));
  }
}

// The key of item `i` of a target's paths: the key itself for one directory (YAML may give it as
// a string), "key[i]" in a list, where the reader recorded each item's position.
std::string path_item_key(const std::string& path_key, const OffloadTarget& target, std::size_t i) {
  if (target.paths.size() == 1) return path_key;
  return std::string(path_key).append("[").append(std::to_string(i)).append("]");
}

// Two names of one directory (a link, "a" and "a/"): the same device and inode. Names that do not
// exist are compared as text (check_directory reports them).
bool same_directory(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  if (::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  return a == b;
}

std::string joined(const std::vector<std::string>& paths) {
  std::string text;
  for (const std::string& p : paths) text.append(text.empty() ? "" : ", ").append(in_quotes(p));
  return text;
}

void check_offload_target(const std::string& prefix, const OffloadTarget& target,
                          ProblemSink& sink) {
  const std::string device_key = prefix + ".device";
  const std::string path_key = prefix + ".path";
  if (!sink.valid(device_key) || !sink.valid(path_key)) return;
  if (target.device == OffloadDevice::nvme) {
    if (target.paths.empty()) {
      sink.report(path_key,
             "device nvme needs a path: an existing, writable directory for this rank's swap "
             "files (or a list of them, one per drive)",
             {path_key, device_key});
      return;
    }
    for (std::size_t i = 0; i < target.paths.size(); ++i) {
      const std::string key = path_item_key(path_key, target, i);
      if (target.paths[i].empty()) {
        sink.report(key, "an empty directory name; name a directory or remove the item");
        continue;
      }
      check_directory(key, target.paths[i], sink);
      for (std::size_t j = 0; j < i; ++j) {
        if (!same_directory(target.paths[j], target.paths[i])) continue;
        std::string message = fmt::format(
            "directory {} is listed twice (item {} is {}, the same directory); zest stripes the swap across the listed "
            "directories, one per drive: list each once",
            in_quotes(target.paths[i]), j, in_quotes(target.paths[j]));
        sink.report(key, std::move(message));
        break;
      }
    }
  } else if (!target.paths.empty()) {
    std::string message = fmt::format(
        "{} {} {} set but {} is {}; only nvme uses a path, so it would be silently ignored. Remove path, or set "
        "device: nvme",
        target.paths.size() == 1 ? "path" : "paths", joined(target.paths), target.paths.size() == 1 ? "is" : "are",
        device_key, in_quotes(detail::enum_name(detail::kOffloadDeviceNames, target.device)));
    sink.report(path_key, std::move(message));
  }
}

// The optimizer and the parameters share one swap (one store, one file per directory) when they
// name the same directories in the same order; lists that only overlap would put two swap files of
// the rank on one path.
void check_shared_swap(const Config& c, ProblemSink& sink) {
  const OffloadTarget& opt = c.offload.optimizer;
  const OffloadTarget& par = c.offload.param;
  if (opt.device != OffloadDevice::nvme || par.device != OffloadDevice::nvme) return;
  if (!sink.valid("offload.optimizer.path") || !sink.valid("offload.param.path") || opt.paths == par.paths) return;
  for (const std::string& a : opt.paths) {
    for (const std::string& b : par.paths) {
      if (!same_directory(a, b)) continue;
      std::string message = fmt::format(
          "directory {} is in both offload.param.path ({}) and offload.optimizer.path ({}), which are not the same "
          "list: the two share one swap only when they list the same directories in the same order. Give both the same "
          "list, or directories apart",
          in_quotes(b), joined(par.paths), joined(opt.paths));
      sink.report("offload.param.path", std::move(message));
      return;
    }
  }
}

// Compact optimizer states (docs/compact-states.md): what is not built yet is refused by name.
void check_compact_states(const Config& c, ProblemSink& sink) {
  if (sink.valid("optimizer.master") && c.optimizer.master == DType::f16) {
    sink.report("optimizer.master",
                "fp16 master weights would overflow and underflow where Adam's updates live; use fp32 or bf16 "
                "(bf16 keeps fp32's range and is rounded stochastically so small updates are not lost)");
  }
  // A bf16 master comes with compact moments (the compact Adam rounds it), and working parameters
  // of 16 bits (fp32 ones would be the bf16 master widened: no precision gained). Where the states
  // stay on a CUDA device the CUDA Adam updates them: its compact kernels keep an fp32 master; the
  // CPU Adam of an offloaded optimizer has a bf16 one.
  const bool states_on_gpu = sink.valid("device.type") && sink.valid("offload.optimizer.device") &&
                             sink.valid("offload.optimizer.ratio") && c.device.type == DeviceType::cuda &&
                             (c.offload.optimizer.device == OffloadDevice::none || c.offload.optimizer_ratio < 1.0);
  if (sink.valid("optimizer.master") && sink.valid("optimizer.states") && sink.valid("precision.dtype") &&
      c.optimizer.master == DType::bf16) {
    if (c.optimizer.states == StatesFormat::f32)
      sink.report("optimizer.master",
                  "a bf16 master needs compact moments: set optimizer.states to bf16 or int8 (6 or 4.125 bytes per "
                  "parameter with the master), or use optimizer.master: fp32",
                  {"optimizer.master", "optimizer.states"});
    else if (states_on_gpu)
      sink.report("optimizer.master",
                  "a bf16 master on a cuda device is not implemented yet: the GPU's compact Adam keeps an fp32 "
                  "master. Use optimizer.master: fp32 (optimizer.states " +
                      std::string(states_format_name(c.optimizer.states)) +
                      " stays compact on the GPU), or offload the optimizer (offload.optimizer.device: cpu or nvme, "
                      "ratio 1), where the CPU Adam keeps a bf16 master",
                  {"optimizer.master", "device.type", "offload.optimizer.device", "offload.optimizer.ratio"});
    else if (c.precision.dtype == DType::f32)
      sink.report("optimizer.master",
                  "a bf16 master with fp32 parameters gains nothing: the parameters would be the bf16 master widened. "
                  "Use precision.dtype: bf16, or optimizer.master: fp32",
                  {"optimizer.master", "precision.dtype"});
  }
}

// Settings that only a stage has: what each needs of it.
void check_stage_settings(const Config& c, ProblemSink& sink) {
  if (sink.valid("stage") && sink.valid("offload.param.device") &&
      c.offload.param.device != OffloadDevice::none && c.stage != 3) {
    sink.report("offload.param.device",
                fmt::format("offloading parameters needs stage 3, but stage is {}: below stage 3 every rank keeps the "
                            "full parameters on its device. Set stage: 3, or offload.param.device: none",
                            c.stage));
  }
  if (sink.valid("stage") && sink.valid("partition.secondary") &&
      c.partition.secondary != SecondaryPartition::none && c.stage != 3) {
    sink.report("partition.secondary",
                fmt::format("a secondary partition copies stage 3's parameter shards within each host, but stage is "
                            "{}: below stage 3 every rank keeps the full parameters and gathers nothing during "
                            "backward. Set stage: 3, or partition.secondary: none",
                            c.stage));
  }
  if (sink.valid("stage") && sink.valid("comm.quantize.params") &&
      c.comm.quantize.params != QuantizeParams::none && c.stage != 3) {
    sink.report("comm.quantize.params",
                fmt::format("quantized parameter all-gathers are stage 3's (each lease gathers the shards), but stage "
                            "is {}: below stage 3 every rank keeps full-precision parameters, gathered once after the "
                            "step, and quantizing them would leave the ranks' copies different. Set stage: 3, or "
                            "comm.quantize.params: none",
                            c.stage));
  }
  if (sink.valid("stage") && sink.valid("comm.quantize.grads") &&
      c.comm.quantize.grads != QuantizeGrads::none && c.stage == 0) {
    sink.report("comm.quantize.grads",
                "a quantized gradient reduction leaves each rank the sum of its shard, but stage 0 all-reduces "
                "every gradient in full. Set stage: 1 or higher, or comm.quantize.grads: none");
  }
  if (sink.valid("stage") && sink.valid("offload.optimizer.device") &&
      c.offload.optimizer.device != OffloadDevice::none && c.stage == 0) {
    sink.report("offload.optimizer.device",
           "offloading the optimizer needs stage 1 or higher: stage 0 keeps full optimizer states "
           "on every rank, with no partition to offload. Use stage 1+, or "
           "offload.optimizer.device: none");
  }
}

// offload.optimizer's ratio and update_ahead against the offload they refine.
void check_optimizer_offload(const Config& c, ProblemSink& sink) {
  if (sink.valid("offload.optimizer.ratio") && sink.valid("offload.optimizer.device") &&
      c.offload.optimizer.device == OffloadDevice::none && c.offload.optimizer_ratio != 1.0) {
    std::string message = "ratio ";
    message.append(number_text(c.offload.optimizer_ratio))
        .append(" offloads that fraction of the optimizer states, but offload.optimizer.device is 'none', so "
                "nothing is offloaded. Set offload.optimizer.device: cpu or nvme, or remove ratio");
    sink.report("offload.optimizer.ratio", std::move(message));
  }
  if (c.offload.optimizer_update_ahead && sink.valid("stage") && sink.valid("offload.optimizer.device") &&
      sink.valid("offload.optimizer.ratio")) {
    // The update ahead reads each gradient shard on the host as its bucket is reduced: only
    // the streamed host shard (stages 2-3, everything offloaded) exists during backward.
    std::string why;
    if (c.offload.optimizer.device == OffloadDevice::none) why = "offload.optimizer.device is 'none'";
    else if (c.stage < 2) why = fmt::format("stage is {}", c.stage);
    else if (c.offload.optimizer_ratio != 1.0)
      why = std::string("ratio is ").append(number_text(c.offload.optimizer_ratio));
    if (!why.empty())
      sink.report("offload.optimizer.update_ahead",
                  "update_ahead updates offloaded states during backward from gradient shards on the host, which "
                  "needs stage 2 or 3 with the whole optimizer offloaded (device cpu or nvme, ratio 1), but " +
                      why + ". Set those, or update_ahead: false");
  }
}

// comm.backend against the device its collectives run on.
void check_backend(const Config& c, ProblemSink& sink) {
  if (sink.valid("comm.backend") && sink.valid("device.type")) {
    if (c.comm.backend == CommBackend::nccl && c.device.type == DeviceType::cpu)
      sink.report("comm.backend",
             "nccl runs collectives on GPUs only, but device.type is cpu. Use backend: mpi (or "
             "auto, which picks mpi for cpu), or device.type: cuda");
    if (c.comm.backend == CommBackend::mpi && c.device.type == DeviceType::cuda)
      sink.report("comm.backend",
             "with device.type cuda, collectives on device buffers run on nccl; mpi only serves "
             "cpu devices. Use backend: nccl (or auto, which picks nccl for cuda), or "
             "device.type: cpu");
  }
}

// A stated device budget must hold the buckets and some working space.
void check_device_memory(const Config& c, ProblemSink& sink) {
  // A cuda budget of 0 means "what the GPU has", so only a stated budget can be too small.
  if (sink.valid("device.type") && sink.valid("device.memory") && sink.valid("buckets.reduce") &&
      sink.valid("buckets.allgather") &&
      (c.device.type == DeviceType::cpu || c.device.memory != 0)) {
    std::size_t needed = 0;
    const bool overflow =
        __builtin_add_overflow(c.buckets.reduce_bytes, c.buckets.allgather_bytes, &needed) ||
        __builtin_add_overflow(needed, kDeviceHeadroom, &needed);
    if (overflow || c.device.memory < needed) {
      std::string message = format_size(c.device.memory);
      message.append(" cannot hold the buckets: it needs at least ");
      message.append(overflow ? std::string("more than 2^64 bytes") : format_size(needed));
      message.append(" (buckets.reduce ").append(format_size(c.buckets.reduce_bytes));
      message.append(" + buckets.allgather ").append(format_size(c.buckets.allgather_bytes));
      message.append(" + 1MiB of working space)");
      if (c.device.memory == 0) message.append("; 0 means \"all the GPU has\" only for cuda");
      message.append(". Raise device.memory or shrink the buckets");
      sink.report("device.memory", std::move(message),
             {"device.memory", "buckets.reduce", "buckets.allgather", "device"});
    }
  }
}

// Loss scaling is fp16's; its floor below its start.
void check_loss_scale(const Config& c, ProblemSink& sink) {
  const LossScaleConfig& scale = c.precision.loss_scale;
  if (sink.valid("precision.dtype") && c.precision.dtype != DType::f16) {
    const std::string dtype(detail::enum_name(detail::kDTypeNames, c.precision.dtype));
    if (sink.valid("precision.loss_scale.dynamic") && scale.dynamic) {
      std::string message = "dynamic loss scaling is for fp16 only, but dtype is ";
      message.append(dtype).append(
          ": fp32 and bf16 have fp32's exponent range, so small gradients do not underflow and "
          "need no loss scaling. Remove the key or set it to false, or use dtype: fp16");
      sink.report("precision.loss_scale.dynamic", std::move(message));
    }
    if (sink.valid("precision.loss_scale.static_scale") && scale.static_scale != 1.0) {
      std::string message = fmt::format(
          "{} would be ignored: dtype {} always uses a loss scale of 1 (only fp16 needs scaling). Remove the key or "
          "set it to 1, or use dtype: fp16",
          number_text(scale.static_scale), dtype);
      sink.report("precision.loss_scale.static_scale", std::move(message));
    }
  }
  if (sink.valid("precision.dtype") && c.precision.dtype == DType::f16 && scale.dynamic &&
      sink.valid("precision.loss_scale.initial_scale_power") &&
      sink.valid("precision.loss_scale.min_scale")) {
    const double initial = std::ldexp(1.0, scale.initial_scale_power);
    if (scale.min_scale > initial) {
      std::string message = fmt::format(
          "{} is above the initial scale 2^{} = {}; the scale would start below its own floor. Lower min_scale or "
          "raise initial_scale_power",
          number_text(scale.min_scale), scale.initial_scale_power, number_text(initial));
      sink.report("precision.loss_scale.min_scale", std::move(message),
             {"precision.loss_scale.min_scale", "precision.loss_scale.initial_scale_power"});
    }
  }
}

void check_combinations(const Config& c, ProblemSink& sink) {
  check_compact_states(c, sink);
  check_stage_settings(c, sink);
  check_optimizer_offload(c, sink);
  check_offload_target("offload.optimizer", c.offload.optimizer, sink);
  check_offload_target("offload.param", c.offload.param, sink);
  check_shared_swap(c, sink);
  check_backend(c, sink);
  check_device_memory(c, sink);
  check_loss_scale(c, sink);
}

bool positive(double x) { return x > 0; }
bool non_negative(double x) { return x >= 0; }
bool unit_interval(double x) { return x >= 0 && x < 1; }
bool fraction(double x) { return x > 0 && x <= 1; }

}  // namespace

const NumberRule kPositive{"a number > 0", positive};
const NumberRule kNonNegative{"a number >= 0", non_negative};
const NumberRule kUnitInterval{"a number >= 0 and < 1", unit_interval};
const NumberRule kClipping{"a number >= 0 (0 turns clipping off)", non_negative};
const NumberRule kOffloadRatio{"a number > 0 and <= 1 (the fraction of the optimizer states offloaded; 1 offloads "
                               "them all)",
                               fraction};

std::string expected_integer(IntRange range) {
  std::string expected = "an integer ";
  if (range.hi == INT_MAX) return expected.append(">= ").append(std::to_string(range.lo));
  expected.append("from ").append(std::to_string(range.lo));
  return expected.append(" to ").append(std::to_string(range.hi));
}

std::string expected_size(SizeRule rule) {
  switch (rule) {
    case SizeRule::positive: return "a size of at least 1 byte (e.g. 512KiB, 25MiB)";
    case SizeRule::io_block:
      return "a power of two from 4KiB to 1GiB (O_DIRECT moves whole aligned blocks; one read "
             "moves at most 2GiB)";
    case SizeRule::bucket:
      return "a size of at least 4B (e.g. 25MiB): a bucket holds at least one element (4 bytes in fp32); any "
             "size below the smallest group (64 elements) already gives every group a bucket of its own";
    case SizeRule::sub_group:
      return "a size of at least 768B (e.g. 256MiB): a sub-group holds at least 64 parameters (the shard "
             "alignment) whose master, m and v take 12 bytes each; a smaller one would be rounded up silently";
    case SizeRule::any: break;
  }
  return "a size (e.g. 4096, 512KiB, 25MiB, 1.5GiB)";
}

std::string number_text(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

void check_config(const Config& config, ProblemSink& sink) {
  check_ranges(config, sink);
  check_combinations(config, sink);
}

}  // namespace zest::detail
