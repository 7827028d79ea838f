// The fused multi-tensor Adam: one block per 64Ki-element chunk of a tensor, 128-bit loads of the
// fp32 arrays where the tensor is 16-byte aligned, the shared per-element math of the CPU Adam.
#include <cuda_runtime.h>

#include "kernels/adam.hpp"
#include "kernels/dtype_access.cuh"
#include "kernels/multi_tensor.cuh"
#include "runtime/device/cuda_check.hpp"
#include "runtime/host/half.hpp"

namespace zest::kernels {
namespace {

using detail::kChunk;
using detail::kThreads;
using detail::load_element;
using Table = detail::TensorTable<CudaAdamTensor>;

enum class Out { none, bf16, f16 };

template <DType G>
__device__ inline float4 load_grad4(const void* grad, std::int64_t i) {
  if constexpr (G == DType::f32) {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(grad) + i);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const std::uint16_t*>(grad) + i);
    const std::uint16_t h[4] = {static_cast<std::uint16_t>(raw.x), static_cast<std::uint16_t>(raw.x >> 16),
                                static_cast<std::uint16_t>(raw.y), static_cast<std::uint16_t>(raw.y >> 16)};
    float f[4];
    for (int k = 0; k < 4; ++k) f[k] = G == DType::bf16 ? bf16_to_float(h[k]) : fp16_to_float(h[k]);
    return make_float4(f[0], f[1], f[2], f[3]);
  }
}

template <Out O>
__device__ inline std::uint16_t to_low(float x) {
  return O == Out::bf16 ? float_to_bf16(x) : float_to_fp16(x);
}

template <DType G, Out O>
__global__ void __launch_bounds__(kThreads) multi_tensor_adam(Table table, optim::AdamCoefficients c,
                                                              const int* overflow) {
  if (overflow != nullptr && *overflow != 0) return;  // an Inf/NaN gradient: skip the step
  const CudaAdamTensor& t = table.tensors[table.block_tensor[blockIdx.x]];
  const std::int64_t begin = static_cast<std::int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const std::int64_t end = begin + kChunk < t.count ? begin + kChunk : t.count;
  const std::uintptr_t align16 = reinterpret_cast<std::uintptr_t>(t.master) |
                                 reinterpret_cast<std::uintptr_t>(t.m) | reinterpret_cast<std::uintptr_t>(t.v);
  const std::uintptr_t grad_align = reinterpret_cast<std::uintptr_t>(t.grad);
  const std::uintptr_t out_align = reinterpret_cast<std::uintptr_t>(t.out);
  const bool vector = (align16 % 16) == 0 && grad_align % (G == DType::f32 ? 16 : 8) == 0 &&
                      (O == Out::none || out_align % 8 == 0);
  std::int64_t i = begin;
  if (vector) {
    // Chunks start at multiples of 65536, so every 4-element group is aligned like the tensor.
    for (std::int64_t j = begin + 4 * static_cast<std::int64_t>(threadIdx.x); j + 4 <= end; j += 4 * kThreads) {
      float4 p = *reinterpret_cast<const float4*>(t.master + j);
      float4 m = *reinterpret_cast<const float4*>(t.m + j);
      float4 v = *reinterpret_cast<const float4*>(t.v + j);
      const float4 g = load_grad4<G>(t.grad, j);
      optim::adam_update(p.x, m.x, v.x, g.x, c);
      optim::adam_update(p.y, m.y, v.y, g.y, c);
      optim::adam_update(p.z, m.z, v.z, g.z, c);
      optim::adam_update(p.w, m.w, v.w, g.w, c);
      *reinterpret_cast<float4*>(t.master + j) = p;
      *reinterpret_cast<float4*>(t.m + j) = m;
      *reinterpret_cast<float4*>(t.v + j) = v;
      if constexpr (O != Out::none) {
        const uint2 packed = make_uint2(to_low<O>(p.x) | (static_cast<unsigned>(to_low<O>(p.y)) << 16),
                                        to_low<O>(p.z) | (static_cast<unsigned>(to_low<O>(p.w)) << 16));
        *reinterpret_cast<uint2*>(static_cast<std::uint16_t*>(t.out) + j) = packed;
      }
    }
    i = begin + (end - begin) / 4 * 4;  // the ragged end of the tensor, below
  }
  for (std::int64_t j = i + threadIdx.x; j < end; j += kThreads) {
    float p = t.master[j], m = t.m[j], v = t.v[j];
    optim::adam_update(p, m, v, load_element<G>(t.grad, j), c);
    t.master[j] = p;
    t.m[j] = m;
    t.v[j] = v;
    if constexpr (O != Out::none) static_cast<std::uint16_t*>(t.out)[j] = to_low<O>(p);
  }
}

template <DType G, Out O>
void launch_all(std::span<const CudaAdamTensor> tensors, const optim::AdamCoefficients& c,
                const int* overflow, cudaStream_t stream) {
  detail::for_each_launch(tensors.data(), tensors.size(), [&](const Table& table, int blocks) {
    multi_tensor_adam<G, O><<<blocks, kThreads, 0, stream>>>(table, c, overflow);
    ZEST_CUDA_CHECK(cudaGetLastError());
  });
}

template <DType G>
void launch_for_out(std::span<const CudaAdamTensor> tensors, bool has_out, DType out_dtype,
                    const optim::AdamCoefficients& c, const int* overflow, cudaStream_t stream) {
  if (!has_out) return launch_all<G, Out::none>(tensors, c, overflow, stream);
  if (out_dtype == DType::f16) return launch_all<G, Out::f16>(tensors, c, overflow, stream);
  return launch_all<G, Out::bf16>(tensors, c, overflow, stream);
}

}  // namespace

void launch_multi_tensor_adam(std::span<const CudaAdamTensor> tensors, DType grad_dtype, bool has_out,
                              DType out_dtype, const optim::AdamCoefficients& c, const int* overflow,
                              void* stream) {
  if (has_out && out_dtype == DType::f32)
    throw Error("launch_multi_tensor_adam: the parameter copy must be bf16 or fp16, got fp32");
  const auto s = static_cast<cudaStream_t>(stream);
  switch (grad_dtype) {
    case DType::f32: return launch_for_out<DType::f32>(tensors, has_out, out_dtype, c, overflow, s);
    case DType::bf16: return launch_for_out<DType::bf16>(tensors, has_out, out_dtype, c, overflow, s);
    case DType::f16: return launch_for_out<DType::f16>(tensors, has_out, out_dtype, c, overflow, s);
  }
}

}  // namespace zest::kernels
