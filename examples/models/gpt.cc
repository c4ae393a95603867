// The GPT; see gpt.h.
#include "examples/models/gpt.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>

#include "absl/strings/str_cat.h"
#include "gpipe/skippable.h"

namespace gpipe {
namespace models {

GptEmbeddingImpl::GptEmbeddingImpl(int64_t vocabulary, int64_t context, int64_t width)
    : vocabulary(vocabulary), context(context), width(width) {
  reset();
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(tokens->weight, 0, 0.02);
  torch::nn::init::normal_(positions->weight, 0, 0.01);
}

void GptEmbeddingImpl::reset() {
  tokens = register_module("tokens", torch::nn::Embedding(vocabulary, width));
  positions = register_module("positions", torch::nn::Embedding(context, width));
}

at::Tensor GptEmbeddingImpl::forward(const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2, "GptEmbedding: token ids must be [batch, time], got ", ids.sizes());
  const int64_t time = ids.size(1);
  TORCH_CHECK(time <= positions->weight.size(0), "GptEmbedding: a sequence of ", time,
              " tokens is longer than the context (", positions->weight.size(0), ")");
  return tokens(ids) + positions(at::arange(time, ids.options()));
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t width, int64_t heads)
    : width(width), heads(heads) {
  TORCH_CHECK(heads > 0 && width % heads == 0, "CausalSelfAttention: width ", width,
              " is not a multiple of heads (", heads, ")");
  reset();
}

void CausalSelfAttentionImpl::reset() {
  qkv = register_module("qkv", torch::nn::Linear(width, 3 * width));
  proj = register_module("proj", torch::nn::Linear(width, width));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), time = x.size(1), width = x.size(2);
  const int64_t head = width / heads;
  // [B, T, 3 D] -> 3 x [B, H, T, D / H]
  const auto parts = qkv(x).view({batch, time, 3, heads, head}).permute({2, 0, 3, 1, 4});
  const at::Tensor q = parts[0], k = parts[1], v = parts[2];
  at::Tensor scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head));
  const at::Tensor future =
      at::ones({time, time}, x.options().dtype(at::kBool)).triu(/*diagonal=*/1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const at::Tensor y = scores.softmax(-1).matmul(v);  // [B, H, T, D / H]
  return proj(y.transpose(1, 2).reshape({batch, time, width}));
}

GptMlpImpl::GptMlpImpl(int64_t width) : width(width) { reset(); }

void GptMlpImpl::reset() {
  fc = register_module("fc", torch::nn::Linear(width, 4 * width));
  proj = register_module("proj", torch::nn::Linear(4 * width, width));
  gelu = register_module("gelu", torch::nn::GELU(torch::nn::GELUOptions().approximate("tanh")));
}

at::Tensor GptMlpImpl::forward(const at::Tensor& x) { return proj(gelu(fc(x))); }

PreNormImpl::PreNormImpl(int64_t width, std::string skip) : width(width), skip(std::move(skip)) {
  reset();
}

void PreNormImpl::reset() {
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
}

at::Tensor PreNormImpl::forward(const at::Tensor& x) {
  stash(skip, x);
  return norm(x);
}

at::Tensor AddResidualImpl::forward(const at::Tensor& x) { return x + pop(skip); }

TiedProjectionImpl::TiedProjectionImpl(const at::Tensor& w) {
  weight = register_parameter("weight", w);
}

void TiedProjectionImpl::reset() {
  // (A clone's: Module::clone copies the values in afterwards.)
  weight = register_parameter("weight", at::empty(weight.sizes(), weight.options()));
}

at::Tensor TiedProjectionImpl::forward(const at::Tensor& x) { return x.matmul(weight.t()); }

torch::nn::Sequential gpt(const GptOptions& o) {
  TORCH_CHECK(o.vocabulary() > 0 && o.context() > 0 && o.layers() >= 0 && o.width() > 0,
              "gpt: vocabulary, context and width must be positive and layers non-negative, got ",
              o.vocabulary(), ", ", o.context(), ", ", o.width(), " and ", o.layers());
  torch::nn::Sequential seq;
  GptEmbedding embed(o.vocabulary(), o.context(), o.width());
  seq->push_back("embed", embed);
  const double residual_std =
      0.02 / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(1, o.layers())));
  for (int64_t i = 0; i < o.layers(); ++i) {
    const std::string block = absl::StrCat("block", i);
    const std::string a = block + "_a", b = block + "_b";
    CausalSelfAttention attn(o.width(), o.heads());
    GptMlp mlp(o.width());
    {
      torch::NoGradGuard no_grad;
      for (torch::nn::Linear linear : {attn->qkv, attn->proj, mlp->fc, mlp->proj}) {
        const bool residual = linear.get() == attn->proj.get() || linear.get() == mlp->proj.get();
        torch::nn::init::normal_(linear->weight, 0, residual ? residual_std : 0.02);
        torch::nn::init::zeros_(linear->bias);
      }
    }
    seq->push_back(block + "_ln1", skippable(PreNorm(o.width(), a), SkippableOptions().stash({a})));
    seq->push_back(block + "_attn", attn);
    seq->push_back(block + "_add1", skippable(AddResidual(a), SkippableOptions().pop({a})));
    seq->push_back(block + "_ln2", skippable(PreNorm(o.width(), b), SkippableOptions().stash({b})));
    seq->push_back(block + "_mlp", mlp);
    seq->push_back(block + "_add2", skippable(AddResidual(b), SkippableOptions().pop({b})));
  }
  seq->push_back("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width()})));
  seq->push_back("head", TiedProjection(embed->tokens->weight));
  return seq;
}

GptOptions gpt2_small() { return GptOptions(50257, 1024).layers(12).width(768).heads(12); }

GptOptions gpt2_medium() { return GptOptions(50257, 1024).layers(24).width(1024).heads(16); }

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape(-1).to(logits.device()));
}

}  // namespace models
}  // namespace gpipe
