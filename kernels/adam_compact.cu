// The fused multi-tensor Adam with compact states (optimizer.states bf16 and int8,
// docs/compact-states.md): the element math of src/optim/compact_math.hpp, shared with the CPU
// kernels, in a file nvcc compiles with -fmad=false, so that no multiply-add is contracted and each
// element's result is the CPU Adam's bit for bit (the rounding itself is integer arithmetic).
//   bf16: one element per thread, as the fp32 kernel's ragged path; the random bits from the
//         element's global index and the step's key.
//   int8: one warp per block of kInt8Block (64) elements, two per lane: dequantize with the old
//         scales, update, the new scales by a warp-wide maximum, encode with the codes in shared
//         memory.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/adam.hpp"
#include "kernels/dtype_access.cuh"
#include "kernels/multi_tensor.cuh"
#include "optim/compact_math.hpp"
#include "runtime/device/cuda_check.hpp"
#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::kernels {
namespace {

using detail::kChunk;
using detail::kThreads;
using detail::load_element;
using Table = detail::TensorTable<CudaCompactAdamTensor>;

constexpr int kWarp = 32;
static_assert(optim::kInt8Block == 2 * kWarp, "the int8 kernel gives each lane two elements of a block");
static_assert(kChunk % optim::kInt8Block == 0, "a chunk is whole blocks");

// m's (signed) and v's (unsigned) dynamic codes, copied into each block's shared memory.
struct Codes {
  optim::DynamicCode m, v;
};
static_assert(sizeof(Codes) % sizeof(float) == 0, "copied into shared memory a float at a time");
__constant__ Codes g_codes;

enum class Out { none, bf16, f16 };

template <Out O>
__device__ inline void store_out(void* out, std::int64_t j, float p) {
  if constexpr (O == Out::bf16) static_cast<std::uint16_t*>(out)[j] = float_to_bf16(p);
  if constexpr (O == Out::f16) static_cast<std::uint16_t*>(out)[j] = float_to_fp16(p);
}

template <DType G, Out O>
__global__ void __launch_bounds__(kThreads) bf16_states_adam(Table table, optim::AdamCoefficients c,
                                                             std::uint32_t key_lo, std::uint32_t key_hi,
                                                             const int* overflow) {
  if (overflow != nullptr && *overflow != 0) return;  // an Inf/NaN gradient: skip the step
  const CudaCompactAdamTensor& t = table.tensors[table.block_tensor[blockIdx.x]];
  const std::int64_t begin = static_cast<std::int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const std::int64_t end = begin + kChunk < t.count ? begin + kChunk : t.count;
  auto* const m = static_cast<std::uint16_t*>(t.m);
  auto* const v = static_cast<std::uint16_t*>(t.v);
  for (std::int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
    float p = t.master[j], mj = bf16_to_float(m[j]), vj = bf16_to_float(v[j]);
    optim::adam_update(p, mj, vj, load_element<G>(t.grad, j), c);
    const std::uint64_t index = t.first_index + static_cast<std::uint64_t>(j);
    const std::uint32_t bits = optim::state_random_bits<std::uint32_t>(
        static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32), key_lo, key_hi);
    t.master[j] = p;
    m[j] = static_cast<std::uint16_t>(optim::stochastic_round_bf16_bits<std::uint32_t>(float_bits(mj), bits & 0xffffu));
    v[j] = static_cast<std::uint16_t>(optim::stochastic_round_bf16_bits<std::uint32_t>(float_bits(vj), bits >> 16));
    store_out<O>(t.out, j, p);
  }
}

__device__ inline float warp_max(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = other > x ? other : x;
  }
  return x;
}

template <DType G, Out O>
__global__ void __launch_bounds__(kThreads) int8_states_adam(Table table, optim::AdamCoefficients c,
                                                             const int* overflow) {
  if (overflow != nullptr && *overflow != 0) return;
  __shared__ Codes codes;
  for (unsigned i = threadIdx.x; i < sizeof(Codes) / sizeof(float); i += kThreads)
    reinterpret_cast<float*>(&codes)[i] = reinterpret_cast<const float*>(&g_codes)[i];
  __syncthreads();
  const CudaCompactAdamTensor& t = table.tensors[table.block_tensor[blockIdx.x]];
  const std::int64_t begin = static_cast<std::int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const std::int64_t end = begin + kChunk < t.count ? begin + kChunk : t.count;
  auto* const qm = static_cast<std::uint8_t*>(t.m);
  auto* const qv = static_cast<std::uint8_t*>(t.v);
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  constexpr std::int64_t kBlock = optim::kInt8Block;
  for (std::int64_t first = begin + warp * kBlock; first < end; first += (kThreads / kWarp) * kBlock) {
    const std::int64_t block = first / kBlock;
    const float old_m_scale = t.m_scale[block], old_v_scale = t.v_scale[block];
    float m_new[2] = {0.0f, 0.0f}, v_new[2] = {0.0f, 0.0f};
    for (int k = 0; k < 2; ++k) {
      const std::int64_t j = first + lane + k * kWarp;
      if (j >= end) continue;  // a short last block: the missing elements are zeros, as on the CPU
      float p = t.master[j];
      m_new[k] = optim::dequantize(codes.m, true, qm[j], old_m_scale);
      v_new[k] = optim::dequantize(codes.v, false, qv[j], old_v_scale);
      optim::adam_update(p, m_new[k], v_new[k], load_element<G>(t.grad, j), c);
      t.master[j] = p;
      store_out<O>(t.out, j, p);
    }
    const auto magnitude = [](float x) { return bits_float(float_bits(x) & 0x7fffffffu); };
    const float m_scale =
        warp_max(magnitude(m_new[0]) > magnitude(m_new[1]) ? magnitude(m_new[0]) : magnitude(m_new[1]));
    const float v_scale =
        warp_max(magnitude(v_new[0]) > magnitude(v_new[1]) ? magnitude(v_new[0]) : magnitude(v_new[1]));
    __syncwarp();  // every lane has read the old scales
    if (lane == 0) {
      t.m_scale[block] = m_scale;
      t.v_scale[block] = v_scale;
    }
    const optim::BlockReciprocal m_r = optim::block_reciprocal(m_scale), v_r = optim::block_reciprocal(v_scale);
    for (int k = 0; k < 2; ++k) {
      const std::int64_t j = first + lane + k * kWarp;
      if (j >= end) continue;
      const std::uint32_t m_byte = optim::dynamic_encode_magnitude<float, std::uint32_t>(
          codes.m, magnitude(m_new[k]) * m_r.pre * m_r.inv, optim::ScalarCodeOps{});
      qm[j] = static_cast<std::uint8_t>(optim::signed_code_byte<std::uint32_t>(float_bits(m_new[k]), m_byte));
      qv[j] = static_cast<std::uint8_t>(optim::unsigned_code_byte<std::uint32_t>(
          float_bits(v_new[k]), optim::dynamic_encode_magnitude<float, std::uint32_t>(
                                    codes.v, magnitude(v_new[k]) * v_r.pre * v_r.inv, optim::ScalarCodeOps{})));
    }
  }
}

template <DType G, Out O>
void launch_all(std::span<const CudaCompactAdamTensor> tensors, StatesFormat states, const optim::AdamCoefficients& c,
                std::uint64_t key, const int* overflow, cudaStream_t stream) {
  detail::for_each_launch(tensors.data(), tensors.size(), [&](const Table& table, int blocks) {
    if (states == StatesFormat::bf16)
      bf16_states_adam<G, O><<<blocks, kThreads, 0, stream>>>(table, c, static_cast<std::uint32_t>(key),
                                                             static_cast<std::uint32_t>(key >> 32), overflow);
    else
      int8_states_adam<G, O><<<blocks, kThreads, 0, stream>>>(table, c, overflow);
    ZEST_CUDA_CHECK(cudaGetLastError());
  });
}

template <DType G>
void launch_for_out(std::span<const CudaCompactAdamTensor> tensors, StatesFormat states, bool has_out,
                    DType out_dtype, const optim::AdamCoefficients& c, std::uint64_t key, const int* overflow,
                    cudaStream_t stream) {
  if (!has_out) return launch_all<G, Out::none>(tensors, states, c, key, overflow, stream);
  if (out_dtype == DType::f16) return launch_all<G, Out::f16>(tensors, states, c, key, overflow, stream);
  return launch_all<G, Out::bf16>(tensors, states, c, key, overflow, stream);
}

}  // namespace

void launch_multi_tensor_adam_compact(std::span<const CudaCompactAdamTensor> tensors, StatesFormat states,
                                      DType grad_dtype, bool has_out, DType out_dtype,
                                      const optim::AdamCoefficients& c, std::uint64_t rounding_key,
                                      const int* overflow, void* stream) {
  if (states == StatesFormat::f32)
    throw Error("launch_multi_tensor_adam_compact: fp32 states take launch_multi_tensor_adam");
  if (has_out && out_dtype == DType::f32)
    throw Error("launch_multi_tensor_adam_compact: the parameter copy must be bf16 or fp16, got fp32");
  const auto s = static_cast<cudaStream_t>(stream);
  if (states == StatesFormat::int8) {
    // The codes into constant memory, ordered on the stream before the kernels that copy them.
    static const Codes host_codes{optim::make_dynamic_code(true), optim::make_dynamic_code(false)};
    ZEST_CUDA_CHECK(cudaMemcpyToSymbolAsync(g_codes, &host_codes, sizeof(Codes), 0, cudaMemcpyHostToDevice, s));
  }
  switch (grad_dtype) {
    case DType::f32:
      return launch_for_out<DType::f32>(tensors, states, has_out, out_dtype, c, rounding_key, overflow, s);
    case DType::bf16:
      return launch_for_out<DType::bf16>(tensors, states, has_out, out_dtype, c, rounding_key, overflow, s);
    case DType::f16:
      return launch_for_out<DType::f16>(tensors, states, has_out, out_dtype, c, rounding_key, overflow, s);
  }
}

}  // namespace zest::kernels
