// Engine: the partitioned optimizer a trainer links in place of its own.
//
// The trainer registers its parameters (name, shape, group) once; the engine lays them out in
// flat, aligned buffers, one segment per group, each split into equal per-rank shards (padded, never
// a silent fall-back), and keeps what the configured ZeRO stage says each rank keeps:
//   stage 0  full params, full grads, full optimizer states (plain data parallel)
//   stage 1  full params, full grads, optimizer states of this rank's shard
//   stage 2  full params, gradient and optimizer-state shards
//   stage 3  parameter, gradient and optimizer-state shards; a group's full parameters exist only
//            while the trainer holds a lease on it (small groups stay resident)
// Master weights, Adam's m and v are fp32; parameters and gradients use precision.dtype.
//
// One training step (with gradient_accumulation_steps = K micro-batches):
//
//   for (int micro = 0; micro < K; ++micro) {
//     for (int g : forward_order) { auto lease = engine.acquire(g); /* forward with lease.param(i) */ }
//     for (int g : backward_order) {
//       auto lease = engine.acquire(g);
//       /* backward: write each tensor's gradient of (loss * engine.loss_scale()) to engine.grad(i) */
//       engine.grads_ready(g);   // its bucket is reduced on the comm stream once full; backward goes on
//     }
//   }
//   zest::StepResult result = engine.step();
//
// Gradients are summed over ranks (and micro-batches): the trainer divides its loss by the global
// number of examples in the step. Buckets (config buckets.reduce): groups share a gradient bucket
// in the order the trainer asks for their gradients (grad()), as long as they fit within
// buckets.reduce bytes (a larger group fills a bucket alone); one collective reduces a bucket once
// every group in it is ready and it is full, or the next group does not fit, or step() is called.
// Two buckets exist (each max(buckets.reduce, the largest group), at most every group together): a
// trainer may hold gradients it has not handed over in at most two of them. After step() and
// load(), the updated parameters are all-gathered likewise (config buckets.allgather): consecutive
// groups whose full parameters fit in buckets.allgather bytes together share one collective through
// a bucket of the largest such run; a larger group is gathered in place.
// Threading: one host thread drives an Engine. Every rank makes the same calls in the same order
// (acquire/grads_ready/step are collective where the stage needs it).
// Each engine issues its collectives from a comm stream of its own: two engines with collectives
// in flight at once need a Communicator each (make_mpi_communicator again duplicates the MPI
// communicator), or their collectives may pair up differently on different ranks.
//
// Offload (config offload.*): optimizer.device cpu|nvme keeps this rank's fp32 master weights and
// Adam moments in pinned host memory or in an NVMe swap file (DIRECTORY/zest-<host>-<pid>-<random>/
// zest-rank<rank>.swap: a directory of the engine's own, created exclusively and locked, so any
// number of engines and jobs share DIRECTORY) and runs the step as a pipeline of sub-groups on the host;
// param.device cpu|nvme (stage 3) keeps the parameter shards there too, fetched before each gather.
// Results are bit-identical to the same run without offload. With offload.optimizer.update_ahead
// the offloaded states of each group are updated while backward goes on, as soon as the group's
// gradients are reduced for the last micro-batch (gradient_accumulation_steps), and step() keeps
// or redoes that work (bit-identical either way; EngineStats counts both). After an IoError from
// step() the offloaded state is partly updated: the engine refuses further steps; rebuild it and
// set or load its weights again.
//
// Backends: the engine runs on any Device (its math sits behind an internal interface). The views
// lease.param() and grad() hand out are device memory: on cpu the trainer reads and writes them directly; on cuda
// its kernels do. The engine works on streams of its own, so it must know when the trainer's
// device work is done: either the trainer finishes it before each call (its stream synchronized
// before grads_ready(), a lease's end and step()), or it names its stream with
// set_compute_stream() and the engine orders itself after that stream with events. When acquire()
// and step() return, the parameters they make available are complete on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/host_purpose.hpp"

namespace zest {

struct ParamSpec {
  std::string name;  // unique and not empty: checkpoints and optimizer parameter groups use it
  std::vector<std::size_t> shape;
  int group = 0;  // a layer: gathered, released and reduced together; groups are contiguous runs
  std::size_t numel() const;  // throws Error when the shape's product overflows
};

// A tensor the engine hands out: device memory (on cpu, host memory the trainer reads and writes),
// with its element type and its registered shape. Valid as long as the call that gave it says.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::span<const std::size_t> shape;  // the ParamSpec's, owned by the engine
  std::size_t numel = 0;
  template <class T>
  T* as() const { return static_cast<T*>(data); }
};

// The Adam hyper-parameters of one optimizer parameter group, as the next step will use them.
struct OptimizerGroupOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct StepResult {
  bool skipped = false;    // an Inf/NaN gradient on some rank (fp16 overflow): nothing was updated
  double grad_norm = 0.0;  // global L2 norm of the unscaled gradient, before clipping
  double loss_scale = 1.0; // the scale for the next step
};

struct LoadResult {
  std::int64_t steps = 0;  // the checkpoint's step count, now the engine's
  // The saving run's settings that differ from this engine's ("lr: 0.001 in the checkpoint,
  // 0.0005 now"): the checkpoint loads all the same; the trainer decides whether that is intended.
  std::vector<std::string> config_changes;
};

struct EngineStats {
  std::int64_t steps = 0;          // optimizer steps attempted
  std::int64_t skipped_steps = 0;
  double loss_scale = 1.0;
  double last_grad_norm = 0.0;
  MemoryStats memory;              // this rank's device memory by category, current and peak
  // Offload (config offload.*): bytes this rank keeps in its NVMe swap file, and the pinned host
  // memory the offloaded optimizer and parameters hold, with the gradient shard it keeps on the host
  // when the whole optimizer is offloaded (also counted in Device::pinned_stats).
  std::size_t nvme_bytes = 0;
  std::size_t offload_pinned_bytes = 0;
  // offload.optimizer.update_ahead, over all steps: groups whose update during backward a step kept,
  // and groups updated during backward whose work a step dropped and redid (it clipped, a
  // hyper-parameter changed after the group's gradients were handed over) or dropped (it was
  // skipped). A group whose gradient changed again (a micro-batch beyond
  // gradient_accumulation_steps) counts in neither.
  std::int64_t groups_updated_ahead = 0;
  std::int64_t groups_redone = 0;
  // Bytes this rank sent over the engine's communicator (zest/communicator.hpp's WireBytes: by
  // collective, inside its host and across hosts): since construction, and in the last step, i.e.
  // everything from the end of the step before (or construction) to the end of this one: its
  // backward's reductions and its gathers, and any get_param or load() called in between.
  WireBytes wire;
  WireBytes wire_last_step;
};

class Engine {
 public:
  // Throws ConfigError/Error on an unusable parameter list (empty, a group that is not one
  // contiguous run, a zero-sized tensor) and OutOfDeviceMemory when the stage's share does not fit.
  Engine(const Config& config, Device& device, Communicator& comm, std::vector<ParamSpec> params);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Tensors are numbered in registration order. Out-of-range indices and unknown names throw Error.
  std::size_t tensor_count() const;
  std::size_t tensor_index(std::string_view name) const;
  const ParamSpec& spec(std::size_t tensor) const;
  std::size_t numel() const;                 // parameters, without padding
  int group_count() const;                   // communication groups (layers)
  DType dtype() const;                       // of parameters and gradients on the device

  // Sets a tensor's value from fp32 host values (exactly spec(tensor).numel() of them, else Error),
  // identical on every rank: master weights and device parameters. Collective. Call before training
  // (or to overwrite weights).
  void set_param(std::size_t tensor, std::span<const float> values);
  // Reads a tensor's fp32 master weights into `values` (exactly numel() of them) on every rank.
  // Collective.
  void get_param(std::size_t tensor, std::span<float> values);

  // Optimizer parameter groups (config optimizer.param_groups; independent of the communication
  // groups above): group 0 holds the tensors no pattern matches, with the optimizer's own values;
  // group i >= 1 is param_groups[i - 1]. Changes take effect at the next step() and must be the
  // same on every rank (each rank updates its own shard with its own values). save() records the
  // current values and load() restores them, so a schedule resumes where it was.
  int optimizer_group_count() const;
  int optimizer_group_of(std::size_t tensor) const;
  OptimizerGroupOptions optimizer_group(int group) const;
  // Throws Error for a group out of range or a value no step can use (lr <= 0, betas outside
  // [0, 1), eps <= 0, weight decay < 0, any of them not finite); nothing changes then.
  void set_optimizer_group(int group, const OptimizerGroupOptions& options);
  void set_lr(int group, double lr);  // set_optimizer_group with only the learning rate changed

  // Checkpoints. Collective; call between steps (no gradient accumulated, every rank the same).
  // save writes this rank's fp32 master weights, Adam's m and v, per tensor range of its shard (one
  // file per state), and rank 0 a manifest (model, step counts, loss scaler, settings, a CRC32C per
  // 4 MiB chunk of every file) into DIR.tmp-<pid>, then swaps it into DIR atomically: a crash at any
  // point leaves DIR holding the previous checkpoint or the new one. Offloaded states go from the
  // host or the NVMe swap file to the checkpoint without passing through device memory.
  // load reads a checkpoint written by any world size and stage into this engine's layout; each rank
  // reads only the ranges of its own shard. It checks the manifest against this model, the files'
  // sizes and the checksum of every chunk it needs first, and throws Error/IoError naming the file
  // and the problem (another model, a missing or truncated file, a checksum mismatch, a newer
  // format) with the engine unchanged. It then sets the optimizer states and the parameters and
  // restores the step counts and the loss scale; the configuration stays this engine's (the result
  // lists the settings that differ).
  void save(const std::string& dir);
  LoadResult load(const std::string& dir);

  // Device access to one group for forward or backward. Holding a lease keeps the group's full
  // parameters alive (stage 3: gathered, and released when the lease ends).
  //
  // Which pointers stay put (so a framework can alias its tensors to them without copies): at
  // stages 0-2, and for stage 3's resident groups (smaller than stage3.persistence_threshold),
  // param(t).data is the same address from construction to destruction, and the engine writes
  // there only inside step() and load() (and set_param). A stage-3 group's gathered parameters
  // live in a pool slot: valid while a lease on the group is held, possibly elsewhere next time.
  // A trainer's write to param(t).data between steps reaches the optimizer only at stages 0-2
  // with fp32 parameters and an fp32 master on the device (MemoryPlan::master_in_params: the parameters
  // are the master weights, as torch's are); elsewhere the next step overwrites it from the master
  // (set_param writes both).
  // Gradient pointers (grad()) are valid from the call until the group's grads_ready().
  class GroupLease {
   public:
    GroupLease(GroupLease&&) noexcept;
    GroupLease& operator=(GroupLease&&) noexcept;
    ~GroupLease();
    // The tensor's parameters (dtype()). The tensor must belong to the group; a moved-from lease
    // throws Error.
    TensorView param(std::size_t tensor) const;
    // Engine::grad for a tensor of the leased group.
    TensorView grad(std::size_t tensor) const;

   private:
    friend class Engine;
    GroupLease(Engine* engine, int group) : engine_(engine), group_(group) {}
    Engine* engine_ = nullptr;
    int group_ = -1;
  };
  GroupLease acquire(int group);

  // Where backward writes (overwrites) the tensor's gradient of this micro-batch, until its group's
  // grads_ready(). Needs no lease: at stage 3 a trainer hands gradients over without gathering
  // parameters. The group's tensors share one place (a bucket), taken at the group's first grad().
  TensorView grad(std::size_t tensor);

  // The group's gradients for this micro-batch are written (cuda: the writes have completed): they
  // are reduced across ranks with their bucket (and added to the accumulated gradient) on the comm
  // stream while the trainer goes on. A later grad() of the group starts a new contribution (the
  // next micro-batch), added to this one. Throws Error when no grad() of the group came since its
  // last grads_ready.
  void grads_ready(int group);

  // After the last micro-batch: reduces the last bucket, waits for the reductions, checks overflow
  // on every rank, computes the global gradient norm, clips, updates this rank's shard with Adam,
  // and makes the updated parameters available again (all-gather where the stage shards them).
  // Collective. Throws Error, changing nothing, when a group's grad() was asked for without its
  // grads_ready, and IoError when the offload's swap file fails (see Offload above).
  StepResult step();

  // The stream the trainer computes on when that work runs asynchronously to the host (cuda: e.g.
  // torch's current stream, through Device::borrow_stream); null (the default): the trainer's
  // device work is finished when it calls the engine. With a stream, the engine's work that reads or
  // rewrites the trainer's memory waits for what was submitted to that stream before the call
  // (recorded there as an event the engine's streams wait on; the host does not wait):
  // grads_ready() before reducing the group's gradients, the end of a stage-3 lease before its
  // gathered buffer is reused, step(), set_param(), save() and load() before they write parameters.
  // The stream must outlive its use here; set another (or null) whenever the trainer's changes.
  void set_compute_stream(Stream* stream);

  // The factor the trainer multiplies its loss by before backward (1 unless fp16 loss scaling).
  double loss_scale() const;
  EngineStats stats() const;

 private:
  struct State;
  struct AheadOfStep;
  std::unique_ptr<State> state_;
};

}  // namespace zest
