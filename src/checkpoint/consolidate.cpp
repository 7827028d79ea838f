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

#include "checkpoint/reader.hpp"
#include "runtime/half.hpp"
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

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
  }
  return "?";
}

// A JSON string literal; the rest of a name's bytes pass through (JSON text is UTF-8).
std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out.append(1, '\\').append(1, c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out.append(escaped);
    } else {
      out.append(1, c);
    }
  }
  return out.append("\"");
}

// JSON text is UTF-8: well-formed sequences only (no overlongs, surrogates or values past U+10FFFF).
bool valid_utf8(const std::string& text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const unsigned c = *p;
    const int more = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (more < 0 || end - p <= more) return false;  // not a lead byte, or cut short
    std::uint32_t code = more == 0 ? c : c & (0x3Fu >> more);
    for (int i = 1; i <= more; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      code = code << 6 | (p[i] & 0x3Fu);
    }
    static constexpr std::uint32_t kSmallest[] = {0, 0x80, 0x800, 0x10000};
    if (code < kSmallest[more] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    p += more + 1;
  }
  return true;
}

// Safetensors metadata is a map of strings to strings: where the weights came from.
std::string metadata_json(const ckpt::Manifest& m, DType dtype) {
  const std::pair<const char*, std::string> entries[] = {
      {"format", "pt"},
      {"zest_checkpoint_format", std::to_string(m.version)},
      {"zest_steps", std::to_string(m.steps)},
      {"zest_skipped_steps", std::to_string(m.skipped)},
      {"zest_world_size", std::to_string(m.world_size)},
      {"zest_stage", std::to_string(m.stage)},
      {"zest_weights", std::string("fp32 master weights").append(dtype == DType::f32 ? "" : ", rounded to nearest even")},
      {"zest_config", m.config},
  };
  std::string out = "{";
  for (const auto& [key, value] : entries)
    out.append(out.size() > 1 ? "," : "").append(json_string(key)).append(":").append(json_string(value));
  return out.append("}");
}

// The JSON header, padded with spaces to a multiple of 8 so the data that follows is aligned.
// Throws Error for names safetensors cannot hold (a duplicate, or its reserved "__metadata__").
std::string header_json(const ckpt::Manifest& m, DType dtype, const std::string& dir) {
  std::string out = std::string("{\"__metadata__\":").append(metadata_json(m, dtype));
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const ckpt::TensorEntry& t : m.tensors) {
    if (!valid_utf8(t.name))
      throw Error(std::string("checkpoint ").append(dir).append(": tensor ").append(std::to_string(names.size()))
                      .append("'s name is not UTF-8, which safetensors' JSON header requires; rename the parameter in the trainer"));
    if (t.name == "__metadata__" || !names.insert(t.name).second)
      throw Error(std::string("checkpoint ").append(dir).append(": tensor name '").append(t.name)
                      .append(t.name == "__metadata__" ? "' is reserved by safetensors" : "' appears twice")
                      .append(": a safetensors file cannot hold it; rename the parameter in the trainer"));
    const std::uint64_t end = offset + std::uint64_t{t.numel} * dtype_size(dtype);
    out.append(",").append(json_string(t.name)).append(":{\"dtype\":\"").append(safetensors_dtype(dtype)).append("\",\"shape\":[");
    for (std::size_t i = 0; i < t.shape.size(); ++i) out.append(i ? "," : "").append(std::to_string(t.shape[i]));
    out.append("],\"data_offsets\":[").append(std::to_string(offset)).append(",").append(std::to_string(end)).append("]}");
    offset = end;
  }
  out.append("}");
  out.append((8 - out.size() % 8) % 8, ' ');
  return out;
}

// The output file while it is written: OUT.tmp-<pid>, removed unless commit() renamed it to OUT.
// Write failures (a full disk among them) throw IoError naming OUT and what to do.
class OutputFile {
 public:
  explicit OutputFile(std::string out)
      : out_(std::move(out)), temp_(std::string(out_).append(".tmp-").append(std::to_string(::getpid()))) {
    guarded([&] { writer_ = std::make_unique<ckpt::FileWriter>(temp_); });
  }
  ~OutputFile() {
    writer_.reset();  // closes it
    if (!committed_) std::remove(temp_.c_str());
  }
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void append(const void* data, std::size_t bytes) { guarded([&] { writer_->append(data, bytes); }); }

  // fsync, rename into place, fsync the directory: OUT is whole or absent after a crash.
  void commit() {
    guarded([&] { writer_->finish(); });
    if (std::rename(temp_.c_str(), out_.c_str()) != 0) {
      const int error = errno;
      throw IoError(std::string("consolidate: cannot rename ").append(temp_).append(" to OUT (is OUT a directory?)"),
                    out_, 0, 0, error);
    }
    committed_ = true;
    const std::filesystem::path parent = std::filesystem::path(out_).parent_path();
    ckpt::fsync_directory(parent.empty() ? "." : parent.string());
  }

 private:
  template <typename Write>
  void guarded(Write&& write) {
    try {
      write();
    } catch (const IoError& e) {
      throw IoError(std::string("consolidate: cannot write ").append(out_).append(" (").append(remedy(e.error_number()))
                        .append("; it was left as it was)"), e.path(), e.offset(), e.length(), e.error_number());
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

  std::string out_, temp_;
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
  ckpt::Reader reader(dir);
  reader.check_files(ckpt::StateKind::master);  // an incomplete checkpoint fails here, before OUT's temp file exists
  const std::string header = header_json(reader.manifest(), dtype, dir);
  const std::uint64_t header_bytes = header.size();

  OutputFile file(out);
  file.append(&header_bytes, sizeof header_bytes);
  file.append(header.data(), header.size());
  std::vector<float> block(kBlockValues);
  std::vector<std::uint16_t> narrow(dtype == DType::f32 ? 0 : kBlockValues);
  for (std::size_t t = 0; t < reader.manifest().tensors.size(); ++t) write_tensor(reader, t, dtype, file, block, narrow);
  file.commit();
}

}  // namespace zest
