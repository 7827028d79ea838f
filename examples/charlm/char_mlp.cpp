#include "char_mlp.hpp"

#include <cblas.h>
#include <fmt/core.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <numbers>
#include <string>

#include "counter_rng.hpp"
#include "zest/error.hpp"

namespace zest::charlm {
namespace {

// C (m x n) = op(A) op(B), row-major, overwriting C. Handles the empty cases BLAS implementations
// treat differently (k == 0 must still clear C: a rank with no example writes zero gradients).
void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, const float* a,
          std::size_t lda, const float* b, std::size_t ldb, float* c, std::size_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (std::size_t row = 0; row < m; ++row) std::fill_n(c + row * ldc, n, 0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f, c, static_cast<int>(ldc));
}

void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, const double* a,
          std::size_t lda, const double* b, std::size_t ldb, double* c, std::size_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (std::size_t row = 0; row < m; ++row) std::fill_n(c + row * ldc, n, 0.0);
    return;
  }
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), 0.0, c, static_cast<int>(ldc));
}

// y[b][j] += bias[j] for a rows x cols matrix.
template <typename Real>
void add_bias(Real* y, const Real* bias, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    Real* row = y + r * cols;
    for (std::size_t j = 0; j < cols; ++j) row[j] += bias[j];
  }
}

// grad_bias[j] = sum over rows of delta[r][j] (overwrites).
template <typename Real>
void column_sums(const Real* delta, std::size_t rows, std::size_t cols, Real* grad_bias) {
  std::fill_n(grad_bias, cols, Real(0));
  for (std::size_t r = 0; r < rows; ++r) {
    const Real* row = delta + r * cols;
    for (std::size_t j = 0; j < cols; ++j) grad_bias[j] += row[j];
  }
}

// Exact GELU, x * Phi(x), and its derivative Phi(x) + x * phi(x).
template <typename Real>
Real gelu(Real x) {
  return Real(0.5) * x * (Real(1) + std::erf(x * Real(std::numbers::sqrt2 / 2)));
}
template <typename Real>
Real gelu_derivative(Real x) {
  const Real cdf = Real(0.5) * (Real(1) + std::erf(x * Real(std::numbers::sqrt2 / 2)));
  const Real pdf = std::exp(Real(-0.5) * x * x) * Real(0.5 * std::numbers::inv_sqrtpi * std::numbers::sqrt2);
  return cdf + x * pdf;
}

std::string shape_problem(const char* what, std::size_t value, const char* fix) {
  return fmt::format("char MLP: {} is {}; {}", what, value, fix);
}

void call(const std::function<void(int)>* hook, int group) {
  if (hook != nullptr && *hook) (*hook)(group);
}

}  // namespace

std::size_t ParamInfo::numel() const {
  std::size_t n = 1;
  for (const std::size_t d : shape) n *= d;
  return n;
}

template <typename Real>
BasicCharMlp<Real>::BasicCharMlp(const CharMlpShape& shape, std::size_t max_batch, int blas_threads)
    : shape_(shape), max_batch_(max_batch) {
  if (shape.vocab == 0) throw Error(shape_problem("vocab", 0, "build the model from a non-empty corpus"));
  if (shape.context == 0) throw Error(shape_problem("context", 0, "set context to at least 1"));
  if (shape.embed == 0) throw Error(shape_problem("embed", 0, "set embed to at least 1"));
  if (shape.layers > 0 && shape.hidden == 0) {
    throw Error(shape_problem("hidden", 0, "set hidden to at least 1, or layers to 0"));
  }
  if (max_batch == 0) throw Error(shape_problem("max_batch", 0, "set it to at least 1"));
  const std::size_t widest = std::max({shape.vocab, shape.context * shape.embed, shape.hidden});
  if (max_batch > INT_MAX || widest > INT_MAX) {
    throw Error(shape_problem("the largest of max_batch and the layer widths",
                              std::max(max_batch, widest),
                              "BLAS takes 32-bit dimensions: keep each below 2^31"));
  }
  if (blas_threads > 0) openblas_set_num_threads(blas_threads);

  const std::size_t e = shape.embed;
  const std::size_t h = shape.hidden;
  params_.push_back({"embed.weight", {shape.vocab, e}, 0});
  for (std::size_t i = 0; i < shape.layers; ++i) {
    const int group = static_cast<int>(i) + 1;
    std::string base = "hidden";
    base.append(std::to_string(i));
    params_.push_back({base + ".weight", {h, layer_input(i)}, group});
    params_.push_back({base + ".bias", {h}, group});
  }
  const int output_group = static_cast<int>(shape.layers) + 1;
  params_.push_back({"output.weight", {shape.vocab, output_input()}, output_group});
  params_.push_back({"output.bias", {shape.vocab}, output_group});

  x0_.resize(max_batch * shape.context * e);
  pre_.resize(shape.layers);
  post_.resize(shape.layers);
  for (std::size_t i = 0; i < shape.layers; ++i) {
    pre_[i].resize(max_batch * h);
    post_[i].resize(max_batch * h);
  }
  logits_.resize(max_batch * shape.vocab);
  const std::size_t delta_width = std::max(shape.context * e, shape.layers > 0 ? h : 0);
  delta_a_.resize(max_batch * delta_width);
  delta_b_.resize(max_batch * delta_width);
}

template <typename Real>
std::size_t BasicCharMlp<Real>::parameter_count(const CharMlpShape& s) {
  std::size_t count = s.vocab * s.embed;
  std::size_t in = s.context * s.embed;
  for (std::size_t i = 0; i < s.layers; ++i) {
    count += in * s.hidden + s.hidden;
    in = s.hidden;
  }
  return count + s.vocab * in + s.vocab;
}

template <typename Real>
std::size_t BasicCharMlp<Real>::layer_input(std::size_t layer) const {
  return layer == 0 ? shape_.context * shape_.embed : shape_.hidden;
}

template <typename Real>
std::size_t BasicCharMlp<Real>::output_input() const {
  return shape_.layers == 0 ? shape_.context * shape_.embed : shape_.hidden;
}

template <typename Real>
const Real* BasicCharMlp<Real>::activation_input(std::size_t layer) const {
  return layer == 0 ? x0_.data() : post_[layer - 1].data();
}

template <typename Real>
void BasicCharMlp<Real>::init(std::span<Real* const> params, std::uint64_t seed) const {
  if (params.size() != params_.size()) {
    throw Error(fmt::format("char MLP init: given {} tensors, the model has {}", params.size(), params_.size()));
  }
  for (std::size_t t = 0; t < params_.size(); ++t) {
    init_tensor(t, 0, std::span<Real>(params[t], params_[t].numel()), seed);
  }
}

template <typename Real>
void BasicCharMlp<Real>::init_tensor(std::size_t tensor, std::size_t first, std::span<Real> out,
                                     std::uint64_t seed) const {
  if (tensor >= params_.size() || first > params_[tensor].numel() ||
      out.size() > params_[tensor].numel() - first) {
    throw Error(fmt::format("char MLP init_tensor: elements [{}, {}) of tensor {} are outside the model's tensors",
                            first, first + out.size(), tensor));
  }
  const ParamInfo& info = params_[tensor];
  double std_dev = 0.0;
  if (tensor == 0) {
    std_dev = 1.0;
  } else if (info.shape.size() == 2) {
    const double fan_in = static_cast<double>(info.shape[1]);
    const bool is_output = tensor + 2 == params_.size();
    const double gain = is_output ? 0.1
                        : shape_.activation == Activation::tanh ? 5.0 / 3.0
                                                                : std::numbers::sqrt2;
    std_dev = gain / std::sqrt(fan_in);
  }
  // Uniform on [-a, a] has standard deviation a / sqrt(3).
  const double half_width = std_dev * std::numbers::sqrt3;
  const std::uint64_t key = seed ^ kInitStream;
  for (std::size_t j = 0; j < out.size(); ++j) {
    const double u = unit_interval(counter_hash(key, tensor, first + j, 0));
    out[j] = static_cast<Real>((2.0 * u - 1.0) * half_width);
  }
}

template <typename Real>
std::size_t BasicCharMlp<Real>::check_batch(std::span<Real* const> params,
                                            std::span<const Token> windows,
                                            double loss_normalizer) const {
  if (params.size() != params_.size()) {
    throw Error(fmt::format("char MLP: given {} parameter tensors, the model has {}", params.size(), params_.size()));
  }
  if (windows.size() % window() != 0) {
    throw Error(fmt::format("char MLP: {} tokens are not a whole number of windows of context + 1 = {}", windows.size(),
                            window()));
  }
  const std::size_t batch = windows.size() / window();
  if (batch > max_batch_) {
    throw Error(fmt::format(
        "char MLP: a batch of {} examples exceeds the max_batch of {} the model was built for; build it with a larger "
        "max_batch",
        batch, max_batch_));
  }
  if (!(loss_normalizer > 0.0)) {
    throw Error(
        fmt::format("char MLP: the loss normalizer is {}; pass the global batch size (> 0)", loss_normalizer));
  }
  for (std::size_t i = 0; i < windows.size(); ++i) {
    if (windows[i] < 0 || static_cast<std::size_t>(windows[i]) >= shape_.vocab) {
      throw Error(
          fmt::format("char MLP: token {} at index {} is outside the vocabulary [0, {})", windows[i], i, shape_.vocab));
    }
  }
  return batch;
}

// Leaves the softmax probabilities in logits_ and returns the summed (unnormalized) loss.
template <typename Real>
double BasicCharMlp<Real>::run_forward(std::span<Real* const> params,
                                       std::span<const Token> windows, std::size_t batch,
                                       const GroupHooks* hooks) {
  const auto* needed = hooks != nullptr ? &hooks->params_needed : nullptr;
  const std::size_t context = shape_.context;
  const std::size_t e = shape_.embed;
  const std::size_t h = shape_.hidden;
  const std::size_t v = shape_.vocab;

  call(needed, 0);
  const Real* embedding = params[0];
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::size_t c = 0; c < context; ++c) {
      const auto token = static_cast<std::size_t>(windows[b * window() + c]);
      std::copy_n(embedding + token * e, e, x0_.data() + (b * context + c) * e);
    }
  }

  for (std::size_t i = 0; i < shape_.layers; ++i) {
    call(needed, static_cast<int>(i) + 1);
    const Real* weight = params[1 + 2 * i];
    const Real* bias = params[2 + 2 * i];
    const std::size_t in = layer_input(i);
    Real* pre = pre_[i].data();
    Real* post = post_[i].data();
    gemm(false, true, batch, h, in, activation_input(i), in, weight, in, pre, h);
    add_bias(pre, bias, batch, h);
    if (shape_.activation == Activation::gelu) {
      for (std::size_t j = 0; j < batch * h; ++j) post[j] = gelu(pre[j]);
    } else {
      for (std::size_t j = 0; j < batch * h; ++j) post[j] = std::tanh(pre[j]);
    }
  }

  call(needed, group_count() - 1);
  const std::size_t out_in = output_input();
  const Real* out_x = shape_.layers == 0 ? x0_.data() : post_.back().data();
  gemm(false, true, batch, v, out_in, out_x, out_in, params[1 + 2 * shape_.layers], out_in,
       logits_.data(), v);
  add_bias(logits_.data(), params[2 + 2 * shape_.layers], batch, v);

  // Softmax cross-entropy, each row shifted by its max; sums in double so a long row of floats
  // loses nothing.
  double loss = 0.0;
  for (std::size_t b = 0; b < batch; ++b) {
    Real* row = logits_.data() + b * v;
    const auto target = static_cast<std::size_t>(windows[b * window() + context]);
    const Real max = *std::max_element(row, row + v);
    const Real target_logit = row[target];
    double sum = 0.0;
    for (std::size_t j = 0; j < v; ++j) {
      row[j] = std::exp(row[j] - max);
      sum += static_cast<double>(row[j]);
    }
    const auto inv_sum = static_cast<Real>(1.0 / sum);
    for (std::size_t j = 0; j < v; ++j) row[j] *= inv_sum;
    loss += std::log(sum) - static_cast<double>(target_logit - max);
  }
  return loss;
}

template <typename Real>
double BasicCharMlp<Real>::forward(std::span<Real* const> params, std::span<const Token> windows,
                                   double loss_normalizer, const GroupHooks* hooks) {
  const std::size_t batch = check_batch(params, windows, loss_normalizer);
  return run_forward(params, windows, batch, hooks) / loss_normalizer;
}

template <typename Real>
double BasicCharMlp<Real>::forward_backward(std::span<Real* const> params,
                                            std::span<Real* const> grads,
                                            std::span<const Token> windows,
                                            double loss_normalizer, const GroupHooks* hooks) {
  const std::size_t batch = check_batch(params, windows, loss_normalizer);
  if (grads.size() != params_.size()) {
    throw Error(fmt::format("char MLP: given {} gradient tensors, the model has {}", grads.size(), params_.size()));
  }
  const double loss = run_forward(params, windows, batch, hooks) / loss_normalizer;

  const auto* needed = hooks != nullptr ? &hooks->params_needed : nullptr;
  const auto* ready = hooks != nullptr ? &hooks->grads_ready : nullptr;
  const std::size_t context = shape_.context;
  const std::size_t e = shape_.embed;
  const std::size_t h = shape_.hidden;
  const std::size_t v = shape_.vocab;
  const std::size_t layers = shape_.layers;

  // d(loss)/d(logits) = (softmax - onehot(target)) / normalizer, in place over the probabilities.
  const auto scale = static_cast<Real>(1.0 / loss_normalizer);
  for (std::size_t b = 0; b < batch; ++b) {
    Real* row = logits_.data() + b * v;
    row[static_cast<std::size_t>(windows[b * window() + context])] -= Real(1);
    for (std::size_t j = 0; j < v; ++j) row[j] *= scale;
  }

  // Output projection.
  call(needed, group_count() - 1);
  const std::size_t out_in = output_input();
  const Real* out_x = layers == 0 ? x0_.data() : post_.back().data();
  gemm(true, false, v, out_in, batch, logits_.data(), v, out_x, out_in, grads[1 + 2 * layers], out_in);
  column_sums(logits_.data(), batch, v, grads[2 + 2 * layers]);
  Real* delta = delta_a_.data();  // d(loss)/d(input of the layer being differentiated)
  Real* spare = delta_b_.data();
  gemm(false, false, batch, out_in, v, logits_.data(), v, params[1 + 2 * layers], out_in, delta, out_in);
  call(ready, group_count() - 1);

  for (std::size_t i = layers; i-- > 0;) {
    const int group = static_cast<int>(i) + 1;
    call(needed, group);
    // delta becomes d(loss)/d(pre-activation).
    const Real* pre = pre_[i].data();
    const Real* post = post_[i].data();
    if (shape_.activation == Activation::gelu) {
      for (std::size_t j = 0; j < batch * h; ++j) delta[j] *= gelu_derivative(pre[j]);
    } else {
      for (std::size_t j = 0; j < batch * h; ++j) delta[j] *= Real(1) - post[j] * post[j];
    }
    const std::size_t in = layer_input(i);
    gemm(true, false, h, in, batch, delta, h, activation_input(i), in, grads[1 + 2 * i], in);
    column_sums(delta, batch, h, grads[2 + 2 * i]);
    gemm(false, false, batch, in, h, delta, h, params[1 + 2 * i], in, spare, in);
    std::swap(delta, spare);
    call(ready, group);
  }

  // Embedding: each input position adds its slice of d(loss)/d(x0) to its token's row.
  call(needed, 0);
  Real* grad_embedding = grads[0];
  std::fill_n(grad_embedding, v * e, Real(0));
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::size_t c = 0; c < context; ++c) {
      const auto token = static_cast<std::size_t>(windows[b * window() + c]);
      const Real* from = delta + (b * context + c) * e;
      Real* to = grad_embedding + token * e;
      for (std::size_t j = 0; j < e; ++j) to[j] += from[j];
    }
  }
  call(ready, 0);
  return loss;
}

template class BasicCharMlp<float>;
template class BasicCharMlp<double>;

}  // namespace zest::charlm
