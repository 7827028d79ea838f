// Engine::save and Engine::load: an engine's training state to and from a checkpoint directory
// (the format in checkpoint/format.hpp). Collective: every rank calls with the same directory.
// They reach the engine through EngineParts, the pieces a checkpoint holds or restores; the
// contract (atomic publish, ranges per rank, verify before change) is Engine's, in zest/engine.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/layout.hpp"
#include "engine/loss_scaler.hpp"
#include "engine/optimizer_states.hpp"
#include "engine/param_gather.hpp"
#include "optim/adam_math.hpp"
#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/engine.hpp"

namespace zest::checkpoint {

struct EngineParts {
  const Config& config;
  Device& device;
  Communicator& comm;
  Stream& stream;  // the engine's comm stream, idle between steps
  const std::vector<ParamSpec>& specs;
  const engine::Layout& layout;
  engine::OptimizerStates& states;
  engine::ParamGather& params;
  std::int64_t& steps;
  std::int64_t& skipped;
  engine::LossScaler& scaler;
  std::vector<optim::AdamHyperParams>& optimizer_groups;  // current values, saved and restored
};

void save(const EngineParts& engine, const std::string& dir);
LoadResult load(const EngineParts& engine, const std::string& dir);

}  // namespace zest::checkpoint
