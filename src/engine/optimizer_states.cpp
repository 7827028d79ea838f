#include "engine/optimizer_states.hpp"

namespace zest::engine {

void visit_laid_out(const optim::StatesLayout& layout, char* base, std::size_t at, std::size_t n, std::size_t first,
                    bool write_back, const OptimizerStates::StatesVisit& visit, std::vector<float>& scratch) {
  float* const master = layout.master(base);
  if (layout.format() == StatesFormat::f32) {
    visit(master + at, master + layout.count() + at, master + 2 * layout.count() + at, first, n);
    return;
  }
  scratch.resize(2 * kVisitChunk);
  float* const m = scratch.data();
  float* const v = m + kVisitChunk;
  static_assert(kVisitChunk % optim::kInt8Block == 0);
  // Whole blocks: an int8 block's scale is its largest element, so it is narrowed with all of them.
  const std::size_t end = at + n;
  for (std::size_t lo = at / optim::kInt8Block * optim::kInt8Block; lo < end; lo += kVisitChunk) {
    const std::size_t hi = std::min({lo + kVisitChunk, layout.count()});
    const optim::CpuAdam::CompactStates states = layout.moments(base, lo, hi - lo);
    optim::widen_moments(states, m, v);
    const std::size_t from = std::max(lo, at), to = std::min(hi, end);
    visit(master + from, m + (from - lo), v + (from - lo), first + (from - at), to - from);
    if (write_back) optim::narrow_moments(m, v, states);
  }
}

}  // namespace zest::engine
