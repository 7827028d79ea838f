// Element-wise conversion between fp32, fp16 and bf16 on the GPU, e.g. the fp32 master copy to the
// low-precision parameters the trainer computes with. Bit-identical to runtime/host/half.hpp's host
// conversions (round to nearest even; NaN stays NaN, Inf stays Inf).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "zest/dtype.hpp"

namespace zest::kernels {

// dst[i] = convert(src[i]) for i < count, queued on `stream`; returns without waiting. Both are
// device (or device-accessible) pointers that must not overlap unless equal types make it a copy
// of the same range. Throws SystemError when the launch fails.
void cast_async(const void* src, DType src_type, void* dst, DType dst_type, std::size_t count,
                cudaStream_t stream);

}  // namespace zest::kernels
