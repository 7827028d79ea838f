// What every rank of a communicator must share (the settings that decide its collectives and its
// update), checked in one collective: a mismatch fails at once on every rank, naming the key and
// two ranks' values, instead of a hang until comm.timeout or a silent per-rank difference.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "zest/communicator.hpp"

namespace zest {

struct SharedValue {
  std::string key;    // as the user names it: "optimizer.lr", "the model's parameters"
  std::string value;  // its text on this rank; compared whole, quoted in the error up to 120 bytes
};

// Collective over host memory: every rank calls it with the same keys in the same order (their
// count included). Throws Error on every rank naming `who`, the first key whose value differs, a
// rank whose value is rank 0's and one whose value is not, and the fix. Two host all-reduces when
// they differ, one otherwise.
void require_same_on_ranks(Communicator& comm, std::span<const SharedValue> values, std::string_view who);

}  // namespace zest
