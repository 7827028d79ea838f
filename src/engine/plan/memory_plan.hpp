// Every size the engine allocates, computed in one place from the config and the layout: the
// Engine constructor, the offloaded optimizer and the parameter offload take their sizes from here,
// and `zest estimate` (zest/estimate.hpp) reports the same figures without building an engine, so
// the estimate cannot drift from what the engine really holds.
//
// The plan comes in parts, one per step of plan_memory and each for the classes that allocate it:
// the parameters on the device (ParamsPlan: ParamGather), the optimizer states kept there
// (DeviceStatesPlan: DeviceOptimizerStates), the gradients and their reduction (ReducePlan:
// GradBuckets, QuantizedReduceScatter), stage 3's gathered buffers and the gather after a step
// (GatherPlan: ParamGather, QuantizedGather), the engine's own buffers (EnginePlan: the Engine,
// HostStaging), and the two offloads (OptimizerOffloadPlan, ParamOffloadPlan). MemoryPlan holds the
// parts and the totals.
//
// All figures are per rank. The engine allocates everything at construction and nothing larger
// during a step, so the device figures are also its peaks.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <vector>

#include "engine/plan/layout.hpp"
#include "optim/block_quant_math.hpp"
#include "optim/states_layout.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/host_purpose.hpp"

namespace zest::engine {

// set_param/get_param move a tensor through pinned memory in chunks of at most this many elements,
// so the staging stays small however large the largest tensor is.
inline constexpr std::size_t kStagingElements = std::size_t{1} << 20;
// The step's scalars sit at the start of the engine's pinned block; the staging follows, aligned.
inline constexpr std::size_t kScalarsBytes = 256;
// The NVMe store's region alignment (O_DIRECT): regions are padded to it on disk and in the
// pinned buffers they move through. engine_estimate_test checks it against a real NvmeStore.
inline constexpr std::size_t kNvmeAlignment = 4096;
// Offload staging slots start on 256-byte boundaries, as device allocations do.
inline constexpr std::size_t kOffloadSlotAlign = 256;

// Elements [begin, end) of the rank's shard buffer.
struct ShardRange {
  std::size_t begin = 0, end = 0;
  std::size_t count() const { return end - begin; }
};

// One piece of the offloaded optimizer's pipeline: the parameters of one group's shard whose states
// fit sub_group_bytes (12 bytes per parameter in fp32; optim::StatesLayout), a multiple of kAlign.
struct SubGroupPlace {
  int group = 0;
  std::size_t offset = 0;    // in the shard buffer, elements
  std::size_t in_group = 0;  // from the start of the group's shard
  std::size_t count = 0;
  // Of the group's part in the offloaded range (all of it, but for the group that a partial offload
  // cuts).
  bool first_of_group = false;
  bool last_of_group = false;
};

struct OptimizerOffloadPlan {
  ShardRange range;                      // the elements whose states are offloaded
  std::size_t slots = 0;                 // offload.optimizer.buffer_count
  optim::StatesForm states;              // optimizer.states and optimizer.master
  std::size_t sub_group_elements = 0;    // the most one sub-group holds (offload.sub_group's worth, aligned)
  std::size_t sub_group_count = 0;
  // One entry per sub-group, only with SubGroups::listed (the engine keeps a region and a pipeline
  // entry per sub-group); the sizes below never need it, so an estimate stays small however many
  // sub-groups a model has.
  std::vector<SubGroupPlace> sub_groups;
  std::size_t largest = 0;               // elements of the largest sub-group
  // The step reads the gradients in place from ReducePlan's host shard (grads_on_host): no
  // gradient staging.
  bool grads_on_host = false;
  std::size_t grad_slot_bytes = 0;       // one gradient (and one output) staging slot
  std::size_t staging_bytes = 0;         // the output staging: slots slots
  std::size_t grad_staging_bytes = 0;    // the gradient staging: as many, or 0 with grads_on_host
  std::size_t states_bytes = 0;          // cpu: master, m, v (and scales) of the range
  std::size_t state_slot_bytes = 0;      // nvme: one sub-group's master, m, v (and scales), store-aligned
  std::size_t state_slots_bytes = 0;     // nvme: slots of them
  // offload.optimizer.update_ahead: sub-groups are updated during backward into a second copy of their
  // states (cpu: spare_states_bytes of pinned memory; nvme: a second region each, in nvme_bytes),
  // which becomes the current one when the step commits, and their updated parameters wait in
  // updated_params_bytes (the range in dtype) until then.
  bool update_ahead = false;
  std::size_t spare_states_bytes = 0;
  std::size_t updated_params_bytes = 0;
  std::size_t pinned_bytes = 0;
  std::size_t nvme_bytes = 0;
};

struct ParamOffloadPlan {
  std::vector<bool> offloaded;  // per group: its shard lives off the device (not resident)
  std::size_t shards_bytes = 0;   // cpu: every group's shard
  std::size_t slot_bytes = 0;     // nvme: the largest offloaded shard, store-aligned
  std::size_t staging_bytes = 0;  // nvme: one fetch slot per gathered-parameter buffer
  std::size_t updates_bytes = 0;  // nvme: two update buffers
  std::size_t pinned_bytes = 0;
  std::size_t nvme_bytes = 0;
};

// Groups whose full parameters step() rebuilds from the updated shards with one all-gather: one
// group (gathered in place, no bucket) or several consecutive ones (through the gather bucket).
struct GatherRun {
  std::vector<int> groups;  // in layout order
  std::size_t shard = 0;    // elements: the groups' shards together, one rank's piece of the run
};

// The parameters on the device (plan_params).
struct ParamsPlan {
  // Device buffers, bytes (0: not allocated).
  std::size_t full_params = 0;           // stages 0-2: every segment
  std::size_t param_shards = 0;          // stage 3 without parameter offload
  std::vector<std::size_t> resident;     // stage 3, per group: the full segment, or 0
  // partition.secondary: host (stage 3, several ranks): 1/secondary_ranks of every non-resident
  // group's full parameters, this rank's slice of it among its host's ranks (params).
  int secondary_ranks = 0;               // ranks per host; 0 without a secondary partition
  std::size_t secondary_params = 0;
};

// The optimizer states kept on the device (plan_device_states).
struct DeviceStatesPlan {
  // The optimizer states of `range` stay on the device; the rest of the shard (from range.end) is
  // offloaded (offload.optimizer.ratio of it, see plan_memory).
  ShardRange range;
  std::size_t bytes = 0;                 // master, m, v (and scales) of range (StatesLayout)
  // fp32 parameters and an fp32 master, nothing offloaded: the master weights are the parameters'
  // own shard (ParamGather::shard_out), updated in place as torch's AdamW updates its parameters,
  // and `bytes` holds m and v only (fp32 states: 8 bytes per parameter instead of 12; bf16 4
  // instead of 8; int8 2.125 instead of 6.125).
  bool master_in_params = false;
  // Offloaded parameters (stage 3): where a group's update leaves the device, the largest part of a
  // group's shard inside range.
  std::size_t update_out = 0;
};

// The gradients and their reduction (plan_reduce).
struct ReducePlan {
  // The accumulated gradient: full segments (stages 0, 1) or this rank's shards (stages 2, 3), on
  // the device, or, when the whole optimizer is offloaded at stages 2-3 (grads_on_host), in pinned
  // host memory: the CPU Adam reads it there, so the device keeps only the reduce buckets, and each
  // bucket's shard part goes to the host as soon as it is reduced. Where offload.optimizer.ratio
  // keeps some states on the device, the device's Adam needs its gradients there: the shard stays.
  std::size_t grads = 0;                 // device
  bool grads_on_host = false;
  std::size_t host_grads = 0;            // pinned: the shard
  // Pinned: where a bucket's shard parts land to be added to the host shard (a gradient's second
  // micro-batch); a bucket's shard parts are at most bucket_elements / partitions elements.
  std::size_t grad_landing = 0;
  // Gradient staging: kStagingSlots reduce buckets of bucket_elements each (in dtype), so backward
  // writes into one while the other reduces.
  std::size_t bucket_elements = 0;
  std::size_t bucket_fill = 0;  // groups share a bucket up to this many elements (buckets.reduce)
  std::size_t staging_slot = 0;
  static constexpr std::size_t kStagingSlots = 2;
  // Stages 1-3 on several ranks, where a bucket can hold several groups: the reduce-scatter's send
  // buffer, a bucket's groups packed rank-major (rank r's shards of each, one after another), as
  // ZeRO's byte count needs (an all-reduce moves twice the bytes). One: reductions run in order.
  std::size_t reduce_pack = 0;
  // comm.quantize.grads (stages 1-3, several ranks): the most elements of one rank's piece of a
  // reduction (a bucket's shards), the codes of every rank's piece (one buffer to send, one to
  // receive, each this large) and the fp32 sums of one piece per host (buffers).
  std::size_t quant_reduce_piece = 0;
  std::size_t quant_reduce_codes = 0;
  std::size_t quant_reduce_sums = 0;
};

// Stage 3's gathered buffers and the gather after each step (plan_gather).
struct GatherPlan {
  std::size_t gathered_slot = 0;         // stage 3: full parameters of one non-resident group
  std::size_t gathered_count = 0;
  std::size_t gathered_shard = 0;        // stage 3, offloaded parameters: per gathered buffer
  // comm.quantize.params (stage 3, several ranks, some group not resident): every rank's int8
  // records of the largest group's shard (as gathered_slot, sized by the largest segment), the
  // codes of one quantized all-gather.
  std::size_t quant_gather_codes = 0;
  // After each step (config buckets.allgather): the groups whose full parameters are rebuilt
  // (stages 1-2: every group; stage 3: the resident ones; stage 0: none) in runs of consecutive
  // groups whose gathered bytes fit in buckets.allgather (one partition: a run per group). The
  // bucket holds the largest run of several groups (0 when none), rank-major.
  std::vector<GatherRun> gather_runs;
  std::size_t gather_bucket = 0;
};

// The engine's own buffers (plan_engine).
struct EnginePlan {
  std::size_t scalars = 0;  // device: the step's scalars (GradStatsScalars)
  // Pinned host memory of the engine itself: the scalars, then set_param/get_param staging.
  std::size_t staging_elements = 0;
  std::size_t pinned = 0;
};

struct MemoryPlan {
  bool offload_optimizer = false;        // some of the optimizer states (optimizer_offload.range)
  bool offload_params = false;
  ParamsPlan params;
  DeviceStatesPlan device_states;
  ReducePlan reduce;
  GatherPlan gather;
  EnginePlan engine;
  OptimizerOffloadPlan optimizer_offload;
  ParamOffloadPlan param_offload;

  // Totals.
  std::array<std::size_t, kMemoryCategoryCount> device{};  // by MemoryCategory
  std::size_t device_total = 0;
  std::size_t pinned_total = 0;  // engine + offload
  std::size_t nvme_total = 0;
};

// comm.quantize.grads' codes where the stage reduces quantized (stages 1-3), or none.
std::optional<optim::QuantBits> quantized_grad_bits(const Config& config);

// The part of group g's shard inside `range` (empty where they do not meet).
ShardRange group_part(const Layout& layout, int g, ShardRange range);

// Whether plan_memory lists the offloaded optimizer's sub-groups (OptimizerOffloadPlan::sub_groups):
// the engine needs the list, an estimate only the sizes, which come in closed form per group.
enum class SubGroups { sizes_only, listed };

// The sizes for `config` over `layout` (partitions = 1 for stage 0, the world size otherwise), with
// `host_ranks` ranks on each host (partition.secondary, comm.quantize.grads; 0: every rank on one). Time and memory
// grow with the layout's groups and tensors, and with the sub-groups only when listed. Throws Error when host_ranks
// does not divide the partitions.
MemoryPlan plan_memory(const Config& config, const Layout& layout, SubGroups sub_groups = SubGroups::listed,
                       int host_ranks = 0);

}  // namespace zest::engine
