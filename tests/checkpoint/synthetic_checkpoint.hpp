// A checkpoint written without an engine, through the format's own writer and serializer: any
// size, rank count and chunk size in a fraction of the time a trained model would take. The
// consolidation tests use it where an Engine cannot go quickly: files of hundreds of MB, chunks of
// a few bytes (values straddling chunk and rank boundaries), names JSON must escape.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "offload/checksum.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"

namespace zest::synthetic_checkpoint {

namespace ckpt = checkpoint;

// Element j of tensor t. Multiples of 1/8 up to ~125 in magnitude: exact in fp32, and most need
// rounding in bf16 (8 significant bits), ties included. tests/cli/checkpoint_consolidate_test.py
// computes the same.
inline float value(std::size_t t, std::size_t j) {
  return static_cast<float>(static_cast<double>((j * 7 + t * 13) % 2001) * 0.125 - 125.0);
}

// Adam's moments are never read by consolidation: sparse files of zeros with their real checksums,
// so a checkpoint of hundreds of MB costs one file's writes.
inline ckpt::StateFile zero_state_file(const std::string& dir, const std::string& name, std::uint64_t bytes,
                                       std::uint64_t chunk_bytes) {
  const std::string path = (std::filesystem::path(dir) / name).string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0 || ::close(fd) != 0)
    throw IoError("synthetic checkpoint: cannot create", path, 0, bytes, errno);
  ckpt::StateFile file{name, bytes, {}};
  const std::vector<char> zeros(static_cast<std::size_t>(std::min<std::uint64_t>(chunk_bytes, bytes)), 0);
  for (std::uint64_t at = 0; at < bytes; at += chunk_bytes)
    file.chunk_crcs.push_back(
        offload::crc32c(zeros.data(), static_cast<std::size_t>(std::min(chunk_bytes, bytes - at))));
  return file;
}

// Writes a checkpoint of `specs` saved by `ranks` ranks into `dir` (created): the tensors'
// elements, laid end to end, split into `ranks` contiguous shards as stage 3 splits them, with
// master weights value(t, j). Returns the manifest.
inline ckpt::Manifest write(const std::string& dir, const std::vector<ParamSpec>& specs, int ranks,
                            std::uint64_t chunk_bytes = ckpt::kChunkBytes) {
  std::filesystem::create_directories(dir);
  ckpt::Manifest m;
  m.world_size = ranks;
  m.stage = 3;
  m.steps = 7;
  m.skipped = 1;
  m.loss_scale = 256;
  m.config = "stage=3 dtype=fp32 writer=synthetic_checkpoint";
  m.chunk_bytes = chunk_bytes;
  std::size_t total = 0;
  for (const ParamSpec& s : specs) {
    m.tensors.push_back({s.name, s.shape, s.group, s.numel()});
    total += s.numel();
  }
  std::size_t tensor = 0, offset = 0;  // the next element to place: tensor's element `offset`
  for (int r = 0; r < ranks; ++r) {
    std::size_t left = total * static_cast<std::size_t>(r + 1) / static_cast<std::size_t>(ranks) -
                       total * static_cast<std::size_t>(r) / static_cast<std::size_t>(ranks);
    ckpt::RankEntry rank;
    const std::string master_name = ckpt::state_file_name(r, ckpt::StateKind::master);
    ckpt::FileWriter master((std::filesystem::path(dir) / master_name).string(), chunk_bytes);
    std::vector<float> values;
    while (left > 0) {
      const std::size_t take = std::min(left, specs[tensor].numel() - offset);
      rank.ranges.push_back({tensor, offset, offset + take});
      constexpr std::size_t kBlock = std::size_t{1} << 20;  // values per append: memory stays bounded
      for (std::size_t lo = offset; lo < offset + take; lo += kBlock) {
        values.clear();
        for (std::size_t j = lo; j < std::min(offset + take, lo + kBlock); ++j) values.push_back(value(tensor, j));
        master.append(values.data(), values.size() * sizeof(float));
      }
      left -= take;
      offset += take;
      if (offset == specs[tensor].numel()) {
        ++tensor;
        offset = 0;
      }
    }
    master.finish();
    rank.files[0] = {master_name, master.bytes(), master.chunk_crcs()};
    for (ckpt::StateKind k : {ckpt::StateKind::m, ckpt::StateKind::v})
      rank.files[static_cast<std::size_t>(k)] =
          zero_state_file(dir, ckpt::state_file_name(r, k), master.bytes(), chunk_bytes);
    m.ranks.push_back(std::move(rank));
  }
  const std::string manifest = ckpt::serialize(m);
  write_file_synced((std::filesystem::path(dir) / ckpt::kManifestName).string(), manifest.data(),
                          manifest.size());
  return m;
}

}  // namespace zest::synthetic_checkpoint
