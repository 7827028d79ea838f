#include "checkpoint/format.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "base/files.hpp"
#include "config/config_names.hpp"
#include "offload/checksum.hpp"
#include "optim/compact_math.hpp"
#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

[[noreturn]] void bad_manifest(const std::string& path, int line, const std::string& what) {
  throw Error(fmt::format(
      "checkpoint manifest {} line {}: {}; the checkpoint is damaged or not a zest checkpoint: load another one", path,
      line, what));
}

// Element counts beyond this would overflow the 64-bit byte sizes and offsets derived from them
// (fp32 files, safetensors data offsets).
constexpr std::uint64_t kMaxElements = std::numeric_limits<std::uint64_t>::max() / sizeof(float);

// a + b and a * b as element counts: false when the result passes kMaxElements.
bool add_elements(std::uint64_t& sum, std::uint64_t n) {
  return !__builtin_add_overflow(sum, n, &sum) && sum <= kMaxElements;
}
bool multiply_elements(std::uint64_t& product, std::uint64_t n) {
  return !__builtin_mul_overflow(product, n, &product) && product <= kMaxElements;
}

std::string hex_double(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%a", value);
  return text;
}

}  // namespace

const char* state_name(StateKind state) {
  switch (state) {
    case StateKind::master: return "master";
    case StateKind::m: return "m";
    case StateKind::v: return "v";
  }
  return "?";
}

std::size_t RankEntry::elements() const {
  std::size_t n = 0;
  for (const Range& r : ranges) n += r.hi - r.lo;
  return n;
}

std::uint64_t int8_blocks(std::uint64_t elements) { return (elements + optim::kInt8Block - 1) / optim::kInt8Block; }

std::uint64_t state_file_bytes(StatesFormat states, StateKind state, const std::vector<Range>& ranges) {
  std::uint64_t elements = 0, blocks = 0;
  for (const Range& r : ranges) {
    elements += r.hi - r.lo;
    blocks += int8_blocks(r.hi - r.lo);
  }
  if (state == StateKind::master || states == StatesFormat::f32) return elements * sizeof(float);
  if (states == StatesFormat::bf16) return elements * sizeof(std::uint16_t);
  return elements + blocks * sizeof(float);
}

std::string state_file_name(int rank, StateKind state) {
  return fmt::format("rank{}.{}.bin", rank, state_name(state));
}

std::string serialize(const Manifest& m) {
  std::ostringstream out;
  out << "zest-checkpoint " << m.version << '\n';
  out << "world_size " << m.world_size << '\n';
  out << "stage " << m.stage << '\n';
  out << "steps " << m.steps << '\n';
  out << "skipped " << m.skipped << '\n';
  out << "loss_scaler " << hex_double(m.loss_scale) << ' ' << m.clean_steps << ' ' << m.hysteresis_left << '\n';
  out << "config " << m.config << '\n';
  if (m.version >= 4) out << "states " << states_format_name(m.states) << '\n';
  // Version 3 on: a manifest parsed from version 2 serializes as it was read.
  if (m.version >= 3) out << "optimizer_groups " << m.optimizer_groups.size() << '\n';
  for (const auto& g : m.optimizer_groups)
    out << "optimizer_group " << hex_double(g.lr) << ' ' << hex_double(g.beta1) << ' ' << hex_double(g.beta2) << ' '
        << hex_double(g.eps) << ' ' << hex_double(g.weight_decay) << '\n';
  out << "chunk_bytes " << m.chunk_bytes << '\n';
  out << "tensors " << m.tensors.size() << '\n';
  for (const TensorEntry& t : m.tensors) {
    out << "tensor " << t.group << ' ' << t.numel << ' ' << t.shape.size();
    for (std::size_t d : t.shape) out << ' ' << d;
    out << ' ' << t.name << '\n';  // last: a name may hold spaces
  }
  out << "ranks " << m.ranks.size() << '\n';
  for (const RankEntry& r : m.ranks) {
    out << "rank " << r.ranges.size() << '\n';
    for (const Range& range : r.ranges) out << "range " << range.tensor << ' ' << range.lo << ' ' << range.hi << '\n';
    for (const StateFile& f : r.files) {
      out << "file " << f.name << ' ' << f.bytes << ' ' << f.chunk_crcs.size();
      for (std::uint32_t crc : f.chunk_crcs) out << ' ' << crc;
      out << '\n';
    }
  }
  std::string text = out.str();
  const std::uint32_t crc = offload::crc32c(text.data(), text.size());
  text.append("end ").append(std::to_string(crc)).append("\n");
  return text;
}

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

std::string tensor_name_problem(const std::string& name) {
  if (name.empty()) return "is empty";
  if (name.size() > kMaxTensorNameBytes)
    return fmt::format("is {} bytes long (at most {})", name.size(), kMaxTensorNameBytes);
  if (name.find('\n') != std::string::npos) return "holds a newline";
  if (name.find('\0') != std::string::npos) return "holds a NUL byte";
  if (!valid_utf8(name))
    return "is not UTF-8 text (safetensors, which consolidate writes, holds names as JSON strings)";
  if (name == "__metadata__") return "is safetensors' reserved key __metadata__";
  return {};
}

namespace {

// The ranks' ranges of each tensor cover it exactly once: a gap would load uninitialised states,
// an overlap two values for one element.
void check_ranges_tile_tensors(const Manifest& m, const std::string& path, int line_no) {
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> of_tensor(m.tensors.size());
  for (const RankEntry& rank : m.ranks)
    for (const Range& range : rank.ranges) of_tensor[range.tensor].emplace_back(range.lo, range.hi);
  for (std::size_t t = 0; t < of_tensor.size(); ++t) {
    auto& ranges = of_tensor[t];
    std::sort(ranges.begin(), ranges.end());
    std::size_t covered = 0;
    const auto refuse = [&](const char* why) {
      bad_manifest(path, line_no,
                   fmt::format("the ranges of tensor '{}' do not cover it exactly once ({})", m.tensors[t].name, why));
    };
    for (const auto& [lo, hi] : ranges) {
      if (lo != covered) refuse(lo < covered ? "elements listed by two ranges" : "elements no rank holds");
      covered = hi;
    }
    if (covered != m.tensors[t].numel) refuse("elements no rank holds");
  }
}

}  // namespace

namespace {

// The version first (a newer format may end differently), then the checksum line: a truncated or
// edited manifest is refused before anything else is read. Returns where the checksum line starts.
std::size_t check_version_and_checksum(const std::string& text, const std::string& path) {
  int version = 0;
  if (std::sscanf(text.c_str(), "zest-checkpoint %d", &version) != 1)
    bad_manifest(path, 1, "not a zest checkpoint manifest");
  if (version > kFormatVersion)
    throw Error(
        fmt::format("checkpoint manifest {}: format version {}, this build reads version {}; load it with a newer zest",
                    path, version, kFormatVersion));
  if (version < kOldestReadableVersion)
    throw Error(
        fmt::format("checkpoint manifest {}: format version {} was written by a pre-release zest; this build reads "
                    "versions {} to {}: save the checkpoint again",
                    path, version, kOldestReadableVersion, kFormatVersion));
  const std::size_t end = text.rfind("end ");
  if (end == std::string::npos || text.empty() || text.back() != '\n')
    bad_manifest(path, 0, "no closing checksum line (truncated?)");
  const unsigned long long stored = std::strtoull(text.c_str() + end + 4, nullptr, 10);
  if (stored != offload::crc32c(text.data(), end)) bad_manifest(path, 0, "its CRC32C does not match its contents");
  return end;
}

// The manifest's lines in order, each opened by its key, and the errors that name the line.
class ManifestLines {
 public:
  ManifestLines(const std::string& body, const std::string& path) : in_(body), path_(path) {}

  // The next line's fields after `key`; an error where the line is missing or has another key.
  std::istringstream next(const char* key) {
    if (!std::getline(in_, line_)) fail(std::string("missing '").append(key).append("'"));
    ++number_;
    std::istringstream fields(line_);
    std::string word;
    fields >> word;
    if (word != key) fail(fmt::format("expected '{}', found '{}'", key, word));
    return fields;
  }
  void check(const std::istream& fields, const char* what) const {
    if (!fields) fail(std::string("unreadable ").append(what));
  }
  // A checksum says the text is what a writer wrote, not that it means anything: every field is
  // held to the range a saving engine can produce, and the error names the field and the value.
  [[noreturn]] void out_of_range(const char* field, const std::string& value, const char* allowed) const {
    fail(fmt::format("{} {} is out of range ({})", field, value, allowed));
  }
  [[noreturn]] void fail(const std::string& what) const { bad_manifest(path_, number_, what); }
  static std::string rest_of_line(std::istream& fields) {
    std::string rest;
    std::getline(fields, rest);
    if (!rest.empty() && rest.front() == ' ') rest.erase(0, 1);
    return rest;
  }
  const std::string& line() const { return line_; }
  int number() const { return number_; }

 private:
  std::istringstream in_;
  const std::string& path_;
  std::string line_;
  int number_ = 0;
};

// Format version to states format: the run as a whole.
void read_run(ManifestLines& lines, Manifest& m) {
  { auto f = lines.next("zest-checkpoint"); f >> m.version; lines.check(f, "format version"); }
  {
    auto f = lines.next("world_size");
    f >> m.world_size;
    lines.check(f, "world size");
    if (m.world_size < 1) lines.fail("a world size below 1");
  }
  {
    auto f = lines.next("stage");
    f >> m.stage;
    lines.check(f, "stage");
    if (m.stage < 0 || m.stage > 3) lines.out_of_range("stage", std::to_string(m.stage), "0 to 3");
  }
  {
    auto f = lines.next("steps");
    f >> m.steps;
    lines.check(f, "steps");
    if (m.steps < 0 || m.steps > kMaxSteps) lines.out_of_range("steps", std::to_string(m.steps), "0 to 2^53");
  }
  {
    auto f = lines.next("skipped");
    f >> m.skipped;
    lines.check(f, "skipped steps");
    if (m.skipped < 0 || m.skipped > m.steps) lines.out_of_range("skipped", std::to_string(m.skipped), "0 to steps");
  }
  {
    auto f = lines.next("loss_scaler");
    std::string scale;
    f >> scale >> m.clean_steps >> m.hysteresis_left;
    lines.check(f, "loss scaler state");
    char* end = nullptr;
    m.loss_scale = std::strtod(scale.c_str(), &end);
    // The step multiplies fp32 gradients by 1 / scale: a scale outside float's normal range (a
    // subnormal, 0x1p-1074) makes that infinite, which no save writes.
    if (*end != '\0' || !std::isnormal(m.loss_scale) || m.loss_scale < 0x1p-126 || m.loss_scale > 0x1p+127)
      lines.out_of_range("loss scale", scale, "a number from 2^-126 to 2^127");
    if (m.clean_steps < 0) lines.out_of_range("loss scaler clean steps", std::to_string(m.clean_steps), "0 or more");
    if (m.hysteresis_left < 0)
      lines.out_of_range("loss scaler hysteresis", std::to_string(m.hysteresis_left), "0 or more");
  }
  { auto f = lines.next("config"); m.config = ManifestLines::rest_of_line(f); }
  if (m.version >= 4) {
    auto f = lines.next("states");
    std::string name;
    f >> name;
    lines.check(f, "states format");
    const auto* known = std::find_if(detail::kStatesFormatNames.begin(), detail::kStatesFormatNames.end(),
                                     [&](const auto& entry) { return entry.name == name; });
    if (known == detail::kStatesFormatNames.end())
      lines.fail(std::string("states '").append(name).append("', not fp32, bf16 or int8"));
    m.states = known->value;
  }
}

// Version 3 on: each optimizer group's values, a line each (`line_count` bounds their count).
void read_optimizer_groups(ManifestLines& lines, Manifest& m, std::size_t line_count) {
  if (m.version < 3) return;
  std::size_t groups = 0;
  { auto f = lines.next("optimizer_groups"); f >> groups; lines.check(f, "optimizer group count"); }
  // Each group is one line of the text: a count beyond the lines left is damage, not a size.
  if (groups > line_count) lines.fail("more optimizer groups than lines");
  for (std::size_t i = 0; i < groups; ++i) {
    auto f = lines.next("optimizer_group");
    std::string v[5];
    f >> v[0] >> v[1] >> v[2] >> v[3] >> v[4];
    lines.check(f, "optimizer group");
    const Manifest::OptimizerGroup g{std::strtod(v[0].c_str(), nullptr), std::strtod(v[1].c_str(), nullptr),
                                     std::strtod(v[2].c_str(), nullptr), std::strtod(v[3].c_str(), nullptr),
                                     std::strtod(v[4].c_str(), nullptr)};
    const bool usable = g.lr > 0 && g.lr < HUGE_VAL && g.beta1 >= 0 && g.beta1 < 1 && g.beta2 >= 0 && g.beta2 < 1 &&
                        g.eps > 0 && g.eps < HUGE_VAL && g.weight_decay >= 0 && g.weight_decay < HUGE_VAL;
    if (!usable) lines.fail("optimizer group values no step can use");
    m.optimizer_groups.push_back(g);
  }
}

void read_chunk_bytes(ManifestLines& lines, Manifest& m) {
  auto f = lines.next("chunk_bytes");
  f >> m.chunk_bytes;
  lines.check(f, "chunk size");
  // A reader holds one chunk in memory: a size past the limit is damage, not a setting.
  if (m.chunk_bytes == 0 || m.chunk_bytes > kMaxChunkBytes)
    lines.fail(fmt::format("a chunk size of {} bytes (1 to {} allowed)", m.chunk_bytes, kMaxChunkBytes));
}

// Counts only bound loops that need a line per item: a huge count runs out of lines and is
// refused there, having allocated no more than the lines it read.
void read_tensors(ManifestLines& lines, Manifest& m) {
  std::size_t count = 0;
  std::uint64_t all_elements = 0;
  { auto f = lines.next("tensors"); f >> count; lines.check(f, "tensor count"); }
  for (std::size_t i = 0; i < count; ++i) {
    auto f = lines.next("tensor");
    TensorEntry t;
    std::size_t dims = 0;
    f >> t.group >> t.numel >> dims;
    lines.check(f, "tensor entry");
    if (t.group < 0) lines.out_of_range("tensor group", std::to_string(t.group), "0 or more");
    // Each dimension takes at least two characters (" 7"): more than the line holds is damage,
    // refused before it sizes anything.
    if (dims > lines.line().size() / 2) lines.fail("more dimensions than the line holds");
    t.shape.resize(dims);
    for (std::size_t& d : t.shape) f >> d;
    lines.check(f, "tensor shape");
    std::uint64_t product = 1;
    for (std::size_t d : t.shape)
      if (!multiply_elements(product, d)) lines.fail("a tensor shape whose element count overflows 64-bit byte sizes");
    if (product != t.numel || t.numel == 0) lines.fail("a tensor whose shape does not hold its element count");
    if (!add_elements(all_elements, t.numel)) lines.fail("tensors whose element count overflows 64-bit byte sizes");
    t.name = ManifestLines::rest_of_line(f);
    if (const std::string problem = tensor_name_problem(t.name); !problem.empty())
      lines.fail("a tensor name that " + problem);
    m.tensors.push_back(std::move(t));
  }
}

// Rank `rank`'s file of `kind`: its own name, the size its ranges need, a checksum per chunk.
void read_state_file(ManifestLines& lines, const Manifest& m, int rank, const RankEntry& entry, StateKind kind,
                     std::uint64_t elements, StateFile& file) {
  auto f = lines.next("file");
  std::size_t chunks = 0;
  f >> file.name >> file.bytes >> chunks;
  lines.check(f, "file entry");
  // The name, size and chunk count are checked against each other before the checksums are read,
  // so the count sizes nothing it does not match. Each rank's files are its own, each of its kind:
  // a name pointing at another rank's file, or at the master file for m, would load one state as
  // another.
  const std::string expected = state_file_name(rank, kind);
  if (file.name != expected)
    lines.fail(fmt::format("rank {}'s file '{}' where its own '{}' belongs", rank, file.name, expected));
  if (file.bytes != state_file_bytes(m.states, kind, entry.ranges))
    lines.fail(fmt::format("file {} of {} bytes for ranges of {} {} values", file.name, file.bytes, elements,
                           kind == StateKind::master ? "fp32" : states_format_name(m.states)));
  if (chunks != file.bytes / m.chunk_bytes + (file.bytes % m.chunk_bytes != 0))
    lines.fail(std::string("file ").append(file.name).append(" with a checksum count that does not fit its size"));
  file.chunk_crcs.resize(chunks);
  for (std::uint32_t& crc : file.chunk_crcs) f >> crc;
  lines.check(f, "chunk checksums");
}

void read_ranks(ManifestLines& lines, Manifest& m) {
  std::size_t count = 0;
  { auto f = lines.next("ranks"); f >> count; lines.check(f, "rank count"); }
  if (count != static_cast<std::size_t>(m.world_size))
    lines.fail(fmt::format("{} ranks listed for world size {}", count, m.world_size));
  for (std::size_t i = 0; i < count; ++i) {
    RankEntry rank;
    std::size_t ranges = 0;
    std::uint64_t elements = 0;  // what rank.elements() sums, checked for overflow as it grows
    { auto f = lines.next("rank"); f >> ranges; lines.check(f, "rank entry"); }
    for (std::size_t r = 0; r < ranges; ++r) {
      auto g = lines.next("range");
      Range range;
      g >> range.tensor >> range.lo >> range.hi;
      lines.check(g, "range");
      if (range.tensor >= m.tensors.size() || range.lo >= range.hi || range.hi > m.tensors[range.tensor].numel)
        lines.fail("a range outside its tensor");
      if (!add_elements(elements, range.hi - range.lo))
        lines.fail("ranges whose element count overflows 64-bit byte sizes");
      rank.ranges.push_back(range);
    }
    for (StateFile& file : rank.files)
      read_state_file(lines, m, static_cast<int>(i), rank, static_cast<StateKind>(&file - rank.files.data()),
                      elements, file);
    m.ranks.push_back(std::move(rank));
  }
}

}  // namespace

Manifest parse(const std::string& text, const std::string& path) {
  const std::size_t end = check_version_and_checksum(text, path);
  ManifestLines lines(text.substr(0, end), path);
  Manifest m;
  read_run(lines, m);
  read_optimizer_groups(lines, m, static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')));
  read_chunk_bytes(lines, m);
  read_tensors(lines, m);
  read_ranks(lines, m);
  check_ranges_tile_tensors(m, path, lines.number());
  return m;
}

Manifest read_manifest(const std::string& dir) {
  const std::string path = join_path(dir, kManifestName);
  return parse(read_regular_file(path, kMaxManifestBytes, "checkpoint manifest"), path);
}

Manifest read_manifest(const Directory& dir) {
  return parse(read_regular_file(dir, kManifestName, kMaxManifestBytes, "checkpoint manifest"),
               dir.path_of(kManifestName));
}

namespace {

// open_regular of `name` relative to `at`, its problem thrown as the checkpoint's errors; `shown`
// is its path for messages.
UniqueFd open_regular_or_throw(int at, const std::string& name, const std::string& shown, const std::string& what,
                               bool follow) {
  FileProblem problem;
  UniqueFd fd = open_regular(at, name, follow, problem);
  if (problem.kind == FileProblem::Kind::not_regular)
    throw Error(
        fmt::format("{} {} is {}, not a regular file: zest does not read it; give a checkpoint written by Engine::save",
                    what, shown, problem.file_kind));
  if (problem) throw IoError(std::string("cannot open ").append(what), shown, 0, 0, problem.error);
  return fd;
}

std::string read_whole_or_throw(const UniqueFd& fd, const std::string& path, std::uint64_t max_bytes,
                                const std::string& what) {
  FileProblem problem;
  std::string text = read_whole(fd.get(), max_bytes, problem);
  switch (problem.kind) {
    case FileProblem::Kind::none:
      return text;
    case FileProblem::Kind::too_large:
      throw Error(fmt::format("{} {} has {} bytes, more than the {} zest reads: it is damaged or not what zest wrote",
                              what, path, problem.size, max_bytes));
    case FileProblem::Kind::grew:
      throw Error(fmt::format("{} {} grew past {} bytes while it was read: it is damaged or not what zest wrote", what,
                              path, max_bytes));
    case FileProblem::Kind::system:
    case FileProblem::Kind::not_regular:
      break;
  }
  throw IoError(std::string("cannot read ").append(what), path, problem.size, 0, problem.error);
}

}  // namespace

UniqueFd open_regular_file(const std::string& path, const std::string& what) {
  return open_regular_or_throw(AT_FDCWD, path, path, what, true);
}

std::string read_regular_file(const std::string& path, std::uint64_t max_bytes, const std::string& what) {
  return read_whole_or_throw(open_regular_or_throw(AT_FDCWD, path, path, what, true), path, max_bytes, what);
}

std::string read_regular_file(const Directory& dir, const std::string& name, std::uint64_t max_bytes,
                              const std::string& what) {
  const std::string path = dir.path_of(name);
  return read_whole_or_throw(open_regular_or_throw(dir.fd(), name, path, what, false), path, max_bytes, what);
}

FileWriter::FileWriter(std::string path, std::uint64_t chunk_bytes)
    : FileWriter(AT_FDCWD, path, path.c_str(), chunk_bytes) {}

FileWriter::FileWriter(const Directory& dir, const std::string& name, std::uint64_t chunk_bytes)
    : FileWriter(dir.fd(), dir.path_of(name), name.c_str(), chunk_bytes) {}

FileWriter::FileWriter(int at, std::string path, const char* name, std::uint64_t chunk_bytes)
    : path_(std::move(path)), chunk_bytes_(chunk_bytes), fd_(create_exclusive(at, name, path_)) {
  identity_ = identity_of(fd_, path_);
}

void FileWriter::append(const void* data, std::size_t bytes) {
  // Checksummed per chunk: a chunk's CRC closes when the file reaches its end.
  const char* in = static_cast<const char*>(data);
  const std::uint64_t start = bytes_;
  for (std::size_t at = 0; at < bytes;) {
    const std::size_t room = static_cast<std::size_t>(chunk_bytes_ - bytes_ % chunk_bytes_);
    const std::size_t take = std::min(room, bytes - at);
    crc_ = offload::crc32c(in + at, take, crc_);
    bytes_ += take;
    at += take;
    if (bytes_ % chunk_bytes_ == 0) {
      crcs_.push_back(crc_);
      crc_ = 0;
    }
  }
  write_all(fd_, path_, data, bytes, start);
}

void FileWriter::finish() {
  if (bytes_ % chunk_bytes_ != 0) crcs_.push_back(crc_);
  sync_and_close(fd_, path_, bytes_);
}

}  // namespace zest::checkpoint
