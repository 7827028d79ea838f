// Stage 3 for a torch module: between uses a parameter holds no storage; while some forward or
// backward needs its group, its storage points at the engine's gathered parameters (a lease).
//
// The swap is done on the StorageImpl, not with set_data: autograd saves views of parameters
// (Linear saves weight.t()), which share the parameter's StorageImpl, so pointing the storage
// elsewhere reaches them too, and releasing it really frees nothing of torch's but the pointer.
// A group is present while forward holds (counted: nested gathered() calls) or a backward hold
// (set by the backward of a gathered() output, dropped when the group's gradients are handed
// over) is on it.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <optional>
#include <unordered_map>
#include <vector>

#include "zest/engine.hpp"

namespace zest::torch::detail {

class ParamResidency {
 public:
  // `tensors` in engine order, `group_of` their communication groups. Releases every tensor's
  // storage (torch's copy of the values is freed; the engine already holds them). Registers the
  // tensors so that of() finds this residency.
  ParamResidency(Engine& engine, std::vector<::torch::Tensor> tensors, std::vector<int> group_of);
  ~ParamResidency();
  ParamResidency(const ParamResidency&) = delete;
  ParamResidency& operator=(const ParamResidency&) = delete;

  // The residency managing `param`, or null (not a zest stage-3 parameter).
  static ParamResidency* of(const ::torch::Tensor& param);

  // The groups holding those of `params` this residency manages, ascending, each once.
  std::vector<int> groups_of(const std::vector<::torch::Tensor>& params) const;

  void hold_forward(int group);
  void drop_forward(int group);
  void hold_backward(int group);
  void drop_backward(int group);
  // Before step(), save() and load(): every group released (the engine needs no lease held).
  void drop_all();

 private:
  struct Hold {
    int forward = 0;
    bool backward = false;
    std::optional<Engine::GroupLease> lease;
  };
  void make_present(int group);
  void release_if_unheld(int group);

  Engine& engine_;
  std::vector<::torch::Tensor> tensors_;
  std::vector<std::vector<std::size_t>> members_;  // tensors of each group
  std::vector<Hold> holds_;
  std::unordered_map<const void*, std::size_t> index_;  // TensorImpl -> tensor
};

}  // namespace zest::torch::detail
