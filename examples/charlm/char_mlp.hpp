// A Bengio-style character language model with its own forward and backward:
//   the `context` previous tokens -> embedding rows (V x E) -> concatenation (context * E)
//   -> `layers` x [linear (H x in) + bias -> GELU or tanh] -> linear (V x H) + bias -> logits
//   -> softmax cross-entropy on the next token.
// Matrix products go through cblas (OpenBLAS); the elementwise code is plain C++.
//
// Parameters are a list of tensors (name, shape, group) with one group per layer: group 0 is the
// embedding, group i+1 hidden layer i, group layers+1 the output projection. A weight of shape
// {out, in} is row-major, so y = W x + b. The model owns no parameters or gradients: the caller
// (a plain loop, or the zest engine) passes one pointer per tensor to every call.
//
// Real is float (what trainers use) or double (what the gradient check uses); both are the same
// code. One instance is not thread-safe: its scratch activations are reused by every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "text_corpus.hpp"

namespace zest::charlm {

enum class Activation { gelu, tanh };

struct CharMlpShape {
  std::size_t vocab = 0;    // from the corpus
  std::size_t context = 8;  // tokens seen before the predicted one
  std::size_t embed = 16;   // E
  std::size_t hidden = 128; // H
  std::size_t layers = 2;   // hidden layers; 0 puts the output projection on the embeddings
  Activation activation = Activation::gelu;
};

struct ParamInfo {
  std::string name;                // e.g. "embed.weight", "hidden0.bias", "output.weight"
  std::vector<std::size_t> shape;  // row-major
  int group = 0;
  std::size_t numel() const;
};

// Per-group hooks for a stage-3 style trainer that holds only some groups' parameters at a time.
// With G = group_count(), forward_backward fires
//   forward:  params_needed(0), params_needed(1), ..., params_needed(G-1)
//   backward: params_needed(G-1), grads_ready(G-1), params_needed(G-2), grads_ready(G-2), ...,
//             params_needed(0), grads_ready(0)
// and forward fires only the forward line. Group g's parameters are read only between
// params_needed(g) and the next hook, and its gradients are all written before grads_ready(g).
// (The embedding's backward reads no parameter; its params_needed still fires, so every group's
// hooks come in the same pattern.) Empty std::functions are skipped.
struct GroupHooks {
  std::function<void(int group)> params_needed;
  std::function<void(int group)> grads_ready;
};

template <typename Real>
class BasicCharMlp {
 public:
  // max_batch: the most examples one call takes; scratch activations for it are allocated here,
  // once. blas_threads > 0 calls openblas_set_num_threads (process-wide!) — pass 1 when ranks
  // share cores; 0 leaves OpenBLAS as configured (OPENBLAS_NUM_THREADS or all cores).
  // Throws zest::Error for a zero vocab, context, embed, max_batch, or hidden with layers > 0.
  BasicCharMlp(const CharMlpShape& shape, std::size_t max_batch, int blas_threads);

  const CharMlpShape& shape() const { return shape_; }
  std::size_t max_batch() const { return max_batch_; }
  std::size_t window() const { return shape_.context + 1; }
  int group_count() const { return static_cast<int>(shape_.layers) + 2; }
  const std::vector<ParamInfo>& parameters() const { return params_; }
  // V*E + sum over hidden layers (in*H + H) + V*in_out + V, where in is context*E for the
  // first hidden layer and H after it, and in_out is H (context*E with no hidden layer).
  static std::size_t parameter_count(const CharMlpShape& shape);

  // Deterministic init, identical on every rank and for any thread count: element j of tensor t
  // is a function of (seed, t, j) alone. Embedding: std 1; hidden weights: std gain/sqrt(in)
  // (gain 5/3 for tanh, sqrt(2) for GELU); output weight: std 0.1/sqrt(in), so the initial loss is
  // close to log(V); biases 0. init_tensor fills elements [first, first + out.size()) of tensor t,
  // for a rank that initializes only its shard.
  void init(std::span<Real* const> params, std::uint64_t seed) const;
  void init_tensor(std::size_t tensor, std::size_t first, std::span<Real> out,
                   std::uint64_t seed) const;

  // One forward and backward over `windows`: consecutive windows of window() tokens (context
  // inputs, then the target), at most max_batch() of them; zero windows is allowed (loss 0, all
  // gradients 0, hooks still fire so collectives stay matched across ranks).
  // Returns sum over the windows of -log p(target) divided by loss_normalizer (> 0; the GLOBAL
  // batch size), and WRITES (overwrites, never accumulates) into grads the gradient of that
  // value; so summing the returns and the gradients over ranks gives the global mean loss and its
  // gradient. params and grads hold one pointer per tensor of parameters(), in that order; the
  // pointers of a group are read only after its params_needed hook returned, so a hook may set
  // them. Throws zest::Error for a wrong count of tensors, a batch over max_batch(), a window
  // count that is not whole, or a token outside [0, vocab).
  double forward_backward(std::span<Real* const> params, std::span<Real* const> grads,
                          std::span<const Token> windows, double loss_normalizer,
                          const GroupHooks* hooks = nullptr);

  // The same loss without gradients (for evaluation).
  double forward(std::span<Real* const> params, std::span<const Token> windows,
                 double loss_normalizer, const GroupHooks* hooks = nullptr);

 private:
  std::size_t check_batch(std::span<Real* const> params, std::span<const Token> windows,
                          double loss_normalizer) const;
  double run_forward(std::span<Real* const> params, std::span<const Token> windows,
                     std::size_t batch, const GroupHooks* hooks);
  std::size_t layer_input(std::size_t layer) const;  // width of hidden layer `layer`'s input
  std::size_t output_input() const;
  const Real* activation_input(std::size_t layer) const;  // X0 or the previous layer's output

  CharMlpShape shape_;
  std::size_t max_batch_;
  std::vector<ParamInfo> params_;
  // Scratch for max_batch_ examples, allocated once.
  std::vector<Real> x0_;                   // concatenated embeddings, B x context*E
  std::vector<std::vector<Real>> pre_;     // per hidden layer: B x H before the activation
  std::vector<std::vector<Real>> post_;    // per hidden layer: B x H after it
  std::vector<Real> logits_;               // B x V; probabilities, then d(loss)/d(logits)
  std::vector<Real> delta_a_, delta_b_;    // B x max(context*E, H): backward ping-pong
};

using CharMlp = BasicCharMlp<float>;

extern template class BasicCharMlp<float>;
extern template class BasicCharMlp<double>;

}  // namespace zest::charlm
