// Optimizer parameter groups alone. What it proves:
// - each tensor takes the first group (in config order) with a matching glob pattern, else group 0;
// - a group's values are the optimizer's with only the keys the group sets changed;
// - the runs of each rank's shard tile [0, shard_numel) in order, each with the group of the
//   tensors it covers (padding joined to the run before it, neighbours of one group merged), at
//   1, 2 and 3 ranks;
// - values no step can use are refused, naming the rule.
#include "engine/optimizer/optimizer_groups.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "zest/error.hpp"

namespace zest::engine {
namespace {

Config two_groups() {
  Config config;
  config.optimizer.lr = 1e-3;
  config.optimizer.weight_decay = 0.1;
  OptimizerParamGroup no_decay;
  no_decay.match = {"*.bias", "norm*"};
  no_decay.weight_decay = 0.0;
  OptimizerParamGroup embed;
  embed.match = {"embed*", "*.bias"};  // *.bias is taken by the first group already
  embed.lr = 5e-4;
  embed.beta2 = 0.95;
  config.optimizer.param_groups = {no_decay, embed};
  return config;
}

std::vector<ParamSpec> specs() {
  return {{"embed.weight", {9, 4}, 0}, {"embed.bias", {4}, 0}, {"block.weight", {4, 4}, 1},
          {"norm.scale", {4}, 1},      {"block.bias", {4}, 1}, {"head.weight", {3, 4}, 2}};
}

TEST(OptimizerGroups, EachTensorTakesTheFirstMatchingGroupElseGroupZero) {
  EXPECT_EQ(optimizer_groups_of(two_groups(), specs()), (std::vector<int>{2, 1, 0, 1, 1, 0}));
  EXPECT_EQ(optimizer_groups_of(Config{}, specs()), std::vector<int>(6, 0));
}

TEST(OptimizerGroups, AGroupChangesOnlyTheValuesItSets) {
  const std::vector<optim::AdamHyperParams> values = optimizer_group_values(two_groups());
  ASSERT_EQ(values.size(), 3u);
  const optim::AdamHyperParams& base = values[0];
  EXPECT_EQ(base, optim::hyper_params_from(two_groups().optimizer));
  optim::AdamHyperParams no_decay = base;
  no_decay.weight_decay = 0.0;
  EXPECT_EQ(values[1], no_decay);
  optim::AdamHyperParams embed = base;
  embed.lr = 5e-4;
  embed.beta2 = 0.95;
  EXPECT_EQ(values[2], embed);
}

TEST(OptimizerGroups, RunsTileEachRanksShardWithTheGroupOfWhatTheyCover) {
  const Config config = two_groups();
  const std::vector<int> group_of = optimizer_groups_of(config, specs());
  const std::vector<optim::AdamHyperParams> values = optimizer_group_values(config);
  for (int ranks : {1, 2, 3}) {
    const Layout layout(specs(), ranks);
    for (int rank = 0; rank < ranks; ++rank) {
      const HyperRuns runs = hyper_runs(layout, rank, group_of, values);
      ASSERT_FALSE(runs.empty());
      EXPECT_EQ(runs.front().begin, 0u);
      EXPECT_EQ(runs.back().end, layout.shard_numel());
      for (std::size_t i = 0; i + 1 < runs.size(); ++i) {
        EXPECT_EQ(runs[i].end, runs[i + 1].begin) << "runs " << i << " and " << i + 1 << " leave a gap";
        EXPECT_NE(runs[i].hyper, runs[i + 1].hyper) << "neighbours of one group are one run";
      }
      // Every element of a tensor in this rank's shard lies in a run of its tensor's group.
      for (std::size_t t = 0; t < layout.tensor_count(); ++t) {
        const Layout::ShardPart part = layout.shard_part(t, rank);
        if (part.empty()) continue;
        const std::size_t at = layout.group(layout.tensor(t).group).shard_offset + (part.lo - part.begin);
        for (std::size_t e = at; e < at + (part.hi - part.lo); ++e) {
          const HyperRun* covering = nullptr;
          for (const HyperRun& r : runs) {
            if (e >= r.begin && e < r.end) covering = &r;
          }
          ASSERT_NE(covering, nullptr) << "element " << e << " of rank " << rank << " of " << ranks;
          EXPECT_EQ(covering->hyper, &values[static_cast<std::size_t>(group_of[t])])
              << specs()[t].name << " at rank " << rank << " of " << ranks;
        }
      }
    }
  }
}

// The states' rounding indices are (group << 40) + the element's place in its segment, and a bf16
// master without compact moments or 16-bit parameters is refused even from an unchecked Config.
TEST(StatesOptions, IndicesFollowTheSegmentAndABf16MasterNeedsItsCompanions) {
  Config config = two_groups();
  config.optimizer.states = StatesFormat::int8;
  config.optimizer.seed = 3;
  const Layout layout(specs(), 2);
  const StatesOptions o = states_options(config, layout, 1);
  ASSERT_EQ(o.shard_index.size(), 3u);
  for (int g = 0; g < 3; ++g)
    EXPECT_EQ(o.shard_index[static_cast<std::size_t>(g)],
              (static_cast<std::uint64_t>(g) << 40) + layout.shard_begin(g, 1));
  EXPECT_EQ(o.rounding(2, 5).first_index, o.shard_index[2] + 5);
  EXPECT_EQ(o.rounding(2, 5).seed, 3u);
  config.optimizer.master = DType::bf16;
  EXPECT_THROW(states_options(config, layout, 1), Error);  // fp32 parameters
  config.precision.dtype = DType::bf16;
  EXPECT_NO_THROW(states_options(config, layout, 1));
  config.optimizer.states = StatesFormat::f32;
  EXPECT_THROW(states_options(config, layout, 1), Error);  // fp32 moments
}

TEST(OptimizerGroups, ValuesNoStepCanUseAreRefused) {
  const OptimizerGroupOptions good{1e-3, 0.9, 0.999, 1e-8, 0.01};
  EXPECT_NO_THROW(check_optimizer_group(good));
  struct BadCase {
    const char* what;
    OptimizerGroupOptions options;
  };
  std::vector<BadCase> cases;
  const auto add = [&](const char* what, auto change) {
    OptimizerGroupOptions options = good;
    change(options);
    cases.push_back({what, options});
  };
  add("lr 0", [](OptimizerGroupOptions& o) { o.lr = 0; });
  add("beta1 1", [](OptimizerGroupOptions& o) { o.beta1 = 1; });
  add("beta2 < 0", [](OptimizerGroupOptions& o) { o.beta2 = -0.1; });
  add("eps 0", [](OptimizerGroupOptions& o) { o.eps = 0; });
  add("weight_decay < 0", [](OptimizerGroupOptions& o) { o.weight_decay = -1e-3; });
  add("lr NaN", [](OptimizerGroupOptions& o) { o.lr = std::numeric_limits<double>::quiet_NaN(); });
  add("eps Inf", [](OptimizerGroupOptions& o) { o.eps = std::numeric_limits<double>::infinity(); });
  for (const BadCase& c : cases) {
    try {
      check_optimizer_group(c.options);
      ADD_FAILURE() << c.what << " was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("needs lr > 0, betas in [0, 1), eps > 0, weight_decay >= 0"),
                std::string::npos) << c.what << ": " << error.what();
    }
  }
  // The value refused is named as given, however small (not as six decimals that round it to 0).
  OptimizerGroupOptions tiny = good;
  tiny.eps = -1e-9;
  try {
    check_optimizer_group(tiny);
    ADD_FAILURE() << "eps -1e-9 was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("eps -1e-09,"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace zest::engine
