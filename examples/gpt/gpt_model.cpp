#include "gpt_model.hpp"

#include <cmath>
#include <limits>

#include "zest/torch.hpp"

namespace zest::gpt {

namespace nn = ::torch::nn;
using zest::torch::gathered;

CausalSelfAttentionImpl::CausalSelfAttentionImpl(std::int64_t embed, std::int64_t heads)
    : heads_(heads),
      qkv_(register_module("qkv", nn::Linear(embed, 3 * embed))),
      proj_(register_module("proj", nn::Linear(embed, embed))) {}

::torch::Tensor CausalSelfAttentionImpl::forward(const ::torch::Tensor& x) {
  const auto batch = x.size(0), time = x.size(1), embed = x.size(2), head_dim = embed / heads_;
  // (batch, time, 3 * embed) -> three (batch, heads, time, head_dim)
  const auto qkv = qkv_(x).view({batch, time, 3, heads_, head_dim}).permute({2, 0, 3, 1, 4});
  const auto q = qkv[0], k = qkv[1], v = qkv[2];
  auto scores = ::torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
  const auto future = ::torch::ones({time, time}, ::torch::kBool).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  const auto y = ::torch::matmul(::torch::softmax(scores, -1), v);
  return proj_(y.transpose(1, 2).reshape({batch, time, embed}));
}

MlpImpl::MlpImpl(std::int64_t embed)
    : fc_(register_module("fc", nn::Linear(embed, 4 * embed))),
      proj_(register_module("proj", nn::Linear(4 * embed, embed))) {}

::torch::Tensor MlpImpl::forward(const ::torch::Tensor& x) { return proj_(::torch::gelu(fc_(x))); }

BlockImpl::BlockImpl(std::int64_t embed, std::int64_t heads)
    : ln1_(register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({embed})))),
      ln2_(register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({embed})))),
      attn_(register_module("attn", CausalSelfAttention(embed, heads))),
      mlp_(register_module("mlp", Mlp(embed))) {}

::torch::Tensor BlockImpl::forward(::torch::Tensor x) {
  x = x + attn_(ln1_(x));
  return x + mlp_(ln2_(x));
}

GptImpl::GptImpl(const GptShape& shape)
    : tok_(register_module("tok", nn::Embedding(shape.vocab, shape.embed))),
      pos_(register_module("pos", nn::Embedding(shape.context, shape.embed))) {
  // A ModuleList names the blocks' parameters blocks.0.*, blocks.1.*, ... (register_module takes
  // no dots); blocks_ keeps them typed for forward.
  auto list = register_module("blocks", nn::ModuleList());
  for (std::int64_t i = 0; i < shape.layers; ++i) {
    blocks_.emplace_back(shape.embed, shape.heads);
    list->push_back(blocks_.back());
  }
  ln_f_ = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({shape.embed})));
  head_ = register_module("head", nn::Linear(nn::LinearOptions(shape.embed, shape.vocab).bias(false)));
}

::torch::Tensor GptImpl::forward(const ::torch::Tensor& tokens) {
  const auto positions = ::torch::arange(tokens.size(1), ::torch::kLong);
  auto x = gathered(*tok_, [&] { return tok_(tokens); }) + gathered(*pos_, [&] { return pos_(positions); });
  for (Block& block : blocks_) x = gathered(*block, [&] { return block(x); });
  x = gathered(*ln_f_, [&] { return ln_f_(x); });
  return gathered(*head_, [&] { return head_(x); });
}

}  // namespace zest::gpt
