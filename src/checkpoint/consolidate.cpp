// zest/checkpoint.hpp's consolidate_checkpoint: a checkpoint's fp32 master weights as one
// safetensors file (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON naming each tensor's dtype, shape and [begin, end) byte offsets
// (relative to the first byte after the header, contiguous, in file order), then the bytes.
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "checkpoint/output_target.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/safetensors_header.hpp"
#include "runtime/host/half.hpp"
#include "zest/checkpoint.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

namespace ckpt = checkpoint;

// The file's numbers and tensor bytes are little-endian; written as the host holds them.
static_assert(std::endian::native == std::endian::little, "consolidate writes host bytes as little-endian");

// Values per read: 4 MiB of fp32, so memory stays bounded by a few such blocks (this one, its
// converted copy and the reader's cached chunk) whatever the model's size.
constexpr std::size_t kBlockValues = (std::size_t{4} << 20) / sizeof(float);

// The output file while it is written: OUT.tmp-<n>, created exclusively (the first such name that
// does not exist, from n = pid on), removed unless commit() renamed it to OUT. Write failures (a
// full disk among them) throw IoError naming OUT and what to do.
class OutputFile {
 public:
  OutputFile(std::string out, std::string dir) : out_(std::move(out)), dir_(std::move(dir)) {
    for (auto n = static_cast<unsigned>(::getpid());; ++n) {
      temp_ = fmt::format("{}.tmp-{}", out_, n);
      try {
        guarded([&] { writer_ = std::make_unique<ckpt::FileWriter>(temp_); });
        return;
      } catch (const IoError& e) {
        if (e.error_number() != EEXIST || n - static_cast<unsigned>(::getpid()) >= 1000) throw;
      }
    }
  }
  // Removes the temporary file unless committed, and only if its path still names the file this
  // created: whatever someone else put at that path is theirs.
  ~OutputFile() {
    const FileIdentity mine = writer_->identity();
    writer_.reset();  // closes it
    if (!committed_ && path_names(temp_, mine)) std::remove(temp_.c_str());
  }
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void append(const void* data, std::size_t bytes) { guarded([&] { writer_->append(data, bytes); }); }

  // fsync, rename into place, fsync the directory: OUT is whole or absent after a crash. OUT is
  // checked again first (it may have changed meanwhile); a new OUT replaces nothing that appeared.
  void commit() {
    guarded([&] { writer_->finish(); });
    const std::string what = std::string("consolidate: cannot rename ").append(temp_).append(" to OUT");
    if (!path_names(temp_, writer_->identity()))
      throw Error(std::string("consolidate: ").append(temp_)
                      .append(" is no longer the file it wrote (someone who can write its directory moved it); "
                              "nothing was renamed: write OUT to a directory only you can write"));
    if (!ckpt::check_output_target(out_, dir_)) {
      rename_noreplace(temp_, out_, what);
    } else if (std::rename(temp_.c_str(), out_.c_str()) != 0) {
      throw IoError(what, out_, 0, 0, errno);
    }
    committed_ = true;
    const std::filesystem::path parent = std::filesystem::path(out_).parent_path();
    fsync_directory(parent.empty() ? "." : parent.string());
  }

 private:
  template <typename Write>
  void guarded(Write&& write) {
    try {
      write();
    } catch (const IoError& e) {
      throw IoError(
          fmt::format("consolidate: cannot write {} ({}; it was left as it was)", out_, remedy(e.error_number())),
          e.path(), e.offset(), e.length(), e.error_number());
    }
  }

  static const char* remedy(int error) {
    switch (error) {
      case ENOSPC: case EDQUOT: case EFBIG: return "free space on its file system, or write it elsewhere";
      case ENOENT: case ENOTDIR: return "create its directory first";
      case EACCES: case EPERM: case EROFS: return "choose a path you can write";
      default: return "check the file system, or write it elsewhere";
    }
  }

  std::string out_, dir_, temp_;
  std::unique_ptr<ckpt::FileWriter> writer_;
  bool committed_ = false;
};

// One tensor's master weights, block by block, converted to `dtype` (round to nearest even).
void write_tensor(ckpt::Reader& reader, std::size_t tensor, DType dtype, OutputFile& out, std::vector<float>& block,
                  std::vector<std::uint16_t>& narrow) {
  const std::size_t numel = reader.manifest().tensors[tensor].numel;
  for (std::size_t a = 0; a < numel; a += kBlockValues) {
    const std::size_t n = std::min(kBlockValues, numel - a);
    reader.read(ckpt::StateKind::master, tensor, a, a + n, block.data());
    if (dtype == DType::f32) {
      out.append(block.data(), n * sizeof(float));
      continue;
    }
    for (std::size_t i = 0; i < n; ++i) store_from_float(narrow.data(), dtype, i, block[i]);
    out.append(narrow.data(), n * sizeof(std::uint16_t));
  }
}

}  // namespace

void consolidate_checkpoint(const std::string& dir, const std::string& out, DType dtype) {
  ckpt::check_output_target(out, dir);  // before any work
  ckpt::Reader reader(dir);
  reader.check_files(ckpt::StateKind::master);  // an incomplete checkpoint fails here, before OUT's temp file exists
  const std::string header = ckpt::safetensors_header(reader.manifest(), dtype, dir);
  const std::uint64_t header_bytes = header.size();

  OutputFile file(out, dir);
  file.append(&header_bytes, sizeof header_bytes);
  file.append(header.data(), header.size());
  std::vector<float> block(kBlockValues);
  std::vector<std::uint16_t> narrow(dtype == DType::f32 ? 0 : kBlockValues);
  for (std::size_t t = 0; t < reader.manifest().tensors.size(); ++t)
    write_tensor(reader, t, dtype, file, block, narrow);
  file.commit();
}

}  // namespace zest
