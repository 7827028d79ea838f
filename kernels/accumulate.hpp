// Element-wise gradient accumulation on the GPU: what the engine does when a later micro-batch's
// reduced gradients join the ones already held. Bit-identical to the host's loop (the sum formed in
// float, rounded once to the storage type with runtime/host/half.hpp's conversions).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "zest/dtype.hpp"

namespace zest::kernels {

// dst[i] += src[i] for i < count, both `dtype`, queued on `stream`; returns without waiting. Device
// pointers that must not overlap. Throws SystemError when the launch fails.
void accumulate_async(void* dst, const void* src, DType dtype, std::size_t count, cudaStream_t stream);

}  // namespace zest::kernels
