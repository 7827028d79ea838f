// A checkpoint directory open for reading: the manifest parsed and checked, and any range of any
// tensor's state read from the rank files with every chunk it touches verified against its CRC32C.
// Engine::load reads only the ranges its rank needs through it; `zest checkpoint consolidate` and
// `inspect` (zest/checkpoint.hpp) read and verify through it too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/format.hpp"

namespace zest::checkpoint {

class Reader {
 public:
  // Reads the manifest and checks that its ranges cover every tensor exactly once. Throws Error
  // (a damaged or unreadable manifest, a newer format) or IoError (no manifest) naming the path.
  explicit Reader(std::string dir);
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  std::string path(int rank, StateKind state) const;

  // Throws unless every file the manifest lists (of `only` that state) exists with the size it
  // says (the data is checked as it is read).
  void check_files(std::optional<StateKind> only = std::nullopt) const;

  // Elements [a, b) of tensor `tensor`'s `state` into out[0, b - a) as fp32 (compact m and v
  // widened: bf16 exactly, int8 as code value times its block's scale); with out null, only
  // verified. Reads the chunks holding them and checks each one's CRC32C before using it: throws
  // Error naming the file, the chunk and its offset on a mismatch, IoError when a read fails or the
  // file is short. Checks the values too, as no save writes otherwise (a checksum recomputed after
  // an edit passes): master and m finite, v finite and not negative, int8 scales finite and not
  // negative; Error names the file, the tensor and the element.
  void read(StateKind state, std::size_t tensor, std::size_t a, std::size_t b, float* out);

  // Checks every file's size and every chunk's CRC32C, all of them: one line per problem found
  // (empty: the checkpoint is intact).
  std::vector<std::string> verify_all();

 private:
  // Tensor elements [lo, hi) sit in `rank`'s state files from element `at` on; in an int8 file
  // their scales from scale `block_at` on, after the rank's `codes` code bytes.
  struct Piece {
    int rank = 0;
    std::size_t tensor = 0;
    std::size_t lo = 0, hi = 0;
    std::uint64_t at = 0;
    std::uint64_t block_at = 0;
    std::uint64_t codes = 0;
  };
  void check_values(StateKind state, int rank, std::size_t tensor, std::size_t first, const float* values,
                    std::size_t n) const;
  // Elements [lo, hi) of piece p, compact (bf16 or int8 m or v), widened into out (null: verified).
  void read_compact(StateKind state, const Piece& p, std::size_t lo, std::size_t hi, float* out);
  int fd(int rank, StateKind state);
  // Bytes [offset, offset + bytes) of a state file into out (null: only verified).
  void read_bytes(int rank, StateKind state, std::uint64_t offset, std::size_t bytes, char* out);
  // Reads chunk `index` of a file into `into` and checks it; returns its length.
  std::size_t load_chunk(int rank, StateKind state, std::size_t index, char* into);

  std::string dir_;
  Manifest manifest_;
  std::vector<std::vector<Piece>> pieces_;  // per tensor, in element order
  std::map<std::pair<int, int>, UniqueFd> fds_;  // (rank, state) -> open file, at most kMaxOpenFiles
  std::vector<char> chunk_;                 // the last chunk read through it, verified
  std::vector<char> raw_;                   // compact values on their way to fp32, a slice at a time
  std::vector<float> scales_;               // the int8 scales of that slice
  std::vector<float> values_;               // a slice of values read only to be verified
  int chunk_rank_ = -1, chunk_state_ = -1;
  std::size_t chunk_index_ = 0, chunk_length_ = 0;
};

}  // namespace zest::checkpoint
