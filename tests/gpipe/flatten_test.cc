// Flattening nested models (Note [Flattening nested models]): names after paths, the same layer
// objects, the same function, a balance that cuts inside a nested block, and the error for a
// ModuleList element that cannot be called.
#include "tests/gpipe/test_util.h"

#include <torch/nn/modules/container/modulelist.h>

#include "gpipe/flatten.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

// A Sequential that can be a layer of another: LibTorch's AnyModule needs a forward of fixed
// types, which Sequential's templated one is not (torchvision's C++ models do the same).
struct StackImpl : nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  at::Tensor forward(const at::Tensor& x) { return SequentialImpl::forward(x); }
};
TORCH_MODULE(Stack);

// stem, two blocks (the second holding a nested Stack), head.
nn::Sequential nested() {
  at::manual_seed(9);
  nn::Sequential model;
  model->push_back("stem", nn::Linear(4, 8));
  model->push_back("block0", Stack(nn::Linear(8, 8), nn::Tanh()));
  model->push_back("block1", Stack(nn::Linear(8, 8), Stack(nn::ReLU(), nn::Linear(8, 8))));
  model->push_back("head", nn::Linear(8, 2));
  model->to(at::kDouble);
  return model;
}

CATCH_TEST_CASE("flatten lists the leaf layers in order, named after their paths, and computes "
                "the nested model's function",
                "[flatten]") {
  nn::Sequential model = nested();
  nn::Sequential flat = flatten(model);
  std::vector<std::string> names;
  for (const auto& item : flat->named_children()) names.push_back(item.key());
  CATCH_CHECK(names == std::vector<std::string>{"stem", "block0_0", "block0_1", "block1_0",
                                                "block1_1_0", "block1_1_1", "head"});
  // The same objects: parameters are shared, not copied.
  CATCH_CHECK(flat->ptr(5).get() == model[2]->as<Stack>()->ptr(1)->as<Stack>()->ptr(1).get());
  CATCH_CHECK(flat->parameters().size() == model->parameters().size());
  const at::Tensor x = at::randn({5, 4}, at::kDouble);
  CATCH_CHECK(max_diff(flat->forward(x), model->forward(x)) == 0);
  // A ModuleList of blocks applied in order.
  nn::ModuleList blocks;
  blocks->push_back(Stack(nn::Linear(4, 4), nn::Tanh()));
  blocks->push_back(Stack(nn::Linear(4, 3)));
  blocks->to(at::kDouble);
  nn::Sequential from_list = flatten(blocks);
  CATCH_CHECK(from_list->named_children().keys() ==
              std::vector<std::string>{"0_0", "0_1", "1_0"});
  at::Tensor expected = x;
  for (const auto& block : *blocks) expected = block->as<Stack>()->forward(expected);
  CATCH_CHECK(max_diff(from_list->forward(x), expected) == 0);
}

CATCH_TEST_CASE("A flattened model in a GPipe, cut inside a nested block, trains as the nested "
                "model",
                "[flatten]") {
  nn::Sequential plain = nested();
  GPipe model(flatten(nested()), GPipeOptions({3, 4}).devices({at::kCPU, at::kCPU}).chunks(2));
  const at::Tensor x = at::randn({6, 4}, at::kDouble);
  plain->forward(x).pow(2).sum().backward();
  model->forward(x).pow(2).sum().backward();
  check_same_grads(plain->parameters(), model->parameters(), 1e-12);
}

CATCH_TEST_CASE("flatten refuses a ModuleList element whose forward it cannot call",
                "[flatten][errors]") {
  nn::ModuleList blocks;
  blocks->push_back(Stack(nn::Linear(2, 2)));
  blocks->push_back(nn::Linear(2, 2));
  CATCH_CHECK_THROWS_WITH(flatten(blocks), gpipe_test::contains("element '1'") &&
                                               gpipe_test::contains("torch::nn::LinearImpl") &&
                                               gpipe_test::contains("make each block a Sequential"));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
