// The block quantizer's kernels, one source compiled once per instruction set with the CPU Adam's
// flags (meson.build), into the same namespaces (ZEST_ADAM_ISA_NS). The element math is
// block_quant_math.hpp's, instantiated here with the build's vector types only (never with a scalar
// in a vector build: adam_kernels.cpp, at the top, says why; so dtype_size is only ever evaluated as a
// constant here). Each block is worked on whole: a
// partial last block runs on a zero-padded copy (zeros leave its largest magnitude as it is and
// encode as 0, which is also the padding the format asks for).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "optim/block_quant.hpp"
#include "optim/block_quant_math.hpp"
#include "optim/isa_vector.hpp"

namespace zest::optim {
namespace ZEST_ADAM_ISA_NS {
namespace {

constexpr std::size_t kBlock = kQuantBlock;
static_assert(kBlock % 16 == 0, "a block is whole vectors of every variant");

inline VecU as_words(VecF x) { return __builtin_bit_cast(VecU, x); }

// The largest of the lanes' words (all below 2^31), in every lane: a tree of lane swaps, so the
// accumulator stays in a register (indexing the vector kept it in memory, at half the speed).
inline VecU all_lanes_max(VecU v) {
#if defined(__AVX512F__)
  v = quant_max_bits(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = quant_max_bits(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = quant_max_bits(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = quant_max_bits(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#elif defined(__AVX2__)
  v = quant_max_bits(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = quant_max_bits(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = quant_max_bits(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return v;
}

// The first lane (a template, so that the scalar build's branch is discarded in the vector builds
// and the other way round).
template <class V>
inline float first_lane(V v) {
  if constexpr (std::is_same_v<V, float>) {
    return v;
  } else {
    return v[0];
  }
}

template <QuantBits B>
constexpr std::size_t kRecordBytes = quant_record_bytes(B, kBlock);

// One block of n <= kBlock elements of type G at `in` into its record.
template <DType G, QuantBits B>
void quantize_block(const void* in, std::size_t n, std::uint8_t* record) {
  constexpr std::size_t size = dtype_size(G);
  alignas(64) unsigned char padded[kBlock * 4];
  const void* x = in;
  if (n < kBlock) {
    std::memcpy(padded, in, n * size);
    std::memset(padded + n * size, 0, (kBlock - n) * size);
    x = padded;
  }
  VecU absmax = VecU{};
  for (std::size_t i = 0; i < kBlock; i += kLanes)
    absmax = quant_max_bits(absmax, quant_magnitude_bits(as_words(load_typed<G>(x, i))));
  const VecF scale = quant_scale<VecF, VecU>(all_lanes_max(absmax), B);
  const VecF divisor = quant_divisor<VecF, VecU>(scale);
  const VecU keep = quant_keep<VecF, VecU>(scale);
  const float s = first_lane(scale);
  std::memcpy(record, &s, sizeof s);
  std::uint8_t* const codes = record + 4;
  constexpr std::uint32_t code_mask = B == QuantBits::int8 ? 0xffu : 0xfu;
  alignas(64) std::uint8_t bytes[kBlock];  // one code per byte
  std::uint8_t* const to = B == QuantBits::int8 && n == kBlock ? codes : bytes;
  for (std::size_t i = 0; i < kBlock; i += kLanes)
    store_low8(to + i, quant_encode<VecF, VecU>(load_typed<G>(x, i), divisor, keep, B) & code_mask);
  if constexpr (B == QuantBits::int4) {
    alignas(64) std::uint8_t packed[kBlock / 2];
    std::uint8_t* const pairs = n == kBlock ? codes : packed;
    for (std::size_t k = 0; k < kBlock / 2; ++k)
      pairs[k] = static_cast<std::uint8_t>(bytes[2 * k] | (bytes[2 * k + 1] << 4));
    if (n < kBlock) std::memcpy(codes, packed, ((n + 1) / 2 + 3) / 4 * 4);  // the padding: zeros' codes
  } else {
    if (n < kBlock) std::memcpy(codes, bytes, (n + 3) / 4 * 4);
  }
}

// The codes of a block's record of n elements, one per byte (0..255 or 0..15), zero beyond n: the
// record's own bytes for a full int8 block, else `bytes`.
template <QuantBits B>
const std::uint8_t* block_codes(const std::uint8_t* record, std::size_t n, std::uint8_t (&bytes)[kBlock]) {
  const std::uint8_t* const codes = record + 4;
  if constexpr (B == QuantBits::int8) {
    if (n == kBlock) return codes;
    std::memcpy(bytes, codes, n);
    std::memset(bytes + n, 0, kBlock - n);
  } else {
    const std::size_t pairs = (n + 1) / 2;
    for (std::size_t k = 0; k < pairs; ++k) {
      bytes[2 * k] = codes[k] & 0xfu;
      bytes[2 * k + 1] = static_cast<std::uint8_t>(codes[k] >> 4);
    }
    std::memset(bytes + 2 * pairs, 0, kBlock - 2 * pairs);
  }
  return bytes;
}

// op(i, values of elements i..i + kLanes) over a block's record.
template <QuantBits B, class Op>
inline void for_each_value(const std::uint8_t* record, std::size_t n, const Op& op) {
  float s;
  std::memcpy(&s, record, sizeof s);
  const VecF scale = VecF{} + s;
  alignas(64) std::uint8_t bytes[kBlock];
  const std::uint8_t* const codes = block_codes<B>(record, n, bytes);
  for (std::size_t i = 0; i < kBlock; i += kLanes) op(i, quant_decode<VecF, VecU>(load_u8(codes + i), scale, B));
}

template <DType D, QuantBits B>
void dequantize_block(const std::uint8_t* record, std::size_t n, void* out) {
  alignas(64) unsigned char padded[kBlock * 4];
  void* const to = n == kBlock ? out : padded;
  for_each_value<B>(record, n, [to](std::size_t i, VecF value) { store_typed<D>(to, i, value); });
  constexpr std::size_t size = dtype_size(D);
  if (n < kBlock) std::memcpy(out, padded, n * size);
}

template <QuantBits B>
void dequantize_add_block(const std::uint8_t* record, std::size_t n, float* acc) {
  alignas(64) float padded[kBlock];
  float* const to = n == kBlock ? acc : padded;
  if (n < kBlock) {
    std::memcpy(padded, acc, n * sizeof(float));
    std::memset(padded + n, 0, (kBlock - n) * sizeof(float));
  }
  for_each_value<B>(record, n, [to](std::size_t i, VecF value) { store_f32(to + i, load_f32(to + i) + value); });
  if (n < kBlock) std::memcpy(acc, padded, n * sizeof(float));
}

// block(index of the block's first element, its element count, its record) over a range.
template <QuantBits B, class Record, class Block>
inline void for_each_block(std::size_t count, Record* records, const Block& block) {
  for (std::size_t first = 0; first < count; first += kBlock, records += kRecordBytes<B>)
    block(first, count - first < kBlock ? count - first : kBlock, records);
}

}  // namespace

void quantize(const void* in, DType dtype, std::size_t count, QuantBits bits, std::uint8_t* out) {
  with_quant_bits(bits, [&]<QuantBits B>() {
    with_quant_dtype(dtype, [&]<DType G>() {
      for_each_block<B>(count, out, [in](std::size_t first, std::size_t n, std::uint8_t* record) {
        constexpr std::size_t size = dtype_size(G);
        quantize_block<G, B>(static_cast<const unsigned char*>(in) + first * size, n, record);
      });
    });
  });
}

void dequantize(const std::uint8_t* in, QuantBits bits, std::size_t count, void* out, DType dtype) {
  with_quant_bits(bits, [&]<QuantBits B>() {
    with_quant_dtype(dtype, [&]<DType D>() {
      for_each_block<B>(count, in, [out](std::size_t first, std::size_t n, const std::uint8_t* record) {
        constexpr std::size_t size = dtype_size(D);
        dequantize_block<D, B>(record, n, static_cast<unsigned char*>(out) + first * size);
      });
    });
  });
}

void dequantize_add(const std::uint8_t* in, QuantBits bits, std::size_t count, float* acc) {
  with_quant_bits(bits, [&]<QuantBits B>() {
    for_each_block<B>(count, in, [acc](std::size_t first, std::size_t n, const std::uint8_t* record) {
      dequantize_add_block<B>(record, n, acc + first);
    });
  });
}

void cast_from_f32(const float* in, std::size_t count, void* out, DType dtype) {
  with_quant_dtype(dtype, [&]<DType D>() {
    std::size_t i = 0;
    for (; i + kLanes <= count; i += kLanes) store_typed<D>(out, i, load_f32(in + i));
    if constexpr (kLanes > 1) {
      if (i == count) return;
      alignas(64) float from[kLanes] = {};
      alignas(64) unsigned char to[kLanes * 4];
      constexpr std::size_t size = dtype_size(D);  // constexpr: no out-of-line call (adam_kernels.cpp)
      std::memcpy(from, in + i, (count - i) * sizeof(float));
      store_typed<D>(to, 0, load_f32(from));
      std::memcpy(static_cast<unsigned char*>(out) + i * size, to, (count - i) * size);
    }
  });
}

}  // namespace ZEST_ADAM_ISA_NS
}  // namespace zest::optim
