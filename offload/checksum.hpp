// CRC32C (Castagnoli) of a byte range: the per-block checksum the stores keep when io.checksum is
// on, to detect data that changed between write and read-back. Uses the CPU's crc32 instruction
// where it has one (chosen at run time, ~8 GB/s per core), else a table (~0.5 GB/s).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zest::offload {

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0);

namespace detail {
std::uint32_t crc32c_table(const void* data, std::size_t bytes, std::uint32_t crc);
// False where the CPU lacks the instruction (then crc32c uses the table).
bool crc32c_hardware_available();
std::uint32_t crc32c_hardware(const void* data, std::size_t bytes, std::uint32_t crc);
}  // namespace detail

}  // namespace zest::offload
