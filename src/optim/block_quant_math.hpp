// Block-wise quantization to int8 or int4 with one fp32 scale per block: the codec of quantized
// collectives (ZeRO++'s qwZ for parameters, qgZ for gradients). This header is the format and its
// element math, shared by every CPU instruction-set variant (block_quant_kernels.cpp) and the CUDA
// kernels (kernels/block_quant.cu); block_quant.hpp is the CPU front end.
//
// The format. Elements are cut into blocks of kQuantBlock from element 0; the last block may be
// partial. Block b has the scale s = absmax / qmax (a float division; qmax = 127 for int8, 7 for
// int4), and element x the code clamp(round_half_even(x / s), -qmax, qmax), which decodes to
// code * s. A block of zeros has s = 0 and codes 0 (decodes to +0). A block holding Inf or NaN has
// s = NaN and codes 0, so the whole block decodes to NaN: the receiver's overflow check sees a
// nonfinite value, as it would in an unquantized reduction (the step is skipped; the block's finite
// values are lost with it).
//
// Error: |x - code * s| <= s / 2, plus the rounding of the product code * s to float (and of the
// output type). Two exceptions, both far outside what gradients and weights hold: a block whose s
// is subnormal (absmax < qmax * 2^-126, about 1.5e-36 for int8) has s rounded to a multiple of
// 2^-149, which adds up to qmax * 2^-150; and for int8 a block whose absmax lies within a relative
// 2^-24 or so of FLT_MAX decodes its largest elements to Inf (127 * s rounds past FLT_MAX).
//
// The buffer. One record per block, back to back: [s: fp32, host byte order][codes], the codes of
// int8 one byte each (two's complement), of int4 two per byte (element 2k in the low nibble of byte
// k, 2k + 1 in the high nibble; two's complement nibbles). A full block's record is 4 + 256 (int8)
// or 4 + 128 (int4) bytes; a partial block's codes are padded with zero bytes to a multiple of 4,
// so every record, and any buffers of records placed back to back, keep their scales 4-byte
// aligned. Elements [a, b) with a a multiple of kQuantBlock are the bytes from
// (a / kQuantBlock) * quant_record_bytes(bits, kQuantBlock), quantized_bytes(bits, b - a) long: a
// range cut on block boundaries (a rank's piece of a collective) is a contiguous, self-contained
// part of the buffer.
//
// The element functions are templates over F (float or a GCC vector of floats) and U (uint32_t or
// a vector of them), as in compact_math.hpp: they use no comparison (a comparison gives bool on
// scalars but a mask on vectors), so one text means the same on every type. The float operations
// are a division and an addition (encode: the quotient, its rounding to an integer), an exact
// subtraction and a multiplication (decode; dequantize-and-add adds once more), each correctly
// rounded on every backend (the CPU variants are compiled with -ffp-contract=off, the CUDA kernels
// with -fmad=false): every backend gets the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "runtime/host/half.hpp"
#include "zest/dtype.hpp"

namespace zest::optim {

// Elements per scale. 256: the scale costs 1.6 % of an int8 buffer and 3 % of an int4 one, one
// outlier coarsens only 256 neighbours, and a block is whole vectors of every variant and 8 codes
// per lane of a CUDA warp.
constexpr std::size_t kQuantBlock = 256;

enum class QuantBits : std::uint8_t { int4 = 4, int8 = 8 };

// run.template operator()<B>() for the format, and run.template operator()<D>() for the element
// type: the kernels' dispatch to their instantiations (CPU and CUDA, host code). Always inlined, so
// that no copy compiled for one instruction set is kept for another (adam_kernels.cpp says why).
template <class Run>
__attribute__((always_inline)) inline void with_quant_bits(QuantBits bits, const Run& run) {
  if (bits == QuantBits::int8) {
    run.template operator()<QuantBits::int8>();
  } else {
    run.template operator()<QuantBits::int4>();
  }
}
template <class Run>
__attribute__((always_inline)) inline void with_quant_dtype(DType dtype, const Run& run) {
  switch (dtype) {
    case DType::f32: run.template operator()<DType::f32>(); return;
    case DType::bf16: run.template operator()<DType::bf16>(); return;
    case DType::f16: run.template operator()<DType::f16>(); return;
  }
}

// The largest code: 7 (int4) or 127 (int8).
ZEST_HOST_DEVICE constexpr std::uint32_t quant_max(QuantBits bits) {
  return (1u << (static_cast<unsigned>(bits) - 1u)) - 1u;
}

// Bytes of the record of a block of n <= kQuantBlock elements: the scale, then the codes padded to
// a multiple of 4 bytes.
ZEST_HOST_DEVICE constexpr std::size_t quant_record_bytes(QuantBits bits, std::size_t n) {
  const std::size_t code_bytes = (n * static_cast<unsigned>(bits) + 7) / 8;
  return 4 + (code_bytes + 3) / 4 * 4;
}

// Bytes of the quantized buffer of `count` elements (0 for none): a multiple of 4.
ZEST_HOST_DEVICE constexpr std::size_t quantized_bytes(QuantBits bits, std::size_t count) {
  const std::size_t rest = count % kQuantBlock;
  return count / kQuantBlock * quant_record_bytes(bits, kQuantBlock) + (rest == 0 ? 0 : quant_record_bytes(bits, rest));
}

// The bits of a float (vector) as words and back; memcpy, which the compilers turn into a move.
template <class To, class From>
ZEST_HOST_DEVICE inline To quant_bit_cast(From x) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<To, float>) {
    return __uint_as_float(x);
  } else {
    return __float_as_uint(x);
  }
#else
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
#endif
}

// max(a, b) of words below 2^31 (the magnitudes' bits, in which NaN > Inf > every finite value):
// a - b then has its top bit set exactly when a < b.
template <class U>
ZEST_HOST_DEVICE inline U quant_max_bits(U a, U b) {
  const U a_below = U{} - ((a - b) >> 31);
  return (b & a_below) | (a & ~a_below);
}

// The bits of |x|.
template <class U>
ZEST_HOST_DEVICE inline U quant_magnitude_bits(U word) {
  return word & 0x7fffffffu;
}

// The block's scale from the bits of its largest magnitude: absmax / qmax, or a quiet NaN when
// absmax is Inf or NaN (bits above 0x7f7fffff).
template <class F, class U>
ZEST_HOST_DEVICE inline F quant_scale(U absmax_bits, QuantBits bits) {
  const U nonfinite = U{} - ((0x7f7fffffu - absmax_bits) >> 31);
  const U scale = quant_bit_cast<U>(quant_bit_cast<F>(absmax_bits) / (F{} + static_cast<float>(quant_max(bits))));
  return quant_bit_cast<F>((scale & ~nonfinite) | (0x7fc00000u & nonfinite));
}

// What encoding needs of a block's scale s: the divisor (s, or 1 for s = 0, so that a zero block
// encodes 0 / 1 rather than 0 / 0) and the mask of the codes to keep (none for s = NaN, whose
// block encodes as zeros).
template <class F, class U>
ZEST_HOST_DEVICE inline F quant_divisor(F scale) {
  const U s = quant_bit_cast<U>(scale);
  const U zero = U{} - ((s - 1u) >> 31);  // s is 0 or a positive float's bits (or NaN's)
  return quant_bit_cast<F>(s | (zero & 0x3f800000u));
}
template <class F, class U>
ZEST_HOST_DEVICE inline U quant_keep(F scale) {
  return ~(U{} - ((0x7f800000u - quant_bit_cast<U>(scale)) >> 31));
}

// The code of x (two's complement, in all 32 bits of the word; the caller keeps the low `bits`):
// |x / divisor| clamped to qmax as words (below 2^31; a larger or NaN quotient, only possible in a
// subnormal-scale or a dropped block, becomes qmax), rounded half to even by adding 1.5 * 2^23
// (whose float spacing is 1), the sign put back.
template <class F, class U>
ZEST_HOST_DEVICE inline U quant_encode(F x, F divisor, U keep, QuantBits bits) {
  const U quotient = quant_bit_cast<U>(x / divisor);
  const U limit = quant_bit_cast<U>(F{} + static_cast<float>(quant_max(bits)));
  const U magnitude = quant_magnitude_bits(quotient);
  const U over = U{} - ((limit - magnitude) >> 31);
  const U clamped = (magnitude & ~over) | (limit & over);
  const U rounded = quant_bit_cast<U>(quant_bit_cast<F>(clamped) + 12582912.0f) - 0x4b400000u;
  const U negative = U{} - (quotient >> 31);
  return ((rounded ^ negative) - negative) & keep;
}

// The value of a code, given as its `bits` low bits (higher bits 0): sign-extended, converted to
// float exactly (as 1.5 * 2^23 + code less 1.5 * 2^23), times the scale.
template <class F, class U>
ZEST_HOST_DEVICE inline F quant_decode(U code, F scale, QuantBits bits) {
  const std::uint32_t sign = 1u << (static_cast<unsigned>(bits) - 1u);
  const U extended = (code ^ sign) - sign;
  return (quant_bit_cast<F>(extended + 0x4b400000u) - 12582912.0f) * scale;
}

// The checks of every front end's arguments (BlockQuantizer, kernels/block_quant.hpp), in
// block_quant.cpp: a supported dtype and bits, pointers aligned to their elements (the quantized
// buffer to its 4-byte scales), buffers of the right size that do not overlap. They throw
// zest::Error naming the problem and the fix; `who` names the call.
void check_quantize_args(const char* who, const void* in, DType dtype, std::size_t count, QuantBits bits,
                         const void* out, std::size_t out_bytes);
void check_dequantize_args(const char* who, const void* in, std::size_t in_bytes, QuantBits bits, const void* out,
                           DType dtype, std::size_t count);

}  // namespace zest::optim
