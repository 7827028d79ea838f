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

::torch::Tensor storage_that_raises(const ::torch::Tensor& like, std::string message) {
  // No bytes are allocated: the sizes are set on an empty tensor, whose storage then refuses every
  // access to its data with the message (torch's own mechanism for tensors without data). Its
  // byte count is the tensor's, so that views (weight.t() in a layer) pass torch's bounds checks
  // and reach the access that raises the message.
  ::torch::Tensor tensor = ::torch::empty({0}, like.options().requires_grad(false));
  tensor.unsafeGetTensorImpl()->set_sizes_contiguous(like.sizes());
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_nbytes(static_cast<std::size_t>(like.numel()) * like.element_size());
  storage->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(message));
  return tensor;
}

std::size_t bytes_held(const ::torch::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return 0;
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  return storage->_mutable_data_ptr_no_checks().get() ? storage->nbytes() : 0;
}

ParamResidency::ParamResidency(Engine& engine, TorchComputeStream& compute, std::vector<::torch::Tensor> tensors,
                               std::vector<int> group_of)
    : engine_(engine), compute_(compute), tensors_(std::move(tensors)) {
  members_.resize(static_cast<std::size_t>(engine.group_count()));
  holds_.resize(members_.size());
  ::torch::NoGradGuard no_grad;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    members_[static_cast<std::size_t>(group_of[t])].push_back(t);
    ::torch::Tensor& param = tensors_[t];
    // The gathered storage is the parameter's own (contiguous, offset 0, nothing allocated), so
    // that pointing it at a lease touches no other tensor.
    gathered_.push_back(::torch::empty({0}, param.options().requires_grad(false)));
    gathered_.back().unsafeGetTensorImpl()->set_sizes_contiguous(param.sizes());
    released_.push_back(storage_that_raises(
        param, "zest: parameter '" + engine.spec(t).name +
                   "' is released (ZeRO stage 3): it holds values only while its module runs, gathered "
                   "(C++: inside zest::torch::gathered(); Python: zest's module hooks). Run the module that "
                   "uses it that way, or read the full values with the optimizer's full_parameters() "
                   "(collective), or use stage 0-2"));
    param.set_data(released_.back());
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
  ::torch::NoGradGuard no_grad;
  for (std::size_t t : members_[static_cast<std::size_t>(group)]) {
    const TensorView view = hold.lease->param(t);
    point_storage(gathered_[t], view.data, view.numel * dtype_size(view.dtype));
    tensors_[t].set_data(gathered_[t]);
  }
}

void ParamResidency::release_if_unheld(int group) {
  Hold& hold = holds_[static_cast<std::size_t>(group)];
  if (hold.forward > 0 || hold.backward || !hold.lease) return;
  ::torch::NoGradGuard no_grad;
  for (std::size_t t : members_[static_cast<std::size_t>(group)]) {
    point_storage(gathered_[t], nullptr, 0);
    tensors_[t].set_data(released_[t]);
  }
  compute_.follow();
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
