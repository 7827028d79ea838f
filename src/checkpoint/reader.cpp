#include "checkpoint/reader.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>

#include <fmt/core.h>

#include "offload/checksum.hpp"
#include "optim/states_layout.hpp"
#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

// Rank files stay open between reads; a checkpoint of thousands of ranks would exceed the
// process's descriptor limit, so the oldest are closed past this many.
constexpr std::size_t kMaxOpenFiles = 64;

}  // namespace

Reader::Reader(std::string dir) : dir_(std::move(dir)) {
  manifest_ = read_manifest(dir_);
  pieces_.resize(manifest_.tensors.size());
  for (std::size_t r = 0; r < manifest_.ranks.size(); ++r) {
    std::uint64_t at = 0, block_at = 0;
    const std::uint64_t codes = manifest_.ranks[r].elements();
    for (const Range& range : manifest_.ranks[r].ranges) {
      pieces_[range.tensor].push_back({static_cast<int>(r), range.tensor, range.lo, range.hi, at, block_at, codes});
      at += range.hi - range.lo;
      block_at += int8_blocks(range.hi - range.lo);
    }
  }
  // parse() checked that each tensor's pieces cover it exactly once.
  for (auto& pieces : pieces_)
    std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) { return x.lo < y.lo; });
}

std::string Reader::path(int rank, StateKind state) const {
  return join_path(dir_,
                   manifest_.ranks.at(static_cast<std::size_t>(rank)).files[static_cast<std::size_t>(state)].name);
}

void Reader::check_files(std::optional<StateKind> only) const {
  for (std::size_t r = 0; r < manifest_.ranks.size(); ++r) {
    for (int k = 0; k < kStates; ++k) {
      if (only && StateKind(k) != *only) continue;
      const StateFile& file = manifest_.ranks[r].files[static_cast<std::size_t>(k)];
      const std::string p = join_path(dir_, file.name);
      struct stat info {};
      if (::stat(p.c_str(), &info) != 0)
        throw IoError(std::string("checkpoint ").append(dir_).append(": a rank file is missing"), p, 0, 0, errno);
      if (!S_ISREG(info.st_mode))
        throw Error(
            fmt::format("checkpoint {}: rank file {} is not a regular file: the checkpoint is damaged", dir_, p));
      if (static_cast<std::uint64_t>(info.st_size) != file.bytes)
        throw Error(fmt::format(
            "checkpoint {}: rank file {} has {} bytes, the manifest says {}: the file is truncated or damaged", dir_, p,
            info.st_size, file.bytes));
    }
  }
}

int Reader::fd(int rank, StateKind state) {
  const auto key = std::make_pair(rank, static_cast<int>(state));
  if (auto it = fds_.find(key); it != fds_.end()) return it->second.get();
  if (fds_.size() >= kMaxOpenFiles) fds_.erase(fds_.begin());
  return (fds_[key] =
              open_regular_file(path(rank, state), std::string("checkpoint ").append(dir_).append(": rank file")))
      .get();
}

std::size_t Reader::load_chunk(int rank, StateKind state, std::size_t index, char* into) {
  const StateFile& file = manifest_.ranks[static_cast<std::size_t>(rank)].files[static_cast<std::size_t>(state)];
  const std::uint64_t offset = index * manifest_.chunk_bytes;
  const std::size_t length = static_cast<std::size_t>(std::min(manifest_.chunk_bytes, file.bytes - offset));
  const std::string p = path(rank, state);
  read_at(fd(rank, state), p, into, length, offset);
  const std::uint32_t crc = offload::crc32c(into, length);
  if (crc != file.chunk_crcs[index])
    throw Error(
        fmt::format("checkpoint {}: rank file {} chunk {} (bytes {} to {}) has CRC32C {}, the manifest says {}: the "
                    "file is damaged; load another checkpoint",
                    dir_, p, index, offset, offset + length, crc, file.chunk_crcs[index]));
  return length;
}

void Reader::read_bytes(int rank, StateKind state, std::uint64_t offset, std::size_t bytes, char* out) {
  const std::uint64_t chunk = manifest_.chunk_bytes;
  const std::uint64_t end = offset + bytes;
  while (offset < end) {
    const std::size_t index = static_cast<std::size_t>(offset / chunk);
    const std::uint64_t chunk_begin = index * chunk;
    const StateFile& file = manifest_.ranks[static_cast<std::size_t>(rank)].files[static_cast<std::size_t>(state)];
    const std::uint64_t chunk_end = std::min(chunk_begin + chunk, file.bytes);
    const std::size_t take = static_cast<std::size_t>(std::min(end, chunk_end) - offset);
    const bool cached = chunk_rank_ == rank && chunk_state_ == static_cast<int>(state) && chunk_index_ == index;
    if (!cached && out && offset == chunk_begin && take == chunk_end - chunk_begin) {
      load_chunk(rank, state, index, out);  // a whole chunk: straight into place
    } else {
      if (!cached) {
        chunk_.resize(static_cast<std::size_t>(chunk));
        chunk_rank_ = -1;  // until the new chunk is verified
        chunk_length_ = load_chunk(rank, state, index, chunk_.data());
        chunk_rank_ = rank;
        chunk_state_ = static_cast<int>(state);
        chunk_index_ = index;
      }
      if (out) std::copy_n(chunk_.data() + (offset - chunk_begin), take, out);
    }
    offset += take;
    if (out) out += take;
  }
}

void Reader::read(StateKind state, std::size_t tensor, std::size_t a, std::size_t b, float* out) {
  if (!out) {
    // Verified all the same, values included, a slice at a time through a bounded buffer.
    constexpr std::size_t kSlice = std::size_t{1} << 16;
    values_.resize(std::min(kSlice, b > a ? b - a : 0));
    for (std::size_t x = a; x < b; x += kSlice) read(state, tensor, x, std::min(b, x + kSlice), values_.data());
    return;
  }
  const bool compact = state != StateKind::master && manifest_.states != StatesFormat::f32;
  for (const Piece& p : pieces_.at(tensor)) {
    const std::size_t lo = std::max(a, p.lo), hi = std::min(b, p.hi);
    if (lo >= hi) continue;
    if (compact)
      read_compact(state, p, lo, hi, out + (lo - a));
    else
      read_bytes(p.rank, state, (p.at + (lo - p.lo)) * sizeof(float), (hi - lo) * sizeof(float),
                 reinterpret_cast<char*>(out + (lo - a)));
    check_values(state, p.rank, tensor, lo, out + (lo - a), hi - lo);
  }
}

// What no save writes: the master weights and m are finite, v finite and not negative (NaN
// appears in them only when training had already failed, and a step refuses to make it).
void Reader::check_values(StateKind state, int rank, std::size_t tensor, std::size_t first, const float* values,
                          std::size_t n) const {
  for (std::size_t i = 0; i < n; ++i) {
    const float x = values[i];
    if (std::isfinite(x) && !(state == StateKind::v && x < 0)) continue;
    throw Error(
        fmt::format("checkpoint {}: rank file {} holds {} = {} for element {} of tensor '{}', which no save writes "
                    "({}): the checkpoint was altered after it was saved; load another checkpoint",
                    dir_, path(rank, state), state_name(state), x, first + i, manifest_.tensors[tensor].name,
                    state == StateKind::v ? "v is finite and not negative" : "it is finite"));
  }
}

void Reader::read_compact(StateKind state, const Piece& p, std::size_t lo, std::size_t hi, float* out) {
  constexpr std::size_t kSlice = std::size_t{1} << 16;  // elements widened at a time: bounded buffers
  static_assert(kSlice % optim::kInt8Block == 0);
  const bool int8 = manifest_.states == StatesFormat::int8;
  const std::size_t element = int8 ? 1 : sizeof(std::uint16_t);
  raw_.resize(kSlice * element);
  scales_.resize(kSlice / optim::kInt8Block + 1);
  for (std::size_t x = lo; x < hi; x += kSlice) {
    const std::size_t n = std::min(kSlice, hi - x);
    char* const raw = out ? raw_.data() : nullptr;
    read_bytes(p.rank, state, (p.at + (x - p.lo)) * element, n * element, raw);
    // int8: the scales of the blocks [first, last] the slice touches, counted from the piece's start.
    const std::uint64_t first = (x - p.lo) / optim::kInt8Block, last = (x + n - 1 - p.lo) / optim::kInt8Block;
    if (int8)
      read_bytes(p.rank, state, p.codes + (p.block_at + first) * sizeof(float),
                 static_cast<std::size_t>(last - first + 1) * sizeof(float),
                 out ? reinterpret_cast<char*>(scales_.data()) : nullptr);
    if (!out) continue;
    if (int8)
      for (std::uint64_t block = 0; block <= last - first; ++block)
        if (!std::isfinite(scales_[block]) || std::signbit(scales_[block]))
          throw Error(
              fmt::format("checkpoint {}: rank file {} holds the int8 scale {} for elements from {} of tensor '{}', "
                          "which no save writes (a block's largest magnitude: finite, not negative): the checkpoint "
                          "was altered after it was saved; load another checkpoint",
                          dir_, path(p.rank, state), scales_[block], p.lo + (first + block) * optim::kInt8Block,
                          manifest_.tensors[p.tensor].name));
    float* const into = out + (x - lo);
    if (!int8) {
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, raw_.data() + 2 * i, sizeof bits);
        into[i] = bf16_to_float(bits);
      }
      continue;
    }
    const bool is_signed = state == StateKind::m;
    const optim::DynamicCode& code = optim::dynamic_code(is_signed);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t block = (x + i - p.lo) / optim::kInt8Block - first;
      into[i] = optim::dequantize(code, is_signed, static_cast<std::uint8_t>(raw_[i]), scales_[block]);
    }
  }
}

std::vector<std::string> Reader::verify_all() {
  std::vector<std::string> problems;
  std::vector<char> buffer(static_cast<std::size_t>(manifest_.chunk_bytes));
  for (std::size_t r = 0; r < manifest_.ranks.size(); ++r) {
    for (int k = 0; k < kStates; ++k) {
      const StateKind state = static_cast<StateKind>(k);
      const StateFile& file = manifest_.ranks[r].files[static_cast<std::size_t>(k)];
      const std::string p = path(static_cast<int>(r), state);
      struct stat info {};
      if (::stat(p.c_str(), &info) != 0) {
        problems.push_back(std::string(p).append(": missing"));
        continue;
      }
      if (static_cast<std::uint64_t>(info.st_size) != file.bytes) {
        problems.push_back(fmt::format("{}: {} bytes, the manifest says {}", p, info.st_size, file.bytes));
        continue;
      }
      for (std::size_t c = 0; c < file.chunk_crcs.size(); ++c) {
        try {
          load_chunk(static_cast<int>(r), state, c, buffer.data());
        } catch (const std::exception& e) {
          problems.push_back(e.what());
        }
      }
    }
  }
  if (!problems.empty()) return problems;
  // Every byte is as saved; the values must also be what a save writes (a checksum recomputed after
  // an edit would pass above): the first such value of each tensor's state.
  for (std::size_t t = 0; t < manifest_.tensors.size(); ++t)
    for (int k = 0; k < kStates; ++k) {
      try {
        read(static_cast<StateKind>(k), t, 0, manifest_.tensors[t].numel, nullptr);
      } catch (const std::exception& e) {
        problems.push_back(e.what());
      }
    }
  return problems;
}

}  // namespace zest::checkpoint
