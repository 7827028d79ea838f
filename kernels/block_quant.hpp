// Block-wise int8/int4 quantization on the GPU: the format of src/optim/block_quant_math.hpp (one
// fp32 scale per optim::kQuantBlock elements; the buffer a record per block), with the same element
// math, compiled without FMA contraction, so every result equals the CPU's
// (optim::BlockQuantizer) bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "optim/block_quant_math.hpp"
#include "zest/dtype.hpp"

namespace zest::kernels {

// Quantizes `count` elements of `dtype` (fp32, bf16 or fp16) at `in` into `out`,
// optim::quantized_bytes(bits, count) bytes, 4-byte aligned. Device pointers that do not overlap;
// queued on `stream`, returns without waiting. Throws zest::Error on a bad argument (before
// anything is queued), SystemError when the launch fails.
void quantize_async(const void* in, DType dtype, std::size_t count, optim::QuantBits bits, void* out,
                    cudaStream_t stream);

// Decodes the `count` elements quantized at `in` into `out` as `dtype` (rounded to nearest even),
// as quantize_async.
void dequantize_async(const void* in, optim::QuantBits bits, std::size_t count, void* out, DType dtype,
                      cudaStream_t stream);

// acc[i] += the value of element i quantized at `in`, in fp32, as quantize_async.
void dequantize_add_async(const void* in, optim::QuantBits bits, std::size_t count, float* acc,
                          cudaStream_t stream);

}  // namespace zest::kernels
