// libFuzzer target: the safetensors header writer (checkpoint::safetensors_header) on manifests
// built from the input: any names (bytes), shapes (any 64-bit dimensions) and element counts.
// It either throws zest::Error or writes a header a safetensors reader accepts: JSON text with no
// raw control characters, padded to a multiple of 8, starting as zest's headers do, with every
// shape multiplying (without overflow) to its element count and offsets that do not wrap.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/format.hpp"
#include "checkpoint/safetensors_header.hpp"
#include "zest/error.hpp"

namespace ckpt = zest::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  ckpt::Manifest m;
  const zest::DType dtype = in.PickValueInArray({zest::DType::f32, zest::DType::bf16, zest::DType::f16});
  m.config = in.ConsumeRandomLengthString(64);
  const std::size_t tensors = in.ConsumeIntegralInRange<std::size_t>(0, 8);
  for (std::size_t t = 0; t < tensors; ++t) {
    ckpt::TensorEntry entry;
    entry.name = in.ConsumeRandomLengthString(32);
    const std::size_t dims = in.ConsumeIntegralInRange<std::size_t>(0, 4);
    for (std::size_t d = 0; d < dims; ++d) entry.shape.push_back(in.ConsumeIntegral<std::uint64_t>());
    entry.numel = in.ConsumeIntegral<std::uint64_t>();
    m.tensors.push_back(entry);
  }
  std::string header;
  try {
    header = ckpt::safetensors_header(m, dtype, "<fuzz>");
  } catch (const zest::Error&) {
    return 0;
  }
  if (header.size() % 8 != 0 || header.rfind(ckpt::kZestHeaderStart, 0) != 0) std::abort();
  for (const char c : header)
    if (static_cast<unsigned char>(c) < 0x20) std::abort();  // JSON strings hold no raw control characters
  std::uint64_t total = 0;
  for (const ckpt::TensorEntry& t : m.tensors) {
    std::uint64_t product = 1, bytes = 0;
    for (const std::uint64_t d : t.shape)
      if (__builtin_mul_overflow(product, d, &product)) std::abort();
    if (product != t.numel || __builtin_mul_overflow(product, std::uint64_t{zest::dtype_size(dtype)}, &bytes) ||
        __builtin_add_overflow(total, bytes, &total))
      std::abort();
  }
  return 0;
}
