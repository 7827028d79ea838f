// The per-element Adam/AdamW update, shared by every CPU instruction-set variant and the CUDA
// kernel, so all backends compute the same thing. The per-step constants (bias corrections,
// gradient scale times clip coefficient, decay factor) are folded on the host once per step.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "runtime/host/half.hpp"
#include "zest/config.hpp"
#include "zest/error.hpp"

namespace zest::optim {

struct AdamHyperParams {
  OptimizerType type = OptimizerType::adamw;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool operator==(const AdamHyperParams&) const = default;
};

inline AdamHyperParams hyper_params_from(const OptimizerConfig& config) {
  return {config.type, config.lr, config.beta1, config.beta2, config.eps, config.weight_decay};
}

// Everything the element update needs for one step, in float.
struct AdamCoefficients {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;        // lr / (1 - beta1^step)
  float inv_sqrt_bias2;   // 1 / sqrt(1 - beta2^step)
  float eps;
  float weight_decay;     // Adam: added to the gradient as weight_decay * param
  float param_decay;      // AdamW: the parameter is multiplied by 1 - lr * weight_decay
  float grad_multiplier;  // grad_scale (1 / loss scale) times the clip coefficient
  bool decoupled;         // AdamW
};

// `step` counts from 1. grad_scale multiplies the raw gradient (1 / loss_scale); clip_coef is
// min(1, max_norm / global_norm) or 1. Throws zest::Error on values no step can use.
inline AdamCoefficients make_adam_coefficients(const AdamHyperParams& hp, std::int64_t step,
                                               double grad_scale = 1.0, double clip_coef = 1.0) {
  if (step < 1)
    throw Error(std::string("Adam step must count from 1, got ").append(std::to_string(step))
                    .append("; pass the number of the step being taken"));
  if (!(hp.beta1 >= 0.0 && hp.beta1 < 1.0) || !(hp.beta2 >= 0.0 && hp.beta2 < 1.0))
    throw Error(std::string("Adam betas must lie in [0, 1), got beta1=")
                    .append(std::to_string(hp.beta1)).append(" beta2=")
                    .append(std::to_string(hp.beta2)).append("; fix optimizer.beta1/beta2"));
  if (!std::isfinite(grad_scale) || !std::isfinite(clip_coef))
    throw Error(std::string("Adam grad_scale and clip_coef must be finite, got ")
                    .append(std::to_string(grad_scale)).append(" and ")
                    .append(std::to_string(clip_coef))
                    .append("; skip the step when the gradients overflowed"));
  const double t = static_cast<double>(step);
  const double bias1 = 1.0 - std::pow(hp.beta1, t);
  const double bias2 = 1.0 - std::pow(hp.beta2, t);
  AdamCoefficients c{};
  c.beta1 = static_cast<float>(hp.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
  c.beta2 = static_cast<float>(hp.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  c.step_size = static_cast<float>(hp.lr / bias1);
  c.inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(bias2));
  c.eps = static_cast<float>(hp.eps);
  c.decoupled = hp.type == OptimizerType::adamw;
  c.weight_decay = c.decoupled ? 0.0f : static_cast<float>(hp.weight_decay);
  c.param_decay = c.decoupled ? static_cast<float>(1.0 - hp.lr * hp.weight_decay) : 1.0f;
  c.grad_multiplier = static_cast<float>(grad_scale * clip_coef);
  return c;
}

// Square root for the element type; the CPU kernel specializes it for its SIMD vectors.
template <class T>
struct AdamSqrt;

template <>
struct AdamSqrt<float> {
  ZEST_HOST_DEVICE static float apply(float x) { return sqrtf(x); }
};

// One element (or one SIMD vector of elements) of Adam. The operation order is fixed and no
// operation may be contracted into an FMA on the CPU, so every CPU variant is bit-identical.
template <class T>
ZEST_HOST_DEVICE inline void adam_update(T& p, T& m, T& v, T g, const AdamCoefficients& c) {
  g = g * c.grad_multiplier;
  if (c.decoupled) {
    p = p * c.param_decay;
  } else {
    g = g + p * c.weight_decay;
  }
  m = m * c.beta1 + g * c.one_minus_beta1;
  v = v * c.beta2 + (g * g) * c.one_minus_beta2;
  const T denom = AdamSqrt<T>::apply(v) * c.inv_sqrt_bias2 + c.eps;
  p = p - (m / denom) * c.step_size;
}

}  // namespace zest::optim
