// The on-disk form of an Engine checkpoint (Engine::save/load), and the file operations it needs.
//
// A checkpoint is a directory: `manifest` (text, written last by rank 0) and, for each rank of the
// saving run, three files, one per optimizer state: rank<r>.master.bin (fp32 master weights),
// rank<r>.m.bin and rank<r>.v.bin (Adam's moments). Each holds, for every tensor range the manifest
// lists for the rank (the part of the tensor inside that rank's shard, in tensor elements [lo, hi)),
// that state's fp32 values, range after range. Data is per tensor, not per shard, so a run of any
// world size and stage finds any element by the manifest alone, and a reader of the weights alone
// (consolidation) opens only the master files.
//
// Every file is checksummed in chunks of `chunk_bytes` (CRC32C per chunk, listed in the manifest),
// so a reader that needs a few ranges verifies what it reads without reading whole files.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/files.hpp"
#include "zest/dtype.hpp"

namespace zest::checkpoint {

constexpr int kFormatVersion = 4;  // 4: m and v in the run's optimizer.states (Manifest::states)
constexpr int kOldestReadableVersion = 2;  // 2 has no optimizer groups (the config's apply)
constexpr const char* kManifestName = "manifest";
constexpr std::uint64_t kChunkBytes = std::uint64_t{4} << 20;
// Limits a reader holds a checkpoint to, so that a damaged or hostile one cannot make it allocate
// without bound: a manifest of 256 MiB lists the checksums of about 90 PB of 4 MiB chunks, and a
// chunk is held in memory whole while it is verified.
constexpr std::uint64_t kMaxManifestBytes = std::uint64_t{256} << 20;
constexpr std::uint64_t kMaxChunkBytes = std::uint64_t{256} << 20;
// A step count a run can reach (2^53: exact in a double, and far beyond any training run).
constexpr std::int64_t kMaxSteps = std::int64_t{1} << 53;

// The three states, in this order everywhere: file names, manifest lines, reads.
enum class StateKind { master = 0, m = 1, v = 2 };
constexpr int kStates = 3;
const char* state_name(StateKind state);  // "master", "m", "v"

struct Range {
  std::size_t tensor = 0;
  std::size_t lo = 0, hi = 0;  // elements of the tensor
};

struct StateFile {
  std::string name;  // in the checkpoint directory
  std::uint64_t bytes = 0;
  std::vector<std::uint32_t> chunk_crcs;  // CRC32C of each chunk_bytes of the file, the last shorter
};

struct RankEntry {
  std::vector<Range> ranges;  // in file order
  std::array<StateFile, kStates> files;
  std::size_t elements() const;  // per state: the sum of the ranges
};

struct TensorEntry {
  std::string name;
  std::vector<std::size_t> shape;
  int group = 0;
  std::size_t numel = 0;
};

struct Manifest {
  int version = kFormatVersion;
  int world_size = 1;
  int stage = 0;
  std::int64_t steps = 0, skipped = 0;
  double loss_scale = 1.0;
  int clean_steps = 0, hysteresis_left = 0;
  // The saving run's settings as space-separated key=value words (stage, dtype, optimizer
  // hyper-parameters); load reports those that differ from the loading engine's.
  std::string config;
  // Each optimizer parameter group's values at the save (version 3; a schedule resumes from them).
  struct OptimizerGroup {
    double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  };
  std::vector<OptimizerGroup> optimizer_groups;
  // How the m and v files hold their values (version 4; fp32 before): fp32; bf16 bit patterns; or
  // int8 dynamic-code bytes of every range, then one fp32 scale per kInt8Block elements of each
  // range from its start (docs/compact-states.md). The master file is fp32 in every version.
  StatesFormat states = StatesFormat::f32;
  std::uint64_t chunk_bytes = kChunkBytes;
  std::vector<TensorEntry> tensors;
  std::vector<RankEntry> ranks;  // one per saving rank, index = rank
};

// Well-formed UTF-8 only (no overlongs, surrogates or values past U+10FFFF): JSON's text.
bool valid_utf8(const std::string& text);

// The one rule for tensor names, which the Engine applies to ParamSpec names and a manifest to its
// own: a manifest is lines of text, so a name is not empty, holds no newline (nor a NUL), and is at
// most kMaxTensorNameBytes long; and consolidate writes safetensors, so it is UTF-8 and not
// "__metadata__". Empty when `name` is fine, else what is wrong ("is empty", ...).
constexpr std::size_t kMaxTensorNameBytes = 4096;
std::string tensor_name_problem(const std::string& name);

std::string state_file_name(int rank, StateKind state);  // rank<r>.<state>.bin

// Scales of an int8 state for a range of `elements`: one per kInt8Block from its start.
std::uint64_t int8_blocks(std::uint64_t elements);
// The bytes of `state`'s file holding `ranges` in `states`' form (see Manifest::states).
std::uint64_t state_file_bytes(StatesFormat states, StateKind state, const std::vector<Range>& ranges);

// Text; ends with a line holding the CRC32C of everything before it.
std::string serialize(const Manifest& manifest);
// Throws Error naming `path` and the line when the text is not a complete, self-consistent
// manifest of a version this build reads. Every count, size and shape is checked (for overflow
// too) before anything is allocated for it: the result's byte sizes and element counts, per
// tensor and summed, fit in 64 bits as fp32.
Manifest parse(const std::string& text, const std::string& path);

// The manifest of the checkpoint in `dir`: read_regular_file(dir/manifest, kMaxManifestBytes), parsed.
Manifest read_manifest(const std::string& dir);
Manifest read_manifest(const Directory& dir);

// Files. Each throws IoError naming the path, the operation and errno (the durable writes, the
// directory held open and the no-replace rename are base/files.hpp's).
// Opens `path` for reading; throws Error, without opening it, unless it is a regular file (a FIFO
// would block the reader forever, a device would never end). `what` names it in the error.
UniqueFd open_regular_file(const std::string& path, const std::string& what);
// The whole of a regular file of at most `max_bytes` (else Error, before reading it).
std::string read_regular_file(const std::string& path, std::uint64_t max_bytes, const std::string& what);
// The same for `name` in `dir`, where a symbolic link is refused like any other non-regular file.
std::string read_regular_file(const Directory& dir, const std::string& name, std::uint64_t max_bytes,
                              const std::string& what);

// Writes a new file by appends, keeping the CRC32C of each chunk: created exclusively
// (create_exclusive), so it throws IoError (EEXIST) when `path` exists.
class FileWriter {
 public:
  explicit FileWriter(std::string path, std::uint64_t chunk_bytes = kChunkBytes);
  FileWriter(const Directory& dir, const std::string& name, std::uint64_t chunk_bytes = kChunkBytes);
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  void append(const void* data, std::size_t bytes);
  void finish();  // fsync, close
  std::uint64_t bytes() const { return bytes_; }
  FileIdentity identity() const { return identity_; }  // of the file it created
  // Valid after finish().
  const std::vector<std::uint32_t>& chunk_crcs() const { return crcs_; }

 private:
  FileWriter(int at, std::string path, const char* name, std::uint64_t chunk_bytes);

  std::string path_;
  std::uint64_t chunk_bytes_;
  UniqueFd fd_;
  FileIdentity identity_;
  std::uint64_t bytes_ = 0;
  std::uint32_t crc_ = 0;  // of the chunk being written
  std::vector<std::uint32_t> crcs_;
};

}  // namespace zest::checkpoint
