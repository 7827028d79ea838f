#include "engine/optimizer/optimizer_groups.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::engine {

std::vector<int> optimizer_groups_of(const Config& config, const std::vector<ParamSpec>& specs) {
  std::vector<int> of(specs.size(), 0);
  const auto& groups = config.optimizer.param_groups;
  for (std::size_t t = 0; t < specs.size(); ++t)
    for (std::size_t i = 0; i < groups.size() && of[t] == 0; ++i)
      for (const std::string& pattern : groups[i].match)
        if (::fnmatch(pattern.c_str(), specs[t].name.c_str(), 0) == 0) {
          of[t] = static_cast<int>(i) + 1;
          break;
        }
  return of;
}

std::vector<optim::AdamHyperParams> optimizer_group_values(const Config& config) {
  std::vector<optim::AdamHyperParams> values{optim::hyper_params_from(config.optimizer)};
  for (const OptimizerParamGroup& g : config.optimizer.param_groups) {
    optim::AdamHyperParams h = values.front();
    h.lr = g.lr.value_or(h.lr);
    h.beta1 = g.beta1.value_or(h.beta1);
    h.beta2 = g.beta2.value_or(h.beta2);
    h.eps = g.eps.value_or(h.eps);
    h.weight_decay = g.weight_decay.value_or(h.weight_decay);
    values.push_back(h);
  }
  return values;
}

HyperRuns hyper_runs(const Layout& layout, int rank, const std::vector<int>& group_of,
                             const std::vector<optim::AdamHyperParams>& values) {
  HyperRuns runs;
  for (int g = 0; g < layout.group_count(); ++g) {
    const auto& place = layout.group(g);
    for (std::size_t t = place.first_tensor; t < place.end_tensor; ++t) {
      const auto part = layout.shard_part(t, rank);
      if (part.empty()) continue;
      const auto* hyper = &values[static_cast<std::size_t>(group_of[t])];
      const std::size_t at = place.shard_offset + (part.lo - part.begin),
                        end = place.shard_offset + (part.hi - part.begin);
      if (!runs.empty() && runs.back().hyper == hyper) runs.back().end = end;
      else runs.push_back({at, end, hyper});
    }
  }
  if (runs.empty()) runs.push_back({0, 0, &values.front()});
  runs.front().begin = 0;
  for (std::size_t i = 0; i + 1 < runs.size(); ++i) runs[i].end = runs[i + 1].begin;
  runs.back().end = layout.shard_numel();
  return runs;
}

StatesOptions states_options(const Config& config, const Layout& layout, int rank) {
  StatesOptions o;
  o.format = config.optimizer.states;
  o.master = config.optimizer.master;
  o.seed = static_cast<std::uint64_t>(config.optimizer.seed);
  // validate() refuses it too; here for a Config that skipped it, once for every part that steps.
  if (o.master == DType::bf16 && (o.format == StatesFormat::f32 || config.precision.dtype == DType::f32))
    throw Error("a bf16 master needs compact moments (optimizer.states bf16 or int8) and 16-bit parameters "
                "(precision.dtype bf16 or fp16)");
  // 2^40 elements per group's segment (a trillion parameters) before two groups' indices could meet.
  constexpr std::uint64_t kGroupIndexBits = 40;
  for (int g = 0; g < layout.group_count(); ++g) {
    if (layout.group(g).padded >= (std::uint64_t{1} << kGroupIndexBits))
      throw Error(
          fmt::format("optimizer.states: group {} has 2^40 or more elements; split it into groups of fewer", g));
    o.shard_index.push_back((static_cast<std::uint64_t>(g) << kGroupIndexBits) + layout.shard_begin(g, rank));
  }
  return o;
}

void check_optimizer_group(const OptimizerGroupOptions& o) {
  const auto bad = [](double x) { return !std::isfinite(x); };
  if (bad(o.lr) || o.lr <= 0 || bad(o.beta1) || o.beta1 < 0 || o.beta1 >= 1 || bad(o.beta2) || o.beta2 < 0 ||
      o.beta2 >= 1 || bad(o.eps) || o.eps <= 0 || bad(o.weight_decay) || o.weight_decay < 0)
    throw Error(
        fmt::format("Engine::set_optimizer_group: lr {}, betas ({}, {}), eps {}, weight_decay {}: "
                    "needs lr > 0, betas in [0, 1), eps > 0, weight_decay >= 0, all finite",
                    o.lr, o.beta1, o.beta2, o.eps, o.weight_decay));
}

}  // namespace zest::engine
