#include "base/trace.hpp"

#include <array>
#include <chrono>
#include <memory>
#include <set>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "zest/error.hpp"

namespace zest::trace {

namespace detail {
std::atomic<bool> recording{false};
}

namespace {

// Held from start() to stop(): start() claims it in one step, so of two threads starting at once
// one is refused (`recording` itself is set only once the room is ready).
std::atomic<bool> claimed{false};

using Clock = std::chrono::steady_clock;

// Written by start() alone, while nothing records; read by the recording threads after they saw
// `recording` set (acquire), and by events_json after stop().
struct Recorder {
  std::unique_ptr<Event[]> events;
  std::size_t capacity = 0;
  Clock::time_point epoch;
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> dropped{0};
  std::array<std::atomic<std::uint32_t>, kLaneCount> busy_tracks{};  // a bit per track in use
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

constexpr std::array<const char*, kLaneCount> kLaneNames = {
    "backward", "host", "comm stream", "copy stream", "update ahead", "nvme read", "nvme write"};

// "1234.567": microseconds with the nanoseconds, as Chrome traces count time.
void append_us(std::string& out, std::int64_t ns) {
  if (ns < 0) {
    out += '-';
    ns = -ns;
  }
  const std::string frac = std::to_string(1000 + ns % 1000);
  out.append(std::to_string(ns / 1000)).append(".").append(frac, 1, 3);
}

// The events are written one at a time (a document of them all would hold each event several times
// over); their strings are escaped by the JSON library every writer uses.
void append_quoted(std::string& out, const char* text) { out += nlohmann::json(std::string(text)).dump(); }

std::string track_name(std::uint16_t tid) {
  const int lane = tid / kTracksPerLane, track = tid % kTracksPerLane;
  std::string name = kLaneNames[static_cast<std::size_t>(lane)];
  const auto l = static_cast<Lane>(lane);
  if (l == Lane::nvme_read || l == Lane::nvme_write) name.append(" ").append(std::to_string(track));
  return name;
}

}  // namespace

const char* lane_name(Lane lane) noexcept { return kLaneNames[static_cast<std::size_t>(lane)]; }

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - recorder().epoch).count();
}

void start(std::size_t capacity) {
  if (capacity == 0 || capacity > kMaxCapacity)
    throw Error(fmt::format("trace: a capacity of {} events; give 1 to {}", capacity, kMaxCapacity));
  bool expected = false;
  if (!claimed.compare_exchange_strong(expected, true, std::memory_order_acq_rel))
    throw Error("trace: already recording (one trace at a time per process); write or stop the first one");
  Recorder& r = recorder();
  if (r.capacity == capacity) {
    for (std::size_t i = 0; i < capacity; ++i) r.events[i].ready.store(false, std::memory_order_relaxed);
  } else {
    try {
      r.events = std::make_unique<Event[]>(capacity);
    } catch (...) {
      r.capacity = 0;  // the old room is gone either way
      claimed.store(false, std::memory_order_release);
      throw;
    }
    r.capacity = capacity;
  }
  r.next.store(0, std::memory_order_relaxed);
  r.dropped.store(0, std::memory_order_relaxed);
  for (auto& bits : r.busy_tracks) bits.store(0, std::memory_order_relaxed);
  r.epoch = Clock::now();
  detail::recording.store(true, std::memory_order_release);
}

void stop() noexcept {
  detail::recording.store(false, std::memory_order_release);
  claimed.store(false, std::memory_order_release);
}

std::size_t dropped() noexcept { return recorder().dropped.load(std::memory_order_relaxed); }
std::size_t capacity() noexcept { return recorder().capacity; }

Event* reserve(const char* name, Lane lane, std::int64_t arg, int track) noexcept {
  if (!detail::recording.load(std::memory_order_acquire)) return nullptr;
  Recorder& r = recorder();
  const std::size_t i = r.next.fetch_add(1, std::memory_order_relaxed);
  if (i >= r.capacity) {
    r.dropped.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  Event& e = r.events[i];
  e.name = name;
  e.arg = arg;
  e.tid = static_cast<std::uint16_t>(static_cast<int>(lane) * kTracksPerLane + track);
  e.begin_ns = now_ns();
  return &e;
}

void finish(Event* event) noexcept {
  event->duration_ns = now_ns() - event->begin_ns;
  event->ready.store(true, std::memory_order_release);
}

Event* begin_transfer(const char* name, Lane lane, std::int64_t arg) noexcept {
  if (!on()) return nullptr;
  // The lowest free track; with every track busy the last one is shared (its spans then overlap).
  std::atomic<std::uint32_t>& busy = recorder().busy_tracks[static_cast<std::size_t>(lane)];
  std::uint32_t bits = busy.load(std::memory_order_relaxed);
  int track = kTracksPerLane - 1;
  for (int t = 0; t < kTracksPerLane - 1; ++t) {
    const std::uint32_t bit = 1u << t;
    if ((bits & bit) != 0) continue;
    if (busy.compare_exchange_weak(bits, bits | bit, std::memory_order_relaxed)) {
      track = t;
      break;
    }
    t = -1;  // `bits` was reloaded: look again from the first track
  }
  Event* event = reserve(name, lane, arg, track);
  if (event == nullptr && track < kTracksPerLane - 1) busy.fetch_and(~(1u << track), std::memory_order_relaxed);
  return event;
}

void end_transfer(Event* event) noexcept {
  if (event == nullptr) return;
  const int lane = event->tid / kTracksPerLane, track = event->tid % kTracksPerLane;
  finish(event);
  if (track < kTracksPerLane - 1)
    recorder().busy_tracks[static_cast<std::size_t>(lane)].fetch_and(~(1u << track), std::memory_order_relaxed);
}

void Span::open(const char* name, Lane lane, std::int64_t arg) noexcept { event_ = reserve(name, lane, arg); }

std::string events_json(int pid) {
  Recorder& r = recorder();
  const std::string p = std::to_string(pid);
  std::string out = R"({"ph":"M","name":"process_name","pid":)" + p + R"(,"tid":0,"args":{"name":"rank )" + p +
                    R"("}},{"ph":"M","name":"process_sort_index","pid":)" + p + R"(,"tid":0,"args":{"sort_index":)" +
                    p + "}}";
  std::set<std::uint16_t> tids;
  const std::size_t n = std::min(r.next.load(std::memory_order_acquire), r.capacity);
  for (std::size_t i = 0; i < n; ++i) {
    const Event& e = r.events[i];
    if (!e.ready.load(std::memory_order_acquire)) continue;
    tids.insert(e.tid);
    out.append(R"(,{"ph":"X","name":)");
    append_quoted(out, e.name);
    out.append(R"(,"pid":)").append(p).append(R"(,"tid":)").append(std::to_string(e.tid)).append(R"(,"ts":)");
    append_us(out, e.begin_ns);
    out.append(R"(,"dur":)");
    append_us(out, e.duration_ns);
    if (e.arg >= 0) out.append(R"(,"args":{"n":)").append(std::to_string(e.arg)).append("}");
    out += '}';
  }
  for (const std::uint16_t tid : tids) {
    const std::string t = std::to_string(tid);
    out.append(R"(,{"ph":"M","name":"thread_name","pid":)").append(p).append(R"(,"tid":)").append(t)
        .append(R"(,"args":{"name":)");
    append_quoted(out, track_name(tid).c_str());
    out.append(R"(}},{"ph":"M","name":"thread_sort_index","pid":)").append(p).append(R"(,"tid":)").append(t)
        .append(R"(,"args":{"sort_index":)").append(t).append("}}");
  }
  return out;
}

}  // namespace zest::trace
