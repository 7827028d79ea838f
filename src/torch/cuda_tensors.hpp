// What zest-torch needs of torch's CUDA to train CUDA tensors: torch's caching allocator as zest's
// device memory, and torch's current stream as the engine's compute stream. Built from
// cuda_tensors.cpp where zest has CUDA and torch has its CUDA libraries (PyPI's Linux wheels do);
// elsewhere from cuda_tensors_absent.cpp, whose calls say how to get them.
#pragma once

#include <memory>
#include <string>

#include "zest/device.hpp"
#include "zest/engine.hpp"

namespace zest::torch::detail {

// Empty where this zest-torch can train CUDA tensors; else why not and what to do.
std::string cuda_tensors_unavailable();

// Torch's CUDA caching allocator on GPU `ordinal` (Runtime's device_memory): the memory is torch's,
// counted by torch.cuda.memory_allocated() and governed by PYTORCH_CUDA_ALLOC_CONF, and tied to the
// stream current at construction (the trainer's), so torch reuses it in that stream's order.
std::shared_ptr<DeviceMemorySource> torch_cuda_memory(int ordinal);

// The GPU behind a cuda Device (-1 for any other device).
int cuda_ordinal(const Device& device);

// Keeps an engine's compute stream (Engine::set_compute_stream) at torch's current stream on the
// engine's GPU, as the calling thread sees it: call follow() before each engine call that reads or
// rewrites what torch computes with (autograd's device threads have streams of their own). Does
// nothing on a cpu device, where torch's work is done when it returns.
class TorchComputeStream {
 public:
  TorchComputeStream(Engine& engine, Device& device);
  ~TorchComputeStream();
  TorchComputeStream(const TorchComputeStream&) = delete;
  TorchComputeStream& operator=(const TorchComputeStream&) = delete;
  void follow();

 private:
  Engine& engine_;
  Device& device_;
  int ordinal_;
  void* current_ = nullptr;          // the handle borrowed_ wraps
  std::unique_ptr<Stream> borrowed_;
};

}  // namespace zest::torch::detail
