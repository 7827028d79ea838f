// The JSON header of the safetensors file (https://huggingface.co/docs/safetensors) that
// `zest checkpoint consolidate` writes: each tensor's dtype, shape and [begin, end) byte offsets
// (relative to the first byte after the header, contiguous, in manifest order), and the
// checkpoint's provenance in `__metadata__`.
#pragma once

#include <string>
#include <string_view>

#include "checkpoint/format.hpp"
#include "zest/dtype.hpp"

namespace zest::checkpoint {

// The header, padded with spaces to a multiple of 8 so the data that follows is aligned. Throws
// Error (naming `dir`) for what a valid safetensors file cannot hold: a name that is not UTF-8, a
// duplicate or the reserved "__metadata__", a shape that does not multiply to its element count
// (or overflows), byte offsets past 64 bits.
std::string safetensors_header(const Manifest& manifest, DType dtype, const std::string& dir);

// How every header safetensors_header writes begins; consolidate replaces an existing output file
// only when it begins so (after its 8-byte length), i.e. when zest wrote it.
constexpr std::string_view kZestHeaderStart = R"({"__metadata__":{"format":"pt","zest_checkpoint_format":)";

}  // namespace zest::checkpoint
