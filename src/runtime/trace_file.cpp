#include "zest/trace.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "base/text.hpp"
#include "base/trace.hpp"
#include "zest/error.hpp"

namespace zest {

namespace {

// Host all-reduces move this many bytes at a time (as int64 words: every other rank adds zeros).
constexpr std::size_t kChunkWords = 1 << 15;

void write_all(int fd, const std::string& text, const std::string& path) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError("writing the trace", path, done, text.size() - done, errno);
    done += static_cast<std::size_t>(n);
  }
}

// Rank `from`'s `text` on rank 0 (the others get an empty string). Collective.
std::string bring_to_rank0(Communicator& comm, int from, const std::string& text, std::size_t length) {
  std::string out;
  std::vector<std::int64_t> words(kChunkWords);
  const std::size_t chunk = kChunkWords * sizeof(std::int64_t);
  for (std::size_t at = 0; at < length; at += chunk) {
    const std::size_t n = std::min(chunk, length - at);
    std::fill(words.begin(), words.end(), 0);
    if (comm.rank() == from) std::memcpy(words.data(), text.data() + at, n);
    if (from != 0) comm.all_reduce_host(std::span<std::int64_t>(words.data(), (n + 7) / 8), ReduceOp::sum);
    if (comm.rank() == 0) out.append(reinterpret_cast<const char*>(words.data()), n);
  }
  return out;
}

}  // namespace

TraceFile::TraceFile(std::string path, Communicator& comm, std::string option, std::size_t capacity)
    : path_(std::move(path)), option_(std::move(option)), comm_(comm), capacity_(capacity) {
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
    const std::string named = option_ + " " + in_quotes(path_) + ": ";
    if (status[0] != 0)
      throw Error(named + "a trace is already recording (on " + std::to_string(status[0]) +
                  " rank(s)); one trace at a time per process");
    const auto error = static_cast<int>(status[1]);
    throw Error(named + (error == EEXIST ? std::string("the file exists, and zest writes a new file only; remove it "
                                                       "or name another")
                                         : std::string("rank 0 cannot create it: ") + std::strerror(error) +
                                               "; name a file in an existing, writable directory"));
  }
  trace::start(capacity);  // after the all-reduce: every rank's clock starts within a collective's skew
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
  trace::start(capacity_);
}

std::size_t TraceFile::write() {
  if (written_) throw Error(option_ + ": the trace was written already; a TraceFile writes once");
  trace::stop();
  const int ranks = comm_.size(), rank = comm_.rank();
  const std::string mine = trace::events_json(rank);
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(ranks), 0), dropped(lengths);
  lengths[static_cast<std::size_t>(rank)] = static_cast<std::int64_t>(mine.size());
  dropped[static_cast<std::size_t>(rank)] = static_cast<std::int64_t>(trace::dropped());
  comm_.all_reduce_host(lengths, ReduceOp::sum);
  comm_.all_reduce_host(dropped, ReduceOp::sum);

  std::string text = R"({"displayTimeUnit":"ms","traceEvents":[)";
  for (int r = 0; r < ranks; ++r) {
    const std::string part = bring_to_rank0(comm_, r, mine, static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]));
    if (rank != 0) continue;
    if (r > 0) text.append(",\n");
    text.append(part);
  }
  std::size_t total_dropped = 0;
  std::string per_rank;
  for (const std::int64_t d : dropped) {
    total_dropped += static_cast<std::size_t>(d);
    per_rank.append(per_rank.empty() ? "" : ",").append(std::to_string(d));
  }
  written_ = true;
  if (rank != 0) return total_dropped;
  text.append("],\n\"otherData\":{\"writer\":\"zest\",\"ranks\":").append(std::to_string(ranks))
      .append(",\"capacity_per_rank\":").append(std::to_string(trace::capacity()))
      .append(",\"dropped_events\":").append(std::to_string(total_dropped))
      .append(",\"dropped_events_per_rank\":[").append(per_rank).append("]}}\n");
  try {
    write_all(fd_, text, path_);
    if (::fsync(fd_) != 0) throw IoError("writing the trace", path_, 0, text.size(), errno);
  } catch (...) {
    discard();  // a trace written in part is no trace
    throw;
  }
  ::close(std::exchange(fd_, -1));
  return total_dropped;
}

}  // namespace zest
