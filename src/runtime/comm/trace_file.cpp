#include "zest/trace.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "base/text.hpp"
#include "base/trace.hpp"
#include "zest/error.hpp"

namespace zest {

namespace {

// Host all-reduces move this many int64 words (256 KiB) of a rank's events at a time; every other
// rank adds zeros.
constexpr std::size_t kChunkWords = 1 << 15;

// Rank 0 writes what the ranks send it into the file as it arrives, so it holds one chunk at a
// time however many ranks there are. After a failed write it keeps taking part in the collectives
// (the other ranks go on sending) and reports the first failure at the end.
class RankZeroWriter {
 public:
  RankZeroWriter(int fd, const std::string& path) : fd_(fd), path_(path) {}
  void write(const char* data, std::size_t n) {
    for (std::size_t done = 0; done < n && error_ == 0;) {
      const ssize_t w = ::write(fd_, data + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        error_ = errno;
        at_ = written_ + done;
        return;
      }
      done += static_cast<std::size_t>(w);
      if (done == n) written_ += n;
    }
  }
  void write(const std::string& text) { write(text.data(), text.size()); }
  void sync() {
    if (error_ == 0 && ::fsync(fd_) != 0) {
      error_ = errno;
      at_ = written_;
    }
  }
  int error() const { return error_; }
  // Throws the first failure as an IoError.
  void check() const {
    if (error_ != 0) throw IoError("writing the trace", path_, at_, 0, error_);
  }

 private:
  int fd_;
  const std::string& path_;
  int error_ = 0;
  std::size_t written_ = 0, at_ = 0;
};

// Rank `from`'s `text` (`length` bytes) to rank 0's `out`. Collective.
void send_to_rank0(Communicator& comm, int from, const std::string& text, std::size_t length, RankZeroWriter* out) {
  std::vector<std::int64_t> words(kChunkWords);
  const std::size_t chunk = kChunkWords * sizeof(std::int64_t);
  for (std::size_t at = 0; at < length; at += chunk) {
    const std::size_t n = std::min(chunk, length - at);
    std::fill(words.begin(), words.end(), 0);
    if (comm.rank() == from) std::memcpy(words.data(), text.data() + at, n);
    if (from != 0) comm.all_reduce_host(std::span<std::int64_t>(words.data(), (n + 7) / 8), ReduceOp::sum);
    if (out) out->write(reinterpret_cast<const char*>(words.data()), n);
  }
}

}  // namespace

TraceFile::TraceFile(std::string path, Communicator& comm, std::string option, std::size_t capacity)
    : path_(std::move(path)), option_(std::move(option)), comm_(comm), capacity_(capacity) {
  // The same on every rank (every rank is given the same capacity): refused before any file exists.
  if (capacity_ == 0 || capacity_ > trace::kMaxCapacity)
    throw Error(fmt::format("{}: room for {} events per rank; give 1 to {}", option_, capacity_, trace::kMaxCapacity));
  // Every rank learns what rank 0 found, so none goes on alone and all say the same: the ranks
  // already recording, and rank 0's errno creating the file.
  std::array<std::int64_t, 2> status{trace::on() ? 1 : 0, 0};
  if (comm_.rank() == 0 && status[0] == 0) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ < 0) status[1] = errno;
  }
  comm_.all_reduce_host(status, ReduceOp::sum);
  if (status[0] != 0 || status[1] != 0) {
    discard();
    const std::string named = fmt::format("{} {}: ", option_, in_quotes(path_));
    if (status[0] != 0)
      throw Error(fmt::format("{}a trace is already recording (on {} rank(s)); one trace at a time per process", named,
                              status[0]));
    const auto error = static_cast<int>(status[1]);
    throw Error(named + (error == EEXIST ? std::string("the file exists, and zest writes a new file only; remove it "
                                                       "or name another")
                                         : std::string("rank 0 cannot create it: ") + std::strerror(error) +
                                               "; name a file in an existing, writable directory"));
  }
  try {
    trace::start(capacity_);  // after the all-reduce: every rank's clock starts within a collective's skew
  } catch (...) {
    discard();  // another thread's trace began in between, or the room could not be had
    throw;
  }
}

TraceFile::~TraceFile() {
  if (!written_) trace::stop();
  discard();
}

// Removes the file this created (empty, or written in part), unless someone has put another one at
// its name since.
void TraceFile::discard() noexcept {
  if (fd_ < 0) return;
  struct stat mine {}, there {};
  if (::fstat(fd_, &mine) == 0 && ::lstat(path_.c_str(), &there) == 0 && mine.st_dev == there.st_dev &&
      mine.st_ino == there.st_ino)
    ::unlink(path_.c_str());
  ::close(std::exchange(fd_, -1));
}

void TraceFile::restart() {
  if (written_) throw Error(option_ + ": the trace was written already; a TraceFile records once");
  trace::stop();
  comm_.barrier();  // every rank's clock starts anew within a collective's skew, as in the constructor
  trace::start(capacity_);
}

std::size_t TraceFile::write() {
  if (written_) throw Error(option_ + ": the trace was written already; a TraceFile writes once");
  trace::stop();
  written_ = true;
  const int ranks = comm_.size(), rank = comm_.rank();
  const std::string mine = trace::events_json(rank);
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(ranks), 0), dropped(lengths);
  lengths[static_cast<std::size_t>(rank)] = static_cast<std::int64_t>(mine.size());
  dropped[static_cast<std::size_t>(rank)] = static_cast<std::int64_t>(trace::dropped());
  comm_.all_reduce_host(lengths, ReduceOp::sum);
  comm_.all_reduce_host(dropped, ReduceOp::sum);
  std::size_t total_dropped = 0;
  for (const std::int64_t d : dropped) total_dropped += static_cast<std::size_t>(d);

  std::optional<RankZeroWriter> out;
  if (rank == 0) {
    out.emplace(fd_, path_);
    out->write(R"({"displayTimeUnit":"ms","traceEvents":[)");
  }
  for (int r = 0; r < ranks; ++r) {
    if (out && r > 0) out->write(",\n");
    send_to_rank0(comm_, r, mine, static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]),
                  out ? &*out : nullptr);
  }
  if (out) {
    const nlohmann::ordered_json other = {{"writer", "zest"},
                                          {"ranks", ranks},
                                          {"capacity_per_rank", trace::capacity()},
                                          {"dropped_events", total_dropped},
                                          {"dropped_events_per_rank", dropped}};
    out->write("],\n\"otherData\":" + other.dump() + "}\n");
    out->sync();
  }
  // Every rank learns whether rank 0 wrote the file, and fails with it.
  std::array<std::int64_t, 1> failed{out ? out->error() : 0};
  comm_.all_reduce_host(failed, ReduceOp::sum);
  if (failed[0] != 0) {
    discard();  // a trace written in part is no trace
    if (out) out->check();
    throw Error(fmt::format("{} {}: rank 0 could not write the trace: {}", option_, in_quotes(path_),
                            std::strerror(static_cast<int>(failed[0]))));
  }
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  return total_dropped;
}

}  // namespace zest
