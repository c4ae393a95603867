// Tied parameters in one process (Note [Tied parameters]): a weight shared by the first and the
// last layer, found or named, trained over several optimizer steps against the plain Sequential
// with the weight truly shared; clones across devices; errors.
#include "tests/gpipe/tied_model.h"
#include "tests/gpipe/test_util.h"

#include <unistd.h>

#include <filesystem>

#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "gpipe/saved_training.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;
using namespace tied_test;  // NOLINT: the tied model

std::unique_ptr<torch::optim::Optimizer> make_optimizer(bool adam,
                                                        const std::vector<at::Tensor>& params) {
  if (adam) {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(0.01).weight_decay(0.1));
  }
  return std::make_unique<torch::optim::SGD>(params,
                                             torch::optim::SGDOptions(0.05).momentum(0.9));
}

enum class Run { kForward, kStageLocal, kStepGPipe, kStep1F1B };

CATCH_TEST_CASE("A weight tied between the first and the last layer trains as in the plain model "
                "over several steps, found or named, in every checkpoint mode",
                "[tied]") {
  const bool named = GENERATE(false, true);
  const std::vector<int64_t> balance = GENERATE(std::vector<int64_t>{2, 3},
                                                std::vector<int64_t>{2, 2, 1});
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const Run run = GENERATE(Run::kForward, Run::kStageLocal, Run::kStepGPipe, Run::kStep1F1B);
  const bool adam = GENERATE(false, true);
  CATCH_CAPTURE(named, balance.size(), static_cast<int>(mode), static_cast<int>(run), adam);

  nn::Sequential plain = tied_model(/*shared=*/true);
  const std::vector<c10::Device> devices(balance.size(), c10::Device(at::kCPU));
  GPipeOptions options = GPipeOptions(balance).devices(devices).chunks(3).checkpoint(mode);
  if (named) options.tied_parameters({{"0.weight", "4.weight"}});
  if (run == Run::kStageLocal) options.worker_per_partition(true).stage_local_backward(true);
  if (run == Run::kStep1F1B) options.schedule(ScheduleKind::k1F1B);
  GPipe model(tied_model(/*shared=*/!named), options);
  CATCH_REQUIRE(model->ties().size() == 1);
  CATCH_CHECK(model->ties()[0].names == std::vector<std::string>{"0.weight", "4.weight"});
  CATCH_CHECK(model->has_tied_copies() == named);

  const std::vector<at::Tensor> plain_params = each_once(plain->parameters());
  CATCH_REQUIRE(plain_params.size() == 5);  // the tie, 2 x (weight, bias)
  CATCH_REQUIRE(model->parameters().size() == plain_params.size());
  CATCH_CHECK(model->named_parameters().keys().front() == "partitions.0.0.weight");
  auto opt1 = make_optimizer(adam, plain_params);
  auto opt2 = make_optimizer(adam, model->parameters());
  const at::Tensor last_place = model->partitions().back()->named_parameters()["4.weight"];

  for (int step = 0; step < 4; ++step) {
    CATCH_INFO("step " << step);
    const at::Tensor x = at::randn({6, kVocab}, at::kDouble);
    const at::Tensor target = at::randn({6, kVocab}, at::kDouble);
    const auto loss_fn = [](const Batch& out, const at::Tensor& y) {
      return (out.tensor() - y).pow(2).mean();  // a mean: split by micro-batch in 1F1B
    };
    opt1->zero_grad();
    opt2->zero_grad();
    const at::Tensor l1 = (plain->forward(x) - target).pow(2).mean();
    l1.backward();
    at::Tensor l2;
    if (run == Run::kStepGPipe || run == Run::kStep1F1B) {
      l2 = model->step(x, target, loss_fn);
    } else {
      l2 = (model->forward(x) - target).pow(2).mean();
      l2.backward();
    }
    CATCH_CHECK(std::abs(l1.item<double>() - l2.item<double>()) <= 1e-10);
    check_same_grads(plain_params, model->parameters(), 1e-10);
    if (named) CATCH_CHECK(!last_place.grad().defined());  // summed into the owner
    opt1->step();
    opt2->step();
    const auto mine = model->parameters();
    for (size_t k = 0; k < plain_params.size(); ++k) {
      CATCH_CHECK(max_diff(plain_params[k], mine[k]) <= 1e-10);
    }
  }
  // The copy is brought up to date by the next forward.
  at::NoGradGuard no_grad;
  const at::Tensor x = at::randn({4, kVocab}, at::kDouble);
  CATCH_CHECK(max_diff(plain->forward(x), model->forward(x)) <= 1e-10);
  CATCH_CHECK(max_diff(last_place, model->parameters()[0]) == 0);
}

CATCH_TEST_CASE("A tied model saved and loaded takes the same next steps", "[tied][saving]") {
  const auto dir = std::filesystem::temp_directory_path() /
                   absl::StrCat("gpipe_tied_", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "tied.pt").string();
  const auto options = GPipeOptions({2, 3})
                           .devices({at::kCPU, at::kCPU})
                           .chunks(2)
                           .tied_parameters({{"0.weight", "4.weight"}});
  const auto train = [](GPipe& model, torch::optim::Optimizer& opt, int steps) {
    std::vector<at::Tensor> losses;
    for (int s = 0; s < steps; ++s) {
      const at::Tensor x = at::randn({4, kVocab}, at::kDouble);
      opt.zero_grad();
      const at::Tensor loss = model->forward(x).pow(2).sum();
      loss.backward();
      opt.step();
      losses.push_back(loss.detach());
    }
    return losses;
  };
  GPipe first(tied_model(false), options);
  torch::optim::Adam adam1(first->parameters(), torch::optim::AdamOptions(0.01));
  train(first, adam1, 2);
  save_training(path, *first, &adam1, 2);
  const auto expected = train(first, adam1, 2);

  GPipe second(tied_model(false), options);
  torch::optim::Adam adam2(second->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(load_training(path, *second, &adam2) == 2);
  const auto got = train(second, adam2, 2);
  for (size_t k = 0; k < got.size(); ++k) CATCH_CHECK(max_diff(expected[k], got[k]) == 0);
  for (size_t k = 0; k < first->parameters().size(); ++k) {
    CATCH_CHECK(max_diff(first->parameters()[k], second->parameters()[k]) == 0);
  }
  std::filesystem::remove_all(dir);
}

CATCH_TEST_CASE("A layer sharing a weight with a layer on another device is cloned there, with "
                "a copy of the weight",
                "[tied]") {
  nn::Sequential model = tied_model(/*shared=*/true);
  // Devices only label the layers here: nothing moves.
  const c10::Device cpu(at::kCPU), gpu("cuda:0");
  const nn::Sequential same = clone_across_devices(model, {cpu, cpu, cpu, cpu, cpu}, "test");
  CATCH_CHECK(same.ptr() == model.ptr());
  const nn::Sequential split = clone_across_devices(model, {cpu, cpu, cpu, gpu, gpu}, "test");
  CATCH_REQUIRE(split->size() == 5);
  for (size_t i = 0; i < 4; ++i) CATCH_CHECK(split->ptr(i).get() == model->ptr(i).get());
  CATCH_CHECK(split->ptr(4).get() != model->ptr(4).get());
  CATCH_CHECK(split->named_children()[4].key() == "4");
  const at::Tensor original = model->named_parameters()["4.weight"];
  const at::Tensor copy = split->named_parameters()["4.weight"];
  CATCH_CHECK(!copy.is_same(original));
  CATCH_CHECK(max_diff(copy, original) == 0);
}

// Not Cloneable.
struct PlainProjectImpl : nn::Module {
  explicit PlainProjectImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor forward(const at::Tensor& h) { return h.matmul(weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(PlainProject);

CATCH_TEST_CASE("Ties that cannot work are refused, naming the parameter", "[tied][errors]") {
  const auto cpu2 = GPipeOptions({2, 3}).devices({at::kCPU, at::kCPU});
  CATCH_CHECK_THROWS_WITH(
      GPipe(tied_model(false), GPipeOptions(cpu2).tied_parameters({{"0.weight", "9.weight"}})),
      gpipe_test::contains("'9.weight'") && gpipe_test::contains("is not a parameter") &&
          gpipe_test::contains("'0.weight'"));
  CATCH_CHECK_THROWS_WITH(
      GPipe(tied_model(false), GPipeOptions(cpu2).tied_parameters({{"0.weight", "1.weight"}})),
      gpipe_test::contains("differ in shape") && gpipe_test::contains("[6, 5]") &&
          gpipe_test::contains("[5, 5]"));
  nn::Sequential frozen = tied_model(false);
  frozen->named_parameters()["4.weight"].set_requires_grad(false);
  CATCH_CHECK_THROWS_WITH(
      GPipe(frozen, GPipeOptions(cpu2).tied_parameters({{"0.weight", "4.weight"}})),
      gpipe_test::contains("only '0.weight' requires grad"));
  const at::Tensor w = at::randn({kVocab, kWidth}, at::kDouble);
  nn::Sequential plain{Embed(w), nn::Tanh(), PlainProject(w)};
  CATCH_CHECK_THROWS_WITH(
      clone_across_devices(plain, {at::kCPU, at::kCPU, c10::Device("cuda:0")}, "GPipe"),
      gpipe_test::contains("layer 2 ('2'") && gpipe_test::contains("cannot be cloned") &&
          gpipe_test::contains("tied_parameters"));
}

CATCH_TEST_CASE("A weight tied across a CPU and a GPU partition trains as in the plain model",
                "[tied][cuda]") {
  nn::Sequential plain = tied_model(/*shared=*/true);
  GPipe model(tied_model(/*shared=*/true),
              GPipeOptions({2, 3}).devices({at::kCPU, c10::Device("cuda:0")}).chunks(3));
  CATCH_CHECK(model->has_tied_copies());
  const std::vector<at::Tensor> plain_params = each_once(plain->parameters());
  auto opt1 = make_optimizer(true, plain_params);
  auto opt2 = make_optimizer(true, model->parameters());
  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = at::randn({6, kVocab}, at::kDouble);
    opt1->zero_grad();
    opt2->zero_grad();
    plain->forward(x).pow(2).sum().backward();
    model->forward(x).pow(2).sum().backward();
    check_same_grads(plain_params, model->parameters(), 1e-10);
    opt1->step();
    opt2->step();
  }
  const at::Tensor copy = model->partitions()[1]->named_parameters()["4.weight"];
  CATCH_CHECK(copy.is_cuda());
  at::NoGradGuard no_grad;
  const at::Tensor x = at::randn({4, kVocab}, at::kDouble);
  CATCH_CHECK(max_diff(plain->forward(x), model->forward(x).cpu()) <= 1e-10);
  CATCH_CHECK(max_diff(copy.cpu(), model->parameters()[0]) == 0);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
