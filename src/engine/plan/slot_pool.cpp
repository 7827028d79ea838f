#include "engine/plan/slot_pool.hpp"

#include <algorithm>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::engine {

bool SlotPool::any_free() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.owner < 0; });
}

int SlotPool::take(int group) {
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].owner < 0) {
      slots_[i].free_after->synchronize();
      slots_[i].owner = group;
      return static_cast<int>(i);
    }
  }
  throw Error(fmt::format("Engine: every {} buffer is in use ({} of them); {}", what_, slots_.size(), remedy_));
}

}  // namespace zest::engine
