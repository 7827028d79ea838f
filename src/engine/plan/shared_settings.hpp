// The settings every rank of an engine must share, as (key, value) pairs for
// require_same_on_ranks: each key of the config (as to_yaml writes it) but those that only shape
// this rank's own resources, and the model's parameter names, shapes and groups.
#pragma once

#include <span>
#include <vector>

#include "runtime/comm/same_on_ranks.hpp"
#include "zest/config.hpp"
#include "zest/engine.hpp"

namespace zest::engine {

std::vector<SharedValue> settings_ranks_share(const Config& config, std::span<const ParamSpec> params);

}  // namespace zest::engine
