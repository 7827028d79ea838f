// Stage 3 for a torch module: between uses a parameter holds no storage; while some forward or
// backward needs its group, its storage points at the engine's gathered parameters (a lease).
//
// Each parameter has two storages of its own. The gathered one is swapped on the StorageImpl, not
// with set_data: autograd saves views of parameters (Linear saves weight.t()), which share the
// parameter's StorageImpl, so pointing that storage at the lease reaches them too, and releasing it
// frees nothing of torch's but the pointer. Between uses the parameter itself is switched (set_data)
// to a storage that holds nothing and raises, on any read, a message naming the parameter and the
// fix: torch would otherwise read through a null pointer (SIGSEGV) or speak of an unallocated storage.
// A group is present while forward holds (counted: nested gathered() calls) or a backward hold
// (set by the backward of a gathered() output, dropped when the group's gradients are handed
// over) is on it.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "torch/cuda_tensors.hpp"
#include "zest/engine.hpp"

namespace zest::torch::detail {

// A tensor shaped like `like` whose storage holds nothing and raises `message` (as a c10::Error,
// which Python sees as RuntimeError) on any access to its data.
::torch::Tensor storage_that_raises(const ::torch::Tensor& like, std::string message);
// The bytes of memory the tensor's storage holds (0 for storage_that_raises and released ones).
std::size_t bytes_held(const ::torch::Tensor& tensor);

class ParamResidency {
 public:
  // `tensors` in engine order, `group_of` their communication groups. Releases every tensor's
  // storage (torch's copy of the values is freed; the engine already holds them). Registers the
  // tensors so that of() finds this residency. `compute` is followed before a lease ends: the
  // engine reuses the gathered memory only after what torch queued on its stream so far (cuda).
  ParamResidency(Engine& engine, TorchComputeStream& compute, std::vector<::torch::Tensor> tensors,
                 std::vector<int> group_of);
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
  TorchComputeStream& compute_;
  std::vector<::torch::Tensor> tensors_;
  std::vector<::torch::Tensor> gathered_;  // per tensor: the storage pointed at the lease
  std::vector<::torch::Tensor> released_;  // per tensor: the storage that raises
  std::vector<std::vector<std::size_t>> members_;  // tensors of each group
  std::vector<Hold> holds_;
  std::unordered_map<const void*, std::size_t> index_;  // TensorImpl -> tensor
};

}  // namespace zest::torch::detail
