#include "runtime/device/stream_span.hpp"

namespace zest {

StreamSpan::StreamSpan(Stream& stream, const char* name, trace::Lane lane, std::int64_t arg) : stream_(stream) {
  if (!trace::on()) return;
  event_ = trace::reserve(name, lane, arg);
  if (event_ == nullptr) return;
  trace::Event* event = event_;
  stream_.host_task([event] { event->begin_ns = trace::now_ns(); });
}

StreamSpan::~StreamSpan() {
  if (event_ == nullptr) return;
  trace::Event* event = event_;
  try {
    stream_.host_task([event] { trace::finish(event); });
  } catch (...) {
    // The span is lost, not the work: a destructor cannot report it.
  }
}

}  // namespace zest
