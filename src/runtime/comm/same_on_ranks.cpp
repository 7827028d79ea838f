#include "runtime/comm/same_on_ranks.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest {
namespace {

// A 63-bit FNV-1a of the key and the value: equal on two ranks iff (almost surely) both are.
std::int64_t digest(const SharedValue& v) {
  std::uint64_t hash = 1469598103934665603ull;
  const auto mix = [&](std::string_view text) {
    for (const char c : text) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    hash = (hash ^ 0xffu) * 1099511628211ull;  // a separator no text byte equals after the key
  };
  mix(v.key);
  mix(v.value);
  return static_cast<std::int64_t>(hash >> 1);
}

// Each rank's text of one value, gathered through a sum of slots that only their owners fill.
constexpr std::size_t kQuoted = 120;
constexpr std::size_t kSlot = (kQuoted + sizeof(std::int64_t)) / sizeof(std::int64_t);  // words, length first

std::vector<std::string> gather_texts(Communicator& comm, const std::string& mine) {
  const auto ranks = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> slots(ranks * kSlot, 0);
  std::int64_t* own = slots.data() + static_cast<std::size_t>(comm.rank()) * kSlot;
  const std::size_t length = std::min(mine.size(), kQuoted);
  own[0] = static_cast<std::int64_t>(mine.size());
  std::memcpy(own + 1, mine.data(), length);
  comm.all_reduce_host(slots, ReduceOp::sum);
  std::vector<std::string> texts;
  for (std::size_t r = 0; r < ranks; ++r) {
    const std::int64_t* slot = slots.data() + r * kSlot;
    const auto full = static_cast<std::size_t>(slot[0]);
    std::string text(reinterpret_cast<const char*>(slot + 1), std::min(full, kQuoted));
    if (full > kQuoted) text += fmt::format("... ({} bytes)", full);
    texts.push_back(std::move(text));
  }
  return texts;
}

}  // namespace

void require_same_on_ranks(Communicator& comm, std::span<const SharedValue> values, std::string_view who) {
  if (comm.size() == 1) return;
  // The largest digest and the largest negated one: equal magnitudes iff every rank has the same.
  // (Ranks listing different numbers of keys send buffers of different sizes: the communicator's
  // agreement on each collective's count reports that.)
  const std::size_t n = values.size();
  std::vector<std::int64_t> agreed(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    agreed[i] = digest(values[i]);
    agreed[n + i] = -agreed[i];
  }
  comm.all_reduce_host(agreed, ReduceOp::max);
  std::size_t differing = 0;
  while (differing < n && agreed[differing] == -agreed[n + differing]) ++differing;
  if (differing == n) return;
  const SharedValue& shared = values[differing];
  const std::vector<std::string> texts = gather_texts(comm, shared.value);
  std::size_t other = 1;
  while (other < texts.size() && texts[other] == texts[0]) ++other;
  std::string message = fmt::format("{}: {} differs between ranks: rank 0 has '{}'", who, shared.key, texts[0]);
  if (other < texts.size())
    message += fmt::format(", rank {} has '{}'", other, texts[other]);
  else
    message += fmt::format(" and so, as far as the first {} bytes show, do the others", kQuoted);
  message.append("; give every rank the same config (and the same model)");
  throw Error(message);
}

}  // namespace zest
