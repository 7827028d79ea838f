#include "engine/optimizer/optimizer_states.hpp"

#include <string>

#include <fmt/core.h>

#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::engine {

void visit_laid_out(const optim::StatesLayout& layout, char* base, std::size_t at, std::size_t n, std::size_t first,
                    bool write_back, const OptimizerStates::StatesVisit& visit, std::vector<float>& scratch,
                    float* master) {
  if (at > layout.count() || n > layout.count() - at)
    throw Error(fmt::format("optimizer states: elements [{}, {}) outside the piece's {}", at, at + n, layout.count()));
  if (layout.master_here() == (master != nullptr))
    throw Error("optimizer states: give the master exactly where the layout does not hold it; this is a zest bug");
  // The master of element `at`, in the layout or given.
  if (layout.master_here()) master = layout.master(base) + at;
  if (layout.form().plain()) {
    visit(master, reinterpret_cast<float*>(layout.m(base)) + at, reinterpret_cast<float*>(layout.v(base)) + at, first,
          n);
    return;
  }
  const bool bf16_master = layout.form().master == DType::bf16;
  scratch.resize(3 * kVisitChunk);
  float* const m = scratch.data();
  float* const v = m + kVisitChunk;
  float* const wide_master = v + kVisitChunk;  // a bf16 master widened
  static_assert(kVisitChunk % optim::kInt8Block == 0);
  // Whole blocks: an int8 block's scale is its largest element, so it is narrowed with all of them.
  const std::size_t end = at + n;
  for (std::size_t lo = at / optim::kInt8Block * optim::kInt8Block; lo < end; lo += kVisitChunk) {
    const std::size_t hi = std::min(lo + kVisitChunk, layout.count());
    const optim::CpuAdam::CompactStates states = layout.moments(base, lo, hi - lo);
    optim::widen_moments(states, m, v);
    std::uint16_t* const bf16 = bf16_master ? layout.bf16_master(base) + lo : nullptr;
    if (bf16_master)
      for (std::size_t i = 0; i < hi - lo; ++i) wide_master[i] = bf16_to_float(bf16[i]);
    const std::size_t from = std::max(lo, at), to = std::min(hi, end);
    float* const p = bf16_master ? wide_master + (from - lo) : master + (from - at);
    visit(p, m + (from - lo), v + (from - lo), first + (from - at), to - from);
    if (!write_back) continue;
    optim::narrow_moments(m, v, states);
    // A value the caller set is rounded to the nearest bf16 (a widened one comes back unchanged).
    if (bf16_master)
      for (std::size_t i = 0; i < hi - lo; ++i) bf16[i] = float_to_bf16(wide_master[i]);
  }
}

}  // namespace zest::engine
