// The README's quick start as a reader copies it: tools/check_doc_snippets.py checks that
// README.md's block is the text between the [quick_start] marks below, and that the
// [quick_start_cpu] copy is the same text with the CPU for both GPUs. On two GPUs ([gpus2]) the
// first runs as written; the second runs everywhere. Both are checked against the plain
// Sequential with the same weights.
#include "tests/gpipe/test_util.h"

#include <torch/torch.h>

#include "gpipe/gpipe.h"

namespace gpipe {
namespace testing {
namespace {

// The plain Sequential that `make` builds, with `params` (a GPipe's, in layer order) copied in.
torch::nn::Sequential plain_with(const std::function<torch::nn::Sequential()>& make,
                                 const std::vector<at::Tensor>& params) {
  torch::nn::Sequential plain = make();
  const std::vector<at::Tensor> mine = plain->parameters();
  CATCH_REQUIRE(mine.size() == params.size());
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < mine.size(); ++k) mine[k].copy_(params[k].cpu());
  return plain;
}

// What the quick start did, checked against the plain model: `model`'s forward() + backward()
// and one SGD step of 0.1 (its weights before the step are the weights after it plus 0.1 times
// the gradients), and `f1b1`'s step() (its gradients, accumulated, and its loss).
void check_quick_start(const std::function<torch::nn::Sequential()>& make, GPipe& model,
                       const at::Tensor& y, GPipe& f1b1, const at::Tensor& loss,
                       const at::Tensor& x, const at::Tensor& target) {
  std::vector<at::Tensor> before;
  for (const at::Tensor& p : model->parameters()) before.push_back(p.detach() + 0.1 * p.grad());
  torch::nn::Sequential plain = plain_with(make, before);
  const at::Tensor plain_y = plain->forward(x.cpu());
  CATCH_CHECK(max_diff(y, plain_y) < 1e-5);
  torch::nn::functional::cross_entropy(plain_y, target.cpu()).backward();
  check_same_grads(plain->parameters(), model->parameters(), 1e-5);

  torch::nn::Sequential plain_1f1b = plain_with(make, f1b1->parameters());
  const at::Tensor plain_loss =
      torch::nn::functional::cross_entropy(plain_1f1b->forward(x.cpu()), target.cpu());
  CATCH_CHECK(max_diff(loss, plain_loss) < 1e-5);
  plain_loss.backward();
  check_same_grads(plain_1f1b->parameters(), f1b1->parameters(), 1e-5);
}

CATCH_TEST_CASE("the README's quick start puts its two partitions on two GPUs and trains as the "
                "plain model",
                "[cuda][gpus2][readme]") {
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({64, 784});
  const at::Tensor target = torch::randint(10, {64});
// [quick_start]
#include <torch/torch.h>
#include "gpipe/gpipe.h"

namespace nn = torch::nn;
auto make = [] {
  return nn::Sequential(nn::Linear(784, 512), nn::ReLU(), nn::Linear(512, 512), nn::ReLU(),
                        nn::Linear(512, 10));
};
gpipe::GPipe model(make(), gpipe::GPipeOptions({3, 2})       // layers per partition
                               .devices({torch::Device("cuda:0"), torch::Device("cuda:1")})
                               .chunks(8));  // micro-batches per mini-batch; devices' default:
                                             // every GPU in turn, else the CPU
torch::optim::SGD opt(model->parameters(), 0.1);

// As a module: forward() pipelines the micro-batches, LibTorch's backward() runs theirs.
auto y = model->forward(x.to(model->devices().front()));     // y is on devices().back()
nn::functional::cross_entropy(y, target.to(y.device())).backward();
opt.step();

// Or a whole training step under a schedule, the loss an argument. 1F1B keeps the activations
// of at most n - s micro-batches on partition s, instead of all of them.
gpipe::GPipe f1b1(make(), gpipe::GPipeOptions({3, 2})
                              .devices({torch::Device("cuda:0"), torch::Device("cuda:1")})
                              .chunks(8)
                              .schedule(gpipe::ScheduleKind::k1F1B));
auto cross_entropy = [](const gpipe::Batch& out, const at::Tensor& t) {
  return nn::functional::cross_entropy(out[0], t.to(out[0].device()));
};
at::Tensor loss = f1b1->step(x.to("cuda:0"), target, cross_entropy);  // gradients accumulated
// [quick_start]
  const std::vector<c10::Device> gpus{c10::Device("cuda:0"), c10::Device("cuda:1")};
  CATCH_CHECK(model->devices() == gpus);
  CATCH_CHECK(f1b1->devices() == gpus);
  CATCH_CHECK(model->parameters().front().device() == gpus[0]);
  CATCH_CHECK(model->parameters().back().device() == gpus[1]);
  CATCH_CHECK(y.device() == gpus[1]);
  check_quick_start(make, model, y, f1b1, loss, x, target);
}

CATCH_TEST_CASE("the README's quick start with the CPU for both GPUs trains as the plain model",
                "[readme]") {
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({64, 784});
  const at::Tensor target = torch::randint(10, {64});
  // snippet-variant: [quick_start_cpu] is [quick_start] with "cuda:0" -> "cpu", "cuda:1" -> "cpu"
// [quick_start_cpu]
#include <torch/torch.h>
#include "gpipe/gpipe.h"

namespace nn = torch::nn;
auto make = [] {
  return nn::Sequential(nn::Linear(784, 512), nn::ReLU(), nn::Linear(512, 512), nn::ReLU(),
                        nn::Linear(512, 10));
};
gpipe::GPipe model(make(), gpipe::GPipeOptions({3, 2})       // layers per partition
                               .devices({torch::Device("cpu"), torch::Device("cpu")})
                               .chunks(8));  // micro-batches per mini-batch; devices' default:
                                             // every GPU in turn, else the CPU
torch::optim::SGD opt(model->parameters(), 0.1);

// As a module: forward() pipelines the micro-batches, LibTorch's backward() runs theirs.
auto y = model->forward(x.to(model->devices().front()));     // y is on devices().back()
nn::functional::cross_entropy(y, target.to(y.device())).backward();
opt.step();

// Or a whole training step under a schedule, the loss an argument. 1F1B keeps the activations
// of at most n - s micro-batches on partition s, instead of all of them.
gpipe::GPipe f1b1(make(), gpipe::GPipeOptions({3, 2})
                              .devices({torch::Device("cpu"), torch::Device("cpu")})
                              .chunks(8)
                              .schedule(gpipe::ScheduleKind::k1F1B));
auto cross_entropy = [](const gpipe::Batch& out, const at::Tensor& t) {
  return nn::functional::cross_entropy(out[0], t.to(out[0].device()));
};
at::Tensor loss = f1b1->step(x.to("cpu"), target, cross_entropy);  // gradients accumulated
// [quick_start_cpu]
  CATCH_CHECK(model->devices() == std::vector<c10::Device>(2, c10::Device("cpu")));
  check_quick_start(make, model, y, f1b1, loss, x, target);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
