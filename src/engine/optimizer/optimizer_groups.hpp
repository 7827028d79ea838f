// Optimizer parameter groups (config optimizer.param_groups): which group each tensor belongs to,
// each group's Adam hyper-parameters, and the runs of a rank's shard buffer they cover, which the
// optimizer states step group by group.
#pragma once

#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "optim/adam_math.hpp"
#include "zest/config.hpp"
#include "zest/engine.hpp"

namespace zest::engine {

// Each tensor's group: the first param_groups entry with a pattern matching its name (entry i is
// group i + 1), else group 0.
std::vector<int> optimizer_groups_of(const Config& config, const std::vector<ParamSpec>& specs);

// Group 0 is the optimizer's own values; group i + 1 is param_groups[i] over them.
std::vector<optim::AdamHyperParams> optimizer_group_values(const Config& config);

// The runs of `rank`'s shard buffer by group, padding joined to the run before it and neighbours of
// one group merged (one group: one run over the whole shard). The runs point into `values`.
HyperRuns hyper_runs(const Layout& layout, int rank, const std::vector<int>& group_of,
                     const std::vector<optim::AdamHyperParams>& values);

// optimizer.states and optimizer.seed for `rank`'s shard (StatesOptions).
StatesOptions states_options(const Config& config, const Layout& layout, int rank);

// Throws Error unless every value is one a step can use (lr > 0, betas in [0, 1), eps > 0, weight
// decay >= 0, all finite).
void check_optimizer_group(const OptimizerGroupOptions& options);

}  // namespace zest::engine
