// The orchestration of a step over the engine's parts (one concern each, see src/engine/):
// GradBuckets (where backward writes gradients, their reduction), ParamGather (where parameters
// live, stage-3 leases and prefetch, the all-gather after a step), OptimizerStates (on the device,
// offloaded, or split between them; the Adam step), LossScaler; and the public API's checks.
// Checkpoints are in checkpoint_io.cpp.
#include "zest/engine.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "engine/checkpoint_io.hpp"
#include "engine/collectives/comm_levels.hpp"
#include "engine/math/device_math.hpp"
#include "engine/optimizer/device_optimizer_states.hpp"
#include "engine/collectives/grad_buckets.hpp"
#include "engine/plan/host_staging.hpp"
#include "engine/plan/layout.hpp"
#include "engine/optimizer/loss_scaler.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/offloaded_optimizer.hpp"
#include "engine/optimizer/optimizer_groups.hpp"
#include "engine/collectives/param_gather.hpp"
#include "engine/plan/shared_settings.hpp"
#include "engine/collectives/quantized_collectives.hpp"
#include "engine/optimizer/updates_ahead.hpp"
#include "engine/optimizer/split_optimizer_states.hpp"
#include "base/trace.hpp"
#include "engine/plan/step_args.hpp"
#include "offload/nvme_store.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

// The rank's swap for `target` (nvme): a file per listed directory, striped. Shared by the
// optimizer and the parameters when both list the same directories (validate refuses lists that
// only overlap): one store per directory list keeps one file per rank in each directory.
std::shared_ptr<offload::Store> nvme_store(const Config& config, const OffloadTarget& target, int rank,
                                           const std::vector<int>& cpus, std::shared_ptr<offload::Store>& shared,
                                           std::vector<std::string>& shared_paths) {
  if (target.device != OffloadDevice::nvme) return nullptr;
  if (shared && shared_paths == target.paths) return shared;
  offload::NvmeStoreOptions options;
  options.directories = target.paths;
  options.rank = rank;
  options.io = config.io;
  options.cpus = cpus;
  shared = std::make_shared<offload::NvmeStore>(std::move(options));
  shared_paths = target.paths;
  return shared;
}

}  // namespace

// offload.optimizer.update_ahead: hands each group's final gradient shard to the offloaded
// optimizer's updates ahead as its bucket is reduced, with the step's arguments as they will be if
// the step neither overflows nor clips (UpdatesAhead::hand_over); step() checks them.
struct Engine::AheadOfStep final : engine::ShardWatcher {
  AheadOfStep(State& state, engine::UpdatesAhead& updates) : s(state), ahead(updates) {}
  void final(int g, const char* shard) override;
  void changing(int g) override;
  State& s;
  engine::UpdatesAhead& ahead;
};


struct Engine::State {
  State(const Config& c, Device& d, Communicator& k, std::vector<ParamSpec> p)
      : config((validate(c), c)),
        device(d),
        // Every rank must share the settings that decide its collectives and its update, and the
        // model: one collective says which differ before any collective could hang or a shard be
        // updated otherwise.
        comms(c, k, engine::settings_ranks_share(c, p), "Engine"),
        comm(comms.world()),
        specs(std::move(p)),
        layout(specs, c.stage == 0 ? 1 : k.size()),
        plan(engine::plan_memory(c, layout, engine::SubGroups::listed, comms.host_size())),
        optimizer_group_of(engine::optimizer_groups_of(c, specs)),
        hyper(engine::optimizer_group_values(c)),
        runs(engine::hyper_runs(layout, k.rank(), optimizer_group_of, hyper)),
        states_options(engine::states_options(c, layout, k.rank())),
        scaler(c.precision.loss_scale),
        math(engine::make_device_math(d, hyper.front(), c.optimizer.threads,
                                      static_cast<std::size_t>(layout.group_count()) + runs.size())),
        comm_stream(d.create_stream()) {}

  // The parts' work runs on comm_stream and may still refer to their buffers (when construction or
  // a step failed part-way): wait for it before anything is destroyed.
  ~State() {
    try {
      comm_stream->synchronize();
    } catch (...) {
      // Destruction must not throw; a failed reduction was already reported by step().
    }
  }

  const Config config;
  Device& device;
  engine::EngineComms comms;
  CountingCommunicator& comm;  // comms.world(): the program's, counting what this rank sends
  const std::vector<ParamSpec> specs;
  const engine::Layout layout;
  const engine::MemoryPlan plan;  // every size allocated below
  const std::vector<int> optimizer_group_of;           // per tensor
  std::vector<optim::AdamHyperParams> hyper;           // per optimizer group; never resized (runs point in)
  const engine::HyperRuns runs;
  const engine::StatesOptions states_options;
  engine::LossScaler scaler;
  std::unique_ptr<engine::DeviceMath> math;
  std::unique_ptr<Stream> comm_stream;
  std::unique_ptr<engine::HostStaging> staging;
  std::unique_ptr<engine::QuantizedGather> quantized_gather;         // comm.quantize.params
  std::unique_ptr<engine::QuantizedReduceScatter> quantized_reduce;  // comm.quantize.grads
  std::unique_ptr<engine::ParamGather> params;
  std::unique_ptr<engine::GradBuckets> grads;
  std::unique_ptr<engine::OptimizerStates> states;
  engine::UpdatesAhead* updates_ahead = nullptr;  // update_ahead only; the offloaded optimizer's
  DeviceBuffer scalars;  // engine::GradStatsScalars; its two floats are reduced across ranks
  // The step's per-group inputs, sized at construction.
  std::vector<engine::StepGroup> step_groups;

  std::int64_t steps = 0, skipped = 0;
  double last_norm = 0;
  std::unique_ptr<AheadOfStep> ahead;    // update_ahead only
  Stream* compute = nullptr;             // set_compute_stream: the trainer's stream, or null
  std::unique_ptr<Event> compute_mark;   // made with the first compute stream

  // The comm stream's next work waits for what the trainer has submitted to its stream so far: an
  // event, so neither the host nor the trainer's stream waits.
  void after_compute() {
    if (!compute) return;
    compute->record(*compute_mark);
    comm_stream->wait(*compute_mark);
  }
  // Ends a lease; at stage 3 its gathered buffer may be rewritten by the next gather, on the comm
  // stream, after the trainer's reads of it.
  void release(int group) noexcept {
    if (!params->release(group)) return;
    try {
      after_compute();
    } catch (...) {
      // Destructors end leases. Without the wait the next gather may overwrite what the trainer
      // still reads; the stream's failure resurfaces at its next checked call (cuda: sticky).
    }
  }

  // Throws Error naming `operation` for an index past the last tensor.
  const ParamSpec& tensor(std::size_t t, const char* operation) const {
    if (t >= specs.size())
      throw Error(fmt::format("{}: no tensor {} (there are {})", operation, t, specs.size()));
    return specs[t];
  }
  // Throws Error unless `t` belongs to the leased `group`.
  void require_in_group(int group, std::size_t t, const char* what) const {
    const ParamSpec& spec = tensor(t, "Engine::GroupLease");
    if (spec.group != group)
      throw Error(fmt::format("Engine: {} of '{}' belongs to group {}, not to the leased group {}", what, spec.name,
                              spec.group, group));
  }
  TensorView view(std::size_t t, void* data) const {
    return {data, config.precision.dtype, specs[t].shape, layout.tensor(t).numel};
  }
  std::size_t shard_begin(int g) const { return layout.shard_begin(g, comm.rank()); }
  // Checkpoints: collective, between steps (no gradient accumulated, no lease held).
  void require_between_steps(const char* operation) {
    if (grads->any_grad() || params->any_leased())
      throw Error(std::string(operation).append(": called inside a step (a gradient is accumulated or a lease held); "
                                                "call it after step() and with every lease released"));
    after_compute();
    comm_stream->synchronize();
  }
  engine::CheckpointParts parts() {
    return {config, device, comm, *comm_stream, specs, layout, *states, *params, steps, skipped, scaler, hyper};
  }
};

Engine::Engine(const Config& config, Device& device, Communicator& comm, std::vector<ParamSpec> params)
    : state_(std::make_unique<State>(config, device, comm, std::move(params))) {
  State& s = *state_;
  // What parsing the config warned of (a deprecated key): said once, by the engine's rank 0.
  if (comm.rank() == 0)
    for (const std::string& warning : config.warnings) std::fprintf(stderr, "zest: warning: %s\n", warning.c_str());
  Stream& stream = *s.comm_stream;
  const auto groups = static_cast<std::size_t>(s.layout.group_count());
  // One NVMe store per directory: the optimizer's and the parameters' share a file when they agree.
  std::shared_ptr<offload::Store> shared_store;
  std::vector<std::string> store_path;
  std::shared_ptr<offload::Store> optimizer_store, param_store;
  if (s.plan.offload_optimizer)
    optimizer_store =
        nvme_store(config, config.offload.optimizer, comm.rank(), device.host_cpus(), shared_store, store_path);
  if (s.plan.offload_params)
    param_store = nvme_store(config, config.offload.param, comm.rank(), device.host_cpus(), shared_store, store_path);
  s.staging = std::make_unique<engine::HostStaging>(device, s.plan.engine, config.precision.dtype);
  if (s.plan.gather.quant_gather_codes > 0)
    s.quantized_gather =
        std::make_unique<engine::QuantizedGather>(device, s.comm, *s.math, s.plan.gather, config.precision.dtype);
  if (s.plan.reduce.quant_reduce_codes > 0)
    s.quantized_reduce = std::make_unique<engine::QuantizedReduceScatter>(
        device, s.comm, *s.comms.host(), s.comms.across(), *s.math, s.plan.reduce, *engine::quantized_grad_bits(config),
        config.precision.dtype);
  s.params = std::make_unique<engine::ParamGather>(engine::param_gather_options(config), device, s.comm, stream,
                                                   s.layout, s.plan, *s.staging, std::move(param_store), s.comms.host(),
                                                   s.quantized_gather.get());
  s.grads = std::make_unique<engine::GradBuckets>(engine::grad_buckets_options(config), device, s.comm, stream, *s.math,
                                                  s.layout, s.plan.reduce, *s.staging, s.quantized_reduce.get());
  // The optimizer states on the device, offloaded, or split between the two (offload.optimizer.ratio).
  const auto on_device = [&] {
    std::vector<float*> params_shards;  // the master weights, where they are the parameters
    if (s.plan.device_states.master_in_params)
      for (int g = 0; g < s.layout.group_count(); ++g)
        params_shards.push_back(reinterpret_cast<float*>(s.params->shard_out(g)));
    return std::make_unique<engine::DeviceOptimizerStates>(device, stream, *s.math, s.layout, s.plan,
                                                           config.precision.dtype, *s.staging, s.runs, s.states_options,
                                                           std::move(params_shards));
  };
  const auto offloaded = [&] {
    return std::make_unique<engine::OffloadedOptimizer>(device, s.plan.optimizer_offload,
                                                        config.precision.dtype, config.optimizer.threads,
                                                        std::move(optimizer_store), s.runs, s.states_options);
  };
  if (!s.plan.offload_optimizer) {
    s.states = on_device();
  } else if (s.plan.device_states.range.count() == 0) {
    std::unique_ptr<engine::OffloadedOptimizer> optimizer = offloaded();
    s.updates_ahead = optimizer->updates_ahead();
    s.states = std::move(optimizer);
  } else {
    s.states = std::make_unique<engine::SplitOptimizerStates>(s.layout, stream, on_device(), offloaded(),
                                                              s.plan.device_states.range.end);
  }
  // Only with offload.optimizer.update_ahead (which validation allows only with the whole optimizer
  // offloaded) is there work ahead of the step to feed.
  if (s.updates_ahead) {
    s.ahead = std::make_unique<AheadOfStep>(s, *s.updates_ahead);
    s.grads->watch(s.ahead.get());
  }
  s.scalars = device.allocate(s.plan.engine.scalars, MemoryCategory::buffers);
  s.step_groups.resize(groups);
  stream.synchronize();
}

Engine::~Engine() = default;

void Engine::AheadOfStep::final(int g, const char* shard) {
  ahead.hand_over(g, shard, engine::assumed_step_args(s.steps - s.skipped, s.scaler.scale()), *s.comm_stream);
}

void Engine::AheadOfStep::changing(int g) { ahead.retract(g, *s.comm_stream); }

std::size_t Engine::tensor_count() const { return state_->specs.size(); }
const ParamSpec& Engine::spec(std::size_t tensor) const { return state_->tensor(tensor, "Engine::spec"); }

std::size_t Engine::tensor_index(std::string_view name) const {
  const auto& specs = state_->specs;
  const auto it = std::find_if(specs.begin(), specs.end(), [&](const ParamSpec& p) { return p.name == name; });
  if (it == specs.end()) throw Error(std::string("Engine::tensor_index: no tensor named '").append(name).append("'"));
  return static_cast<std::size_t>(it - specs.begin());
}
std::size_t Engine::numel() const { return state_->layout.numel(); }
int Engine::group_count() const { return state_->layout.group_count(); }
DType Engine::dtype() const { return state_->config.precision.dtype; }
double Engine::loss_scale() const { return state_->scaler.scale(); }

// Throws Error unless `values` holds exactly the tensor's elements.
static void require_numel(const ParamSpec& spec, std::size_t given, const char* operation) {
  if (given != spec.numel())
    throw Error(
        fmt::format("{}: tensor '{}' has {} elements, given {} values", operation, spec.name, spec.numel(), given));
}

void Engine::set_param(std::size_t tensor, std::span<const float> given) {
  State& s = *state_;
  require_numel(s.tensor(tensor, "Engine::set_param"), given.size(), "Engine::set_param");
  s.after_compute();
  const float* const values = given.data();
  const auto& t = s.layout.tensor(tensor);
  // The tensor's part of this rank's shard goes to the master weights in one call, so each NVMe
  // sub-group it touches is rewritten once.
  const auto part = s.layout.shard_part(tensor, s.comm.rank());
  if (!part.empty())
    s.states->write_master(s.layout.group(t.group).shard_offset + (part.lo - part.begin), values + (part.lo - t.offset),
                           part.hi - part.lo);
  s.params->set_tensor(tensor, values);
}

void Engine::get_param(std::size_t tensor, std::span<float> given) {
  State& s = *state_;
  require_numel(s.tensor(tensor, "Engine::get_param"), given.size(), "Engine::get_param");
  float* const values = given.data();
  const auto& t = s.layout.tensor(tensor);
  const auto& g = s.layout.group(t.group);
  Stream& stream = *s.comm_stream;
  if (s.layout.partitions() == 1) return s.states->read_master(g.shard_offset + t.offset, values, t.numel);
  // Each rank fills its part, -0.0 elsewhere; a sum across ranks assembles the tensor exactly (x +
  // -0.0 is x for every x, -0.0 included, where +0.0 would turn -0.0 into +0.0). The sum runs in a
  // free gradient bucket, so nothing is allocated outside the memory plan; the bucket is all zeros
  // when free and is zeroed again after each chunk.
  const std::size_t begin = s.shard_begin(t.group), end = begin + g.shard;
  float* const staging = s.staging->f32();
  engine::Slot& assembly = s.grads->borrow(t.group);
  float* const out = assembly.buffer.as<float>();
  const std::size_t chunk = std::min(s.staging->elements(), assembly.buffer.bytes() / sizeof(float));
  for (std::size_t first = 0; first < t.numel; first += chunk) {
    const std::size_t count = std::min(chunk, t.numel - first);
    const std::size_t lo = t.offset + first, hi = lo + count;
    const std::size_t mine_lo = std::max(lo, begin), mine_hi = std::min(hi, end);
    std::fill(staging, staging + count, -0.0f);
    s.device.copy_async(out, staging, count * sizeof(float), stream);
    stream.synchronize();  // the staging is refilled next
    if (mine_lo < mine_hi) {
      s.states->read_master(g.shard_offset + (mine_lo - begin), staging, mine_hi - mine_lo);
      s.device.copy_async(out + (mine_lo - lo), staging, (mine_hi - mine_lo) * sizeof(float), stream);
    }
    s.comm.all_reduce(out, out, count, DType::f32, ReduceOp::sum, stream);
    s.device.copy_async(staging, out, count * sizeof(float), stream);
    s.device.memset_async(out, 0, count * sizeof(float), stream);
    stream.synchronize();
    std::memcpy(values + first, staging, count * sizeof(float));
  }
  s.grads->give_back(assembly);
}

int Engine::optimizer_group_count() const { return static_cast<int>(state_->hyper.size()); }

int Engine::optimizer_group_of(std::size_t tensor) const {
  state_->tensor(tensor, "Engine::optimizer_group_of");
  return state_->optimizer_group_of[tensor];
}

static std::size_t checked_optimizer_group(const std::vector<optim::AdamHyperParams>& hyper, int group,
                                           const char* operation) {
  if (group < 0 || static_cast<std::size_t>(group) >= hyper.size())
    throw Error(fmt::format("{}: no optimizer group {} (there are {}: 0 and one per optimizer.param_groups entry)",
                            operation, group, hyper.size()));
  return static_cast<std::size_t>(group);
}

OptimizerGroupOptions Engine::optimizer_group(int group) const {
  const auto& h = state_->hyper[checked_optimizer_group(state_->hyper, group, "Engine::optimizer_group")];
  return {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
}

void Engine::set_optimizer_group(int group, const OptimizerGroupOptions& o) {
  auto& h = state_->hyper[checked_optimizer_group(state_->hyper, group, "Engine::set_optimizer_group")];
  engine::check_optimizer_group(o);
  h.lr = o.lr;
  h.beta1 = o.beta1;
  h.beta2 = o.beta2;
  h.eps = o.eps;
  h.weight_decay = o.weight_decay;
}

void Engine::set_lr(int group, double lr) {
  OptimizerGroupOptions o = optimizer_group(group);
  o.lr = lr;
  set_optimizer_group(group, o);
}

Engine::GroupLease Engine::acquire(int group) {
  State& s = *state_;
  if (group < 0 || group >= s.layout.group_count())
    throw Error(fmt::format("Engine::acquire: no group {} (there are {})", group, s.layout.group_count()));
  s.params->acquire(group);
  return GroupLease(this, group);
}

Engine::GroupLease::GroupLease(GroupLease&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)), group_(other.group_) {}

Engine::GroupLease& Engine::GroupLease::operator=(GroupLease&& other) noexcept {
  if (this != &other) {
    if (engine_) engine_->state_->release(group_);
    engine_ = std::exchange(other.engine_, nullptr);
    group_ = other.group_;
  }
  return *this;
}

Engine::GroupLease::~GroupLease() {
  if (engine_) engine_->state_->release(group_);
}

TensorView Engine::GroupLease::param(std::size_t tensor) const {
  if (!engine_) throw Error("Engine::GroupLease::param: this lease was moved from; use the lease it was moved to");
  State& s = *engine_->state_;
  s.require_in_group(group_, tensor, "parameter");
  return s.view(tensor, s.params->full(group_) + dtype_size(s.config.precision.dtype) * s.layout.tensor(tensor).offset);
}

TensorView Engine::GroupLease::grad(std::size_t tensor) const {
  if (!engine_) throw Error("Engine::GroupLease::grad: this lease was moved from; use the lease it was moved to");
  engine_->state_->require_in_group(group_, tensor, "gradient");
  return engine_->grad(tensor);
}

TensorView Engine::grad(std::size_t tensor) {
  State& s = *state_;
  s.tensor(tensor, "Engine::grad");
  return s.view(tensor, s.grads->grad(tensor));
}

void Engine::grads_ready(int group) {
  State& s = *state_;
  if (group < 0 || group >= s.layout.group_count())
    throw Error(fmt::format("Engine::grads_ready: no group {} (there are {})", group, s.layout.group_count()));
  if (!s.grads->requested(group))
    throw Error(
        fmt::format("Engine::grads_ready({}): no gradient of this group was requested through a lease's grad() since "
                    "its last grads_ready",
                    group));
  s.after_compute();
  s.grads->ready(group);
}

void Engine::set_compute_stream(Stream* stream) {
  State& s = *state_;
  if (stream && !s.compute_mark) s.compute_mark = s.device.create_event();
  s.compute = stream;
}

StepResult Engine::step() {
  const trace::Span step_span("step", trace::Lane::host);
  State& s = *state_;
  // However step() returns, what this rank sent since the last one ended (the backward's reductions,
  // this step's gathers) is the last step's.
  struct StepEnd {
    engine::EngineComms& comms;
    ~StepEnd() { comms.end_step(); }
  } const step_end{s.comms};
  Stream& stream = *s.comm_stream;
  const engine::Layout& layout = s.layout;
  trace::Span wait_span("wait for reductions", trace::Lane::host);
  // Everything the step writes (parameters, in place or gathered) waits for the trainer's last
  // reads of them: the comm stream directly, the offloaded optimizer's uploads through the host's
  // wait for the statistics below.
  s.after_compute();
  s.grads->flush();
  const std::int64_t taken = s.steps - s.skipped;  // Adam steps before this one
  ++s.steps;

  // Statistics after the reductions (same stream), agreed across ranks, then read by the host. The
  // buckets compute them where the reduced gradients live (on the device, or on the host when the
  // optimizer is offloaded), so the orchestration is the same for every placement.
  auto* scalars = s.scalars.as<engine::GradStatsScalars>();
  s.grads->grad_stats(scalars);
  if (layout.partitions() > 1)
    s.comm.all_reduce(scalars->reduced, scalars->reduced, 2, DType::f32, ReduceOp::sum, stream);
  s.device.copy_async(s.staging->scalars(), scalars, sizeof(engine::GradStatsScalars), stream);
  stream.synchronize();
  wait_span.end();
  const auto& agreed = *static_cast<const engine::GradStatsScalars*>(s.staging->scalars());
  // One partition: nothing was reduced, and the double sum is exact.
  const bool reduced = layout.partitions() > 1;
  const double sum_squares = reduced ? agreed.reduced[0] : agreed.sum_squares;
  const bool overflow = reduced ? agreed.reduced[1] > 0 : agreed.nonfinite != 0;

  const double scale = s.scaler.scale();
  StepResult result;
  result.skipped = overflow || !std::isfinite(sum_squares);
  result.grad_norm = result.skipped ? 0.0 : std::sqrt(sum_squares) / scale;
  s.scaler.update(result.skipped);
  result.loss_scale = s.scaler.scale();
  s.last_norm = result.grad_norm;
  s.params->end_step();
  if (result.skipped) {
    ++s.skipped;
    if (s.updates_ahead) s.updates_ahead->skip_step();
    s.grads->end_step();
    return result;
  }

  const optim::AdamStepArgs args = engine::adam_step_args(taken, scale, result.grad_norm, s.config.gradient_clipping);
  for (int g = 0; g < layout.group_count(); ++g)
    s.step_groups[static_cast<std::size_t>(g)] = {s.grads->reduced(g), s.params->shard_out(g)};
  {
    const trace::Span span("optimizer step", trace::Lane::host);
    s.states->step(s.step_groups, args, s.params->sink());
    s.params->finish_updates();
  }
  s.grads->end_step();
  const trace::Span span("all-gather", trace::Lane::host);
  s.params->gather_all();
  return result;
}

EngineStats Engine::stats() const {
  const State& s = *state_;
  const engine::AheadCounts ahead = s.updates_ahead ? s.updates_ahead->counts() : engine::AheadCounts{};
  return {s.steps, s.skipped, s.scaler.scale(), s.last_norm, s.device.memory_stats(),
          s.states->nvme_bytes() + s.params->nvme_bytes(),
          s.states->pinned_bytes() + s.params->pinned_bytes() + s.grads->pinned_bytes(), ahead.kept, ahead.redone,
          s.comms.sent(), s.comms.last_step()};
}

void Engine::save(const std::string& dir) {
  state_->require_between_steps("Engine::save");
  engine::save_checkpoint(state_->parts(), dir);
}

LoadResult Engine::load(const std::string& dir) {
  state_->require_between_steps("Engine::load");
  return engine::load_checkpoint(state_->parts(), dir);
}

}  // namespace zest
