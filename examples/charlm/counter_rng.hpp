// Counter-based random numbers: a value is a pure function of (key, a, b, c), so any rank can
// compute any example position or any parameter's initial value without sharing or replaying a
// generator's state. The mixer is SplitMix64's finalizer, applied once per input word.
#pragma once

#include <cstdint>

namespace zest::charlm {

constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Chained, not xor-ed together: (key, a, b, c) and a permutation of it give unrelated values.
constexpr std::uint64_t counter_hash(std::uint64_t key, std::uint64_t a, std::uint64_t b,
                                     std::uint64_t c) {
  return splitmix64(splitmix64(splitmix64(splitmix64(key) ^ a) ^ b) ^ c);
}

// Uniform in [0, range) without the bias of a modulo: the high word of hash * range.
// (__extension__: the 128-bit product is a GCC/Clang builtin type that -Wpedantic flags.)
__extension__ typedef unsigned __int128 Uint128;
inline std::uint64_t below(std::uint64_t hash, std::uint64_t range) {
  return static_cast<std::uint64_t>((static_cast<Uint128>(hash) * range) >> 64);
}

// Uniform in [0, 1) with 53 random bits.
constexpr double unit_interval(std::uint64_t hash) {
  return static_cast<double>(hash >> 11) * 0x1.0p-53;
}

// Streams keep the sampler's draws and the initializer's draws independent for the same seed.
inline constexpr std::uint64_t kSamplerStream = 0x73616D706C657221ULL;
inline constexpr std::uint64_t kInitStream = 0x696E697469616C21ULL;

}  // namespace zest::charlm
