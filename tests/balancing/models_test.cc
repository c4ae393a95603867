// The bundled models: the sequential ResNets have the standard architectures' parameter counts,
// one layer per block, and run in a GPipe exactly as on their own.
#include "tests/gpipe/test_util.h"

#include "examples/models/registry.h"
#include "examples/models/resnet.h"

namespace gpipe {
namespace testing {
namespace {

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

CATCH_TEST_CASE("the sequential ResNets have torchvision's parameter counts", "[models]") {
  // torchvision.models.resnetN(num_classes=1000).
  const std::vector<std::pair<int64_t, int64_t>> expected{
      {18, 11689512}, {34, 21797672}, {50, 25557032}, {101, 44549160}, {152, 60192808}};
  for (const auto& [depth, count] : expected) {
    CATCH_INFO("ResNet-" << depth);
    CATCH_CHECK(parameter_count(*models::resnet(depth)) == count);
  }
}

CATCH_TEST_CASE("a sequential ResNet is the stem, one layer per block, and the head",
                "[models]") {
  CATCH_CHECK(models::resnet(18)->size() == 1 + 8 + 1);
  CATCH_CHECK(models::resnet(50)->size() == 1 + 16 + 1);
  CATCH_CHECK(models::resnet(101)->size() == 1 + 33 + 1);
  CATCH_CHECK(models::resnet(152)->size() == 1 + 50 + 1);
  CATCH_CHECK_THROWS_WITH(models::resnet(42), gpipe_test::contains("18, 34, 50, 101 or 152, got 42"));
}

CATCH_TEST_CASE("a CIFAR ResNet in a GPipe equals the plain model", "[models][transparency]") {
  auto make = [] { return models::resnet(18, 10, /*imagenet=*/false); };
  torch::nn::Sequential plain = build(make, 5);
  GPipe model(build(make, 5), GPipeOptions({3, 4, 3}).devices({at::kCPU, at::kCPU, at::kCPU}).chunks(2));
  plain->eval();
  model->eval();
  const at::Tensor x = at::randn({3, 3, 32, 32}, at::kDouble);
  at::Tensor y1 = plain->forward(x);
  at::Tensor y2 = model->forward(x);
  CATCH_CHECK(y2.sizes() == at::IntArrayRef({3, 10}));
  CATCH_CHECK(max_diff(y1, y2) <= 1e-10);
  y1.sum().backward();
  y2.sum().backward();
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
}

CATCH_TEST_CASE("every bundled model builds and takes its sample", "[models]") {
  for (const std::string& name : models::model_names()) {
    if (name.rfind("resnet", 0) == 0 && name.find("18") == std::string::npos) continue;  // size
    CATCH_INFO(name);
    models::NamedModel named = models::make_model(name);
    std::vector<int64_t> shape{2};
    shape.insert(shape.end(), named.sample_shape.begin(), named.sample_shape.end());
    named.model->eval();
    CATCH_CHECK(named.model->forward(at::randn(shape)).size(0) == 2);
  }
  CATCH_CHECK_THROWS_WITH(models::make_model("vgg"), gpipe_test::contains("unknown model 'vgg'"));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
