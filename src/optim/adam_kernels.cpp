// The CPU Adam kernels, one source compiled once per instruction set (see meson.build): with
// -mavx512* it uses 16-lane vectors, with -mavx2 -mfma -mf16c 8 lanes, with no flags one lane.
// ZEST_ADAM_ISA_NS names the namespace each copy lands in.
// The vector types, loads and stores are optim/isa_vector.hpp's.
//
// Every function here has internal linkage or lives in the per-ISA namespace, and the vector
// builds never call an inline function of a shared header with a scalar argument: otherwise the
// linker could keep an AVX-512-compiled copy of that inline function for every caller, and the
// scalar fallback would crash on CPUs without AVX-512. That is why the vector builds handle
// ragged tails by padding them to one full vector instead of running a scalar loop.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "optim/adam_kernels.hpp"
#include "optim/compact_math.hpp"
#include "optim/isa_vector.hpp"

#if !defined(ZEST_ADAM_ISA_NS)
#error "compile adam_kernels.cpp with -DZEST_ADAM_ISA_NS=<namespace> (see src/optim/meson.build)"
#endif

namespace zest::optim {

// The vector square root of adam_update (VecF: optim/isa_vector.hpp).
#if defined(__AVX512F__)
template <>
struct AdamSqrt<VecF> {
  static VecF apply(VecF x) { return _mm512_sqrt_ps(x); }
};
#elif defined(__AVX2__)
template <>
struct AdamSqrt<VecF> {
  static VecF apply(VecF x) { return _mm256_sqrt_ps(x); }
};
#endif

// Forces inlining where GCC's heuristics stop short in these large template instantiations (the
// AVX2 bf16-states op was an out-of-line call per vector, its vectors passed through memory).
#define ZEST_KERNEL_INLINE __attribute__((always_inline)) inline

namespace ZEST_ADAM_ISA_NS {
namespace {

// The parameter copy written in the update's pass: none, a 16-bit copy, or fp32 parameters that
// are not the master weights' memory (the engine's fp32 parameters: writing them here saves a
// copy of the master afterwards, a read and a write of every parameter).
enum class Out { none, bf16, f16, f32 };
template <Out O>
constexpr std::size_t kOutSize = O == Out::f32 ? 4 : 2;

#if defined(__AVX512F__)
// The high 16 bits of each word of mw to m and of vw to v: one two-register word permute.
inline void store_high16_pair(std::uint16_t* m, std::uint16_t* v, VecU mw, VecU vw) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                       25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i both = _mm512_permutex2var_epi16(__builtin_bit_cast(__m512i, mw), odd, __builtin_bit_cast(__m512i, vw));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(m), _mm512_castsi512_si256(both));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), _mm512_extracti64x4_epi64(both, 1));
}
// stochastic_round_bf16_bits(bits of x, r) << 16, with a mask for NaN: the high half of u + r, or
// for NaN of u | 0x400000, (u >> 16) | 0x40.
inline VecU stochastic_round_bf16_high(VecF x, VecU r) {
  const __m512i u = _mm512_castps_si512(x);
  return __builtin_bit_cast(VecU, _mm512_mask_or_epi32(_mm512_add_epi32(u, __builtin_bit_cast(__m512i, r)),
                                                       _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u,
                                                       _mm512_set1_epi32(0x400000)));
}
// max(a, acc) that keeps acc where a is NaN (as the scalar a > acc ? a : acc).
inline VecF max_keeping(VecF a, VecF acc) { return _mm512_max_ps(a, acc); }
inline float horizontal_max(VecF x) { return _mm512_reduce_max_ps(x); }

// The float x >= 0 rounded to 16 significant bits, to nearest, ties away from 0: for the products
// of DynamicCode::value_step, none of which lies halfway, that is make_dynamic_code's rounding.
inline __m512i round_to_16_bits(__m512 x) {
  return _mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x80)),
                          _mm512_set1_epi32(~0xff));
}

// The int8 code's values in closed form (DynamicCode::value_step), for m (N = 128) and v (N = 256):
// ten vector operations on two registers. m's 128 values as a register table took 8 registers,
// 4 vpermt2ps, 3 blends and a copy of the table per permute (vpermt2ps overwrites it), and
// spilled in the update loop; v's 256 more so.
template <std::uint32_t N>
struct Int8Decoder {
  __m512 step, base;
  explicit Int8Decoder(const DynamicCode& code)
      : step(_mm512_loadu_ps(code.value_step)), base(_mm512_loadu_ps(code.value_base)) {}
  // The value of magnitude byte b (bits 0..6 for m, whose top bit is the sign: dropped here).
  VecF value(VecU byte) const {
    // 2b + 1 with b = byte & (N - 1): one ternary logic operation on byte << 1.
    const __m512i twice = _mm512_slli_epi32(__builtin_bit_cast(__m512i, byte), 1);
    const __m512i odd_word = _mm512_ternarylogic_epi32(twice, _mm512_set1_epi32(static_cast<int>(2 * N - 2)),
                                                       _mm512_set1_epi32(1), 0xea);  // (a & b) | c
    const __m512 odd = _mm512_cvtepi32_ps(odd_word);
    const __m512i slot = _mm512_srli_epi32(_mm512_castps_si512(odd), 23);  // 128 + k; 127 for b = 0
    const __m512 n = _mm512_fmadd_ps(odd, _mm512_set1_ps(4.5f), _mm512_permutexvar_ps(slot, base));
    return __builtin_bit_cast(VecF, round_to_16_bits(_mm512_mul_ps(n, _mm512_permutexvar_ps(slot, step))));
  }
  // A signed (m) byte times the scale, as dequantize: bits 0..6 give the magnitude, bit 7 the sign.
  VecF signed_value(VecU byte, VecF scale) const {
    const __m512 magnitude = _mm512_mul_ps(value(byte), scale);
    return _mm512_mask_xor_ps(magnitude,
                              _mm512_test_epi32_mask(__builtin_bit_cast(__m512i, byte), _mm512_set1_epi32(0x80)),
                              magnitude, _mm512_set1_ps(-0.0f));
  }
};

// signed_code_byte with masks.
inline VecU signed_byte(VecU word, VecU magnitude) {
  const __m512i m = __builtin_bit_cast(__m512i, magnitude);
  const __mmask16 negative = _mm512_movepi32_mask(__builtin_bit_cast(__m512i, word)) & _mm512_test_epi32_mask(m, m);
  return __builtin_bit_cast(VecU, _mm512_mask_or_epi32(m, negative, m, _mm512_set1_epi32(0x80)));
}

// unsigned_code_byte with a mask: the magnitude raised to at least 1 where |v| is neither 0 nor NaN
// (0 < bits of |v| <= 0x7f800000: one unsigned comparison of bits - 1), three operations where the
// branch-free word arithmetic took nine.
inline VecU unsigned_byte(VecU word, VecU magnitude) {
  const __m512i x = _mm512_and_si512(__builtin_bit_cast(__m512i, word), _mm512_set1_epi32(0x7fffffff));
  const __mmask16 finite_nonzero =
      _mm512_cmplt_epu32_mask(_mm512_sub_epi32(x, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7f800000));
  const __m512i m = __builtin_bit_cast(__m512i, magnitude);
  return __builtin_bit_cast(VecU, _mm512_mask_max_epu32(m, finite_nonzero, m, _mm512_set1_epi32(1)));
}

// The byte nearest to a in closed form (DynamicCode::decade_slope), equal to the binary search
// dynamic_encode_magnitude on every float: dynamic_encode_from_guess's one exact comparison decides.
// Only the few vectors with a lane near a boundary read midpoints, with a gather: holding the table
// in registers (8 or 16 of them) cost more in loads and spills at every block than the gathers do.
template <std::uint32_t N>
struct Int8Encoder {
  const float* midpoints;
  __m512 key_low, key_high, slope, offset, band;
  explicit Int8Encoder(const DynamicCode& code)
      : midpoints(code.midpoints),
        key_low(_mm512_loadu_ps(code.binade_key)),
        key_high(_mm512_loadu_ps(code.binade_key + 16)),
        slope(_mm512_loadu_ps(code.decade_slope)),
        offset(_mm512_loadu_ps(code.decade_offset)),
        band(_mm512_set1_ps(code.guess_band)) {}
  VecU encode(VecF a) const {
    // The decade from the binade (DynamicCode::binade_key): one table read, one comparison.
    const __m512i field = _mm512_max_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 23), _mm512_set1_epi32(96));
    const __m512 key = _mm512_permutex2var_ps(key_low, field, key_high);
    const __m512i decade = _mm512_mask_sub_epi32(_mm512_castps_si512(key), _mm512_cmp_ps_mask(a, key, _CMP_GT_OQ),
                                                 _mm512_castps_si512(key), _mm512_set1_epi32(1));
    // The byte coordinate, clamped to [0, N - 0.5] (max_ps returns its second operand, 0, for NaN,
    // which encodes as 0; beyond the top value a byte is the top), and its floor, the guess.
    __m512 x = _mm512_fmadd_ps(a, _mm512_permutexvar_ps(decade, slope), _mm512_permutexvar_ps(decade, offset));
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_setzero_ps()), _mm512_set1_ps(static_cast<float>(N) - 0.5f));
    const __m512 floor = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512i guess = _mm512_cvttps_epi32(floor);
    // The guess is the byte unless x lies above the band, just below the next integer, where the
    // boundary can be (at most 0.15 % of lanes): only vectors with such a lane read the midpoints.
    const __mmask16 near = _mm512_cmp_ps_mask(_mm512_sub_ps(x, floor), band, _CMP_GE_OQ);
    if (__builtin_expect(near == 0, 1)) return __builtin_bit_cast(VecU, guess);
    // g <= N - 2 for the table; a lane at N - 1 is not near, so its a > midpoints[N - 2] adds the 1 back.
    const __m512i g = _mm512_min_epi32(guess, _mm512_set1_epi32(static_cast<int>(N - 2)));
    const __mmask16 above = _mm512_cmp_ps_mask(a, _mm512_i32gather_ps(g, midpoints, 4), _CMP_GT_OQ);
    return __builtin_bit_cast(VecU, _mm512_mask_add_epi32(g, above, g, _mm512_set1_epi32(1)));
  }
};

struct SquareSum {
  __m512d lo = _mm512_setzero_pd();
  __m512d hi = _mm512_setzero_pd();
  __m512 bad = _mm512_setzero_ps();  // x - x: stays 0 unless some x is Inf or NaN
  void add(VecF x) {
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lo = lo + a * a;
    hi = hi + b * b;
    bad = bad + (x - x);
  }
  GradStats finish() const {
    return {_mm512_reduce_add_pd(lo + hi), _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0};
  }
};

#elif defined(__AVX2__)
struct VecCodeOps {
  VecF gather(const float* table, VecU index) const {
    return _mm256_i32gather_ps(table, __builtin_bit_cast(__m256i, index), 4);
  }
  VecU greater(VecF a, VecF b) const { return __builtin_bit_cast(VecU, _mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
};
inline VecF max_keeping(VecF a, VecF acc) { return _mm256_max_ps(a, acc); }
// The high 16 bits of each word of mw to m and of vw to v: one pack of both (whose 128-bit lanes
// hold m0-3 v0-3 | m4-7 v4-7) and one permute.
inline void store_high16_pair(std::uint16_t* m, std::uint16_t* v, VecU mw, VecU vw) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(__builtin_bit_cast(__m256i, mw), 16),
                                             _mm256_srli_epi32(__builtin_bit_cast(__m256i, vw), 16));
  const __m256i both = _mm256_permute4x64_epi64(packed, 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(m), _mm256_castsi256_si128(both));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(v), _mm256_extracti128_si256(both, 1));
}
// As the AVX-512 stochastic_round_bf16_high, with a blend.
inline VecU stochastic_round_bf16_high(VecF x, VecU r) {
  const __m256i u = _mm256_castps_si256(x);
  return __builtin_bit_cast(VecU, _mm256_blendv_epi8(_mm256_add_epi32(u, __builtin_bit_cast(__m256i, r)),
                                                     _mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                                                     _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))));
}


// The int8 code of N magnitudes (128: m, 256: v), as the AVX-512 Int8Decoder/Int8Encoder with 8
// lanes. AVX2 has no two-register permute to hold a table, so values are computed in closed form
// (DynamicCode::value_step; the slot of byte 0, exponent 127 & 7, is k = 7's, so byte 0 is masked
// to 0), and the few vectors with a lane near a boundary gather their midpoints.
template <std::uint32_t N>
struct Int8Decoder {
  __m256 step, base;
  explicit Int8Decoder(const DynamicCode& code)
      : step(_mm256_loadu_ps(code.value_step)), base(_mm256_loadu_ps(code.value_base)) {}
  VecF value(VecU byte) const {
    const __m256i b = __builtin_bit_cast(__m256i, byte);
    const __m256 odd = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(b, b), _mm256_set1_epi32(1)));
    const __m256i slot = _mm256_srli_epi32(_mm256_castps_si256(odd), 23);  // 128 + k; 127 for b = 0
    const __m256 n = _mm256_fmadd_ps(odd, _mm256_set1_ps(4.5f), _mm256_permutevar8x32_ps(base, slot));
    const __m256i u = _mm256_castps_si256(_mm256_mul_ps(n, _mm256_permutevar8x32_ps(step, slot)));
    // To 16 significant bits, to nearest (no product lies halfway: see the AVX-512 round_to_16_bits).
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_set1_epi32(0x80)), _mm256_set1_epi32(~0xff));
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()), rounded));
  }
  VecF signed_value(VecU byte, VecF scale) const {
    return __builtin_bit_cast(VecF, __builtin_bit_cast(VecU, value(byte & 0x7fu) * scale) ^ signed_code_sign(byte));
  }
};
inline VecU signed_byte(VecU word, VecU magnitude) { return signed_code_byte(word, magnitude); }
// unsigned_code_byte with compares: the magnitude raised to at least 1 where 0 < bits of |v| <=
// 0x7f800000 (neither 0 nor NaN).
inline VecU unsigned_byte(VecU word, VecU magnitude) {
  const __m256i x = _mm256_and_si256(__builtin_bit_cast(__m256i, word), _mm256_set1_epi32(0x7fffffff));
  const __m256i raise = _mm256_and_si256(_mm256_cmpgt_epi32(x, _mm256_setzero_si256()),
                                         _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800001), x));
  return __builtin_bit_cast(VecU, _mm256_max_epu32(__builtin_bit_cast(__m256i, magnitude),
                                                   _mm256_and_si256(raise, _mm256_set1_epi32(1))));
}
template <std::uint32_t N>
struct Int8Encoder {
  const DynamicCode& code;
  VecU encode(VecF a) const {
    // The decade: w - 1, less one for each power of ten below a (compares give -1; unused
    // thresholds are +Inf; NaN compares false everywhere).
    __m256i decade = _mm256_set1_epi32(N == 256 ? 7 : 6);
    for (int i = 0; i < 7; ++i)
      decade = _mm256_add_epi32(
          decade, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(code.decade_threshold[i]), _CMP_GT_OQ)));
    __m256 x = _mm256_fmadd_ps(a, _mm256_permutevar8x32_ps(_mm256_loadu_ps(code.decade_slope), decade),
                               _mm256_permutevar8x32_ps(_mm256_loadu_ps(code.decade_offset), decade));
    // Clamped to [0, N - 0.5] (max_ps returns its second operand, 0, for NaN, which encodes as 0),
    // floored; only vectors with a lane above the band, just below the next integer, gather a
    // midpoint (see the AVX-512 Int8Encoder).
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_setzero_ps()), _mm256_set1_ps(static_cast<float>(N) - 0.5f));
    const __m256 floor = _mm256_floor_ps(x);
    const __m256i guess = _mm256_cvttps_epi32(floor);
    const int near =
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x, floor), _mm256_set1_ps(code.guess_band), _CMP_GE_OQ));
    if (__builtin_expect(near == 0, 1)) return __builtin_bit_cast(VecU, guess);
    const __m256i g = _mm256_min_epi32(guess, _mm256_set1_epi32(static_cast<int>(N - 2)));
    return dynamic_encode_from_guess<VecF, VecU>(code, a, __builtin_bit_cast(VecU, g), VecCodeOps{});
  }
};
inline float horizontal_max(VecF x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

struct SquareSum {
  __m256d lo = _mm256_setzero_pd();
  __m256d hi = _mm256_setzero_pd();
  __m256 bad = _mm256_setzero_ps();
  void add(VecF x) {
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo = lo + a * a;
    hi = hi + b * b;
    bad = bad + (x - x);
  }
  GradStats finish() const {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, lo + hi);
    const bool nonfinite = _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) != 0;
    return {(lanes[0] + lanes[1]) + (lanes[2] + lanes[3]), nonfinite};
  }
};

#else
// Scalar: the baseline build, where calling the shared inline helpers is safe.
using VecCodeOps = ScalarCodeOps;
inline VecF max_keeping(VecF a, VecF acc) { return a > acc ? a : acc; }
inline void store_high16_pair(std::uint16_t* m, std::uint16_t* v, VecU mw, VecU vw) {
  *m = static_cast<std::uint16_t>(mw >> 16);
  *v = static_cast<std::uint16_t>(vw >> 16);
}
inline VecU stochastic_round_bf16_high(VecF x, VecU r) { return stochastic_round_bf16_bits(float_bits(x), r) << 16; }

// The int8 code, scalar: the table and the binary search as defined (the reference the SIMD
// variants' closed form is checked against).
template <std::uint32_t N>
struct Int8Decoder {
  const DynamicCode& code;
  explicit Int8Decoder(const DynamicCode& c) : code(c) {}
  VecF value(VecU byte) const { return code.values[byte]; }
  VecF signed_value(VecU byte, VecF scale) const {
    return bits_float(float_bits(value(byte & 0x7fu) * scale) ^ signed_code_sign(byte));
  }
};
inline VecU signed_byte(VecU word, VecU magnitude) { return signed_code_byte(word, magnitude); }
inline VecU unsigned_byte(VecU word, VecU magnitude) { return unsigned_code_byte(word, magnitude); }
template <std::uint32_t N>
struct Int8Encoder {
  const DynamicCode& code;
  VecU encode(VecF a) const { return dynamic_encode_magnitude<VecF, VecU>(code, a, ScalarCodeOps{}); }
};
inline float horizontal_max(VecF x) { return x; }

struct SquareSum {
  double sum = 0.0;
  float bad = 0.0f;
  void add(VecF x) {
    const double d = x;
    sum += d * d;
    bad = bad + (x - x);
  }
  GradStats finish() const { return {sum, bad != bad}; }
};
#endif


template <Out O>
inline void store_out(void* out, std::size_t i, VecF p) {
  if constexpr (O == Out::bf16) {
    store_bf16(static_cast<std::uint16_t*>(out) + i, p);
  } else if constexpr (O == Out::f16) {
    store_f16(static_cast<std::uint16_t*>(out) + i, p);
  } else if constexpr (O == Out::f32) {
    store_f32(static_cast<float*>(out) + i, p);
  }
}

// The states are read at p_in, m_in and v_in and written at p, m and v (the same places but for
// an update that keeps the old states).
template <DType G, Out O, class Op>
inline void vector_at(const float* p_in, const float* m_in, const float* v_in, float* p, float* m, float* v,
                      const void* grad, void* out, std::size_t i, const Op& op) {
  VecF pv = load_f32(p_in + i);
  VecF mv = load_f32(m_in + i);
  VecF vv = load_f32(v_in + i);
  op(pv, mv, vv, load_typed<G>(grad, i));
  store_f32(p + i, pv);
  store_f32(m + i, mv);
  store_f32(v + i, vv);
  store_out<O>(out, i, pv);
}

// One pass over the range: read p, g, m, v; write p, m, v and the optional low-precision p.
template <DType G, Out O, class Op>
void for_each_vector(const AdamRange& r, const Op& op_in) {
  // Local copies: the compiler can then prove the stores through the float pointers never
  // modify them and keeps pointers and coefficients in registers instead of reloading them
  // after every store (that reloading cost ~10% of single-thread throughput).
  const Op op = op_in;
  float* const p = r.master;
  float* const m = r.m;
  float* const v = r.v;
  const float* const p_in = r.master_in != nullptr ? r.master_in : p;
  const float* const m_in = r.master_in != nullptr ? r.m_in : m;
  const float* const v_in = r.master_in != nullptr ? r.v_in : v;
  const void* const grad = r.grad;
  void* const out = r.out;
  const std::size_t n = r.count;
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vector_at<G, O>(p_in, m_in, v_in, p, m, v, grad, out, i, op);
  if constexpr (kLanes > 1) {
    const std::size_t rest = n - i;
    if (rest == 0) return;
    // Zero padding keeps the unused lanes finite (v = 0 gives denom = eps).
    alignas(64) float tp[kLanes] = {};
    alignas(64) float tm[kLanes] = {};
    alignas(64) float tv[kLanes] = {};
    alignas(64) unsigned char tg[kLanes * 4] = {};
    alignas(64) unsigned char to[kLanes * 4] = {};
    constexpr std::size_t grad_size = dtype_size(G);  // constexpr: no out-of-line call (see top)
    std::memcpy(tp, p_in + i, rest * 4);
    std::memcpy(tm, m_in + i, rest * 4);
    std::memcpy(tv, v_in + i, rest * 4);
    std::memcpy(tg, static_cast<const unsigned char*>(grad) + i * grad_size, rest * grad_size);
    vector_at<G, O>(tp, tm, tv, tp, tm, tv, tg, to, 0, op);
    std::memcpy(p + i, tp, rest * 4);
    std::memcpy(m + i, tm, rest * 4);
    std::memcpy(v + i, tv, rest * 4);
    if constexpr (O != Out::none)
      std::memcpy(static_cast<unsigned char*>(out) + i * kOutSize<O>, to, rest * kOutSize<O>);
  }
}

// Calls run.template operator()<G, O>() for the range's gradient type and output.
template <class Run>
void with_types(DType grad_dtype, const void* out_ptr, DType out_dtype, const Run& run) {
  const Out out = out_ptr == nullptr           ? Out::none
                  : out_dtype == DType::f32   ? Out::f32
                  : out_dtype == DType::f16   ? Out::f16
                                              : Out::bf16;
  auto with_grad = [&]<Out O>() {
    switch (grad_dtype) {
      case DType::f32: run.template operator()<DType::f32, O>(); return;
      case DType::bf16: run.template operator()<DType::bf16, O>(); return;
      case DType::f16: run.template operator()<DType::f16, O>(); return;
    }
  };
  switch (out) {
    case Out::none: with_grad.template operator()<Out::none>(); return;
    case Out::bf16: with_grad.template operator()<Out::bf16>(); return;
    case Out::f16: with_grad.template operator()<Out::f16>(); return;
    case Out::f32: with_grad.template operator()<Out::f32>(); return;
  }
}

template <class Op>
void dispatch(const AdamRange& r, const Op& op) {
  with_types(r.grad_dtype, r.out, r.out_dtype,
             [&]<DType G, Out O>() { for_each_vector<G, O>(r, op); });
}

inline VecU as_words(VecF x) { return __builtin_bit_cast(VecU, x); }

// Where a pass reads the master and the states (of type S): the places it writes, or those of the
// states an update ahead keeps (CompactAdamRange::master_in...).
template <class S>
struct Sources {
  const float* p;
  const S* m;
  const S* v;
};

// One vector of a bf16-states pass at offset i of the pointers, read from `in`; (hi:lo) is the
// global index of each lane. op(p, m, v, g, lo, hi, m_out, v_out) updates p and sets the words
// whose high 16 bits are the bf16 m and v to store.
template <DType G, Out O, class Op>
ZEST_KERNEL_INLINE void bf16_states_at(const Sources<std::uint16_t>& in, float* p, std::uint16_t* m, std::uint16_t* v,
                                       const void* grad, void* out, std::size_t i, VecU lo, VecU hi, const Op& op) {
  VecF pv = load_f32(in.p + i);
  VecF mv = load_bf16(in.m + i);
  VecF vv = load_bf16(in.v + i);
  VecU m_out;
  VecU v_out;
  op(pv, mv, vv, load_typed<G>(grad, i), lo, hi, m_out, v_out);
  store_f32(p + i, pv);
  store_high16_pair(m + i, v + i, m_out, v_out);
  store_out<O>(out, i, pv);
}

// The lanes' global indices (hi:lo) of the vector whose first element has global index `index`.
inline void lane_indices(std::uint64_t index, VecU& lo, VecU& hi) {
  add_index(VecU{} + static_cast<std::uint32_t>(index), VecU{} + static_cast<std::uint32_t>(index >> 32),
            kLaneOffsets, lo, hi);
}

// How far ahead (elements) the bf16-states pass prefetches its four streams. With its arithmetic
// (two hashes, a square root and a division per element) the hardware prefetcher did not hide the
// memory time (the run in DRAM took the run in L2's time plus the roofline's): one thread reached
// 0.80-0.86 of the roofline on AVX-512 without this, 1.05-1.2 with it (thread CPU time; 2048 beat
// 1024 and 512).
constexpr std::size_t kBf16Prefetch = 2048;

// As for_each_vector, for bf16 m and v. The lanes' indices step by kLanes in the low word, and the
// high word is the same in every lane until the low word wraps (at most once in 2^32 elements):
// runs of such vectors keep both in registers, a vector across the wrap computes them with carries.
template <DType G, Out O, bool Prefetch, class Op>
void for_each_bf16_states_vector(const CompactAdamRange& r, const Op& op_in) {
  const Op op = op_in;  // local copies: see for_each_vector
  float* const p = r.master;
  std::uint16_t* const m = static_cast<std::uint16_t*>(r.m);
  std::uint16_t* const v = static_cast<std::uint16_t*>(r.v);
  const Sources<std::uint16_t> in{r.master_in != nullptr ? r.master_in : p,
                                  r.m_in != nullptr ? static_cast<const std::uint16_t*>(r.m_in) : m,
                                  r.v_in != nullptr ? static_cast<const std::uint16_t*>(r.v_in) : v};
  const void* const grad = r.grad;
  void* const out = r.out;
  const std::size_t n = r.count;
  const std::uint64_t first = r.first_index;
  const std::size_t whole = n - n % kLanes;
  constexpr std::size_t grad_bytes = dtype_size(G);  // constexpr: no out-of-line call (see top)
  std::size_t i = 0;
  while (i < whole) {
    const std::uint64_t index = first + i;
    // Vectors from here whose lanes all lie before the low word wraps.
    const std::uint64_t room = ((std::uint64_t{1} << 32) - static_cast<std::uint32_t>(index)) / kLanes;
    const std::size_t end = i + (room < (whole - i) / kLanes ? room : (whole - i) / kLanes) * kLanes;
    if (end == i) {
      VecU lo;
      VecU hi;
      lane_indices(index, lo, hi);
      bf16_states_at<G, O>(in, p, m, v, grad, out, i, lo, hi, op);
      i += kLanes;
      continue;
    }
    const VecU hi = VecU{} + static_cast<std::uint32_t>(index >> 32);
    VecU lo = (VecU{} + static_cast<std::uint32_t>(index)) + kLaneOffsets;
    for (; i < end; i += kLanes, lo += static_cast<std::uint32_t>(kLanes)) {
      if (Prefetch && kLanes > 1 && i + kBf16Prefetch < n) {  // the scalar reference does without
        __builtin_prefetch(in.p + i + kBf16Prefetch, 1);
        __builtin_prefetch(static_cast<const unsigned char*>(grad) + (i + kBf16Prefetch) * grad_bytes);
        __builtin_prefetch(in.m + i + kBf16Prefetch, 1);
        __builtin_prefetch(in.v + i + kBf16Prefetch, 1);
      }
      bf16_states_at<G, O>(in, p, m, v, grad, out, i, lo, hi, op);
    }
  }
  if constexpr (kLanes > 1) {
    const std::size_t rest = n - i;
    if (rest == 0) return;
    alignas(64) float tp[kLanes] = {};
    alignas(64) std::uint16_t tm[kLanes] = {};
    alignas(64) std::uint16_t tv[kLanes] = {};
    alignas(64) unsigned char tg[kLanes * 4] = {};
    alignas(64) unsigned char to[kLanes * 4] = {};
    constexpr std::size_t grad_size = dtype_size(G);
    std::memcpy(tp, in.p + i, rest * 4);
    std::memcpy(tm, in.m + i, rest * 2);
    std::memcpy(tv, in.v + i, rest * 2);
    std::memcpy(tg, static_cast<const unsigned char*>(grad) + i * grad_size, rest * grad_size);
    VecU lo;
    VecU hi;
    lane_indices(first + i, lo, hi);
    bf16_states_at<G, O>({tp, tm, tv}, tp, tm, tv, tg, to, 0, lo, hi, op);
    std::memcpy(p + i, tp, rest * 4);
    std::memcpy(m + i, tm, rest * 2);
    std::memcpy(v + i, tv, rest * 2);
    if constexpr (O != Out::none)
      std::memcpy(static_cast<unsigned char*>(out) + i * kOutSize<O>, to, rest * kOutSize<O>);
  }
}

// Prefetch: the update prefetches; the roofline, whose light arithmetic the hardware prefetcher
// keeps up with, runs as it always has (prefetching made it ~10 % slower).
template <bool Prefetch, class Op>
void dispatch_bf16_states(const CompactAdamRange& r, const Op& op) {
  with_types(r.grad_dtype, r.out, r.out_dtype,
             [&]<DType G, Out O>() { for_each_bf16_states_vector<G, O, Prefetch>(r, op); });
}

template <DType G>
GradStats grad_stats_of(const void* grad, std::size_t count) {
  SquareSum sum;
  std::size_t i = 0;
  for (; i + kLanes <= count; i += kLanes) sum.add(load_typed<G>(grad, i));
  if constexpr (kLanes > 1) {
    if (i < count) {
      constexpr std::size_t grad_size = dtype_size(G);
      alignas(64) unsigned char g[kLanes * 4] = {};
      std::memcpy(g, static_cast<const unsigned char*>(grad) + i * grad_size, (count - i) * grad_size);
      sum.add(load_typed<G>(g, 0));
    }
  }
  return sum.finish();
}

}  // namespace

void adam(const AdamRange& range, const AdamCoefficients& c) {
  dispatch(range, [c](VecF& p, VecF& m, VecF& v, VecF g) { adam_update(p, m, v, g, c); });
}

void roofline(const AdamRange& range) {
  // Trivial arithmetic that keeps the values bounded over many repetitions.
  const float k = 1.0f / 1024.0f;
  dispatch(range, [k](VecF& p, VecF& m, VecF& v, VecF g) {
    p = p + g * k;
    m = m + g * k;
    v = v + g * k;
  });
}

namespace {

inline VecF as_floats(VecU x) { return __builtin_bit_cast(VecF, x); }

// compact_math.hpp's block_reciprocal, with internal linkage (a shared inline function called with a
// float could be linked as another variant's copy: see the top of this file).
inline BlockReciprocal reciprocal_of(float scale) {
  const float pre = scale >= 0x1p-126f ? 1.0f : 0x1p64f;
  return {pre, 1.0f / (scale * pre)};
}

// m's (signed: 7 magnitude bits) and v's codecs, built once per range, not per block: the AVX-512
// ones hold their tables in registers.
struct Int8Codecs {
  Int8Decoder<128> m_decoder;
  Int8Decoder<256> v_decoder;
  Int8Encoder<128> m_encoder;
  Int8Encoder<256> v_encoder;
  Int8Codecs(const DynamicCode& m, const DynamicCode& v) : m_decoder(m), v_decoder(v), m_encoder{m}, v_encoder{v} {}
};

// The blocks a run of the int8 update covers at most: its new moments, 2 x 4 KiB, stay in L1.
constexpr std::size_t kInt8RunBlocks = 16;

// One run of int8-states blocks: `len` elements at the pointers, a multiple of kLanes, in
// ceil(len / kInt8Block) blocks with their scales at m_scale and v_scale (the caller pads a short
// last block with zeros, which leave its largest magnitude as it is). Dequantize, update in fp32
// keeping the new moments here and each block's largest magnitudes, then quantize every block with
// its new scales. Two passes over the whole run, not one pair per block: each pass's vectors are
// independent of one another, so the core overlaps them; a block's encode waiting on its own
// maximum stalled the next block's decode.
// Where an int8 pass reads the master, the codes and their scales (Sources).
struct Int8Sources {
  const float* p;
  const std::uint8_t* m;
  const std::uint8_t* v;
  const float* m_scale;
  const float* v_scale;
};

template <DType G, Out O>
ZEST_KERNEL_INLINE void int8_run(const Int8Sources& in, float* p, std::uint8_t* qm, std::uint8_t* qv, const void* grad,
                                 void* out, std::size_t len, float* m_scale, float* v_scale, const Int8Codecs& codecs,
                                 const AdamCoefficients& c) {
  alignas(64) float new_m[kInt8RunBlocks * kInt8Block];
  alignas(64) float new_v[kInt8RunBlocks * kInt8Block];
  BlockReciprocal m_r[kInt8RunBlocks];
  BlockReciprocal v_r[kInt8RunBlocks];
  const std::size_t blocks = (len + kInt8Block - 1) / kInt8Block;
  for (std::size_t block = 0; block < blocks; ++block) {
    const std::size_t end = (block + 1) * kInt8Block < len ? (block + 1) * kInt8Block : len;
    VecF m_max = VecF{};
    VecF v_max = VecF{};
    const VecF old_m_scale = VecF{} + in.m_scale[block];
    const VecF old_v_scale = VecF{} + in.v_scale[block];
    for (std::size_t i = block * kInt8Block; i < end; i += kLanes) {
      VecF pv = load_f32(in.p + i);
      VecF mv = codecs.m_decoder.signed_value(load_u8(in.m + i), old_m_scale);
      VecF vv = codecs.v_decoder.value(load_u8(in.v + i)) * old_v_scale;
      adam_update(pv, mv, vv, load_typed<G>(grad, i), c);
      store_f32(p + i, pv);
      store_out<O>(out, i, pv);
      store_f32(new_m + i, mv);
      store_f32(new_v + i, vv);
      m_max = max_keeping(as_floats(as_words(mv) & 0x7fffffffu), m_max);
      v_max = max_keeping(as_floats(as_words(vv) & 0x7fffffffu), v_max);
    }
    m_scale[block] = horizontal_max(m_max);
    v_scale[block] = horizontal_max(v_max);
    m_r[block] = reciprocal_of(m_scale[block]);
    v_r[block] = reciprocal_of(v_scale[block]);
  }
  for (std::size_t block = 0; block < blocks; ++block) {
    const std::size_t end = (block + 1) * kInt8Block < len ? (block + 1) * kInt8Block : len;
    const auto encode = [&](auto scaled) __attribute__((always_inline)) {
      for (std::size_t i = block * kInt8Block; i < end; i += kLanes) {
        const VecU mw = as_words(load_f32(new_m + i));
        const VecU vw = as_words(load_f32(new_v + i));
        store_low8(qm + i, signed_byte(mw, codecs.m_encoder.encode(scaled(as_floats(mw & 0x7fffffffu), m_r[block]))));
        store_low8(qv + i, unsigned_byte(vw, codecs.v_encoder.encode(scaled(as_floats(vw & 0x7fffffffu), v_r[block]))));
      }
    };
    // |x| * pre * inv (block_reciprocal); pre is 1 but for blocks of subnormal scale, so the
    // common loop leaves its multiply out (x * 1 is x).
    if (__builtin_expect(m_r[block].pre == 1.0f && v_r[block].pre == 1.0f, 1))
      encode([](VecF a, const BlockReciprocal& r) __attribute__((always_inline)) { return a * r.inv; });
    else
      encode([](VecF a, const BlockReciprocal& r) __attribute__((always_inline)) { return a * r.pre * r.inv; });
  }
}

// The blocks of an int8 range in runs: run(in, p, qm, qv, grad, out, len, m_scale, v_scale) on each
// run of up to kInt8RunBlocks whole blocks, len a multiple of kLanes, m_scale and v_scale its
// blocks' scales, `in` where it reads them (a short last block runs alone on zero-padded copies).
template <DType G, Out O, class Run>
void for_each_int8_run(const CompactAdamRange& r, const Run& run) {
  auto* const qm = static_cast<std::uint8_t*>(r.m);
  auto* const qv = static_cast<std::uint8_t*>(r.v);
  const bool ahead = r.m_in != nullptr;
  const Int8Sources from{r.master_in != nullptr ? r.master_in : r.master,
                         ahead ? static_cast<const std::uint8_t*>(r.m_in) : qm,
                         ahead ? static_cast<const std::uint8_t*>(r.v_in) : qv, ahead ? r.m_scale_in : r.m_scale,
                         ahead ? r.v_scale_in : r.v_scale};
  constexpr std::size_t grad_size = dtype_size(G);
  const std::size_t whole = r.count - r.count % kInt8Block;
  for (std::size_t begin = 0; begin < whole; begin += kInt8RunBlocks * kInt8Block) {
    const std::size_t len = whole - begin < kInt8RunBlocks * kInt8Block ? whole - begin : kInt8RunBlocks * kInt8Block;
    const void* grad = static_cast<const unsigned char*>(r.grad) + begin * grad_size;
    void* out = O == Out::none ? nullptr : static_cast<unsigned char*>(r.out) + begin * kOutSize<O>;
    const std::size_t block = begin / kInt8Block;
    run({from.p + begin, from.m + begin, from.v + begin, from.m_scale + block, from.v_scale + block}, r.master + begin,
        qm + begin, qv + begin, grad, out, len, r.m_scale + block, r.v_scale + block);
  }
  const std::size_t len = r.count - whole;
  if (len == 0) return;
  alignas(64) float tp[kInt8Block] = {};
  alignas(64) std::uint8_t tm[kInt8Block] = {};
  alignas(64) std::uint8_t tv[kInt8Block] = {};
  alignas(64) unsigned char tg[kInt8Block * 4] = {};
  alignas(64) unsigned char to[kInt8Block * 4] = {};
  std::memcpy(tp, from.p + whole, len * 4);
  std::memcpy(tm, from.m + whole, len);
  std::memcpy(tv, from.v + whole, len);
  std::memcpy(tg, static_cast<const unsigned char*>(r.grad) + whole * grad_size, len * grad_size);
  const std::size_t padded = (len + kLanes - 1) / kLanes * kLanes;
  const std::size_t block = whole / kInt8Block;
  run({tp, tm, tv, from.m_scale + block, from.v_scale + block}, tp, tm, tv, tg, to, padded, r.m_scale + block,
      r.v_scale + block);
  std::memcpy(r.master + whole, tp, len * 4);
  std::memcpy(qm + whole, tm, len);
  std::memcpy(qv + whole, tv, len);
  if constexpr (O != Out::none)
    std::memcpy(static_cast<unsigned char*>(r.out) + whole * kOutSize<O>, to, len * kOutSize<O>);
}

}  // namespace

void adam_compact(const CompactAdamRange& range, const AdamCoefficients& c, const StateRounding& rounding) {
  if (range.states == StatesFormat::int8) {
    const Int8Codecs codecs(*range.m_code, *range.v_code);
    with_types(range.grad_dtype, range.out, range.out_dtype, [&]<DType G, Out O>() {
      for_each_int8_run<G, O>(range, [&](const Int8Sources& in, float* p, std::uint8_t* qm, std::uint8_t* qv,
                                         const void* grad, void* out, std::size_t len, float* m_scale, float* v_scale)
                                         __attribute__((always_inline)) {
        int8_run<G, O>(in, p, qm, qv, grad, out, len, m_scale, v_scale, codecs, c);
      });
    });
    return;
  }
  // CpuAdam refuses the formats without a kernel; only bf16 reaches here.
  if (range.states != StatesFormat::bf16) return;
  const VecU key_lo = VecU{} + static_cast<std::uint32_t>(rounding.key);
  const VecU key_hi = VecU{} + static_cast<std::uint32_t>(rounding.key >> 32);
  dispatch_bf16_states<true>(range, [c, key_lo, key_hi](VecF& p, VecF& m, VecF& v, VecF g, VecU lo, VecU hi,
                                                  VecU& m_out, VecU& v_out) __attribute__((always_inline)) {
    adam_update(p, m, v, g, c);
    const VecU bits = state_random_bits(lo, hi, key_lo, key_hi);
    m_out = stochastic_round_bf16_high(m, bits & 0xffffu);
    v_out = stochastic_round_bf16_high(v, bits >> 16);
  });
}

void roofline_compact(const CompactAdamRange& range) {
  // The traffic of adam_compact with trivial arithmetic (states truncated to bf16; int8 bytes and
  // scales rewritten).
  const float k = 1.0f / 1024.0f;
  if (range.states == StatesFormat::int8) {
    with_types(range.grad_dtype, range.out, range.out_dtype, [&]<DType G, Out O>() {
      for_each_int8_run<G, O>(range, [k](const Int8Sources&, float* p, std::uint8_t* qm, std::uint8_t* qv,
                                         const void* grad, void* out, std::size_t len, float* m_scale, float* v_scale) {
        for (std::size_t i = 0; i < len; i += kLanes) {
          const VecF pv = load_f32(p + i) + load_typed<G>(grad, i) * k;
          store_f32(p + i, pv);
          store_out<O>(out, i, pv);
          store_low8(qm + i, (load_u8(qm + i) + 1u) & 0xffu);
          store_low8(qv + i, (load_u8(qv + i) + 1u) & 0xffu);
        }
        for (std::size_t block = 0; block * kInt8Block < len; ++block) {
          m_scale[block] = m_scale[block] * 0.5f + 1.0f;
          v_scale[block] = v_scale[block] * 0.5f + 1.0f;
        }
      });
    });
    return;
  }
  if (range.states != StatesFormat::bf16) return;
  dispatch_bf16_states<false>(range, [k](VecF& p, VecF& m, VecF& v, VecF g, VecU, VecU, VecU& m_out, VecU& v_out)
                                     __attribute__((always_inline)) {
    p = p + g * k;
    m_out = as_words(m + g * k);
    v_out = as_words(v + g * k);
  });
}

void widen_bf16(const std::uint16_t* from, float* to, std::size_t n) {
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_f32(to + i, load_bf16(from + i));
  if constexpr (kLanes > 1) {
    if (i < n) {
      alignas(64) std::uint16_t h[kLanes] = {};
      alignas(64) float f[kLanes];
      std::memcpy(h, from + i, (n - i) * sizeof(std::uint16_t));
      store_f32(f, load_bf16(h));
      std::memcpy(to + i, f, (n - i) * sizeof(float));
    }
  }
}

void round_master(const float* p, std::uint16_t* master, std::size_t n, std::uint64_t first_index,
                  const StateRounding& rounding) {
  const VecU key_lo = VecU{} + static_cast<std::uint32_t>(rounding.key);
  const VecU key_hi = VecU{} + static_cast<std::uint32_t>(rounding.key >> 32);
  const auto at = [&](const float* from, std::uint16_t* to, std::uint64_t index) {
    VecU lo;
    VecU hi;
    add_index(VecU{} + static_cast<std::uint32_t>(index), VecU{} + static_cast<std::uint32_t>(index >> 32),
              kLaneOffsets, lo, hi);
    store_low16(to, stochastic_round_bf16_bits(as_words(load_f32(from)), master_random_bits(lo, hi, key_lo, key_hi)));
  };
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) at(p + i, master + i, first_index + i);
  if constexpr (kLanes > 1) {
    if (i < n) {
      alignas(64) float f[kLanes] = {};
      alignas(64) std::uint16_t h[kLanes];
      std::memcpy(f, p + i, (n - i) * sizeof(float));
      at(f, h, first_index + i);
      std::memcpy(master + i, h, (n - i) * sizeof(std::uint16_t));
    }
  }
}

GradStats grad_stats(const void* grad, DType grad_dtype, std::size_t count) {
  switch (grad_dtype) {
    case DType::f32: return grad_stats_of<DType::f32>(grad, count);
    case DType::bf16: return grad_stats_of<DType::bf16>(grad, count);
    case DType::f16: return grad_stats_of<DType::f16>(grad, count);
  }
  return {};
}

}  // namespace ZEST_ADAM_ISA_NS
}  // namespace zest::optim
