// zest for libtorch: a torch::optim optimizer over the Engine (library zest-torch, pkg-config
// zest-torch; built where libtorch is found).
//
//   auto model = std::make_shared<Net>();                 // same seed on every rank
//   zest::Runtime runtime(config);                        // or let the optimizer make one
//   zest::torch::Optimizer opt(model->named_parameters(), config, &runtime);
//   for (...) {
//     auto loss = compute_loss(model, batch) * opt.loss_scale();
//     loss.backward();                                    // gradients go to zest as they are made
//     opt.step();                                         // reduce, clip, Adam, all-gather
//     opt.zero_grad();
//   }
//
// What each stage changes for the module:
//   0-2  The module's parameters alias zest's device parameters (one copy of the weights); the
//        engine writes them only inside step(), load() and construction.
//   3    Between uses a parameter holds no storage (numel() unchanged, storage size 0). Run each
//        submodule through zest::torch::gathered(), which gathers its parameters for its forward,
//        releases them after, and gathers them again for its backward. Reading a parameter
//        outside gathered() (norm(), printing, torch::save of the model, an unwrapped layer)
//        raises a c10::Error naming the parameter; full_parameters() gives the full values.
// Gradients: a hook on each parameter's gradient accumulator copies the gradient into zest's
// bucket as soon as autograd has produced it and frees torch's copy, so a group is reduced while
// backward goes on. p.grad() then holds a placeholder of the parameter's shape and no bytes: any
// read of it (torch::nn::utils::clip_grad_norm_, p.grad().norm()) raises a c10::Error naming
// where the gradient went and the config's gradient_clipping, instead of finding no gradient and
// doing nothing. Call backward once per micro-batch, gradient_accumulation_steps times per step()
// (gradients of micro-batches add up; another count makes step() throw Error); the loss must
// already be divided by the global number of examples and multiplied by loss_scale(). A sparse
// gradient (an embedding with sparse=True) is refused by name during backward.
// A parameter that gets no gradient in a whole step makes step() throw Error (torch's AdamW would
// skip it; zest updates every parameter). A tensor listed twice (tied weights) is one parameter,
// as in torch; two tensors over the same memory are refused.
// Hyper-parameters: each torch parameter group holds AdamWOptions (lr, betas, eps, weight decay);
// whatever changes them between steps (torch::optim::StepLR, a warm-up) takes effect at the next
// step. amsgrad is not supported. The update itself is the config's (optimizer.type adamw or adam,
// gradient clipping, fp16 loss scaling).
// Devices: the tensors are on the cpu or on one CUDA GPU (zest-torch built with CUDA against a
// CUDA libtorch), and the engine runs there: the optimizer's own Runtime follows them (device.type,
// and the whole GPU as the budget unless the config names cuda itself), a Runtime given must be on
// the same device. On a GPU zest's device memory is torch's caching allocator's, and its streams
// wait for torch's current stream with events (Engine::set_compute_stream).
// Limits: one host thread at a time drives the optimizer (autograd's device threads run the hooks
// while the caller waits in backward); module->to() or anything else that calls set_data on a
// parameter afterwards breaks the aliasing.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "zest/config.hpp"
#include "zest/engine.hpp"
#include "zest/runtime.hpp"

namespace zest::torch {

using NamedParameters = ::torch::OrderedDict<std::string, ::torch::Tensor>;
using ProcessGroup = c10::intrusive_ptr<c10d::ProcessGroup>;

// The ranks of a torch.distributed process group as zest's world (RuntimeOptions::world), for a
// program launched by torchrun (or any env:// launcher) that made the group itself: the ranks are
// the group's, each rank's host is found through the group's store, and zest's collectives run on
// the cpu device over duplicates of the group (it needs a cpu backend: gloo), on a cuda device over
// zest's own NCCL communicator, whose id goes from rank 0 through the group's store. Collective:
// every rank calls it, in the same order as its other zest uses of the group. `timeout` (0: the
// store's own) bounds the wait for the other ranks here; the communicators take comm.timeout.
//
// zest makes groups of its own over the group's ranks with `make_group` (two per communicator, and
// per host or per place on a host for hpZ and qgZ's groups): every rank calls it for every group,
// in the same order, as torch.distributed's new_group must be called; it returns null where this
// rank is not among `ranks` (ranks of `group`). Empty: `group`'s splitGroup.
using GroupMaker = std::function<ProcessGroup(const std::vector<int>& ranks)>;
std::shared_ptr<World> process_group_world(ProcessGroup group, std::chrono::milliseconds timeout = kDefaultCommTimeout,
                                           GroupMaker make_group = {});

class Optimizer : public ::torch::optim::Optimizer {
 public:
  // `params` (module->named_parameters()) names the tensors for checkpoints and fixes their order;
  // consecutive tensors of one module form one communication group (a layer). The torch parameter
  // groups mirror the config's optimizer groups (optimizer.param_groups; group 0 holds the tensors
  // no pattern matches). The tensors' values, identical on every rank (checked: Error otherwise),
  // become the engine's. Without `runtime` the optimizer makes and owns one. Collective.
  Optimizer(const NamedParameters& params, const Config& config, Runtime* runtime = nullptr);
  // The same with torch's own parameter groups: every tensor of `params` in exactly one group
  // (Error otherwise), each group's AdamWOptions (unset: the config's optimizer values) its
  // hyper-parameters.
  Optimizer(const NamedParameters& params, std::vector<::torch::optim::OptimizerParamGroup> groups,
            const Config& config, Runtime* runtime = nullptr);
  // The same over the ranks of `world` (process_group_world: a torch.distributed process group's)
  // instead of MPI's: the optimizer makes and owns a Runtime over it. Error where the config's
  // comm.backend is mpi.
  Optimizer(const NamedParameters& params, const Config& config, std::shared_ptr<World> world);
  Optimizer(const NamedParameters& params, std::vector<::torch::optim::OptimizerParamGroup> groups,
            const Config& config, std::shared_ptr<World> world);
  ~Optimizer() override;

  // Hands over what backward left, applies the param groups' options, runs the engine's step.
  // Collective. Returns the closure's loss (undefined without a closure).
  ::torch::Tensor step(LossClosure closure = nullptr) override;
  // The result of the last step(): skipped (fp16 overflow), the gradient norm, the next loss scale.
  const StepResult& last_step() const;
  // The factor to multiply the loss by before backward (1 unless fp16 loss scaling).
  double loss_scale() const;
  // Multiplies every gradient as it is handed over (default 1): 1 / world size gives the mean over
  // ranks that torch's DistributedDataParallel gives, where the engine itself sums. Must be the
  // same on every rank; takes effect for the gradients handed over after the call. Error unless
  // finite and > 0.
  void set_grad_scale(double scale);
  double grad_scale() const;

  // zest checkpoints (Engine::save/load: any rank count and stage). save() records the groups'
  // hyper-parameters as param_groups() hold them then (a scheduler stepped after the last step()
  // included); load() restores them into param_groups(). A scheduler given to load() (built over
  // this optimizer and not stepped yet) is stepped to the checkpoint's step count, so one that
  // steps once per optimizer step resumes where it was; the learning rates are the checkpoint's.
  void save(const std::string& dir);
  LoadResult load(const std::string& dir, ::torch::optim::LRScheduler* scheduler = nullptr);
  // Every trained parameter's full values (a copy on the cpu, in its own dtype), by every name
  // `params` gave it (a tied tensor under each): what a stage-3 model cannot give by itself between
  // uses. Collective.
  NamedParameters full_parameters();
  // torch's archives cannot hold a sharded optimizer: these throw Error, pointing at save(dir).
  void save(::torch::serialize::OutputArchive& archive) const override;
  void load(::torch::serialize::InputArchive& archive) override;

  Engine& engine();
  Runtime& runtime();
  // Bytes of parameter storage torch itself owns now (not aliased to zest), and the largest
  // gradient torch allocated before the hook handed it over (one tensor at a time).
  std::size_t torch_param_bytes() const;
  std::size_t peak_transient_grad_bytes() const;

  struct Impl;

 private:
  Optimizer(const NamedParameters& params, std::vector<::torch::optim::OptimizerParamGroup> groups,
            const Config& config, Runtime* runtime, std::shared_ptr<World> world);
  std::unique_ptr<Impl> impl_;
};

// Runs `forward` (typically the module's forward) with `module`'s parameters present: at stage 3
// they are gathered first, released after, and gathered again for the backward of the returned
// tensor. Where no zest optimizer at stage 3 manages the module's parameters (stages 0-2, or a
// plain torch optimizer), it just calls `forward`, so one model serves both.
::torch::Tensor gathered(::torch::nn::Module& module, const std::function<::torch::Tensor()>& forward);

// gathered()'s steps one by one, for frameworks that run modules themselves (the Python package's
// module hooks): each takes a module's own parameters (not its submodules'), and acts on those a
// zest optimizer at stage 3 manages (the others, and every tensor at stages 0-2, are left alone).
// hold_for_forward gathers them until the matching drop_after_forward (holds nest: a module used
// twice in one forward) and returns whether any was zest's; hold_for_backward gathers them for
// their backward, until their gradients are handed over (or the next step()). Collective where the
// gather is: every rank calls them in the same order.
bool hold_for_forward(const std::vector<::torch::Tensor>& params);
void drop_after_forward(const std::vector<::torch::Tensor>& params);
void hold_for_backward(const std::vector<::torch::Tensor>& params);

}  // namespace zest::torch
