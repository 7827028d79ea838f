// The vector types and the loads and stores of one instruction set, for the sources compiled once
// per instruction set (adam_kernels.cpp, block_quant_kernels.cpp; see meson.build) and nothing
// else: every function has internal linkage, in the build's own namespace ZEST_ADAM_ISA_NS, so no
// vector-compiled copy can stand in for another build's (adam_kernels.cpp, at the top, says why that
// matters). With -mavx512* the vectors have 16 lanes, with -mavx2 -mfma -mf16c 8, with no flags 1.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/host/half.hpp"
#include "zest/dtype.hpp"

#if !defined(ZEST_ADAM_ISA_NS)
#error "optim/isa_vector.hpp is for the per-instruction-set sources (see src/optim/meson.build)"
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
// GCC 12's AVX-512 headers start some conversions from _mm512_undefined_*(), which -O3 then
// reports as maybe-uninitialized wherever they are inlined (and, in the int8 block loop, as
// uninitialized: the same false report).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace zest::optim {

// Plain GCC vector types (the intrinsics' __m512/__m256 carry may_alias, which a template
// argument drops); they convert implicitly to and from the intrinsics' types.
#if defined(__AVX512F__)
using VecF = float __attribute__((vector_size(64)));
#elif defined(__AVX2__)
using VecF = float __attribute__((vector_size(32)));
#endif

namespace ZEST_ADAM_ISA_NS {
namespace {

#if defined(__AVX512F__)
constexpr std::size_t kLanes = 16;

inline VecF load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f32(float* p, VecF x) { _mm512_storeu_ps(p, x); }
inline __m256i load_u16(const std::uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline VecF load_bf16(const std::uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_u16(p)), 16));
}
inline VecF load_f16(const std::uint16_t* p) { return _mm512_cvtph_ps(load_u16(p)); }
// Round to nearest even as runtime/host/half.hpp does; NaN becomes a quiet NaN with its top bits kept.
inline void store_bf16(std::uint16_t* p, VecF x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}
inline void store_f16(std::uint16_t* p, VecF x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
using VecU = std::uint32_t __attribute__((vector_size(64)));
constexpr VecU kLaneOffsets = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
// The low 16 bits of each word (all words hold values below 0x10000).
inline void store_low16(std::uint16_t* p, VecU x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(__builtin_bit_cast(__m512i, x)));
}
inline VecU load_u8(const std::uint8_t* p) {
  return __builtin_bit_cast(VecU, _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store_low8(std::uint8_t* p, VecU x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(__builtin_bit_cast(__m512i, x)));
}

#elif defined(__AVX2__)
constexpr std::size_t kLanes = 8;

inline VecF load_f32(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f32(float* p, VecF x) { _mm256_storeu_ps(p, x); }
inline __m128i load_u16(const std::uint16_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline VecF load_bf16(const std::uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_u16(p)), 16));
}
inline VecF load_f16(const std::uint16_t* p) { return _mm256_cvtph_ps(load_u16(p)); }
inline void store_bf16(std::uint16_t* p, VecF x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i result = _mm256_blendv_epi8(rounded, quiet, nan);
  // Every 32-bit lane holds a value below 0x10000, so the saturating pack is exact.
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(result),
                                    _mm256_extracti128_si256(result, 1)));
}
inline void store_f16(std::uint16_t* p, VecF x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
using VecU = std::uint32_t __attribute__((vector_size(32)));
constexpr VecU kLaneOffsets = {0, 1, 2, 3, 4, 5, 6, 7};
// The low 16 bits of each word: every word holds a value below 0x10000, so the saturating pack is exact.
inline void store_low16(std::uint16_t* p, VecU x) {
  const __m256i w = __builtin_bit_cast(__m256i, x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
inline VecU load_u8(const std::uint8_t* p) {
  return __builtin_bit_cast(VecU, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Every word holds a value below 0x100: both saturating packs are exact.
inline void store_low8(std::uint8_t* p, VecU x) {
  const __m256i w = __builtin_bit_cast(__m256i, x);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
}

#else
// Scalar: the baseline build, where calling the shared inline helpers is safe.
using VecF = float;
constexpr std::size_t kLanes = 1;

inline VecF load_f32(const float* p) { return *p; }
inline void store_f32(float* p, VecF x) { *p = x; }
inline VecF load_bf16(const std::uint16_t* p) { return bf16_to_float(*p); }
inline VecF load_f16(const std::uint16_t* p) { return fp16_to_float(*p); }
inline void store_bf16(std::uint16_t* p, VecF x) { *p = float_to_bf16(x); }
inline void store_f16(std::uint16_t* p, VecF x) { *p = float_to_fp16(x); }
using VecU = std::uint32_t;
constexpr VecU kLaneOffsets = 0;
inline void store_low16(std::uint16_t* p, VecU x) { *p = static_cast<std::uint16_t>(x); }
inline VecU load_u8(const std::uint8_t* p) { return *p; }
inline void store_low8(std::uint8_t* p, VecU x) { *p = static_cast<std::uint8_t>(x); }
#endif

// kLanes elements of type G from element i of `data`, widened to float (exact).
template <DType G>
inline VecF load_typed(const void* data, std::size_t i) {
  if constexpr (G == DType::f32) {
    return load_f32(static_cast<const float*>(data) + i);
  } else if constexpr (G == DType::bf16) {
    return load_bf16(static_cast<const std::uint16_t*>(data) + i);
  } else {
    return load_f16(static_cast<const std::uint16_t*>(data) + i);
  }
}

// x as kLanes elements of type D at element i of `data`, rounded to nearest even (runtime/host/half.hpp).
template <DType D>
inline void store_typed(void* data, std::size_t i, VecF x) {
  if constexpr (D == DType::f32) {
    store_f32(static_cast<float*>(data) + i, x);
  } else if constexpr (D == DType::bf16) {
    store_bf16(static_cast<std::uint16_t*>(data) + i, x);
  } else {
    store_f16(static_cast<std::uint16_t*>(data) + i, x);
  }
}

}  // namespace
}  // namespace ZEST_ADAM_ISA_NS
}  // namespace zest::optim
