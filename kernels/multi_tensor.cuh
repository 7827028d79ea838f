// Packing many tensors into one launch: the kernel argument carries a table of tensors and, per
// block, which tensor and which chunk of it the block handles (the apex multi_tensor_apply
// scheme). The table fits the 4 KiB kernel parameter space of every CUDA architecture.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zest::kernels::detail {

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr std::int64_t kChunk = 65536;  // elements per block; offsets are 64-bit
constexpr int kThreads = 256;

template <class Tensor>
struct TensorTable {
  Tensor tensors[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

// Calls launch(table, blocks) as often as needed to cover every chunk of every tensor.
template <class Tensor, class Launch>
void for_each_launch(const Tensor* tensors, std::size_t count, const Launch& launch) {
  TensorTable<Tensor> table{};
  int used_tensors = 0, used_blocks = 0;
  for (std::size_t t = 0; t < count; ++t) {
    if (tensors[t].count == 0) continue;
    int slot = used_tensors++;
    table.tensors[slot] = tensors[t];
    const std::int64_t chunks = (tensors[t].count + kChunk - 1) / kChunk;
    for (std::int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[used_blocks] = static_cast<unsigned char>(slot);
      table.block_chunk[used_blocks] = static_cast<int>(c);
      ++used_blocks;
      const bool last_chunk = c + 1 == chunks;
      if (used_blocks == kMaxBlocks || (last_chunk && used_tensors == kMaxTensors)) {
        launch(table, used_blocks);
        used_blocks = 0;
        if (last_chunk) {
          used_tensors = 0;
        } else {
          table.tensors[0] = table.tensors[slot];  // the rest of this tensor goes on in slot 0
          slot = 0;
          used_tensors = 1;
        }
      }
    }
  }
  if (used_blocks > 0) launch(table, used_blocks);
}

}  // namespace zest::kernels::detail
