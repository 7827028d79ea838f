// zest::torch::gathered: stage 3's gather before a submodule's forward, release after, and gather
// again before its backward.
#include <torch/autograd.h>

#include "torch/param_residency.hpp"
#include "zest/torch.hpp"

namespace zest::torch {
namespace {

using detail::ParamResidency;

// Identity in forward; its backward runs before the backward nodes of the layer whose output it
// wraps, so it gathers that layer's parameters for them. They are released as soon as their
// gradients are handed over (the optimizer's accumulator hooks).
struct GatherForBackward : public ::torch::autograd::Function<GatherForBackward> {
  static ::torch::Tensor forward(::torch::autograd::AutogradContext* ctx, ::torch::Tensor output,
                                 ParamResidency* residency, const std::vector<int>* groups) {
    ctx->saved_data["residency"] = reinterpret_cast<std::int64_t>(residency);
    ctx->saved_data["groups"] = std::vector<std::int64_t>(groups->begin(), groups->end());
    return output;
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    auto* residency = reinterpret_cast<ParamResidency*>(ctx->saved_data["residency"].toInt());
    for (std::int64_t group : ctx->saved_data["groups"].toIntVector())
      residency->hold_backward(static_cast<int>(group));
    return {grads[0], ::torch::Tensor(), ::torch::Tensor()};
  }
};

// The forward holds of one gathered() call, dropped however forward ends.
class ForwardHolds {
 public:
  ForwardHolds(ParamResidency& residency, const std::vector<int>& groups) : residency_(residency), groups_(groups) {
    for (int group : groups_) {
      residency_.hold_forward(group);
      ++held_;
    }
  }
  ~ForwardHolds() {
    for (std::size_t i = 0; i < held_; ++i) residency_.drop_forward(groups_[i]);
  }
  // The holds outlive this object (hold_for_forward: dropped by a later drop_after_forward); a
  // gather failing part way still drops those taken.
  void keep() { held_ = 0; }
  ForwardHolds(const ForwardHolds&) = delete;
  ForwardHolds& operator=(const ForwardHolds&) = delete;

 private:
  ParamResidency& residency_;
  const std::vector<int>& groups_;
  std::size_t held_ = 0;
};

}  // namespace

::torch::Tensor gathered(::torch::nn::Module& module, const std::function<::torch::Tensor()>& forward) {
  const std::vector<::torch::Tensor> params = module.parameters(/*recurse=*/true);
  ParamResidency* residency = nullptr;
  for (std::size_t i = 0; i < params.size() && !residency; ++i) residency = ParamResidency::of(params[i]);
  if (!residency) return forward();
  const std::vector<int> groups = residency->groups_of(params);
  ::torch::Tensor output;
  {
    ForwardHolds holds(*residency, groups);
    output = forward();
  }
  if (::torch::GradMode::is_enabled() && output.requires_grad())
    output = GatherForBackward::apply(output, residency, &groups);
  return output;
}

namespace {

// The residency managing any of `params`, with the groups they are in.
detail::ParamResidency* residency_of(const std::vector<::torch::Tensor>& params, std::vector<int>& groups) {
  detail::ParamResidency* residency = nullptr;
  for (std::size_t i = 0; i < params.size() && !residency; ++i) residency = detail::ParamResidency::of(params[i]);
  if (residency) groups = residency->groups_of(params);
  return residency;
}

}  // namespace

bool hold_for_forward(const std::vector<::torch::Tensor>& params) {
  std::vector<int> groups;
  detail::ParamResidency* residency = residency_of(params, groups);
  if (!residency) return false;
  ForwardHolds holds(*residency, groups);
  holds.keep();
  return true;
}

void drop_after_forward(const std::vector<::torch::Tensor>& params) {
  std::vector<int> groups;
  if (detail::ParamResidency* residency = residency_of(params, groups))
    for (int group : groups) residency->drop_forward(group);
}

void hold_for_backward(const std::vector<::torch::Tensor>& params) {
  std::vector<int> groups;
  if (detail::ParamResidency* residency = residency_of(params, groups))
    for (int group : groups) residency->hold_backward(group);
}

}  // namespace zest::torch
