// StreamSpan: a span of the step's trace (base/trace.hpp) timed when a stream runs the work, not
// when the host enqueues it: the reductions and the all-gather on the comm stream, the copies.
#pragma once

#include <cstdint>

#include "base/trace.hpp"
#include "zest/device.hpp"

namespace zest {

// The work enqueued on `stream` during this object's life, as one span timed when the stream
// runs it (a host task marks its begin and one its end: on cpu the stream's worker thread, on
// cuda a host function between the kernels). Costs nothing but a branch while not recording.
class StreamSpan {
 public:
  StreamSpan(Stream& stream, const char* name, trace::Lane lane, std::int64_t arg = -1);
  ~StreamSpan();
  StreamSpan(const StreamSpan&) = delete;
  StreamSpan& operator=(const StreamSpan&) = delete;

 private:
  Stream& stream_;
  trace::Event* event_ = nullptr;
};

}  // namespace zest
