// The bundled ResNets (one layer per block, split into single layers, He et al.'s CIFAR ones) and
// the model registry: the standard architectures' parameter counts and layer counts, and training
// steps in a GPipe equal to the plain model's.
#include "tests/models/model_test_util.h"

#include "examples/models/registry.h"
#include "examples/models/resnet.h"

namespace gpipe {
namespace testing {
namespace {

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

CATCH_TEST_CASE("the fine-grained ResNets split every block into single layers with the "
                "parameters of the coarse ones", "[models]") {
  // The reference's ResNet-101: 4 stem layers, 33 bottlenecks of 11 layers, 3 head layers.
  torch::nn::Sequential fine101 = models::resnet_fine(101);
  CATCH_CHECK(fine101->size() == 370);
  CATCH_CHECK(parameter_count(*fine101) == 44549160);
  for (int64_t depth : {18, 50}) {
    CATCH_INFO("ResNet-" << depth);
    CATCH_CHECK(parameter_count(*models::resnet_fine(depth)) ==
                parameter_count(*models::resnet(depth)));
  }
  // ResNet-18: 4 stem layers, 8 basic blocks of 8 layers, 3 head layers.
  CATCH_CHECK(models::resnet_fine(18)->size() == 4 + 8 * 8 + 3);
  CATCH_CHECK_NOTHROW(verify_skippables(fine101));
  CATCH_CHECK_THROWS_WITH(models::resnet_fine(20), gpipe_test::contains("got 20"));
}

CATCH_TEST_CASE("He et al.'s CIFAR ResNets have their parameter counts and 3n + 2 layers",
                "[models]") {
  // The option-A (parameter-free shortcut) counts, e.g. akamaster/pytorch_resnet_cifar10.
  const std::vector<std::pair<int64_t, int64_t>> expected{
      {20, 269722}, {32, 464154}, {44, 658586}, {56, 853018}};
  for (const auto& [depth, count] : expected) {
    CATCH_INFO("ResNet-" << depth);
    torch::nn::Sequential model = models::resnet_cifar(depth);
    CATCH_CHECK(parameter_count(*model) == count);
    CATCH_CHECK(static_cast<int64_t>(model->size()) == 3 * (depth - 2) / 6 + 2);
  }
  CATCH_CHECK_THROWS_WITH(models::resnet_cifar(21), gpipe_test::contains("6n + 2"));
}

CATCH_TEST_CASE("a training step of a fine-grained ResNet in a GPipe, with partitions cutting "
                "inside blocks and shortcuts crossing them, equals the plain model's",
                "[models][transparency]") {
  // 70 layers: 3 stem, 8 blocks of 8 (Shortcut at 3 + 8k, Residual at 8 + 8k), 3 head.
  const std::vector<int64_t> balance =
      GENERATE(std::vector<int64_t>{70}, std::vector<int64_t>{5, 30, 35},
               std::vector<int64_t>{9, 14, 20, 27});
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways);
  CATCH_CAPTURE(balance, static_cast<int>(mode));
  auto make = [] { return models::resnet_fine(18, 10, /*imagenet=*/false, /*in_channels=*/1); };
  at::manual_seed(3);
  const at::Tensor x = at::randn({6, 1, 12, 12}, at::kDouble);
  const at::Tensor labels = at::randint(10, {6}, at::kLong);
  check_training_step(make, x, labels, cpu_options(balance, 3, mode));
}

CATCH_TEST_CASE("a training step of a CIFAR ResNet in a GPipe equals the plain model's",
                "[models][transparency]") {
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast);
  auto make = [] { return models::resnet_cifar(20, 10, /*in_channels=*/1); };
  at::manual_seed(4);
  const at::Tensor x = at::randn({4, 1, 16, 16}, at::kDouble);
  const at::Tensor labels = at::randint(10, {4}, at::kLong);
  check_training_step(make, x, labels,
                      GPipeOptions({4, 4, 3}).devices({at::kCPU, at::kCPU, at::kCPU}).chunks(2)
                          .checkpoint(mode));
}

CATCH_TEST_CASE("every bundled model builds and takes its sample", "[models]") {
  std::vector<std::string> names = models::model_names();
  names.push_back("amoebanet_d_3_32");  // the patterns' stand-ins in model_names()
  names.push_back("unet_1_8");
  names.push_back("gpt_2_64");
  for (const std::string& name : names) {
    // (GPT-2's shapes: built and counted in gpt_test.cc.)
    const bool big = (name.rfind("resnet", 0) == 0 && name.find("18") == std::string::npos &&
                      name.find("20_") == std::string::npos) ||
                     name.rfind("gpt2", 0) == 0;
    if (big || name.find("_<") != std::string::npos) continue;  // time and memory; patterns
    CATCH_INFO(name);
    models::NamedModel named = models::make_model(name);
    named.model->eval();
    CATCH_CHECK(named.model->forward(models::sample_batch(named, 2)).size(0) == 2);
  }
  CATCH_CHECK_THROWS_WITH(models::make_model("vgg"), gpipe_test::contains("unknown model 'vgg'"));
  CATCH_CHECK_THROWS_WITH(models::make_model("amoebanet_d_18"),
                          gpipe_test::contains("not amoebanet_d_<L>_<D>"));
}

CATCH_TEST_CASE("the registry gives its models the data's channels, size and classes",
                "[models]") {
  for (const char* name : {"resnet18_cifar", "resnet18_fine", "resnet20_cifar", "amoebanet_d_3_32"}) {
    CATCH_INFO(name);
    models::NamedModel named = models::make_model(name, {/*channels=*/1, /*size=*/28, /*classes=*/7});
    CATCH_CHECK(named.sample_shape == std::vector<int64_t>{1, 28, 28});
    named.model->eval();
    CATCH_CHECK(named.model->forward(at::randn({2, 1, 28, 28})).sizes() ==
                at::IntArrayRef({2, 7}));
  }
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
