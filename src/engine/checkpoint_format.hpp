// The on-disk form of an Engine checkpoint (Engine::save/load), and the file operations it needs.
//
// A checkpoint is a directory: `manifest` (text, written last by rank 0) and one `rank<r>.bin` per
// rank of the saving run. A rank file holds, for each tensor range the manifest lists for it (the
// part of the tensor inside that rank's shard, in tensor elements [lo, hi)), the fp32 master
// weights of every range in order, then m of every range, then v. Data is per tensor, not per
// shard, so a run of any world size and stage finds any element by the manifest alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zest::engine::checkpoint {

constexpr int kFormatVersion = 1;
constexpr const char* kManifestName = "manifest";

struct Range {
  std::size_t tensor = 0;
  std::size_t lo = 0, hi = 0;  // elements of the tensor
};

struct RankFile {
  std::string name;  // in the checkpoint directory
  std::uint64_t bytes = 0;
  std::uint32_t crc32c = 0;  // of the whole file
  std::vector<Range> ranges;  // in file order
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
  std::string config;  // fingerprint: stage, dtype, optimizer hyper-parameters (informational)
  std::vector<TensorEntry> tensors;
  std::vector<RankFile> files;  // one per saving rank, index = rank
};

std::string rank_file_name(int rank);

// Text; ends with a line holding the CRC32C of everything before it.
std::string serialize(const Manifest& manifest);
// Throws Error naming `path` and the line when the text is not a complete manifest of a version
// this build reads.
Manifest parse(const std::string& text, const std::string& path);

// Files. Each throws IoError naming the path, the operation and errno.
void write_file_synced(const std::string& path, const void* data, std::size_t bytes);  // create, write, fsync
std::string read_whole_file(const std::string& path);
void read_at(int fd, const std::string& path, void* data, std::size_t bytes, std::uint64_t offset);
std::uint32_t file_crc32c(const std::string& path, std::uint64_t bytes);
void fsync_directory(const std::string& path);

// Writes a rank file incrementally (pwrite-free appends) and keeps its CRC32C.
class FileWriter {
 public:
  explicit FileWriter(std::string path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  void append(const void* data, std::size_t bytes);
  void finish();  // fsync, close
  std::uint64_t bytes() const { return bytes_; }
  std::uint32_t crc32c() const { return crc_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t bytes_ = 0;
  std::uint32_t crc_ = 0;
};

}  // namespace zest::engine::checkpoint
