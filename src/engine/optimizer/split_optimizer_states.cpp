#include "engine/optimizer/split_optimizer_states.hpp"

#include <algorithm>
#include <utility>

namespace zest::engine {
namespace {

// The group cut by the boundary has parameters updated by both parts. Where they go to the host
// (stage 3's offloaded parameters), its buffer must be asked for once and declared complete once:
// the device part's end_update is held back until the offloaded part, which runs after it, ends it.
class JoinedSink final : public HostParamSink {
 public:
  JoinedSink(HostParamSink* sink, int cut) : sink_(sink), cut_(cut) {}
  void* begin_update(int group) override {
    if (group != cut_) return sink_->begin_update(group);
    if (!cut_buffer_) cut_buffer_ = sink_->begin_update(group);
    return cut_buffer_;
  }
  void end_update(int group) override {
    if (group == cut_ && !cut_half_done_) {
      cut_half_done_ = true;
      return;
    }
    sink_->end_update(group);
  }

 private:
  HostParamSink* sink_;
  const int cut_;
  void* cut_buffer_ = nullptr;
  bool cut_half_done_ = false;
};

int cut_group(const Layout& layout, std::size_t boundary) {
  for (int g = 0; g < layout.group_count(); ++g) {
    const auto& place = layout.group(g);
    if (place.shard_offset < boundary && boundary < place.shard_offset + place.shard) return g;
  }
  return -1;
}

}  // namespace

SplitOptimizerStates::SplitOptimizerStates(const Layout& layout, Stream& stream,
                                           std::unique_ptr<DeviceOptimizerStates> on_device,
                                           std::unique_ptr<OffloadedOptimizer> offloaded, std::size_t boundary)
    : stream_(stream),
      on_device_(std::move(on_device)),
      offloaded_(std::move(offloaded)),
      boundary_(boundary),
      cut_group_(cut_group(layout, boundary)) {}

template <class F>
void SplitOptimizerStates::for_each_part(std::size_t offset, std::size_t count, F f) {
  const std::size_t end = offset + count, cut = std::clamp(boundary_, offset, end);
  if (offset < cut) f(*on_device_, offset, cut - offset, std::size_t{0});
  if (cut < end) f(*offloaded_, cut, end - cut, cut - offset);
}

void SplitOptimizerStates::write_master(std::size_t offset, const float* values, std::size_t count) {
  for_each_part(offset, count, [&](OptimizerStates& part, std::size_t at, std::size_t n, std::size_t first) {
    part.write_master(at, values + first, n);
  });
}

void SplitOptimizerStates::read_master(std::size_t offset, float* values, std::size_t count) {
  for_each_part(offset, count, [&](OptimizerStates& part, std::size_t at, std::size_t n, std::size_t first) {
    part.read_master(at, values + first, n);
  });
}

void SplitOptimizerStates::visit_states(std::size_t offset, std::size_t count, bool write_back,
                                        const StatesVisit& visit) {
  for_each_part(offset, count, [&](OptimizerStates& part, std::size_t at, std::size_t n, std::size_t first) {
    part.visit_states(at, n, write_back, [&](float* master, float* m, float* v, std::size_t piece, std::size_t k) {
      visit(master, m, v, first + piece, k);
    });
  });
}

void SplitOptimizerStates::step(std::span<const StepGroup> groups, const optim::AdamStepArgs& args,
                                HostParamSink* sink) {
  offloaded_->check_usable();  // before the device part moves on a step the other would refuse
  JoinedSink joined(sink, cut_group_);
  HostParamSink* const parts_sink = sink ? &joined : nullptr;
  on_device_->step(groups, args, parts_sink);  // launched on the stream
  try {
    offloaded_->step(groups, args, parts_sink);
  } catch (...) {
    stream_.synchronize();  // the device part's work refers to the step's buffers
    throw;
  }
  stream_.synchronize();
}

}  // namespace zest::engine
