#include "optim/block_quant.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::optim {
namespace {

bool supported(DType dtype) { return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16; }
bool supported(QuantBits bits) { return bits == QuantBits::int8 || bits == QuantBits::int4; }

std::string prefix(const char* who) { return std::string(who).append(": "); }

void check_format(const char* who, DType dtype, QuantBits bits) {
  if (!supported(bits))
    throw Error(fmt::format("{}: {} bits is not a quantized format; use QuantBits::int8 or QuantBits::int4", who,
                            static_cast<unsigned>(bits)));
  if (!supported(dtype))
    throw Error(fmt::format(
        "{}: element type {} is not one the codec reads or writes; use DType::f32, DType::bf16 or DType::f16", who,
        static_cast<unsigned>(dtype)));
}

void check_pointer(const char* who, const char* name, const void* p, std::size_t count, std::size_t align,
                   const char* why) {
  if (count > 0 && p == nullptr) throw Error(prefix(who).append(name).append(" is null; pass the buffer"));
  if (reinterpret_cast<std::uintptr_t>(p) % align != 0)
    throw Error(
        fmt::format("{}: {} is not {}-byte aligned ({}); pass an aligned buffer (an allocator's memory is; "
                    "cut a quantized buffer only at record boundaries, quant_record_bytes)",
                    who, name, align, why));
}

void check_bytes(const char* who, const char* name, std::size_t bytes, QuantBits bits, std::size_t count) {
  const std::size_t want = quantized_bytes(bits, count);
  if (bytes != want)
    throw Error(
        fmt::format("{}: {} has {} bytes, but {} elements quantized to int{} take {} (quantized_bytes); pass "
                    "a span of exactly that size",
                    who, name, bytes, count, static_cast<unsigned>(bits), want));
}

void check_disjoint(const char* who, const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes,
                    const char* what = "the quantized buffer overlaps the values") {
  const auto a0 = reinterpret_cast<std::uintptr_t>(a), b0 = reinterpret_cast<std::uintptr_t>(b);
  if (a_bytes > 0 && b_bytes > 0 && a0 < b0 + b_bytes && b0 < a0 + a_bytes)
    throw Error(prefix(who).append(what).append("; use separate buffers"));
}

// `records` records of `piece` elements each, back to back in `bytes` bytes (the pieces calls).
void check_records(const char* who, const char* name, std::size_t bytes, QuantBits bits, std::size_t piece,
                   std::size_t records) {
  const std::size_t want = records * quantized_bytes(bits, piece);
  if (bytes != want)
    throw Error(
        fmt::format("{}: {} has {} bytes, but {} records of {} elements take {} (quantized_bytes of a piece, "
                    "times the records); pass a span of exactly that size",
                    who, name, bytes, records, piece, want));
}

// How many whole pieces of `piece` elements `count` holds (Error where it is not whole).
std::size_t whole_pieces(const char* who, const char* name, std::size_t count, std::size_t piece) {
  if (piece == 0 ? count != 0 : count % piece != 0)
    throw Error(fmt::format("{}: {} has {} elements, not a whole number of pieces of {}; pass whole pieces", who, name,
                            count, piece));
  return piece == 0 ? 0 : count / piece;
}

// A range of `count` elements from a block boundary: its first block's record and its elements.
template <class T>
T* at_block(T* base, std::size_t block, std::size_t record_bytes) {
  return base + block * record_bytes;
}

}  // namespace

void check_quantize_args(const char* who, const void* in, DType dtype, std::size_t count, QuantBits bits,
                         const void* out, std::size_t out_bytes) {
  check_format(who, dtype, bits);
  check_pointer(who, "the input", in, count, dtype_size(dtype), "its elements");
  check_pointer(who, "the quantized buffer", out, count, 4, "its scales are floats");
  check_bytes(who, "the quantized buffer", out_bytes, bits, count);
  check_disjoint(who, out, out_bytes, in, count * dtype_size(dtype));
}

void check_dequantize_args(const char* who, const void* in, std::size_t in_bytes, QuantBits bits, const void* out,
                           DType dtype, std::size_t count) {
  check_format(who, dtype, bits);
  check_pointer(who, "the quantized buffer", in, count, 4, "its scales are floats");
  check_bytes(who, "the quantized buffer", in_bytes, bits, count);
  check_pointer(who, "the output", out, count, dtype_size(dtype), "its elements");
  check_disjoint(who, in, in_bytes, out, count * dtype_size(dtype));
}

const QuantKernels& quant_kernels(Isa isa) {
  static const QuantKernels scalar{Isa::scalar, &scalar_isa::quantize, &scalar_isa::dequantize,
                                   &scalar_isa::dequantize_add, &scalar_isa::cast_from_f32};
  static const QuantKernels avx2{Isa::avx2, &avx2_isa::quantize, &avx2_isa::dequantize, &avx2_isa::dequantize_add,
                                 &avx2_isa::cast_from_f32};
  static const QuantKernels avx512{Isa::avx512, &avx512_isa::quantize, &avx512_isa::dequantize,
                                   &avx512_isa::dequantize_add, &avx512_isa::cast_from_f32};
  return kernels_for(isa, "the block quantizer's variant", scalar, avx2, avx512);
}

namespace {

int checked_threads(int threads) {
  if (threads < 1) throw Error(fmt::format("BlockQuantizer: the thread count must be at least 1, got {}", threads));
  return threads;
}

}  // namespace

BlockQuantizer::BlockQuantizer(int threads, std::vector<int> cpus)
    : BlockQuantizer(threads, std::move(cpus), select_isa()) {}

BlockQuantizer::BlockQuantizer(int threads, std::vector<int> cpus, Isa isa)
    : kernels_(&quant_kernels(isa)), arena_(checked_threads(threads), std::move(cpus)) {}

template <class Body>
void BlockQuantizer::for_each_tile(std::size_t count, const Body& body) {
  const std::size_t blocks = (count + kQuantBlock - 1) / kQuantBlock;
  if (blocks <= kTileBlocks) {
    if (blocks > 0) body(0, blocks);
    return;
  }
  arena_.for_each_tile(blocks, kTileBlocks, [&](std::size_t begin, std::size_t end) { body(begin, end); });
}

template <class Body>
void BlockQuantizer::for_each_piece_tile(std::size_t pieces, std::size_t piece, const Body& body) {
  constexpr std::size_t tile = kTileBlocks * kQuantBlock;
  const std::size_t tiles = (piece + tile - 1) / tile;  // per piece
  const auto run = [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      const std::size_t first = (i % tiles) * tile;
      body(i / tiles, first, std::min(first + tile, piece));
    }
  };
  if (pieces * tiles <= 1) {
    if (pieces * tiles == 1) run(0, 1);
    return;
  }
  arena_.for_each_tile(pieces * tiles, 1, run);
}

void BlockQuantizer::quantize_pieces(ConstTensorSpan in, std::size_t piece, std::span<const std::size_t> order,
                                     QuantBits bits, std::span<std::byte> out) {
  const char* const who = "BlockQuantizer::quantize_pieces";
  check_format(who, in.dtype, bits);
  const std::size_t pieces = whole_pieces(who, "the input", in.count, piece);
  for (std::size_t r = 0; r < order.size(); ++r)
    if (order[r] >= pieces)
      throw Error(fmt::format("{}: record {} takes piece {}, but the input holds {}; pass piece indices below that",
                              who, r, order[r], pieces));
  check_pointer(who, "the input", in.data, in.count, dtype_size(in.dtype), "its elements");
  check_pointer(who, "the quantized buffer", out.data(), out.size(), 4, "its scales are floats");
  check_records(who, "the quantized buffer", out.size(), bits, piece, order.size());
  check_disjoint(who, out.data(), out.size(), in.data, in.count * dtype_size(in.dtype));
  const std::size_t block_record = quant_record_bytes(bits, kQuantBlock), piece_record = quantized_bytes(bits, piece);
  const std::size_t size = dtype_size(in.dtype);
  const auto kernel = kernels_->quantize;
  for_each_piece_tile(order.size(), piece, [&](std::size_t r, std::size_t first, std::size_t last) {
    kernel(static_cast<const unsigned char*>(in.data) + (order[r] * piece + first) * size, in.dtype, last - first, bits,
           reinterpret_cast<std::uint8_t*>(out.data()) + r * piece_record + first / kQuantBlock * block_record);
  });
}

void BlockQuantizer::dequantize_sum(std::span<const std::byte> in, QuantBits bits, std::size_t piece,
                                    std::size_t terms, std::span<float> out) {
  const char* const who = "BlockQuantizer::dequantize_sum";
  check_format(who, DType::f32, bits);
  if (terms == 0) throw Error(prefix(who).append("a sum needs at least one term; pass terms >= 1"));
  const std::size_t sums = whole_pieces(who, "the output", out.size(), piece);
  check_pointer(who, "the quantized buffer", in.data(), in.size(), 4, "its scales are floats");
  check_records(who, "the quantized buffer", in.size(), bits, piece, terms * sums);
  check_pointer(who, "the output", out.data(), out.size(), 4, "its elements");
  check_disjoint(who, in.data(), in.size(), out.data(), out.size_bytes());
  const std::size_t block_record = quant_record_bytes(bits, kQuantBlock), piece_record = quantized_bytes(bits, piece);
  const auto* const records = reinterpret_cast<const std::uint8_t*>(in.data());
  const auto decode = kernels_->dequantize;
  const auto add = kernels_->dequantize_add;
  for_each_piece_tile(sums, piece, [&](std::size_t s, std::size_t first, std::size_t last) {
    float* const to = out.data() + s * piece + first;
    for (std::size_t t = 0; t < terms; ++t) {
      const std::uint8_t* const from = records + (t * sums + s) * piece_record + first / kQuantBlock * block_record;
      if (t == 0) decode(from, bits, last - first, to, DType::f32);
      else add(from, bits, last - first, to);
    }
  });
}

void BlockQuantizer::dequantize_pieces(std::span<const std::byte> in, QuantBits bits, std::size_t piece,
                                       TensorSpan out) {
  const char* const who = "BlockQuantizer::dequantize_pieces";
  check_format(who, out.dtype, bits);
  const std::size_t pieces = whole_pieces(who, "the output", out.count, piece);
  check_pointer(who, "the quantized buffer", in.data(), in.size(), 4, "its scales are floats");
  check_records(who, "the quantized buffer", in.size(), bits, piece, pieces);
  check_pointer(who, "the output", out.data, out.count, dtype_size(out.dtype), "its elements");
  check_disjoint(who, in.data(), in.size(), out.data, out.count * dtype_size(out.dtype));
  const std::size_t block_record = quant_record_bytes(bits, kQuantBlock), piece_record = quantized_bytes(bits, piece);
  const std::size_t size = dtype_size(out.dtype);
  const auto kernel = kernels_->dequantize;
  for_each_piece_tile(pieces, piece, [&](std::size_t r, std::size_t first, std::size_t last) {
    kernel(reinterpret_cast<const std::uint8_t*>(in.data()) + r * piece_record + first / kQuantBlock * block_record,
           bits, last - first, static_cast<unsigned char*>(out.data) + (r * piece + first) * size, out.dtype);
  });
}

void BlockQuantizer::quantize(ConstTensorSpan in, QuantBits bits, std::span<std::byte> out) {
  check_quantize_args("BlockQuantizer::quantize", in.data, in.dtype, in.count, bits, out.data(), out.size());
  const std::size_t record = quant_record_bytes(bits, kQuantBlock), size = dtype_size(in.dtype);
  const auto kernel = kernels_->quantize;
  for_each_tile(in.count, [&](std::size_t begin, std::size_t end) {
    const std::size_t first = begin * kQuantBlock, last = std::min(end * kQuantBlock, in.count);
    kernel(static_cast<const unsigned char*>(in.data) + first * size, in.dtype, last - first, bits,
           at_block(reinterpret_cast<std::uint8_t*>(out.data()), begin, record));
  });
}

void BlockQuantizer::dequantize(std::span<const std::byte> in, QuantBits bits, TensorSpan out) {
  check_dequantize_args("BlockQuantizer::dequantize", in.data(), in.size(), bits, out.data, out.dtype, out.count);
  const std::size_t record = quant_record_bytes(bits, kQuantBlock), size = dtype_size(out.dtype);
  const auto kernel = kernels_->dequantize;
  for_each_tile(out.count, [&](std::size_t begin, std::size_t end) {
    const std::size_t first = begin * kQuantBlock, last = std::min(end * kQuantBlock, out.count);
    kernel(at_block(reinterpret_cast<const std::uint8_t*>(in.data()), begin, record), bits, last - first,
           static_cast<unsigned char*>(out.data) + first * size, out.dtype);
  });
}

void BlockQuantizer::dequantize_add(std::span<const std::byte> in, QuantBits bits, std::span<float> acc) {
  check_dequantize_args("BlockQuantizer::dequantize_add", in.data(), in.size(), bits, acc.data(), DType::f32,
                        acc.size());
  const std::size_t record = quant_record_bytes(bits, kQuantBlock);
  const auto kernel = kernels_->dequantize_add;
  for_each_tile(acc.size(), [&](std::size_t begin, std::size_t end) {
    const std::size_t first = begin * kQuantBlock, last = std::min(end * kQuantBlock, acc.size());
    kernel(at_block(reinterpret_cast<const std::uint8_t*>(in.data()), begin, record), bits, last - first,
           acc.data() + first);
  });
}

void BlockQuantizer::cast_from_f32(std::span<const float> in, TensorSpan out) {
  const char* const who = "BlockQuantizer::cast_from_f32";
  check_format(who, out.dtype, QuantBits::int8);
  if (out.count != in.size())
    throw Error(fmt::format("{}: the output has {} elements for {} values; pass an output of the same count", who,
                            out.count, in.size()));
  check_pointer(who, "the input", in.data(), in.size(), 4, "its elements");
  check_pointer(who, "the output", out.data, out.count, dtype_size(out.dtype), "its elements");
  check_disjoint(who, out.data, out.count * dtype_size(out.dtype), in.data(), in.size_bytes(),
                 "the output overlaps the input");
  const std::size_t size = dtype_size(out.dtype);
  const auto kernel = kernels_->cast_from_f32;
  for_each_tile(in.size(), [&](std::size_t begin, std::size_t end) {
    const std::size_t first = begin * kQuantBlock, last = std::min(end * kQuantBlock, in.size());
    kernel(in.data() + first, last - first, static_cast<unsigned char*>(out.data) + first * size, out.dtype);
  });
}

}  // namespace zest::optim
