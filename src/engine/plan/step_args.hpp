// The Adam step's arguments, computed here only. Engine::step() passes them to the optimizer
// states; the updates ahead of the step (offload.optimizer.update_ahead) assume them before the
// gradient norm is known, and the step keeps that work only where its own arguments are equal to
// the assumed ones, so both must come from the same arithmetic.
#pragma once

#include <cstdint>

#include "optim/cpu_adam.hpp"

namespace zest::engine {

// The arguments of the Adam step after `taken` steps that updated the states (steps not skipped),
// whose gradients carry `loss_scale` and have the unscaled global norm `grad_norm`, clipped to
// `max_norm` (gradient_clipping; 0: no clipping).
inline optim::AdamStepArgs adam_step_args(std::int64_t taken, double loss_scale, double grad_norm, double max_norm) {
  optim::AdamStepArgs args;
  args.step = taken + 1;
  args.grad_scale = 1.0 / loss_scale;
  args.clip_coef = max_norm > 0 && grad_norm > max_norm ? max_norm / (grad_norm + 1e-6) : 1.0;
  return args;
}

// What an update ahead of the step assumes: the step is not skipped and nothing clips.
inline optim::AdamStepArgs assumed_step_args(std::int64_t taken, double loss_scale) {
  return adam_step_args(taken, loss_scale, 0.0, 0.0);
}

}  // namespace zest::engine
