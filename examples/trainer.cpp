#include "trainer.hpp"

#include <algorithm>
#include <string>

#include <fmt/core.h>

#include "base/trace.hpp"
#include "runtime/host/half.hpp"

namespace zest::train {
namespace {

void to_float(const void* src, DType dtype, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = load_as_float(src, dtype, i);
}

// dst = src * scale, in the engine's dtype.
void store_scaled(const float* src, double scale, void* dst, DType dtype, std::size_t n) {
  const float s = static_cast<float>(scale);
  for (std::size_t i = 0; i < n; ++i) store_from_float(dst, dtype, i, src[i] * s);
}

std::size_t largest_slice(std::size_t micro_batch, int world) {
  std::size_t most = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, charlm::rank_slice(micro_batch, r, world).count);
  return most;
}

}  // namespace

std::vector<ParamSpec> engine_params(const charlm::CharMlp& model) {
  std::vector<ParamSpec> specs;
  for (const auto& p : model.parameters()) specs.push_back({p.name, p.shape, p.group});
  return specs;
}

// Connects the model's per-group hooks to the engine: a group is leased when the model needs its
// parameters and released when the next group is needed; its gradients are handed over as soon as
// backward finishes them, so their reduction overlaps the rest of backward. The model computes on
// the CPU: on a device the host cannot read (cuda), each group's parameters are copied to host
// staging when leased and its gradients copied back when handed over.
class Trainer::Binding {
 public:
  Binding(Engine& engine, const charlm::CharMlp& model, Device& device)
      : engine_(engine),
        leases_(static_cast<std::size_t>(engine.group_count())),
        device_(device),
        staged_(!device.host_accessible()),
        stream_(staged_ ? device.create_stream() : nullptr) {
    for (const auto& p : model.parameters()) {
      grads_.emplace_back(p.numel());
      if (engine.dtype() != DType::f32 || staged_) converted_.emplace_back(p.numel());
      if (staged_) staging_.emplace_back(p.numel() * dtype_size(engine.dtype()));
    }
    param_ptrs_.assign(grads_.size(), nullptr);
    for (auto& g : grads_) grad_ptrs_.push_back(g.data());
    hooks_.params_needed = [this](int group) { lease(group); };
    hooks_.grads_ready = [this](int group) { hand_over(group); };
  }

  std::span<float* const> params() const { return param_ptrs_; }
  std::span<float* const> grads() const { return grad_ptrs_; }
  const charlm::GroupHooks& hooks() const { return hooks_; }
  void release_all() {
    for (auto& lease : leases_) lease.reset();
  }

 private:
  void lease(int group) {
    release_all();
    auto& lease = leases_[static_cast<std::size_t>(group)];
    lease.emplace(engine_.acquire(group));
    for (std::size_t t = 0; t < engine_.tensor_count(); ++t) {
      if (engine_.spec(t).group != group) continue;
      void* device = lease->param(t).data;
      if (staged_) {
        device_.copy_async(staging_[t].data(), device, staging_[t].size(), *stream_);
        stream_->synchronize();
        device = staging_[t].data();
      }
      if (engine_.dtype() == DType::f32 && !staged_) {
        param_ptrs_[t] = static_cast<float*>(device);
      } else {
        to_float(device, engine_.dtype(), converted_[t].data(), converted_[t].size());
        param_ptrs_[t] = converted_[t].data();
      }
    }
  }

  void hand_over(int group) {
    const trace::Span span("gradient hand-off", trace::Lane::backward, group);
    auto& lease = leases_[static_cast<std::size_t>(group)];
    for (std::size_t t = 0; t < engine_.tensor_count(); ++t) {
      if (engine_.spec(t).group != group) continue;
      void* out = staged_ ? static_cast<void*>(staging_[t].data()) : lease->grad(t).data;
      store_scaled(grads_[t].data(), engine_.loss_scale(), out, engine_.dtype(), grads_[t].size());
      if (staged_) device_.copy_async(lease->grad(t).data, out, staging_[t].size(), *stream_);
    }
    if (staged_) stream_->synchronize();
    engine_.grads_ready(group);
  }

  Engine& engine_;
  std::vector<std::optional<Engine::GroupLease>> leases_;
  std::vector<std::vector<float>> grads_, converted_;  // host fp32 scratch, allocated once
  Device& device_;
  bool staged_;                                         // the host cannot read the device's memory
  std::unique_ptr<Stream> stream_;                      // the staging copies' (staged_ only)
  std::vector<std::vector<unsigned char>> staging_;     // per tensor, in the engine's dtype
  std::vector<float*> param_ptrs_, grad_ptrs_;
  charlm::GroupHooks hooks_;
};

Trainer::Trainer(const Config& config, const TrainConfig& train, const charlm::TextCorpus& corpus, Device& device,
                 Communicator& comm, int blas_threads)
    : train_(train),
      accumulation_(config.gradient_accumulation_steps),
      corpus_(corpus),
      device_(device),
      comm_(comm),
      model_(
          [&] {
            charlm::CharMlpShape shape = train.model;
            shape.vocab = corpus.vocab_size();
            return shape;
          }(),
          std::max<std::size_t>(
              1, largest_slice(train.global_batch / static_cast<std::size_t>(config.gradient_accumulation_steps),
                               comm.size())),
          blas_threads),
      sampler_(corpus.tokens().size(), train.model.context, train.global_batch, train.seed) {
  if (train.global_batch % static_cast<std::size_t>(accumulation_) != 0)
    throw Error(
        fmt::format("train.global_batch ({}) must split evenly into gradient_accumulation_steps ({}) micro-batches",
                    train.global_batch, accumulation_));
  engine_ = std::make_unique<Engine>(config, device, comm, engine_params(model_));
  for (std::size_t t = 0; t < engine_->tensor_count(); ++t) {
    std::vector<float> values(engine_->spec(t).numel());
    model_.init_tensor(t, 0, values, train.seed);
    engine_->set_param(t, values);
  }
  binding_ = std::make_unique<Binding>(*engine_, model_, device);
  windows_.resize(model_.max_batch() * sampler_.window());
  stream_ = device.create_stream();
  loss_ = device.allocate(sizeof(float), MemoryCategory::buffers);
  loss_host_ = device.allocate_pinned(sizeof(float));
}

Trainer::~Trainer() = default;

double Trainer::step(int step) {
  const std::size_t micro_batch = train_.global_batch / static_cast<std::size_t>(accumulation_);
  double loss = 0;
  for (int micro = 0; micro < accumulation_; ++micro) {
    charlm::ExampleRange range = charlm::rank_slice(micro_batch, comm_.rank(), comm_.size());
    range.first += static_cast<std::size_t>(micro) * micro_batch;
    std::span<charlm::Token> mine(windows_.data(), range.count * sampler_.window());
    sampler_.gather(corpus_.tokens(), static_cast<std::uint64_t>(step), range, mine);
    const trace::Span span("forward + backward", trace::Lane::backward, micro);
    loss += model_.forward_backward(binding_->params(), binding_->grads(), mine,
                                    static_cast<double>(train_.global_batch), &binding_->hooks());
    binding_->release_all();
  }
  last_ = engine_->step();
  // The whole batch's loss is the sum of every rank's share.
  *loss_host_.as<float>() = static_cast<float>(loss);
  device_.copy_async(loss_.data(), loss_host_.data(), sizeof(float), *stream_);
  comm_.all_reduce(loss_.data(), loss_.data(), 1, DType::f32, ReduceOp::sum, *stream_);
  device_.copy_async(loss_host_.data(), loss_.data(), sizeof(float), *stream_);
  stream_->synchronize();
  return *loss_host_.as<float>();
}

}  // namespace zest::train
