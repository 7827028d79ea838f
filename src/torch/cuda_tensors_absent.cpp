// Built in place of cuda_tensors.cpp where zest has no CUDA or torch has no CUDA libraries: the
// adapter trains cpu tensors and refuses CUDA ones saying why.
#include "torch/cuda_tensors.hpp"

#include "zest/error.hpp"

namespace zest::torch::detail {

std::string cuda_tensors_unavailable() {
  return ZEST_TORCH_NO_CUDA_REASON;
}

std::shared_ptr<DeviceMemorySource> torch_cuda_memory(int /*ordinal*/) { throw Error(cuda_tensors_unavailable()); }

int cuda_ordinal(const Device& /*device*/) { return -1; }

TorchComputeStream::TorchComputeStream(Engine& engine, Device& device)
    : engine_(engine), device_(device), ordinal_(-1) {}

TorchComputeStream::~TorchComputeStream() = default;

void TorchComputeStream::follow() {}

}  // namespace zest::torch::detail
