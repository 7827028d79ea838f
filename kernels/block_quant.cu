// Block-wise quantization (src/optim/block_quant_math.hpp) on the GPU: one warp per block of
// kQuantBlock (256) elements, eight contiguous elements per lane, so each lane writes whole 32-bit
// words of codes (two for int8, one for int4) and the block's largest magnitude is one warp-wide
// maximum. The element math is the shared header's and this file is compiled with -fmad=false
// (dequantize-and-add's product and sum stay two roundings), so the results equal the CPU's bit
// for bit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/block_quant.hpp"
#include "kernels/dtype_access.cuh"
#include "optim/block_quant_math.hpp"
#include "runtime/device/cuda_check.hpp"
#include "runtime/host/half.hpp"

namespace zest::kernels {
namespace {

using optim::QuantBits;

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr std::size_t kBlock = optim::kQuantBlock;
constexpr int kPerLane = static_cast<int>(kBlock) / kWarp;
static_assert(kPerLane == 8, "a lane's codes are whole 32-bit words: 8 int4 codes or 2 x 4 int8 codes");
constexpr std::size_t kMaxGrid = 65535;

template <QuantBits B>
constexpr std::size_t kRecordBytes = optim::quant_record_bytes(B, kBlock);

// The words of codes of a block of n elements, its padding included.
template <QuantBits B>
__device__ inline std::size_t code_words(std::size_t n) {
  return (optim::quant_record_bytes(B, n) - 4) / 4;
}

// Calls body(block index, its first element, its element count, its record) for the blocks of
// this warp (a grid-stride loop over warps).
template <QuantBits B, class Record, class Body>
__device__ inline void for_each_block(std::size_t count, Record* records, const Body& body) {
  const std::size_t blocks = (count + kBlock - 1) / kBlock;
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * kWarpsPerBlock;
  for (std::size_t b = static_cast<std::size_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; b < blocks;
       b += warps) {
    const std::size_t first = b * kBlock;
    body(first, count - first < kBlock ? count - first : kBlock, records + b * kRecordBytes<B>);
  }
}

template <DType G, QuantBits B>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const void* in, std::size_t count, std::uint8_t* out) {
  const unsigned lane = threadIdx.x % kWarp;
  for_each_block<B>(count, out, [&](std::size_t first, std::size_t n, std::uint8_t* record) {
    float x[kPerLane];
    std::uint32_t absmax = 0;
    for (int k = 0; k < kPerLane; ++k) {
      const std::size_t j = lane * kPerLane + k;
      x[k] = j < n ? detail::load_element<G>(in, static_cast<std::int64_t>(first + j)) : 0.0f;
      absmax = optim::quant_max_bits(absmax, optim::quant_magnitude_bits(float_bits(x[k])));
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2)
      absmax = optim::quant_max_bits(absmax, __shfl_xor_sync(0xffffffffu, absmax, offset));
    const float scale = optim::quant_scale<float, std::uint32_t>(absmax, B);
    const float divisor = optim::quant_divisor<float, std::uint32_t>(scale);
    const std::uint32_t keep = optim::quant_keep<float, std::uint32_t>(scale);
    if (lane == 0) *reinterpret_cast<float*>(record) = scale;
    std::uint32_t words[2] = {0, 0};
    for (int k = 0; k < kPerLane; ++k) {
      const std::uint32_t code = optim::quant_encode<float, std::uint32_t>(x[k], divisor, keep, B);
      if constexpr (B == QuantBits::int8) {
        words[k / 4] |= (code & 0xffu) << (8 * (k % 4));
      } else {
        words[0] |= (code & 0xfu) << (4 * k);
      }
    }
    auto* const codes = reinterpret_cast<std::uint32_t*>(record + 4);
    const std::size_t used = code_words<B>(n);
    constexpr int kWordsPerLane = B == QuantBits::int8 ? 2 : 1;
    for (int w = 0; w < kWordsPerLane; ++w) {
      const std::size_t index = lane * kWordsPerLane + w;
      if (index < used) codes[index] = words[w];  // past n, the codes of the zeros: the padding
    }
  });
}

// The values of a lane's elements of one block, to op(element in block, value).
template <QuantBits B, class Op>
__device__ inline void decode_lane(const std::uint8_t* record, std::size_t n, unsigned lane, const Op& op) {
  const float scale = *reinterpret_cast<const float*>(record);
  const auto* const codes = reinterpret_cast<const std::uint32_t*>(record + 4);
  const std::size_t used = code_words<B>(n);
  constexpr int kWordsPerLane = B == QuantBits::int8 ? 2 : 1;
  std::uint32_t words[2] = {0, 0};
  for (int w = 0; w < kWordsPerLane; ++w) {
    const std::size_t index = lane * kWordsPerLane + w;
    if (index < used) words[w] = codes[index];
  }
  for (int k = 0; k < kPerLane; ++k) {
    const std::size_t j = lane * kPerLane + k;
    if (j >= n) break;
    const std::uint32_t code = B == QuantBits::int8 ? (words[k / 4] >> (8 * (k % 4))) & 0xffu
                                                   : (words[0] >> (4 * k)) & 0xfu;
    op(j, optim::quant_decode<float, std::uint32_t>(code, scale, B));
  }
}

template <DType D, QuantBits B>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const std::uint8_t* in, std::size_t count, detail::Storage<D>* out) {
  const unsigned lane = threadIdx.x % kWarp;
  for_each_block<B>(count, in, [&](std::size_t first, std::size_t n, const std::uint8_t* record) {
    decode_lane<B>(record, n, lane, [&](std::size_t j, float value) { out[first + j] = detail::narrow<D>(value); });
  });
}

template <QuantBits B>
__global__ void __launch_bounds__(kThreads)
    dequantize_add_kernel(const std::uint8_t* in, std::size_t count, float* acc) {
  const unsigned lane = threadIdx.x % kWarp;
  for_each_block<B>(count, in, [&](std::size_t first, std::size_t n, const std::uint8_t* record) {
    decode_lane<B>(record, n, lane, [&](std::size_t j, float value) { acc[first + j] = acc[first + j] + value; });
  });
}

unsigned grid_for(std::size_t count) {
  const std::size_t blocks = (count + kBlock - 1) / kBlock;
  return static_cast<unsigned>(std::min<std::size_t>((blocks + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxGrid));
}

}  // namespace

void quantize_async(const void* in, DType dtype, std::size_t count, QuantBits bits, void* out, cudaStream_t stream) {
  optim::check_quantize_args("kernels::quantize_async", in, dtype, count, bits, out,
                             optim::quantized_bytes(bits, count));
  if (count == 0) return;  // a launch with an empty grid is an error
  optim::with_quant_bits(bits, [&]<QuantBits B>() {
    optim::with_quant_dtype(dtype, [&]<DType G>() {
      quantize_kernel<G, B><<<grid_for(count), kThreads, 0, stream>>>(in, count, static_cast<std::uint8_t*>(out));
    });
  });
  ZEST_CUDA_CHECK(cudaGetLastError());
}

void dequantize_async(const void* in, QuantBits bits, std::size_t count, void* out, DType dtype, cudaStream_t stream) {
  optim::check_dequantize_args("kernels::dequantize_async", in, optim::quantized_bytes(bits, count), bits, out, dtype,
                               count);
  if (count == 0) return;
  optim::with_quant_bits(bits, [&]<QuantBits B>() {
    optim::with_quant_dtype(dtype, [&]<DType D>() {
      dequantize_kernel<D, B><<<grid_for(count), kThreads, 0, stream>>>(
          static_cast<const std::uint8_t*>(in), count, static_cast<detail::Storage<D>*>(out));
    });
  });
  ZEST_CUDA_CHECK(cudaGetLastError());
}

void dequantize_add_async(const void* in, QuantBits bits, std::size_t count, float* acc, cudaStream_t stream) {
  optim::check_dequantize_args("kernels::dequantize_add_async", in, optim::quantized_bytes(bits, count), bits, acc,
                               DType::f32, count);
  if (count == 0) return;
  optim::with_quant_bits(bits, [&]<QuantBits B>() {
    dequantize_add_kernel<B>
        <<<grid_for(count), kThreads, 0, stream>>>(static_cast<const std::uint8_t*>(in), count, acc);
  });
  ZEST_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zest::kernels
