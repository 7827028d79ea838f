#include "engine/checkpoint_format.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "offload/checksum.hpp"
#include "zest/error.hpp"

namespace zest::engine::checkpoint {
namespace {

[[noreturn]] void bad_manifest(const std::string& path, int line, const std::string& what) {
  throw Error(std::string("checkpoint manifest ").append(path).append(" line ").append(std::to_string(line))
                  .append(": ").append(what)
                  .append("; the checkpoint is damaged or not a zest checkpoint: load another one"));
}

std::string hex_double(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%a", value);
  return text;
}

}  // namespace

std::size_t RankFile::elements() const {
  std::size_t n = 0;
  for (const Range& r : ranges) n += r.hi - r.lo;
  return n;
}

std::string rank_file_name(int rank) { return std::string("rank").append(std::to_string(rank)).append(".bin"); }

std::string serialize(const Manifest& m) {
  std::ostringstream out;
  out << "zest-checkpoint " << m.version << '\n';
  out << "world_size " << m.world_size << '\n';
  out << "stage " << m.stage << '\n';
  out << "steps " << m.steps << '\n';
  out << "skipped " << m.skipped << '\n';
  out << "loss_scaler " << hex_double(m.loss_scale) << ' ' << m.clean_steps << ' ' << m.hysteresis_left << '\n';
  out << "config " << m.config << '\n';
  out << "tensors " << m.tensors.size() << '\n';
  for (const TensorEntry& t : m.tensors) {
    out << "tensor " << t.group << ' ' << t.numel << ' ' << t.shape.size();
    for (std::size_t d : t.shape) out << ' ' << d;
    out << ' ' << t.name << '\n';  // last: a name may hold spaces
  }
  out << "files " << m.files.size() << '\n';
  for (const RankFile& f : m.files) {
    out << "file " << f.name << ' ' << f.bytes << ' ' << f.crc32c << ' ' << f.ranges.size() << '\n';
    for (const Range& r : f.ranges) out << "range " << r.tensor << ' ' << r.lo << ' ' << r.hi << '\n';
  }
  std::string text = out.str();
  const std::uint32_t crc = offload::crc32c(text.data(), text.size());
  text.append("end ").append(std::to_string(crc)).append("\n");
  return text;
}

Manifest parse(const std::string& text, const std::string& path) {
  // The version first (a newer format may end differently), then the checksum line: a truncated
  // or edited manifest is refused before anything else is read.
  {
    int version = 0;
    if (std::sscanf(text.c_str(), "zest-checkpoint %d", &version) != 1) bad_manifest(path, 1, "not a zest checkpoint manifest");
    if (version > kFormatVersion || version < 1)
      throw Error(std::string("checkpoint manifest ").append(path).append(": format version ")
                      .append(std::to_string(version)).append(", this build reads versions 1 to ")
                      .append(std::to_string(kFormatVersion)).append("; load it with a newer zest"));
  }
  const std::size_t end = text.rfind("end ");
  if (end == std::string::npos || text.empty() || text.back() != '\n')
    bad_manifest(path, 0, "no closing checksum line (truncated?)");
  const unsigned long long stored = std::strtoull(text.c_str() + end + 4, nullptr, 10);
  if (stored != offload::crc32c(text.data(), end))
    bad_manifest(path, 0, "its CRC32C does not match its contents");

  std::istringstream in(text.substr(0, end));
  Manifest m;
  int line_no = 0;
  std::string line;
  auto next = [&](const char* key) {
    if (!std::getline(in, line)) bad_manifest(path, line_no, std::string("missing '").append(key).append("'"));
    ++line_no;
    std::istringstream fields(line);
    std::string word;
    fields >> word;
    if (word != key) bad_manifest(path, line_no, std::string("expected '").append(key).append("', found '").append(word).append("'"));
    return fields;
  };
  auto check = [&](std::istream& fields, const char* what) {
    if (!fields) bad_manifest(path, line_no, std::string("unreadable ").append(what));
  };
  {
    auto f = next("zest-checkpoint");
    f >> m.version;
    check(f, "format version");
  }
  { auto f = next("world_size"); f >> m.world_size; check(f, "world size"); }
  { auto f = next("stage"); f >> m.stage; check(f, "stage"); }
  { auto f = next("steps"); f >> m.steps; check(f, "steps"); }
  { auto f = next("skipped"); f >> m.skipped; check(f, "skipped steps"); }
  {
    auto f = next("loss_scaler");
    std::string scale;
    f >> scale >> m.clean_steps >> m.hysteresis_left;
    check(f, "loss scaler state");
    m.loss_scale = std::strtod(scale.c_str(), nullptr);
  }
  {
    auto f = next("config");
    std::getline(f, m.config);
    if (!m.config.empty() && m.config.front() == ' ') m.config.erase(0, 1);
  }
  std::size_t count = 0;
  { auto f = next("tensors"); f >> count; check(f, "tensor count"); }
  for (std::size_t i = 0; i < count; ++i) {
    auto f = next("tensor");
    TensorEntry t;
    std::size_t dims = 0;
    f >> t.group >> t.numel >> dims;
    t.shape.resize(dims);
    for (std::size_t& d : t.shape) f >> d;
    check(f, "tensor entry");
    std::getline(f, t.name);
    if (!t.name.empty() && t.name.front() == ' ') t.name.erase(0, 1);
    m.tensors.push_back(std::move(t));
  }
  { auto f = next("files"); f >> count; check(f, "file count"); }
  for (std::size_t i = 0; i < count; ++i) {
    auto f = next("file");
    RankFile file;
    std::size_t ranges = 0;
    f >> file.name >> file.bytes >> file.crc32c >> ranges;
    check(f, "file entry");
    if (file.name.find('/') != std::string::npos) bad_manifest(path, line_no, "a file name with a '/'");
    for (std::size_t r = 0; r < ranges; ++r) {
      auto g = next("range");
      Range range;
      g >> range.tensor >> range.lo >> range.hi;
      check(g, "range");
      if (range.tensor >= m.tensors.size() || range.lo >= range.hi || range.hi > m.tensors[range.tensor].numel)
        bad_manifest(path, line_no, "a range outside its tensor");
      file.ranges.push_back(range);
    }
    m.files.push_back(std::move(file));
  }
  return m;
}

void write_file_synced(const std::string& path, const void* data, std::size_t bytes) {
  FileWriter writer(path);
  writer.append(data, bytes);
  writer.finish();
}

std::string read_whole_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("checkpoint: cannot open", path, 0, 0, errno);
  std::string text;
  char buffer[1 << 14];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      throw IoError("checkpoint: cannot read", path, text.size(), sizeof buffer, error);
    }
    if (n == 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return text;
}

void read_at(int fd, const std::string& path, void* data, std::size_t bytes, std::uint64_t offset) {
  char* out = static_cast<char*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, out + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError("checkpoint: cannot read", path, offset + done, bytes - done, errno);
    if (n == 0) throw IoError("checkpoint: file ends early (truncated)", path, offset + done, bytes - done, EIO);
    done += static_cast<std::size_t>(n);
  }
}

std::uint32_t file_crc32c(const std::string& path, std::uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("checkpoint: cannot open", path, 0, 0, errno);
  std::vector<char> buffer(std::size_t{1} << 20);
  std::uint32_t crc = 0;
  try {
    for (std::uint64_t at = 0; at < bytes;) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), bytes - at));
      read_at(fd, path, buffer.data(), n, at);
      crc = offload::crc32c(buffer.data(), n, crc);
      at += n;
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return crc;
}

void fsync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError("checkpoint: cannot open directory", path, 0, 0, errno);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) throw IoError("checkpoint: cannot fsync directory", path, 0, 0, error);
}

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError("checkpoint: cannot create", path_, 0, 0, errno);
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::append(const void* data, std::size_t bytes) {
  const char* in = static_cast<const char*>(data);
  crc_ = offload::crc32c(data, bytes, crc_);
  for (std::size_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd_, in + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError("checkpoint: cannot write", path_, bytes_ + done, bytes - done, errno);
    done += static_cast<std::size_t>(n);
  }
  bytes_ += bytes;
}

void FileWriter::finish() {
  if (::fsync(fd_) != 0) throw IoError("checkpoint: cannot fsync", path_, 0, bytes_, errno);
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) throw IoError("checkpoint: cannot close", path_, 0, bytes_, errno);
}

}  // namespace zest::engine::checkpoint
