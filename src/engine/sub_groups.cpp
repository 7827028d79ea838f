#include "engine/sub_groups.hpp"

#include <algorithm>
#include <cstring>
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
                           const HyperRuns& runs, DType dtype)
    : adam_(initial, threads, std::move(cpus)), runs_(runs), dtype_(dtype) {}

void SubGroupAdam::update(const SubGroupPlace& sub, const float* from, float* to, const char* grad, char* out,
                          const optim::AdamStepArgs& args, std::span<const optim::AdamHyperParams> hyper) {
  const std::size_t element = dtype_size(dtype_), stride = sub.count;
  for (std::size_t r = 0; r < runs_.size(); ++r) {
    const std::size_t lo = std::max(sub.offset, runs_[r].begin), hi = std::min(sub.offset + sub.count, runs_[r].end);
    if (lo >= hi) continue;
    const std::size_t at = lo - sub.offset, n = hi - lo;
    adam_.set_hyper(hyper[r]);
    const std::span<float> master{to + at, n}, m{to + stride + at, n}, v{to + 2 * stride + at, n};
    const optim::ConstTensorSpan g{grad + at * element, dtype_, n};
    const optim::TensorSpan low =
        dtype_ == DType::f32 ? optim::TensorSpan{} : optim::TensorSpan{out + at * element, dtype_, n};
    if (from == to)
      adam_.step(master, m, v, g, args, low);
    else
      adam_.step_from({from + at, from + stride + at, from + 2 * stride + at}, master, m, v, g, args, low);
  }
  if (dtype_ == DType::f32 && out) std::memcpy(out, to, sub.count * sizeof(float));
}

void SubGroupAdam::current_hyper(std::vector<optim::AdamHyperParams>& hyper) const {
  hyper.resize(runs_.size());
  for (std::size_t r = 0; r < runs_.size(); ++r) hyper[r] = *runs_[r].hyper;
}

}  // namespace zest::engine
