#include "engine/plan/layout.hpp"

#include <algorithm>
#include <limits>
#include <set>
#include <string>

#include <fmt/core.h>

#include "checkpoint/format.hpp"
#include "zest/error.hpp"

namespace zest {

std::size_t ParamSpec::numel() const {
  // Bounded so that every byte count the engine derives from it (fp32 states, padding) fits too.
  constexpr std::size_t kLimit = std::numeric_limits<std::size_t>::max() / 64;
  std::size_t n = 1;
  for (std::size_t d : shape) {
    if (d != 0 && n > kLimit / d)
      throw Error(fmt::format(
          "ParamSpec: the shape of '{}' holds more than {} elements (its product overflows); check its dimensions",
          name, kLimit));
    n *= d;
  }
  return n;
}

namespace engine {
namespace {

std::size_t round_up(std::size_t n, std::size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// As ParamSpec::numel's: every byte count derived from the padded layout (fp32 states, update_ahead's
// second copy) fits in 64 bits.
constexpr std::size_t kMaxLayoutElements = std::numeric_limits<std::size_t>::max() / 64;

std::size_t checked_sum(std::size_t a, std::size_t b, int partitions) {
  std::size_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum) || sum > kMaxLayoutElements)
    throw Error(
        fmt::format("Engine: the parameters, each group padded to split into {} aligned shards, hold more than {} "
                    "elements; use fewer ranks or fewer, larger groups",
                    partitions, kMaxLayoutElements));
  return sum;
}

}  // namespace

std::size_t Layout::shard_begin(int g, int rank) const {
  return partitions_ == 1 ? 0 : static_cast<std::size_t>(rank) * group(g).shard;
}

Layout::ShardPart Layout::shard_part(std::size_t t, int rank) const {
  const TensorPlace& place = tensor(t);
  const std::size_t begin = shard_begin(place.group, rank);
  const std::size_t lo = std::max(place.offset, begin),
                    hi = std::min(place.offset + place.numel, begin + group(place.group).shard);
  return {begin, lo, std::max(lo, hi)};
}

Layout::Layout(const std::vector<ParamSpec>& params, int partitions) : partitions_(partitions) {
  if (params.empty()) throw Error("Engine: the parameter list is empty; register the model's parameters");
  if (partitions < 1) throw Error("Engine: partitions must be at least 1");
  tensors_.reserve(params.size());
  std::vector<bool> group_seen;
  std::set<std::string_view> names;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (const std::string problem = checkpoint::tensor_name_problem(p.name); !problem.empty())
      throw Error(fmt::format(
          "Engine: the name of parameter {} {}; give every tensor a name a checkpoint can hold (one line of text, not "
          "empty, at most {} bytes): checkpoints and optimizer parameter groups find tensors by name",
          i, problem, checkpoint::kMaxTensorNameBytes));
    if (!names.insert(p.name).second)
      throw Error(std::string("Engine: two parameters are named '").append(p.name).append("'; names must be unique"));
    if (p.numel() == 0)
      throw Error(std::string("Engine: parameter '").append(p.name).append("' has no elements; "
                  "leave it out of the list"));
    if (p.group < 0)
      throw Error(fmt::format("Engine: parameter '{}' has negative group {}", p.name, p.group));
    const bool new_group = groups_.empty() || p.group != params[i - 1].group;
    if (new_group) {
      if (static_cast<std::size_t>(p.group) < group_seen.size() && group_seen[static_cast<std::size_t>(p.group)])
        throw Error(
            fmt::format("Engine: group {} is not one contiguous run of parameters (it resumes at '{}'); register each "
                        "group's parameters together",
                        p.group, p.name));
      if (static_cast<std::size_t>(p.group) != groups_.size())
        throw Error(
            fmt::format("Engine: groups must be numbered 0, 1, 2, ... in registration order; '{}' starts group {} "
                        "where group {} was expected",
                        p.name, p.group, groups_.size()));
      if (group_seen.size() <= static_cast<std::size_t>(p.group))
        group_seen.resize(static_cast<std::size_t>(p.group) + 1);
      group_seen[static_cast<std::size_t>(p.group)] = true;
      groups_.push_back(GroupPlace{i, i, 0, 0, 0, 0});
    }
    GroupPlace& g = groups_.back();
    tensors_.push_back(TensorPlace{p.group, g.padded, p.numel()});
    g.padded = round_up(checked_sum(g.padded, p.numel(), partitions), kAlign);
    g.end_tensor = i + 1;
    numel_ = checked_sum(numel_, p.numel(), partitions);
  }
  for (GroupPlace& g : groups_) {
    const std::size_t multiple = kAlign * static_cast<std::size_t>(partitions);
    checked_sum(g.padded, multiple - 1, partitions);  // round_up's sum
    g.padded = round_up(g.padded, multiple);
    g.shard = g.padded / static_cast<std::size_t>(partitions);
    g.full_offset = full_numel_;
    g.shard_offset = shard_numel_;
    full_numel_ = checked_sum(full_numel_, g.padded, partitions);
    shard_numel_ += g.shard;
    if (g.padded > largest_segment_) largest_segment_ = g.padded;
  }
}

}  // namespace engine
}  // namespace zest
