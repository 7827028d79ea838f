#include "torch/param_residency.hpp"

#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "zest/error.hpp"

namespace zest::torch::detail {
namespace {

// Which residency manages which parameter, for gathered(): a model's forward knows its modules,
// not the optimizer. Guarded because several optimizers may live in one process.
std::mutex registry_mutex;
std::unordered_map<const void*, ParamResidency*>& registry() {
  static std::unordered_map<const void*, ParamResidency*> map;
  return map;
}

// Points the tensor's storage at `data` (not owned) of `nbytes`; null and 0 release it.
void point_storage(const ::torch::Tensor& tensor, void* data, std::size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(data, tensor.device()));
  storage->set_nbytes(nbytes);
}

}  // namespace

ParamResidency::ParamResidency(Engine& engine, std::vector<::torch::Tensor> tensors, std::vector<int> group_of)
    : engine_(engine), tensors_(std::move(tensors)) {
  members_.resize(static_cast<std::size_t>(engine.group_count()));
  holds_.resize(members_.size());
  ::torch::NoGradGuard no_grad;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    members_[static_cast<std::size_t>(group_of[t])].push_back(t);
    ::torch::Tensor& param = tensors_[t];
    // A storage of the parameter's own (contiguous, offset 0), so that pointing it elsewhere
    // touches no other tensor; then released.
    param.set_data(::torch::empty(param.sizes(), param.options()));
    point_storage(param, nullptr, 0);
    index_.emplace(param.unsafeGetTensorImpl(), t);
  }
  std::lock_guard lock(registry_mutex);
  for (const auto& [impl, t] : index_) registry()[impl] = this;
}

ParamResidency::~ParamResidency() {
  std::lock_guard lock(registry_mutex);
  for (const auto& [impl, t] : index_) registry().erase(impl);
}

ParamResidency* ParamResidency::of(const ::torch::Tensor& param) {
  std::lock_guard lock(registry_mutex);
  const auto found = registry().find(param.unsafeGetTensorImpl());
  return found == registry().end() ? nullptr : found->second;
}

std::vector<int> ParamResidency::groups_of(const std::vector<::torch::Tensor>& params) const {
  std::vector<int> groups;
  for (const ::torch::Tensor& param : params) {
    const auto found = index_.find(param.unsafeGetTensorImpl());
    if (found == index_.end()) continue;  // not this optimizer's (frozen): torch keeps it
    groups.push_back(engine_.spec(found->second).group);
  }
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  return groups;
}

void ParamResidency::make_present(int group) {
  Hold& hold = holds_[static_cast<std::size_t>(group)];
  if (hold.lease) return;
  hold.lease.emplace(engine_.acquire(group));
  for (std::size_t t : members_[static_cast<std::size_t>(group)]) {
    const TensorView view = hold.lease->param(t);
    point_storage(tensors_[t], view.data, view.numel * dtype_size(view.dtype));
  }
}

void ParamResidency::release_if_unheld(int group) {
  Hold& hold = holds_[static_cast<std::size_t>(group)];
  if (hold.forward > 0 || hold.backward || !hold.lease) return;
  for (std::size_t t : members_[static_cast<std::size_t>(group)]) point_storage(tensors_[t], nullptr, 0);
  hold.lease.reset();
}

void ParamResidency::hold_forward(int group) {
  make_present(group);
  ++holds_[static_cast<std::size_t>(group)].forward;
}

void ParamResidency::drop_forward(int group) {
  --holds_[static_cast<std::size_t>(group)].forward;
  release_if_unheld(group);
}

void ParamResidency::hold_backward(int group) {
  make_present(group);
  holds_[static_cast<std::size_t>(group)].backward = true;
}

void ParamResidency::drop_backward(int group) {
  holds_[static_cast<std::size_t>(group)].backward = false;
  release_if_unheld(group);
}

void ParamResidency::drop_all() {
  for (int g = 0; g < static_cast<int>(holds_.size()); ++g) {
    holds_[static_cast<std::size_t>(g)].forward = 0;
    holds_[static_cast<std::size_t>(g)].backward = false;
    release_if_unheld(g);
  }
}

}  // namespace zest::torch::detail
