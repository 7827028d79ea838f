#include "offload/checksum.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace zest::offload {
namespace detail {
namespace {

constexpr std::uint32_t kPolynomial = 0x82F63B78u;  // CRC32C, reflected

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<std::uint32_t, 256> kTable = make_table();

}  // namespace

std::uint32_t crc32c_table(const void* data, std::size_t bytes, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < bytes; ++i) crc = kTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

#if defined(__x86_64__)
bool crc32c_hardware_available() { return __builtin_cpu_supports("sse4.2"); }

__attribute__((target("sse4.2"))) std::uint32_t crc32c_hardware(const void* data, std::size_t bytes,
                                                                  std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t c = ~crc;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; bytes > 0; --bytes, ++p) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}
#else
bool crc32c_hardware_available() { return false; }
std::uint32_t crc32c_hardware(const void* data, std::size_t bytes, std::uint32_t crc) {
  return crc32c_table(data, bytes, crc);
}
#endif

}  // namespace detail

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc) {
  static const bool hardware = detail::crc32c_hardware_available();
  return hardware ? detail::crc32c_hardware(data, bytes, crc) : detail::crc32c_table(data, bytes, crc);
}

}  // namespace zest::offload
