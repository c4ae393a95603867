// A decoder-only transformer (GPT-2's architecture) as one flat Sequential fine enough to balance:
// each block's attention and MLP are layers of their own, the residuals skips, and the output
// projection tied to the token embedding.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

namespace gpipe {
namespace models {

/// The shape of a GPT.
///
///   auto gpt = gpipe::models::gpt(gpipe::models::GptOptions(/*vocabulary=*/256, /*context=*/128)
///                                     .layers(4).width(128).heads(4));
struct GptOptions {
  GptOptions(int64_t vocabulary, int64_t context) : vocabulary_(vocabulary), context_(context) {}
  /// Tokens: 50,257 for GPT-2's byte-pair encoding, 256 for bytes.
  TORCH_ARG(int64_t, vocabulary);
  /// The longest sequence (positions learned).
  TORCH_ARG(int64_t, context);
  /// Transformer blocks.
  TORCH_ARG(int64_t, layers) = 12;
  /// The model's width (embedding size); a multiple of heads.
  TORCH_ARG(int64_t, width) = 768;
  /// Attention heads per block.
  TORCH_ARG(int64_t, heads) = 12;
};

/// Token and position embeddings: token ids [B, T] (int64) -> [B, T, width].
struct GptEmbeddingImpl : torch::nn::Cloneable<GptEmbeddingImpl> {
  GptEmbeddingImpl(int64_t vocabulary, int64_t context, int64_t width);
  void reset() override;
  at::Tensor forward(const at::Tensor& ids);
  int64_t vocabulary, context, width;
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
};
TORCH_MODULE(GptEmbedding);

/// Causal multi-head self-attention: [B, T, width] -> [B, T, width].
struct CausalSelfAttentionImpl : torch::nn::Cloneable<CausalSelfAttentionImpl> {
  CausalSelfAttentionImpl(int64_t width, int64_t heads);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t width, heads;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

/// The block's MLP: Linear(width, 4 width), GELU (tanh), Linear(4 width, width).
struct GptMlpImpl : torch::nn::Cloneable<GptMlpImpl> {
  explicit GptMlpImpl(int64_t width);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t width;
  torch::nn::Linear fc{nullptr}, proj{nullptr};
  torch::nn::GELU gelu{nullptr};
};
TORCH_MODULE(GptMlp);

/// LayerNorm that first stashes its input as the residual `skip` (a skippable layer's module).
struct PreNormImpl : torch::nn::Cloneable<PreNormImpl> {
  PreNormImpl(int64_t width, std::string skip);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t width;
  std::string skip;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(PreNorm);

/// Adds the residual `skip` back: x + pop(skip).
struct AddResidualImpl : torch::nn::Cloneable<AddResidualImpl> {
  explicit AddResidualImpl(std::string skip) : skip(std::move(skip)) {}
  void reset() override {}
  at::Tensor forward(const at::Tensor& x);
  std::string skip;
};
TORCH_MODULE(AddResidual);

/// The output projection onto the vocabulary with the token embedding's weight: [B, T, width] ->
/// [B, T, vocabulary] logits. Cloneable, so that a GPipe can give a device of its own a copy
/// (Note [Tied parameters] in gpipe/tied_parameters.h).
struct TiedProjectionImpl : torch::nn::Cloneable<TiedProjectionImpl> {
  /// Uses `weight` ([vocabulary, width]) itself: the tie.
  explicit TiedProjectionImpl(const at::Tensor& weight);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
};
TORCH_MODULE(TiedProjection);

// Note [A transformer as layers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pre-norm block computes x = x + attn(ln1(x)); x = x + mlp(ln2(x)): not a chain, since x is
// used twice. As layers of a Sequential, each residual is a skip: "block<i>_ln1" stashes x under
// "block<i>_a" and returns ln1(x); "block<i>_attn" attends; "block<i>_add1" pops x and adds it.
// The MLP half is the same with "block<i>_b". A GPipe may cut anywhere (a skip crosses partitions
// on its own, Note [Skips and checkpointing]); across processes skips stay within a stage, so
// stages end after an "_add" layer. The layers: "embed", six per block, "ln_f", "head" (6 L + 3);
// "head" holds "embed"'s token weight itself, a tie that GPipe and PipelineStage find (Note [Tied
// parameters]). Initialised as GPT-2: weights normal(0, 0.02), the residual projections
// normal(0, 0.02 / sqrt(2 L)), biases zero, LayerNorms one and zero.

/// A GPT (Note [A transformer as layers]): token ids [B, T] (int64, T <= context) -> logits
/// [B, T, vocabulary].
torch::nn::Sequential gpt(const GptOptions& options);

/// GPT-2 small (12 x 768, 12 heads) and medium (24 x 1,024, 16 heads): vocabulary 50,257,
/// context 1,024.
GptOptions gpt2_small();
GptOptions gpt2_medium();

/// The mean cross-entropy of next-token prediction: logits [B, T, V] against targets [B, T].
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace models
}  // namespace gpipe
