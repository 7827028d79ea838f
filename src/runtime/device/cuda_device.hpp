// The cuda backend's internals that other CUDA code (the NCCL communicator, the engine's kernel
// launches) needs: the cudaStream_t behind a zest::Stream and the GPU behind a zest::Device.
// make_cuda_device and cuda_device_available are declared in zest/device.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include "zest/device.hpp"

namespace zest {

// The CUDA stream behind `stream`. Throws CommError when `stream` was not made by a cuda Device
// (CUDA work and NCCL collectives cannot be ordered on a cpu stream).
cudaStream_t cuda_stream_handle(Stream& stream);

// The CUDA device ordinal behind `device`, or -1 when `device` is not a cuda Device.
int cuda_device_ordinal(const Device& device) noexcept;

}  // namespace zest
