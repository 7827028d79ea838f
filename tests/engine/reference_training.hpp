// The engine tests' model and reference, shared by every backend's test: a least-squares model
// whose gradient depends on the parameters, trained with the global batch split across ranks, and
// the same training in one process in double precision with Adam written out plainly.
#pragma once

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "runtime/host/half.hpp"
#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/engine.hpp"

namespace zest::reference_training {

// Odd sizes, several tensors per group, one tiny group (resident under stage 3's threshold).
inline std::vector<ParamSpec> model() {
  return {{"embed", {331, 3}, 0}, {"w1", {37, 11}, 1}, {"b1", {5}, 1}, {"w2", {2049}, 2}, {"bias", {1}, 3}};
}

constexpr int kExamples = 8;  // global batch

inline double target(int step, int example, std::size_t tensor, std::size_t j) {
  return std::sin(0.37 * step + 1.3 * example + 0.7 * static_cast<double>(tensor) + 0.011 * static_cast<double>(j));
}
inline double weight(int example) { return 0.5 + 0.125 * example; }

// Gradient of (1/E) sum_e w_e/2 |p - t_e|^2 over examples [first, last), for one element.
inline double partial_grad(double p, int step, int first, int last, std::size_t tensor, std::size_t j) {
  double g = 0;
  for (int e = first; e < last; ++e) g += weight(e) * (p - target(step, e, tensor, j));
  return g / kExamples;
}

inline double initial(std::size_t tensor, std::size_t j) {
  return 0.5 * std::cos(0.3 * static_cast<double>(tensor) + 0.05 * static_cast<double>(j));
}

struct Options {
  int stage = 0;
  DType dtype = DType::f32;
  int accumulation = 1;
  double clip = 0;
  int overflow_at_step = -1;  // the last rank writes an Inf gradient at this step
  std::size_t max_live = std::size_t{1} << 30;
  // Offload (engine_offload_test): where optimizer states and stage 3's parameter shards live.
  OffloadDevice offload_optimizer = OffloadDevice::none;
  OffloadDevice offload_param = OffloadDevice::none;
  double offload_ratio = 1;           // offload.optimizer.ratio
  bool update_ahead = false;          // offload.optimizer.update_ahead
  int config_accumulation = 0;        // gradient_accumulation_steps when not `accumulation` (0: it)
  std::string nvme_path;              // the directory for nvme
  std::vector<std::string> nvme_dirs; // several directories (striped); when set, nvme_path is unused
  std::size_t io_block = 0;           // io.block_size (the stripe); 0: the default
  int io_threads = 1;                 // io.threads
  std::size_t sub_group_bytes = 0;    // 0: the default
  int buffer_count = 4;
  std::vector<ParamSpec> specs;       // empty: model()
  std::size_t reduce_bucket = 0;      // buckets.reduce; 0: the default
  std::size_t allgather_bucket = 0;   // buckets.allgather; 0: the default
  std::vector<OptimizerParamGroup> param_groups;  // optimizer.param_groups
  std::function<double(int step)> lr_factor;      // a schedule: every group's lr times this at `step`
  StatesFormat states = StatesFormat::f32;        // optimizer.states
  DType master = DType::f32;                      // optimizer.master
  int seed = 0;                                   // optimizer.seed
  bool secondary_host = false;                    // partition.secondary: host
  QuantizeParams quantize_params = QuantizeParams::none;  // comm.quantize.params
  QuantizeGrads quantize_grads = QuantizeGrads::none;     // comm.quantize.grads

  std::vector<std::string> nvme_paths() const {
    return nvme_dirs.empty() ? std::vector<std::string>{nvme_path} : nvme_dirs;
  }
};

inline std::vector<ParamSpec> specs_of(const Options& o) { return o.specs.empty() ? model() : o.specs; }

inline Config make_config(const Options& o) {
  Config c;
  c.stage = o.stage;
  c.device.memory = std::size_t{256} << 20;
  c.optimizer.type = OptimizerType::adamw;
  c.optimizer.lr = 0.01;
  c.optimizer.weight_decay = 0.01;
  c.optimizer.threads = 1;
  c.precision.dtype = o.dtype;
  c.precision.loss_scale.dynamic = o.dtype == DType::f16;
  c.precision.loss_scale.initial_scale_power = 8;
  c.precision.loss_scale.hysteresis = 1;
  c.gradient_clipping = o.clip;
  c.gradient_accumulation_steps = o.config_accumulation > 0 ? o.config_accumulation : o.accumulation;
  c.stage3.persistence_threshold_bytes = 1024;
  c.stage3.prefetch_bytes = 1 << 20;
  c.stage3.max_live_bytes = o.max_live;
  c.offload.optimizer.device = o.offload_optimizer;
  c.offload.param.device = o.offload_param;
  c.offload.optimizer_ratio = o.offload_ratio;
  c.offload.optimizer_update_ahead = o.update_ahead;
  c.offload.optimizer.buffer_count = c.offload.param.buffer_count = o.buffer_count;
  if (o.offload_optimizer == OffloadDevice::nvme) c.offload.optimizer.paths = o.nvme_paths();
  if (o.offload_param == OffloadDevice::nvme) c.offload.param.paths = o.nvme_paths();
  if (o.sub_group_bytes > 0) c.offload.sub_group_bytes = o.sub_group_bytes;
  if (o.io_block > 0) c.io.block_size = o.io_block;
  c.io.threads = o.io_threads;
  if (o.reduce_bucket > 0) c.buckets.reduce_bytes = o.reduce_bucket;
  if (o.allgather_bucket > 0) c.buckets.allgather_bytes = o.allgather_bucket;
  c.optimizer.param_groups = o.param_groups;
  c.optimizer.states = o.states;
  c.optimizer.master = o.master;
  c.optimizer.seed = o.seed;
  if (o.secondary_host) c.partition.secondary = SecondaryPartition::host;
  c.comm.quantize.params = o.quantize_params;
  c.comm.quantize.grads = o.quantize_grads;
  return c;
}

// Every tensor's master weights (get_param: collective).
inline std::vector<std::vector<float>> params_of(Engine& engine) {
  std::vector<std::vector<float>> result;
  for (std::size_t t = 0; t < engine.tensor_count(); ++t) {
    result.emplace_back(engine.spec(t).numel());
    engine.get_param(t, result.back());
  }
  return result;
}

// Trains `steps` steps with an engine on `device` and `comm`; returns every tensor's final master
// weights. On a host-accessible device the trainer reads parameters and writes gradients in place;
// elsewhere it goes through host copies, as a GPU trainer's kernels would write them, and finishes
// its writes (stream synchronized) before grads_ready. `before_step` runs just before each step(),
// `after_step` after each step() returns.
inline std::vector<std::vector<float>> train_engine(const Options& o, int steps, Device& device, Communicator& comm,
                                                    EngineStats* stats_out = nullptr,
                                                    const std::function<void()>& after_step = {},
                                                    const std::function<void()>& before_step = {}) {
  const std::vector<ParamSpec> specs = specs_of(o);
  Engine engine(make_config(o), device, comm, specs);
  for (std::size_t t = 0; t < specs.size(); ++t) {
    std::vector<float> values(specs[t].numel());
    for (std::size_t j = 0; j < values.size(); ++j) values[j] = static_cast<float>(initial(t, j));
    engine.set_param(t, values);
  }
  std::vector<double> base_lr;  // each optimizer group's, for the schedule
  for (int i = 0; i < engine.optimizer_group_count(); ++i) base_lr.push_back(engine.optimizer_group(i).lr);
  const bool direct = device.host_accessible();
  const std::unique_ptr<Stream> stream = direct ? nullptr : device.create_stream();
  std::vector<unsigned char> host_param, host_grad;  // the copies where the device is not the host's
  const int ranks = comm.size(), rank = comm.rank();
  const int per_micro = kExamples / o.accumulation;
  for (int step = 1; step <= steps; ++step) {
    for (int micro = 0; micro < o.accumulation; ++micro) {
      // This rank's examples of this micro-batch.
      const int base = micro * per_micro;
      const int first = base + rank * per_micro / ranks, last = base + (rank + 1) * per_micro / ranks;
      for (int g = 0; g < engine.group_count(); ++g) auto forward = engine.acquire(g);  // forward: gathers
      for (int g = engine.group_count() - 1; g >= 0; --g) {
        auto lease = engine.acquire(g);
        for (std::size_t t = 0; t < specs.size(); ++t) {
          if (specs[t].group != g) continue;
          const std::size_t bytes = specs[t].numel() * dtype_size(o.dtype);
          const void* p = lease.param(t).data;
          void* grad = lease.grad(t).data;
          if (!direct) {
            host_param.resize(bytes);
            host_grad.resize(bytes);
            device.copy_async(host_param.data(), p, bytes, *stream);
            stream->synchronize();
            p = host_param.data();
          }
          void* write = direct ? grad : host_grad.data();
          for (std::size_t j = 0; j < specs[t].numel(); ++j) {
            double value = partial_grad(load_as_float(p, o.dtype, j), step, first, last, t, j) * engine.loss_scale();
            if (step == o.overflow_at_step && rank == ranks - 1 && t == 0 && j == 0)
              value = std::numeric_limits<double>::infinity();
            store_from_float(write, o.dtype, j, static_cast<float>(value));
          }
          if (!direct) {
            device.copy_async(grad, host_grad.data(), bytes, *stream);
            stream->synchronize();
          }
        }
        engine.grads_ready(g);
      }
    }
    if (o.lr_factor)
      for (int i = 0; i < engine.optimizer_group_count(); ++i)
        engine.set_lr(i, base_lr[static_cast<std::size_t>(i)] * o.lr_factor(step));
    if (before_step) before_step();
    engine.step();
    if (after_step) after_step();
  }
  if (stats_out) *stats_out = engine.stats();
  return params_of(engine);
}

// A tensor's hyper-parameters: the first optimizer.param_groups entry whose pattern matches its
// name, over the optimizer's; the learning rate times the schedule's factor.
struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
};
inline Hyper hyper_of(const Config& c, const std::string& name, double lr_factor) {
  const auto& o = c.optimizer;
  Hyper h{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay};
  for (const OptimizerParamGroup& g : o.param_groups) {
    if (std::none_of(g.match.begin(), g.match.end(),
                     [&](const std::string& pattern) { return fnmatch(pattern.c_str(), name.c_str(), 0) == 0; }))
      continue;
    h = {g.lr.value_or(h.lr), g.beta1.value_or(h.beta1), g.beta2.value_or(h.beta2), g.eps.value_or(h.eps),
         g.weight_decay.value_or(h.weight_decay)};
    break;
  }
  h.lr *= lr_factor;
  return h;
}

// The same training in one process, in double precision, Adam written out plainly.
inline std::vector<std::vector<double>> train_reference(const Options& o, int steps) {
  const Config c = make_config(o);
  const std::vector<ParamSpec> specs = specs_of(o);
  std::vector<std::vector<double>> p, m, v;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    p.emplace_back(specs[t].numel());
    for (std::size_t j = 0; j < p[t].size(); ++j) p[t][j] = static_cast<float>(initial(t, j));
    m.emplace_back(specs[t].numel(), 0.0);
    v.emplace_back(specs[t].numel(), 0.0);
  }
  int taken = 0;
  for (int step = 1; step <= steps; ++step) {
    if (step == o.overflow_at_step) continue;  // skipped on every rank
    ++taken;
    std::vector<std::vector<double>> grad;
    double norm_sq = 0;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      grad.emplace_back(specs[t].numel());
      for (std::size_t j = 0; j < grad[t].size(); ++j) {
        grad[t][j] = partial_grad(p[t][j], step, 0, kExamples, t, j);
        norm_sq += grad[t][j] * grad[t][j];
      }
    }
    const double norm = std::sqrt(norm_sq);
    const double clip =
        c.gradient_clipping > 0 && norm > c.gradient_clipping ? c.gradient_clipping / (norm + 1e-6) : 1.0;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      const Hyper h = hyper_of(c, specs[t].name, o.lr_factor ? o.lr_factor(step) : 1.0);
      for (std::size_t j = 0; j < p[t].size(); ++j) {
        const double g = grad[t][j] * clip;
        p[t][j] *= 1 - h.lr * h.weight_decay;
        m[t][j] = h.beta1 * m[t][j] + (1 - h.beta1) * g;
        v[t][j] = h.beta2 * v[t][j] + (1 - h.beta2) * g * g;
        const double denom = std::sqrt(v[t][j]) / std::sqrt(1 - std::pow(h.beta2, taken)) + h.eps;
        p[t][j] -= h.lr / (1 - std::pow(h.beta1, taken)) * m[t][j] / denom;
      }
    }
  }
  return p;
}

// Largest |got - want| / max(1, |want|) over every element.
inline double max_relative_error(const std::vector<std::vector<float>>& got,
                                 const std::vector<std::vector<double>>& want) {
  double worst = 0;
  for (std::size_t t = 0; t < want.size(); ++t)
    for (std::size_t j = 0; j < want[t].size(); ++j)
      worst = std::max(worst, std::abs(got[t][j] - want[t][j]) / std::max(1.0, std::abs(want[t][j])));
  return worst;
}

}  // namespace zest::reference_training
