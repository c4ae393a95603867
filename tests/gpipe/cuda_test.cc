// GPipe on CUDA: streams, copies between devices, the CUDA random generator in recomputation and
// deferred batch norm. Tagged [cuda]: skipped where no CUDA device is present.
#include "tests/gpipe/test_util.h"

#include <torch/cuda.h>

#include "gpipe/stream.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

nn::Sequential cuda_model() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 8, 3).padding(1)), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(8, 8, 3).padding(1)), nn::Tanh(),
                        nn::Flatten(), nn::Linear(8 * 6 * 6, 16), nn::Dropout(0.25), nn::ReLU(),
                        nn::Linear(16, 4));
}

// One training step with the generators seeded; returns the output and the gradients (on CPU).
std::vector<at::Tensor> step(const std::function<at::Tensor(const at::Tensor&)>& forward,
                             const std::vector<at::Tensor>& params, const at::Tensor& x) {
  at::manual_seed(5);
  at::Tensor y = forward(x);
  (y * y).sum().backward();
  std::vector<at::Tensor> out{y.detach().cpu()};
  for (const auto& p : params) out.push_back(p.grad().cpu());
  return out;
}

CATCH_TEST_CASE("on one GPU, GPipe equals the plain Sequential with streams and copies",
                "[cuda][transparency]") {
  const int64_t chunks = GENERATE(1, 3, 4);
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(chunks, static_cast<int>(mode));
  const c10::Device gpu(at::kCUDA, 0);
  auto make = [] { return cuda_model(); };
  nn::Sequential plain = build(make, 3);
  plain->to(gpu);
  plain->eval();  // no dropout: the micro-batch split changes the random draws
  GPipe model(build(make, 3),
              GPipeOptions({2, 3, 4}).devices({gpu, gpu, gpu}).chunks(chunks).checkpoint(mode));
  model->train();
  for (auto& m : model->modules()) {
    if (dynamic_cast<nn::DropoutImpl*>(m.get())) m->eval();
  }
  const at::Tensor x = at::randn({7, 3, 6, 6}, at::TensorOptions(at::kDouble).device(gpu));
  const auto a = step([&](const at::Tensor& in) { return plain->forward(in); }, plain->parameters(), x);
  const auto b = step([&](const at::Tensor& in) { return model->forward(in); }, model->parameters(), x);
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(max_diff(a[k], b[k]) <= 1e-10);
}

CATCH_TEST_CASE("a pipeline from the CPU to a GPU copies activations and gradients across",
                "[cuda][copy]") {
  const c10::Device gpu(at::kCUDA, 0);
  auto make = [] { return cuda_model(); };
  nn::Sequential plain = build(make, 4);
  plain->eval();
  GPipe model(build(make, 4), GPipeOptions({4, 5}).devices({at::kCPU, gpu}).chunks(3));
  model->eval();
  const at::Tensor x = at::randn({6, 3, 6, 6}, at::kDouble);
  at::Tensor y = model->forward(x);
  CATCH_CHECK(y.device() == gpu);
  CATCH_CHECK(model->partitions()[0]->parameters()[0].device().is_cpu());
  const auto a = step([&](const at::Tensor& in) { return plain->forward(in); }, plain->parameters(), x);
  const auto b = step([&](const at::Tensor& in) { return model->forward(in); }, model->parameters(), x);
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(max_diff(a[k], b[k]) <= 1e-10);
}

CATCH_TEST_CASE("on a GPU, recomputation replays the CUDA generator: dropout masks match",
                "[cuda][checkpoint]") {
  const c10::Device gpu(at::kCUDA, 0);
  const at::Tensor x = at::randn({8, 3, 6, 6}, at::TensorOptions(at::kDouble).device(gpu));
  auto run = [&](Checkpoint mode) {
    GPipe model(build([] { return cuda_model(); }, 6),
                GPipeOptions({4, 5}).devices({gpu, gpu}).chunks(4).checkpoint(mode));
    model->train();
    return step([&](const at::Tensor& in) { return model->forward(in); }, model->parameters(), x);
  };
  const auto never = run(Checkpoint::kNever);
  const auto always = run(Checkpoint::kAlways);
  for (size_t k = 0; k < never.size(); ++k) CATCH_CHECK(max_diff(never[k], always[k]) == 0.0);
}

CATCH_TEST_CASE("on a GPU, deferred batch norm matches a full-batch BatchNorm",
                "[cuda][batchnorm]") {
  const c10::Device gpu(at::kCUDA, 0);
  auto make = [] {
    return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)), nn::BatchNorm2d(4));
  };
  nn::Sequential plain = build(make, 2);
  plain->to(gpu);
  GPipe model(build(make, 2), GPipeOptions({1, 1}).devices({gpu, gpu}).chunks(4).deferred_batch_norm(true));
  // The BatchNorm is the second partition's only layer and sees the first layer's output, which
  // does not depend on the split into micro-batches.
  const at::Tensor x = at::randn({8, 3, 5, 5}, at::TensorOptions(at::kDouble).device(gpu));
  plain->forward(x);
  model->forward(x);
  auto expected = plain->named_buffers();
  auto actual = model->named_buffers();
  for (const auto& b : expected) {
    CATCH_CHECK(max_diff(b.value(), actual["partitions.1." + b.key()]) <= 1e-6);
  }
}

CATCH_TEST_CASE("memory statistics are reported for CUDA devices", "[cuda][stream]") {
  const c10::Device gpu(at::kCUDA, 0);
  const int64_t before = memory_allocated(gpu);
  at::Tensor t = at::empty({1 << 20}, at::TensorOptions(at::kFloat).device(gpu));
  CATCH_CHECK(memory_allocated(gpu) >= before + (4 << 20));
  CATCH_CHECK(memory_allocated(at::kCPU) == -1);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
