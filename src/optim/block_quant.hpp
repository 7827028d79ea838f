// The CPU block-wise quantizer: fp32, bf16 or fp16 values to int8 or int4 codes with one fp32 scale
// per kQuantBlock elements, and back, and fp32 to bf16 or fp16 (the format, the error bound, Inf/NaN and the buffer's
// layout: block_quant_math.hpp). One kernel source compiled per instruction set (block_quant_kernels.cpp), chosen at
// run time as the CPU Adam's is; large ranges are split into tiles of whole blocks over a pinned oneTBB arena.
// kernels/block_quant.hpp has the CUDA kernels, equal to these bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "optim/adam_kernels.hpp"
#include "optim/block_quant_math.hpp"
#include "optim/cpu_adam.hpp"
#include "optim/pinned_arena.hpp"
#include "zest/dtype.hpp"

namespace zest::optim {

// The single-threaded kernels of one instruction set, over `count` elements that start on a block
// boundary, whose records (quantized_bytes(bits, count) bytes, 4-byte aligned) are at `out` or
// `in`. They check nothing: BlockQuantizer does.
struct QuantKernels {
  Isa isa;
  void (*quantize)(const void* in, DType dtype, std::size_t count, QuantBits bits, std::uint8_t* out);
  void (*dequantize)(const std::uint8_t* in, QuantBits bits, std::size_t count, void* out, DType dtype);
  // acc[i] += the value of element i, in fp32 (the product rounded, then the sum).
  void (*dequantize_add)(const std::uint8_t* in, QuantBits bits, std::size_t count, float* acc);
  // out = the count fp32 values at `in` in `dtype`, rounded to nearest even (runtime/host/half.hpp).
  void (*cast_from_f32)(const float* in, std::size_t count, void* out, DType dtype);
};

// The kernels of one instruction set; Isa::avx2/avx512 must be supported by this CPU (Error).
const QuantKernels& quant_kernels(Isa isa);

#define ZEST_DECLARE_QUANT_KERNELS(ns)                                                                      \
  namespace ns {                                                                                            \
  void quantize(const void* in, DType dtype, std::size_t count, QuantBits bits, std::uint8_t* out);        \
  void dequantize(const std::uint8_t* in, QuantBits bits, std::size_t count, void* out, DType dtype);      \
  void dequantize_add(const std::uint8_t* in, QuantBits bits, std::size_t count, float* acc);              \
  void cast_from_f32(const float* in, std::size_t count, void* out, DType dtype);                          \
  }
ZEST_DECLARE_QUANT_KERNELS(scalar_isa)
ZEST_DECLARE_QUANT_KERNELS(avx2_isa)
ZEST_DECLARE_QUANT_KERNELS(avx512_isa)
#undef ZEST_DECLARE_QUANT_KERNELS

class BlockQuantizer {
 public:
  // Blocks per tile: 64 (16384 elements, CpuAdam's tile). Ranges of at most one tile run on the
  // calling thread, without the arena.
  static constexpr std::size_t kTileBlocks = 64;

  // threads >= 1; thread i runs on cpus[i % cpus.size()] (empty: every CPU this process may use).
  // The variant is select_isa()'s (ZEST_ADAM_ISA forces one, as for the CPU Adam). Throws
  // zest::Error on invalid arguments.
  BlockQuantizer(int threads, std::vector<int> cpus = {});
  BlockQuantizer(int threads, std::vector<int> cpus, Isa isa);

  // Quantizes in.count elements of in.dtype (fp32, bf16 or fp16, aligned to its size) into `out`,
  // exactly quantized_bytes(bits, in.count) bytes, 4-byte aligned, not overlapping `in`.
  void quantize(ConstTensorSpan in, QuantBits bits, std::span<std::byte> out);
  // Decodes the out.count elements quantized in `in` (exactly quantized_bytes(bits, out.count)
  // bytes, 4-byte aligned) into out.dtype (fp32, bf16 or fp16: the fp32 value rounded to nearest
  // even), not overlapping `in`.
  void dequantize(std::span<const std::byte> in, QuantBits bits, TensorSpan out);
  // acc[i] += the value of element i of `in` (quantized_bytes(bits, acc.size()) bytes), in fp32:
  // one rank's piece of a reduction of quantized gradients.
  void dequantize_add(std::span<const std::byte> in, QuantBits bits, std::span<float> acc);
  // out = `in` in out.dtype (fp32, bf16 or fp16: rounded to nearest even, as runtime/host/half.hpp),
  // out.count == in.size(), not overlapping: the 16-bit wire format of uncompressed collectives.
  void cast_from_f32(std::span<const float> in, TensorSpan out);

  // The pieces of a quantized collective in one call each, their tiles sharing one pass over the
  // arena (one call per piece forked and joined the threads per piece). Records are
  // quantized_bytes(bits, piece) bytes each, back to back.
  // Record r of `out` (order.size() records) = piece order[r] of `in` (in.count / piece whole
  // pieces, back to back) quantized: the bytes of one quantize per piece.
  void quantize_pieces(ConstTensorSpan in, std::size_t piece, std::span<const std::size_t> order, QuantBits bits,
                       std::span<std::byte> out);
  // The sums of a quantized reduction: `in` holds terms x S records, record t * S + s being term t
  // of sum s; piece s of `out` (S = out.size() / piece pieces, fp32) = its terms decoded and added
  // in t's order, the bits of a dequantize then dequantize_adds. Each tile of a sum stays in cache
  // across its terms.
  void dequantize_sum(std::span<const std::byte> in, QuantBits bits, std::size_t piece, std::size_t terms,
                      std::span<float> out);
  // Piece r of `out` (out.count / piece pieces, in out.dtype) = record r decoded.
  void dequantize_pieces(std::span<const std::byte> in, QuantBits bits, std::size_t piece, TensorSpan out);

  // Not thread-safe: one call at a time per BlockQuantizer.
  Isa isa() const { return kernels_->isa; }
  int threads() const { return arena_.threads(); }

 private:
  // body(first block, end block) over the tiles of `count` elements.
  template <class Body>
  void for_each_tile(std::size_t count, const Body& body);
  // body(piece index, first element, end element) over the tiles of `pieces` pieces of `piece`
  // elements each (a tile: kTileBlocks blocks of one piece).
  template <class Body>
  void for_each_piece_tile(std::size_t pieces, std::size_t piece, const Body& body);

  const QuantKernels* kernels_;
  PinnedArena arena_;
};

}  // namespace zest::optim
