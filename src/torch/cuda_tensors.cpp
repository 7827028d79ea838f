// zest-torch's CUDA half (see cuda_tensors.hpp), over c10's CUDA allocator and streams.
#include "torch/cuda_tensors.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "runtime/device/cuda_device.hpp"

namespace zest::torch::detail {
namespace {

class TorchCudaMemory final : public DeviceMemorySource {
 public:
  TorchCudaMemory(int ordinal, cudaStream_t stream)
      : ordinal_(static_cast<c10::DeviceIndex>(ordinal)), stream_(stream) {}

  void* allocate(std::size_t bytes) override {
    const c10::cuda::CUDAGuard guard(ordinal_);
    try {
      return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream_);
    } catch (const c10::OutOfMemoryError&) {
      // zest's OutOfDeviceMemory names the budget and what zest holds by category (Python: a
      // torch.cuda.OutOfMemoryError too).
      return nullptr;
    }
  }

  void free(void* data, std::size_t /*bytes*/) noexcept override {
    try {
      const c10::cuda::CUDAGuard guard(ordinal_);
      c10::cuda::CUDACachingAllocator::raw_delete(data);
    } catch (...) {
      // Only an unknown pointer or a dead driver make raw_delete throw; neither can be helped here.
    }
  }

 private:
  c10::DeviceIndex ordinal_;
  cudaStream_t stream_;
};

void* current_stream(int ordinal) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ordinal)).stream();
}

}  // namespace

std::string cuda_tensors_unavailable() { return {}; }

std::shared_ptr<DeviceMemorySource> torch_cuda_memory(int ordinal) {
  return std::make_shared<TorchCudaMemory>(ordinal, static_cast<cudaStream_t>(current_stream(ordinal)));
}

int cuda_ordinal(const Device& device) { return cuda_device_ordinal(device); }

TorchComputeStream::TorchComputeStream(Engine& engine, Device& device)
    : engine_(engine), device_(device), ordinal_(cuda_device_ordinal(device)) {
  follow();
}

TorchComputeStream::~TorchComputeStream() {
  try {
    engine_.set_compute_stream(nullptr);
  } catch (...) {
  }
}

void TorchComputeStream::follow() {
  if (ordinal_ < 0) return;
  void* const now = current_stream(ordinal_);
  if (now == current_ && borrowed_) return;
  std::unique_ptr<Stream> next = device_.borrow_stream(now);
  engine_.set_compute_stream(next.get());
  borrowed_ = std::move(next);
  current_ = now;
}

}  // namespace zest::torch::detail
