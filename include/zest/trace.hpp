// TraceFile: what ran when in each rank's steps, as ONE Chrome trace file (JSON, "pid" the rank,
// "tid" the lane; chrome://tracing and https://ui.perfetto.dev open it): the --trace FILE of
// zest-train, zest-gpt and `zest bench step`, and zest.torch.Optimizer(..., trace=FILE).
//
// Lanes: backward (the trainer's forward + backward, each gradient handed over), host (step() and
// its phases, the offloaded optimizer's sub-groups and Adam), comm stream (each bucket's
// reduction, the all-gather, stage 3's gathers: timed when the stream runs them), copy stream
// (parameters uploaded),
// update ahead (offload.optimizer.update_ahead's thread), nvme read / nvme write (each transfer, from
// submission to completion). Recording is off unless a TraceFile lives; off, a span costs a branch.
// The events are kept in room for `capacity` of them per rank, allocated here: the recorder
// allocates nothing inside a step, and events past it are dropped and counted in otherData.
//
// The file is the user's name: rank 0 creates it exclusively (O_EXCL | O_NOFOLLOW) before any
// work, so an existing file is refused and never touched; the events reach rank 0 through the
// communicator's host all-reduce (no shared directory needed, no temporary parts); and a trace
// never written (the run failed) removes only the empty file it created.
#pragma once

#include <cstddef>
#include <string>

#include "zest/communicator.hpp"

namespace zest {

class TraceFile {
 public:
  // Enough for hundreds of steps of a small model: 2^18 events of 40 bytes (10 MiB) per rank.
  static constexpr std::size_t kDefaultCapacity = std::size_t{1} << 18;

  // Collective over `comm`, which must outlive this. `option` names the flag or argument in
  // errors (e.g. "--trace"). Throws zest::Error on every rank when rank 0 cannot create `path`
  // (it exists, or its directory is missing), or when a trace is already recording; and for a
  // capacity of 0 or past trace::kMaxCapacity (2^24 events), before any file is made.
  TraceFile(std::string path, Communicator& comm, std::string option = "--trace",
            std::size_t capacity = kDefaultCapacity);
  // Not written: stops recording and removes the file this created (if it is still that file).
  ~TraceFile();
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;

  // Collective: stops recording, brings every rank's events to rank 0, which writes the file.
  // Rank 0 writes each rank's events as they arrive, holding one 256 KiB chunk at a time. Returns
  // the events dropped over all ranks (past the capacity; also in the file's otherData). Once only.
  // When rank 0's write fails, every rank throws (rank 0 an IoError, the others an Error naming
  // rank 0's failure) and what was written is removed.
  std::size_t write();
  // Collective: drops what was recorded so far and records anew, every rank's clock restarted after
  // a barrier (zest bench step: the timed steps only). Call it with nothing in flight: the streams
  // synchronized, no transfer running.
  void restart();
  const std::string& path() const { return path_; }

 private:
  void discard() noexcept;

  std::string path_;
  std::string option_;
  Communicator& comm_;
  std::size_t capacity_;
  int fd_ = -1;  // rank 0's, until written
  bool written_ = false;
};

}  // namespace zest
