// The step's trace: what ran when, on which lane, in each rank (--trace FILE of the programs).
//
// One recorder per process (a rank), off by default. Off, a span costs one relaxed load and one
// predictable branch. On (start), events go into an array of fixed capacity allocated at start:
// a slot is taken with one atomic increment from any thread, filled, and published with a release
// store; events past the capacity are counted as dropped, never allocated. runtime/comm/trace_file.cpp
// starts it and writes every rank's events as one Chrome trace (chrome://tracing, Perfetto).
//
// An event is a complete span ("ph":"X"): a name (a string literal: only the pointer is kept), a
// lane (the trace's "tid"), a begin and a duration, and optionally one number shown as its "n"
// (a bucket, a sub-group, a group). Spans that overlap on one lane must nest, except on the lanes
// whose spans are transfers in flight (nvme read, nvme write): those take one of a few tracks of
// the lane at begin() so that overlapping transfers lie side by side.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace zest::trace {

enum class Lane : std::uint8_t {
  backward,      // the trainer's thread during backward: gradients handed to the engine
  host,          // the trainer's thread: step() and its phases, the optimizer's pipeline
  comm_stream,   // the engine's stream: reductions, the all-gather, device math
  copy_stream,   // the offloaded optimizer's copy streams (parameters up to the device)
  update_ahead,  // offload.optimizer.update_ahead's thread: sub-groups updated during backward
  nvme_read,     // NVMe transfers, submission to completion
  nvme_write,
};
inline constexpr int kLaneCount = 7;
// The most events start() allocates room for: 2^24 of 40 bytes, 640 MiB per rank.
inline constexpr std::size_t kMaxCapacity = std::size_t{1} << 24;
inline constexpr int kTracksPerLane = 8;  // transfers side by side on the nvme lanes
const char* lane_name(Lane lane) noexcept;

struct Event {
  const char* name = nullptr;
  std::int64_t begin_ns = 0;  // since start()
  std::int64_t duration_ns = 0;
  std::int64_t arg = -1;      // shown as args.n when >= 0
  std::uint16_t tid = 0;      // lane * kTracksPerLane + track
  std::atomic<bool> ready{false};
};

namespace detail {
extern std::atomic<bool> recording;
}

// True while recording. The one branch a span costs when tracing is off.
inline bool on() noexcept { return detail::recording.load(std::memory_order_relaxed); }
std::int64_t now_ns() noexcept;  // since start()

// Allocates room for `capacity` events (or reuses the last start's room of that size) and starts
// recording; clears what an earlier recording held. Call it with no span of an earlier recording
// still open on another thread. Throws zest::Error while recording already (one trace at a time
// per process, also when two threads start at once) or for a capacity of 0 or past kMaxCapacity.
void start(std::size_t capacity);
// Stops recording. Events still being filled by other threads are left out of what follows.
void stop() noexcept;
// Every published event as Chrome trace JSON objects, comma-separated (no brackets), with "pid"
// `pid`, plus the metadata events naming the process ("rank <pid>") and the lanes it used. Call
// after stop().
std::string events_json(int pid);
std::size_t dropped() noexcept;   // events past the capacity since start()
std::size_t capacity() noexcept;  // of the last start()

// A slot for an event whose begin and end are set by different calls (or threads): null when
// not recording or full (then counted as dropped). `track` picks the lane's track (< kTracksPerLane).
Event* reserve(const char* name, Lane lane, std::int64_t arg, int track = 0) noexcept;
// Sets the duration (now - begin) and publishes it.
void finish(Event* event) noexcept;

// A transfer in flight on an nvme lane: takes a free track of the lane at begin, gives it back at
// end. Either may run on any thread; end() of a null span does nothing.
Event* begin_transfer(const char* name, Lane lane, std::int64_t arg) noexcept;
void end_transfer(Event* event) noexcept;

// A span on the calling thread, from construction to destruction.
class Span {
 public:
  explicit Span(const char* name, Lane lane, std::int64_t arg = -1) noexcept {
    if (on()) open(name, lane, arg);
  }
  ~Span() { end(); }
  // Ends the span before the scope does (a phase of a longer function).
  void end() noexcept {
    if (event_ != nullptr) finish(std::exchange(event_, nullptr));
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  void open(const char* name, Lane lane, std::int64_t arg) noexcept;
  Event* event_ = nullptr;
};

}  // namespace zest::trace
