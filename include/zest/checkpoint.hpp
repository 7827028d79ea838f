// Checkpoints written by Engine::save, read without an engine: what `zest checkpoint inspect` and
// `zest checkpoint consolidate` do, for programs that want the same.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zest/dtype.hpp"

namespace zest {

struct CheckpointTensorInfo {
  std::string name;
  std::vector<std::size_t> shape;
  int group = 0;
};

struct CheckpointFileInfo {
  std::string name;  // in the checkpoint directory
  std::uint64_t bytes = 0;
  std::size_t chunks = 0;  // each with its CRC32C in the manifest
};

struct CheckpointInfo {
  int format_version = 0;
  int world_size = 0;  // of the run that saved it
  int stage = 0;
  std::int64_t steps = 0, skipped_steps = 0;
  double loss_scale = 1.0;
  std::string config;  // the saving run's settings, key=value words
  StatesFormat states = StatesFormat::f32;  // how the m and v files hold them (optimizer.states)
  std::uint64_t chunk_bytes = 0;
  std::vector<CheckpointTensorInfo> tensors;
  std::vector<CheckpointFileInfo> files;  // rank<r>.master.bin, rank<r>.m.bin, rank<r>.v.bin per rank
};

// The manifest of the checkpoint in `dir`. Throws IoError (no manifest) or Error (damaged, or a
// format this build does not read), naming the file.
CheckpointInfo read_checkpoint_info(const std::string& dir);

// Checks every file's size and every chunk's CRC32C; one line per problem, naming the file and
// the chunk (empty: the checkpoint is intact). Throws as read_checkpoint_info for the manifest.
std::vector<std::string> verify_checkpoint(const std::string& dir);

// Throws unless Engine::save(dir) may write there: `dir` must be absent, an empty directory, or a
// zest checkpoint holding only its own files (a save never deletes or overwrites anything else).
// The error says what is there and what to do. A trainer calls it before training, so that a
// wrong --save path fails at once instead of after the run. Save checks again itself.
void check_checkpoint_target(const std::string& dir);

// Writes the checkpoint's weights (fp32 master weights; `dtype` f32, or bf16 rounded to nearest
// even) as one safetensors file at `out`, tensors under their registered names, streaming: memory
// stays bounded by a few chunks whatever the model's size. Every chunk read is verified. The file
// is written as OUT.tmp-<n> (a new file) and renamed into place, so a failure leaves no partial
// OUT. Before any work, throws Error unless `out` is a new file's path outside `dir` or a
// safetensors file zest wrote (replaced): never a directory, FIFO, device, link, or another file.
void consolidate_checkpoint(const std::string& dir, const std::string& out, DType dtype);

}  // namespace zest
