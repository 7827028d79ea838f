// A decoder-only transformer in libtorch: token and position embeddings, pre-LayerNorm blocks of
// causal self-attention and an MLP, a final LayerNorm and a linear head. Each submodule runs
// through zest::torch::gathered(), so the same model trains at ZeRO stage 3 (parameters gathered
// per block) and with any plain torch optimizer (gathered() then just calls forward).
#pragma once

#include <torch/torch.h>

#include "gpt_config.hpp"

namespace zest::gpt {

class CausalSelfAttentionImpl : public ::torch::nn::Module {
 public:
  CausalSelfAttentionImpl(std::int64_t embed, std::int64_t heads);
  ::torch::Tensor forward(const ::torch::Tensor& x);

 private:
  std::int64_t heads_;
  ::torch::nn::Linear qkv_{nullptr}, proj_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

class MlpImpl : public ::torch::nn::Module {
 public:
  explicit MlpImpl(std::int64_t embed);
  ::torch::Tensor forward(const ::torch::Tensor& x);

 private:
  ::torch::nn::Linear fc_{nullptr}, proj_{nullptr};
};
TORCH_MODULE(Mlp);

class BlockImpl : public ::torch::nn::Module {
 public:
  BlockImpl(std::int64_t embed, std::int64_t heads);
  ::torch::Tensor forward(::torch::Tensor x);

 private:
  ::torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  CausalSelfAttention attn_{nullptr};
  Mlp mlp_{nullptr};
};
TORCH_MODULE(Block);

class GptImpl : public ::torch::nn::Module {
 public:
  explicit GptImpl(const GptShape& shape);
  // tokens: (batch, time <= context) int64 -> logits (batch, time, vocab).
  ::torch::Tensor forward(const ::torch::Tensor& tokens);

 private:
  ::torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  std::vector<Block> blocks_;
  ::torch::nn::LayerNorm ln_f_{nullptr};
  ::torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace zest::gpt
