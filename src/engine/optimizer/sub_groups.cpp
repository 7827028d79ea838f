#include "engine/optimizer/sub_groups.hpp"

#include <algorithm>
#include <utility>

namespace zest::engine {

SubGroupList::SubGroupList(std::vector<SubGroupPlace> places) : list(std::move(places)) {
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto g = static_cast<std::size_t>(list[i].group);
    if (groups.size() <= g) groups.resize(g + 1, OfGroup{i, i});
    groups[g].end = i + 1;
  }
}

SubGroupAdam::SubGroupAdam(const optim::AdamHyperParams& initial, int threads, std::vector<int> cpus,
                           const HyperRuns& runs, DType dtype, const StatesOptions& states)
    : adam_(initial, threads, std::move(cpus)), runs_(runs), dtype_(dtype), states_(states) {}

void SubGroupAdam::update(const SubGroupPlace& sub, const char* from, char* to, const char* grad, char* out,
                          const optim::AdamStepArgs& args, std::span<const optim::AdamHyperParams> hyper) {
  const optim::StatesLayout place = layout(sub);
  const bool compact = states_.format != StatesFormat::f32;
  // An update ahead (from != to) reads the states at `from` and writes them at `to` in its one pass
  // (step_from, step_compact_from): no copy first.
  char* const source = const_cast<char*>(from);  // only read: StatesLayout's places are char*
  const std::size_t element = dtype_size(dtype_), stride = sub.count;
  for (std::size_t r = 0; r < runs_.size(); ++r) {
    const std::size_t lo = std::max(sub.offset, runs_[r].begin), hi = std::min(sub.offset + sub.count, runs_[r].end);
    if (lo >= hi) continue;
    const std::size_t at = lo - sub.offset, n = hi - lo;
    adam_.set_hyper(hyper[r]);
    float* const master = place.master(to);
    const optim::ConstTensorSpan g{grad + at * element, dtype_, n};
    // The parameters (fp32 ones too) are written in the update's pass, not copied from the master after it.
    const optim::TensorSpan low = out ? optim::TensorSpan{out + at * element, dtype_, n} : optim::TensorSpan{};
    const optim::CpuAdam::CompactRounding rounding = states_.rounding(sub.group, sub.in_group + at);
    if (states_.master == DType::bf16) {
      const std::span<std::uint16_t> p(place.bf16_master(to) + at, n);
      if (from == to)
        adam_.step_compact(p, place.moments(to, at, n), g, args, rounding, low);
      else
        adam_.step_compact_from({place.bf16_master(source) + at, place.moments(source, at, n)}, p,
                                place.moments(to, at, n), g, args, rounding, low);
      continue;
    }
    if (compact) {
      if (from == to)
        adam_.step_compact({master + at, n}, place.moments(to, at, n), g, args, rounding, low);
      else
        adam_.step_compact_from({place.master(source) + at, place.moments(source, at, n)}, {master + at, n},
                                place.moments(to, at, n), g, args, rounding, low);
      continue;
    }
    const std::span<float> p{master + at, n}, m{master + stride + at, n}, v{master + 2 * stride + at, n};
    const auto* const old = reinterpret_cast<const float*>(from);
    if (from == to)
      adam_.step(p, m, v, g, args, low);
    else
      adam_.step_from({old + at, old + stride + at, old + 2 * stride + at}, p, m, v, g, args, low);
  }
}

void SubGroupAdam::current_hyper(std::vector<optim::AdamHyperParams>& hyper) const {
  hyper.resize(runs_.size());
  for (std::size_t r = 0; r < runs_.size(); ++r) hyper[r] = *runs_[r].hyper;
}

}  // namespace zest::engine
