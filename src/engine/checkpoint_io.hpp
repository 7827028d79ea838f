// Engine::save and Engine::load: an engine's training state to and from a checkpoint directory
// (the format, reader and publish in src/checkpoint/, the layer below, which knows no engine).
// Collective: every rank calls with the same directory. They reach the engine through
// CheckpointParts, the pieces a checkpoint holds or restores; the contract (atomic publish, ranges
// per rank, verify before change) is Engine's, in zest/engine.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/optimizer/loss_scaler.hpp"
#include "engine/optimizer/optimizer_states.hpp"
#include "engine/collectives/param_gather.hpp"
#include "optim/adam_math.hpp"
#include "zest/communicator.hpp"
#include "zest/config.hpp"
#include "zest/device.hpp"
#include "zest/engine.hpp"

namespace zest::engine {

struct CheckpointParts {
  const Config& config;
  Device& device;
  Communicator& comm;
  Stream& stream;  // the engine's comm stream, idle between steps
  const std::vector<ParamSpec>& specs;
  const Layout& layout;
  OptimizerStates& states;
  ParamGather& params;
  std::int64_t& steps;
  std::int64_t& skipped;
  LossScaler& scaler;
  std::vector<optim::AdamHyperParams>& optimizer_groups;  // current values, saved and restored
};

void save_checkpoint(const CheckpointParts& engine, const std::string& dir);
LoadResult load_checkpoint(const CheckpointParts& engine, const std::string& dir);

}  // namespace zest::engine
