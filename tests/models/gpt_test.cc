// The GPT (examples/models/gpt.h): GPT-2's parameter counts with the tie counted once, its layers,
// its output against a straightforward implementation written here from its parameters, and
// training in a GPipe (skips and the tie across partitions) against the plain model.
#include <cmath>

#include <torch/optim/adam.h>

#include "examples/models/gpt.h"
#include "examples/models/registry.h"
#include "gpipe/gpipe.h"
#include "tests/catch.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace models {
namespace {

int64_t unique_parameter_count(const torch::nn::Sequential& model) {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const at::Tensor& p : model->parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  }
  return n;
}

CATCH_TEST_CASE("GPT-2 small and medium have the published parameter counts with the tied "
                "embedding counted once",
                "[models][gpt]") {
  // 124,439,808 and 354,823,168: OpenAI's GPT-2 checkpoints (Hugging Face's gpt2, gpt2-medium).
  const auto [name, count] = GENERATE(table<std::string, int64_t>(
      {{"gpt2_small", 124439808}, {"gpt2_medium", 354823168}}));
  CATCH_CAPTURE(name);
  const NamedModel named = make_model(name);
  CATCH_CHECK(unique_parameter_count(named.model) == count);
  const int64_t layers = name == "gpt2_small" ? 12 : 24;
  CATCH_CHECK(static_cast<int64_t>(named.model->size()) == 6 * layers + 3);
  CATCH_CHECK(named.vocabulary == 50257);
  CATCH_CHECK(named.sample_shape == std::vector<int64_t>{1024});
  // The head holds the token embedding's weight itself.
  const auto params = named.model->named_parameters();
  CATCH_CHECK(params["head.weight"].is_same(params["embed.tokens.weight"]));
}

// The same network written plainly from the parameters: per head, per position, a softmax over
// the positions before it.
at::Tensor reference_forward(const torch::nn::Sequential& model, const at::Tensor& ids,
                             int64_t layers, int64_t heads) {
  auto p = model->named_parameters();
  const auto ln = [&](const at::Tensor& x, const std::string& prefix) {
    const at::Tensor mean = x.mean(-1, true);
    const at::Tensor var = (x - mean).pow(2).mean(-1, true);
    return (x - mean) / (var + 1e-5).sqrt() * p[prefix + ".weight"] + p[prefix + ".bias"];
  };
  const auto linear = [&](const at::Tensor& x, const std::string& prefix) {
    return x.matmul(p[prefix + ".weight"].t()) + p[prefix + ".bias"];
  };
  const int64_t batch = ids.size(0), time = ids.size(1);
  at::Tensor x = p["embed.tokens.weight"].index_select(0, ids.reshape(-1)).view({batch, time, -1}) +
                 p["embed.positions.weight"].narrow(0, 0, time);
  const int64_t width = x.size(2), head = width / heads;
  for (int64_t i = 0; i < layers; ++i) {
    const std::string b = "block" + std::to_string(i);
    const at::Tensor h = ln(x, b + "_ln1.module.norm");
    const at::Tensor qkv = linear(h, b + "_attn.qkv");
    at::Tensor attended = at::zeros_like(h);
    for (int64_t n = 0; n < heads; ++n) {
      const at::Tensor q = qkv.narrow(2, n * head, head);
      const at::Tensor k = qkv.narrow(2, width + n * head, head);
      const at::Tensor v = qkv.narrow(2, 2 * width + n * head, head);
      for (int64_t t = 0; t < time; ++t) {
        // Position t attends to positions 0 .. t.
        const at::Tensor s = (q.narrow(1, t, 1) * k.narrow(1, 0, t + 1)).sum(-1) /
                             std::sqrt(static_cast<double>(head));  // [B, t + 1]
        const at::Tensor w = (s - s.amax(1, true)).exp();
        const at::Tensor a = w / w.sum(1, true);
        attended.narrow(1, t, 1).narrow(2, n * head, head).copy_(
            (a.unsqueeze(2) * v.narrow(1, 0, t + 1)).sum(1, true));
      }
    }
    x = x + linear(attended, b + "_attn.proj");
    const at::Tensor u = linear(ln(x, b + "_ln2.module.norm"), b + "_mlp.fc");
    const at::Tensor gelu =
        0.5 * u * (1 + (std::sqrt(2.0 / M_PI) * (u + 0.044715 * u.pow(3))).tanh());
    x = x + linear(gelu, b + "_mlp.proj");
  }
  return ln(x, "ln_f").matmul(p["embed.tokens.weight"].t());
}

torch::nn::Sequential small_gpt() {
  at::manual_seed(3);
  torch::nn::Sequential model = gpt(GptOptions(11, 8).layers(2).width(8).heads(2));
  model->to(at::kDouble);
  return model;
}

CATCH_TEST_CASE("The GPT computes what a straightforward implementation computes",
                "[models][gpt]") {
  torch::nn::Sequential model = small_gpt();
  const at::Tensor ids = at::randint(11, {3, 7}, at::kLong);
  const at::Tensor got = model->forward(ids);
  CATCH_CHECK(got.sizes() == std::vector<int64_t>{3, 7, 11});
  CATCH_CHECK(gpipe::testing::max_diff(got, reference_forward(model, ids, 2, 2)) <= 1e-10);
  // Causal: the logits of position 3 do not depend on later tokens.
  at::Tensor changed = ids.clone();
  changed.narrow(1, 4, 3).fill_(0);
  CATCH_CHECK(gpipe::testing::max_diff(model->forward(changed).narrow(1, 0, 4),
                                       got.narrow(1, 0, 4)) <= 1e-12);
}

CATCH_TEST_CASE("A GPT in a GPipe, cut inside blocks and its tie across partitions, trains as "
                "the plain model",
                "[models][gpt][tied]") {
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast);
  CATCH_CAPTURE(static_cast<int>(mode));
  torch::nn::Sequential plain = small_gpt();
  // 15 layers: embed, 2 x 6, ln_f, head; the cuts split block 0 after its attention (a skip
  // crosses) and block 1 before its MLP half.
  GPipe model(small_gpt(), GPipeOptions({3, 7, 5})
                               .devices({at::kCPU, at::kCPU, at::kCPU})
                               .chunks(3)
                               .checkpoint(mode));
  CATCH_REQUIRE(model->ties().size() == 1);
  std::vector<at::Tensor> unique;
  {
    std::set<const void*> seen;
    for (const at::Tensor& t : plain->parameters()) {
      if (seen.insert(t.unsafeGetTensorImpl()).second) unique.push_back(t);
    }
  }
  CATCH_REQUIRE(model->parameters().size() == unique.size());
  torch::optim::Adam adam1(unique, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  torch::optim::Adam adam2(model->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor ids = at::randint(11, {6, 8}, at::kLong);
    const at::Tensor targets = at::randint(11, {6, 8}, at::kLong);
    adam1.zero_grad();
    adam2.zero_grad();
    const at::Tensor l1 = next_token_loss(plain->forward(ids), targets);
    l1.backward();
    const at::Tensor l2 = next_token_loss(model->forward(ids), targets);
    l2.backward();
    CATCH_CHECK(std::abs(l1.item<double>() - l2.item<double>()) <= 1e-10);
    gpipe::testing::check_same_grads(unique, model->parameters(), 1e-10);
    adam1.step();
    adam2.step();
  }
}

}  // namespace
}  // namespace models
}  // namespace gpipe
