// The SIMD int8 codecs of adam_kernels.cpp against their definitions, outside the kernel: this
// program includes the kernel source, compiled for one instruction set (see meson.build), and
// checks that Int8Encoder::encode equals the binary search dynamic_encode_magnitude, the decoders
// dequantize and the code bytes signed_code_byte and unsigned_code_byte, on every input that matters. The closed-form
// encoder is exact by an error bound (DynamicCode::decade_slope), so the check is what proves it: the test runs a dense
// sample (every float within 2^14 units in the last place of each midpoint, decade threshold and power of two, every
// 61st float of [0, 1] and beyond, Inf and NaN; ~1 s); `--all` checks all 2^31 non-negative floats (a minute), which is
// how the codecs were accepted.
#include "../../src/optim/adam_kernels.cpp"  // NOLINT: the kernel's internals, for this ISA

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using namespace zest::optim;
using namespace zest::optim::ZEST_ADAM_ISA_NS;

std::uint32_t bits_of(float x) { return __builtin_bit_cast(std::uint32_t, x); }

struct Checker {
  long failures = 0;

  // Encodes the floats with these bit patterns (non-negative: the kernel encodes |x| / scale).
  template <std::uint32_t N>
  void encode(const DynamicCode& code, const std::vector<std::uint32_t>& words) {
    const Int8Encoder<N> encoder{code};
    for (std::size_t i = 0; i < words.size(); i += kLanes) {
      VecU w{};
      for (std::size_t l = 0; l < kLanes; ++l) w[l] = words[i + l < words.size() ? i + l : i];
      const VecF a = __builtin_bit_cast(VecF, w);
      const VecU got = encoder.encode(a);
      for (std::size_t l = 0; l < kLanes; ++l) {
        const std::uint32_t want =
            dynamic_encode_magnitude<float, std::uint32_t>(code, __builtin_bit_cast(float, w[l]), ScalarCodeOps{});
        if (got[l] != want && ++failures <= 10)
          std::printf("encode N=%u: %08x gives %u, want %u\n", N, static_cast<unsigned>(w[l]),
                      static_cast<unsigned>(got[l]), want);
      }
    }
  }

  template <std::uint32_t N>
  void decode(const DynamicCode& code) {
    const Int8Decoder<N> decoder{code};
    for (std::uint32_t b = 0; b < N; b += kLanes) {
      const VecF got = decoder.value(kLaneOffsets + b);
      for (std::size_t l = 0; l < kLanes; ++l)
        if (bits_of(got[l]) != bits_of(code.values[b + l]) && ++failures <= 10)
          std::printf("value N=%u byte %u\n", N, static_cast<unsigned>(b + l));
    }
  }

  void signed_codes(const DynamicCode& code) {
    const Int8Decoder<128> decoder{code};
    for (float scale : {1.0f, 1.5f, 3.3e-20f, 7.1e30f, 1e-40f, 0.0f}) {
      for (std::uint32_t b = 0; b < 256; b += kLanes) {
        const VecF got = decoder.signed_value(kLaneOffsets + b, VecF{} + scale);
        for (std::size_t l = 0; l < kLanes; ++l) {
          const float want = dequantize(code, true, static_cast<std::uint8_t>(b + l), scale);
          if (bits_of(got[l]) != bits_of(want) && ++failures <= 10)
            std::printf("signed value byte %u scale %g\n", static_cast<unsigned>(b + l), scale);
        }
      }
    }
    std::uint32_t seed = 1;
    for (int t = 0; t < 100000; ++t) {
      VecU word{};
      VecU magnitude{};
      for (std::size_t l = 0; l < kLanes; ++l) {
        seed = seed * 1664525u + 1013904223u;
        word[l] = seed;
        magnitude[l] = (seed >> 20) % 3 == 0 ? 0 : (seed >> 7) % 128;
      }
      const VecU got = signed_byte(word, magnitude);
      for (std::size_t l = 0; l < kLanes; ++l)
        if (got[l] != signed_code_byte<std::uint32_t>(word[l], magnitude[l]) && ++failures <= 10)
          std::printf("signed byte %08x %u\n", static_cast<unsigned>(word[l]), static_cast<unsigned>(magnitude[l]));
    }
  }
};

// Every float within `radius` units in the last place of x (x >= 0).
void add_around(std::vector<std::uint32_t>& words, float x, std::uint32_t radius) {
  const std::uint32_t center = bits_of(x);
  for (std::uint32_t u = center > radius ? center - radius : 0; u <= center + radius; ++u) words.push_back(u);
}

std::vector<std::uint32_t> sample(const DynamicCode& code) {
  std::vector<std::uint32_t> words;
  for (std::uint32_t b = 0; b + 1 < code.magnitudes; ++b) add_around(words, code.midpoints[b], 1u << 14);
  for (float t : code.decade_threshold)
    if (t < 2.0f) add_around(words, t, 1u << 14);
  for (int e = -40; e <= 2; ++e) add_around(words, std::ldexp(1.0f, e), 1u << 14);
  for (std::uint64_t u = 0; u < 0x40000000u; u += 61) words.push_back(static_cast<std::uint32_t>(u));
  for (std::uint64_t u = 0x40000000u; u < 0x80000000u; u += 65537) words.push_back(static_cast<std::uint32_t>(u));
  for (std::uint32_t u : {0x7f800000u, 0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0x3f800000u, 0u, 1u}) words.push_back(u);
  return words;
}

template <std::uint32_t N>
void encode_all(Checker& checker, const DynamicCode& code) {
  std::vector<std::uint32_t> words(1u << 24);
  for (std::uint64_t start = 0; start < 0x80000000u; start += words.size()) {
    for (std::size_t i = 0; i < words.size(); ++i) words[i] = static_cast<std::uint32_t>(start + i);
    checker.encode<N>(code, words);
  }
}

// The kernel's unsigned_byte against unsigned_code_byte: random words and the special ones (±0,
// the smallest subnormal, the largest finite, ±Inf, NaN), each with magnitude 0 and others.
void unsigned_codes(Checker& checker) {
  std::vector<std::uint32_t> words{0u, 0x80000000u, 1u, 0x80000001u, 0x7f7fffffu, 0x7f800000u, 0xff800000u,
                                   0x7f800001u, 0x7fc00000u, 0xffffffffu, 0x3f800000u};
  std::uint32_t seed = 7;
  for (int t = 0; t < 100000; ++t) words.push_back(seed = seed * 1664525u + 1013904223u);
  for (std::size_t i = 0; i < words.size(); i += kLanes) {
    VecU word{};
    VecU magnitude{};
    for (std::size_t l = 0; l < kLanes; ++l) {
      word[l] = words[(i + l) % words.size()];
      magnitude[l] = (i / kLanes + l) % 3 == 0 ? 0 : (word[l] >> 9) % 256;
    }
    const VecU got = unsigned_byte(word, magnitude);
    for (std::size_t l = 0; l < kLanes; ++l)
      if (got[l] != unsigned_code_byte<std::uint32_t>(word[l], magnitude[l]) && ++checker.failures <= 10)
        std::printf("unsigned byte %08x %u\n", static_cast<unsigned>(word[l]), static_cast<unsigned>(magnitude[l]));
  }
}

bool supported() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#elif defined(__AVX2__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return true;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (!supported()) {
    std::printf("this CPU lacks the instruction set: skipped\n");
    return 77;  // meson's "skipped"
  }
  const bool all = argc > 1 && std::strcmp(argv[1], "--all") == 0;
  const DynamicCode m_code = make_dynamic_code(true);
  const DynamicCode v_code = make_dynamic_code(false);
  Checker checker;
  checker.decode<128>(m_code);
  checker.decode<256>(v_code);
  checker.signed_codes(m_code);
  unsigned_codes(checker);
  if (all) {
    encode_all<128>(checker, m_code);
    encode_all<256>(checker, v_code);
  } else {
    checker.encode<128>(m_code, sample(m_code));
    checker.encode<256>(v_code, sample(v_code));
  }
  std::printf("%s: %ld mismatches (%s)\n", argv[0], checker.failures, all ? "every float" : "sample");
  return checker.failures == 0 ? 0 : 1;
}
