// Transformers' needs in one process: tied parameters (Note [Tied parameters]: a weight shared by
// the first and the last layer, found or named, trained over several optimizer steps against the
// plain Sequential with the weight truly shared; clones across devices; errors), flattening
// nested models (Note [Flattening nested models]), and dynamic loss scaling (Note [Loss
// scaling]: the documented growth and back-off, a step with an inf in one partition skipped on
// every partition, a forced scale, saved state, float16 on CUDA against float32).
#include "tests/gpipe/tied_model.h"
#include "tests/gpipe/test_util.h"

#include <unistd.h>

#include <filesystem>
#include <limits>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "gpipe/flatten.h"
#include "gpipe/grad_scaler.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/internal/stage_backward.h"
#include "gpipe/saved_training.h"
#include "gpipe/skippable.h"

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

enum class Run { kForward, kStageLocal, kStepGPipe, kStep1F1B, kStepZB };

CATCH_TEST_CASE("A weight tied between the first and the last layer trains as in the plain model "
                "over several steps, found or named, in every checkpoint mode",
                "[tied]") {
  const bool named = GENERATE(false, true);
  const std::vector<int64_t> balance = GENERATE(std::vector<int64_t>{2, 3},
                                                std::vector<int64_t>{2, 2, 1});
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const Run run =
      GENERATE(Run::kForward, Run::kStageLocal, Run::kStepGPipe, Run::kStep1F1B, Run::kStepZB);
  const bool adam = GENERATE(false, true);
  CATCH_CAPTURE(named, balance.size(), static_cast<int>(mode), static_cast<int>(run), adam);

  nn::Sequential plain = tied_model(/*shared=*/true);
  const std::vector<c10::Device> devices(balance.size(), c10::Device(at::kCPU));
  GPipeOptions options = GPipeOptions(balance).devices(devices).chunks(3).checkpoint(mode);
  if (named) options.tied_parameters({{"0.weight", "4.weight"}});
  // forward(): the one graph, and the engine's default on these CPU partitions, each partition's
  // backward on its thread (Note [Stage-local backward in one process]).
  if (run == Run::kForward) options = gpipe::internal::with_stage_local_backward(options, false);
  if (run == Run::kStageLocal) options = gpipe::internal::with_stage_local_backward(options, true);
  if (run == Run::kStep1F1B) options.schedule(ScheduleKind::k1F1B);
  if (run == Run::kStepZB) options.schedule(ScheduleKind::kZeroBubble);  // W split by layer
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
    if (run == Run::kStepGPipe || run == Run::kStep1F1B || run == Run::kStepZB) {
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

CATCH_TEST_CASE("After a step that fails in backward, a weight tied across a CPU and a GPU "
                "partition takes the plain model's gradients in the next step",
                "[tied][cuda][errors]") {
  nn::Sequential plain = tied_model(/*shared=*/true);
  GPipe model(tied_model(/*shared=*/true),
              GPipeOptions({2, 3}).devices({at::kCPU, c10::Device("cuda:0")}).chunks(3));
  CATCH_REQUIRE(model->has_tied_copies());
  auto mse = [](const Batch& out, const at::Tensor& y) {
    return (out[0].to(y.device()) - y).pow(2).mean();
  };
  // The input's gradient hook throws: the step fails after every partition's backward, the
  // GPU copy's gradient made.
  const at::Tensor bad = at::randn({6, kVocab}, at::kDouble).requires_grad_(true);
  bad.register_hook([](const at::Tensor&) -> at::Tensor {
    throw std::runtime_error("the input's hook fails");
  });
  CATCH_CHECK_THROWS_WITH(model->step(bad, at::randn({6, kVocab}, at::kDouble), mse),
                          gpipe_test::contains("the input's hook fails"));
  for (const at::Tensor& p : model->parameters()) p.mutable_grad() = at::Tensor();  // zero_grad
  const at::Tensor x = at::randn({6, kVocab}, at::kDouble);
  const at::Tensor y = at::randn({6, kVocab}, at::kDouble);
  mse(Batch(plain->forward(x)), y).backward();
  model->step(x, y, mse);
  check_same_grads(each_once(plain->parameters()), model->parameters(), 1e-10);
}

CATCH_TEST_CASE(
    "After a step that fails in backward, a weight tied by name across CPU "
    "partitions takes the plain model's gradients in the next step",
    "[tied][errors]") {
  const ScheduleKind kind =
      GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZeroBubble);
  CATCH_CAPTURE(schedule_kind_name(kind));
  nn::Sequential plain = tied_model(/*shared=*/true);
  GPipe model(tied_model(/*shared=*/false), GPipeOptions({2, 3})
                                                .devices({at::kCPU, at::kCPU})
                                                .chunks(3)
                                                .schedule(kind)
                                                .tied_parameters({{"0.weight", "4.weight"}}));
  CATCH_REQUIRE(model->has_tied_copies());
  auto mse = [](const Batch& out, const at::Tensor& y) { return (out[0] - y).pow(2).mean(); };
  // The input's gradient hook throws after every partition's backward, the copy's gradient made.
  const at::Tensor bad = at::randn({6, kVocab}, at::kDouble).requires_grad_(true);
  bad.register_hook(
      [](const at::Tensor&) -> at::Tensor { throw std::runtime_error("the input's hook fails"); });
  CATCH_CHECK_THROWS_WITH(model->step(bad, at::randn({6, kVocab}, at::kDouble), mse),
                          gpipe_test::contains("the input's hook fails"));
  const std::vector<at::Tensor> params = model->parameters();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
  opt.zero_grad();  // reaches the owner only: the copy's gradient must not survive the failure
  const at::Tensor x = at::randn({6, kVocab}, at::kDouble);
  const at::Tensor y = at::randn({6, kVocab}, at::kDouble);
  mse(Batch(plain->forward(x)), y).backward();
  model->step(x, y, mse);
  check_same_grads(each_once(plain->parameters()), params, 1e-10);
}

// Identity whose output's gradient hook throws while `armed`: a backward that fails after the
// layers behind it (the tie's owner among them) have their gradients.
struct GateImpl : nn::Module {
  explicit GateImpl(std::shared_ptr<bool> armed) : armed(std::move(armed)) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x * 1.0;
    if (*armed && y.requires_grad()) {
      y.register_hook([](const at::Tensor&) -> at::Tensor {
        throw std::runtime_error("the gate's hook fails");
      });
    }
    return y;
  }
  std::shared_ptr<bool> armed;
};
TORCH_MODULE(Gate);

CATCH_TEST_CASE(
    "After a forward() whose backward fails, a weight tied by name takes the plain model's "
    "gradients, whether the user zeroes them or goes on accumulating",
    "[tied][errors]") {
  const bool stage_local = GENERATE(false, true);
  const bool zero = GENERATE(false, true);
  CATCH_CAPTURE(stage_local, zero);
  auto armed = std::make_shared<bool>(true);
  const auto gated = [&](bool shared) {
    nn::Sequential tied = tied_model(shared);
    nn::Sequential model{Gate(armed)};
    for (const nn::AnyModule& layer : *tied) model->push_back(layer);
    return model;
  };
  nn::Sequential plain = gated(/*shared=*/true);
  // Going on, one micro-batch: which of several micro-batches' nodes a failed backward ran
  // before it stopped is the engine's choice, while one's are ordered (a leaf's gradient is
  // accumulated before the node that made the leaf's user's input runs).
  GPipeOptions options = GPipeOptions({3, 3})
                             .devices({at::kCPU, at::kCPU})
                             .chunks(zero ? 3 : 1)
                             .tied_parameters({{"1.weight", "5.weight"}});
  GPipe model(gated(/*shared=*/false),
              gpipe::internal::with_stage_local_backward(options, stage_local));
  CATCH_REQUIRE(model->has_tied_copies());
  const std::vector<at::Tensor> plain_params = each_once(plain->parameters());
  const std::vector<at::Tensor> params = model->parameters();
  torch::optim::SGD opt1(plain_params, torch::optim::SGDOptions(0.05));
  torch::optim::SGD opt2(params, torch::optim::SGDOptions(0.05));
  const auto mse = [](const at::Tensor& out, const at::Tensor& y) {
    return (out - y).pow(2).mean();
  };
  // The copy (in the last partition) has its gradient and the owner its part, when the gate's
  // hook fails.
  const at::Tensor bad = at::randn({6, kVocab}, at::kDouble).requires_grad_(true);
  const at::Tensor bad_y = at::randn({6, kVocab}, at::kDouble);
  CATCH_CHECK_THROWS_WITH(mse(plain->forward(bad), bad_y).backward(),
                          gpipe_test::contains("the gate's hook fails"));
  CATCH_CHECK_THROWS_WITH(mse(model->forward(bad), bad_y).backward(),
                          gpipe_test::contains("the gate's hook fails"));
  *armed = false;
  for (int step = 0; step < 2; ++step) {
    CATCH_INFO("step " << step);
    if (zero || step > 0) {
      opt1.zero_grad();
      opt2.zero_grad();
    }
    const at::Tensor x = at::randn({6, kVocab}, at::kDouble);
    const at::Tensor y = at::randn({6, kVocab}, at::kDouble);
    mse(plain->forward(x), y).backward();
    mse(model->forward(x), y).backward();
    check_same_grads(plain_params, params, 1e-10);
    opt1.step();
    opt2.step();
  }
}

// Identity that asks for current_microbatch(), as a layer keeping its own map does.
struct AskImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    asked.push_back(current_microbatch());
    return x * 1.0;
  }
  std::vector<MicroBatch> asked;
};
TORCH_MODULE(Ask);

CATCH_TEST_CASE("A layer asking for current_microbatch() beside a weight shared across partitions "
                "of one device trains under step() as the plain model",
                "[tied][microbatch]") {
  const ScheduleKind kind =
      GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZeroBubble);
  CATCH_CAPTURE(schedule_kind_name(kind));
  nn::Sequential plain = tied_model(/*shared=*/true);
  Ask ask;
  nn::Sequential with_ask = tied_model(/*shared=*/true);
  with_ask->push_back(ask);
  // The shared weight is one tensor in both partitions (no copy): partition 1's graph reaches it.
  GPipe model(with_ask,
              GPipeOptions({2, 4})
                  .devices({at::kCPU, at::kCPU})
                  .chunks(3)
                  .checkpoint(Checkpoint::kNever)  // every micro-batch's graph walked
                  .schedule(kind));
  CATCH_REQUIRE_FALSE(model->has_tied_copies());
  auto mse = [](const Batch& out, const at::Tensor& y) { return (out[0] - y).pow(2).mean(); };
  const at::Tensor x = at::randn({6, kVocab}, at::kDouble);
  const at::Tensor y = at::randn({6, kVocab}, at::kDouble);
  if (kind == ScheduleKind::kGPipe) {
    mse(Batch(plain->forward(x)), y).backward();
  } else {
    for (int64_t i = 0; i < 3; ++i) {
      (mse(Batch(plain->forward(x.narrow(0, 2 * i, 2))), y.narrow(0, 2 * i, 2)) / 3).backward();
    }
  }
  model->step(x, y, mse);
  CATCH_CHECK(ask->asked.size() == 3);
  check_same_grads(each_once(plain->parameters()), model->parameters(), 1e-10);
}

CATCH_TEST_CASE(
    "Two steps accumulated into one optimizer step give a tied weight the plain "
    "model's summed gradients, found or named",
    "[tied][accumulation]") {
  const bool named = GENERATE(false, true);
  const Run run = GENERATE(Run::kForward, Run::kStepGPipe, Run::kStep1F1B, Run::kStepZB);
  CATCH_CAPTURE(named, static_cast<int>(run));
  nn::Sequential plain = tied_model(/*shared=*/true);
  GPipeOptions options = GPipeOptions({2, 2, 1}).devices({at::kCPU, at::kCPU, at::kCPU}).chunks(3);
  if (named) options.tied_parameters({{"0.weight", "4.weight"}});
  if (run == Run::kStep1F1B) options.schedule(ScheduleKind::k1F1B);
  if (run == Run::kStepZB) options.schedule(ScheduleKind::kZeroBubble);
  GPipe model(tied_model(/*shared=*/!named), options);
  CATCH_CHECK(model->has_tied_copies() == named);
  const std::vector<at::Tensor> plain_params = each_once(plain->parameters());
  auto opt1 = make_optimizer(/*adam=*/true, plain_params);
  auto opt2 = make_optimizer(/*adam=*/true, model->parameters());
  const auto loss_fn = [](const Batch& out, const at::Tensor& y) {
    return (out.tensor() - y).pow(2).mean();
  };
  for (int step = 0; step < 3; ++step) {
    CATCH_INFO("step " << step);
    opt1->zero_grad();
    opt2->zero_grad();
    for (int part = 0; part < 2; ++part) {  // two mini-batches, one optimizer step
      const at::Tensor x = at::randn({6, kVocab}, at::kDouble);
      const at::Tensor y = at::randn({6, kVocab}, at::kDouble);
      (plain->forward(x) - y).pow(2).mean().backward();
      if (run == Run::kForward) {
        const int64_t cuts = gpipe::internal::cut_backwards();
        (model->forward(x) - y).pow(2).mean().backward();
        // Each partition's backward on its own thread, tied copies (named) or one parameter
        // that two partitions' backwards accumulate into (found).
        CATCH_CHECK(gpipe::internal::cut_backwards() == cuts + 1);
      } else {
        model->step(x, y, loss_fn);
      }
    }
    check_same_grads(plain_params, model->parameters(), 1e-10);
    opt1->step();
    opt2->step();
    const auto mine = model->parameters();
    for (size_t k = 0; k < plain_params.size(); ++k) {
      CATCH_CHECK(max_diff(plain_params[k], mine[k]) <= 1e-10);
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace gpipe

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
  CATCH_CHECK_THROWS_WITH(flatten(blocks),
                          gpipe_test::contains("element '1'") &&
                              gpipe_test::contains("torch::nn::LinearImpl") &&
                              gpipe_test::contains("make each block a Sequential"));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

CATCH_TEST_CASE("The scale backs off after an inf and grows after growth_interval clean steps, "
                "and an inf skips the optimizer's step",
                "[grad_scaler]") {
  GradScaler scaler(GradScalerOptions().init_scale(8).growth_factor(2).backoff_factor(0.5)
                        .growth_interval(3));
  at::Tensor p = at::ones({2}, at::kDouble).requires_grad_(true);
  torch::optim::SGD sgd({p}, 0.5);
  // (inf this step, the scale after it): GradScaler's documented rule from 8 with interval 3.
  const std::vector<std::pair<bool, double>> steps{
      {false, 8}, {false, 8}, {false, 16}, {true, 8}, {false, 8},
      {false, 8}, {false, 16}, {false, 16}, {true, 8}, {true, 4}};
  int64_t skipped = 0;
  for (size_t k = 0; k < steps.size(); ++k) {
    CATCH_INFO("step " << k);
    const double s = scaler.scale_value();
    p.mutable_grad() = at::full({2}, 2.0 * s, at::kDouble);  // a scaled gradient of 2
    if (steps[k].first) p.mutable_grad()[1] = std::numeric_limits<double>::infinity();
    const at::Tensor before = p.detach().clone();
    const bool stepped = scaler.step(sgd, {p});
    CATCH_CHECK(stepped == !steps[k].first);
    if (stepped) {
      CATCH_CHECK(max_diff(p, before - 1.0) == 0);  // lr 0.5 x the unscaled gradient 2
    } else {
      ++skipped;
      CATCH_CHECK(max_diff(p, before) == 0);
    }
    scaler.update();
    CATCH_CHECK(scaler.scale_value() == steps[k].second);
  }
  CATCH_CHECK(scaler.skipped() == skipped);
}

CATCH_TEST_CASE("A float16 loss is scaled in float32, a gradient listed twice is unscaled once, "
                "and the scale grows only while float32 holds it",
                "[grad_scaler]") {
  GradScaler scaler;  // the default scale, 65536
  // float16's largest value is 65504: 2 x 65536 would be inf in float16.
  const at::Tensor loss = at::full({}, 2.0, at::kHalf);
  const at::Tensor scaled = scaler.scale(loss);
  CATCH_CHECK(scaled.scalar_type() == at::kFloat);
  CATCH_CHECK(scaled.item<double>() == 2.0 * 65536);
  CATCH_CHECK(scaler.scale(at::full({}, 2.0, at::kBFloat16)).scalar_type() == at::kFloat);
  CATCH_CHECK(scaler.scale(at::full({}, 2.0, at::kDouble)).scalar_type() == at::kDouble);

  // One parameter given twice (as a tied weight listed by two layers): its gradient unscaled once.
  at::Tensor p = at::ones({2}, at::kDouble).requires_grad_(true);
  p.mutable_grad() = at::full({2}, 3.0 * 65536, at::kDouble);
  CATCH_CHECK_FALSE(scaler.unscale({p, p}));
  CATCH_CHECK(max_diff(p.grad(), at::full({2}, 3.0, at::kDouble)) == 0);
  scaler.update();

  // Growing past float32's largest value (3.4e38) is refused: the scale stays.
  GradScaler near(GradScalerOptions().init_scale(2e38).growth_factor(2).growth_interval(1));
  p.mutable_grad() = at::zeros({2}, at::kDouble);
  near.unscale({p});
  near.update();
  CATCH_CHECK(near.scale_value() == 2e38);
  GradScaler below(GradScalerOptions().init_scale(1e38).growth_factor(2).growth_interval(1));
  below.unscale({p});
  below.update();
  CATCH_CHECK(below.scale_value() == 2e38);
}

CATCH_TEST_CASE("A scaler step that throws ends the step, so the next one unscales its own "
                "gradients, and a save between step() and update() is refused",
                "[grad_scaler][errors]") {
  GradScaler scaler(GradScalerOptions().init_scale(1024));
  const at::Tensor w = at::zeros({2}, at::kDouble).requires_grad_(true);
  const at::Tensor ref = at::zeros({2}, at::kDouble).requires_grad_(true);
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt({ref}, torch::optim::SGDOptions(0.1));
  w.mutable_grad() = at::full({2}, 3.0 * 1024, at::kDouble);
  CATCH_CHECK_THROWS_WITH(
      scaler.step(opt, {w}, [](bool) -> bool { throw std::runtime_error("a peer failed"); }),
      gpipe_test::contains("a peer failed"));
  CATCH_CHECK(max_diff(w, ref) == 0);  // not stepped
  opt.zero_grad();
  w.mutable_grad() = at::full({2}, 5.0 * 1024, at::kDouble);  // the retry's backward
  CATCH_CHECK(scaler.step(opt, {w}));
  torch::serialize::OutputArchive archive;
  CATCH_CHECK_THROWS_WITH(scaler.save(archive), gpipe_test::contains("call update() first"));
  scaler.update();
  scaler.save(archive);
  ref.mutable_grad() = at::full({2}, 5.0, at::kDouble);
  ref_opt.step();
  CATCH_CHECK(max_diff(w, ref) == 0);

  // An unscale that throws (a sparse gradient) leaves the step to start again.
  GradScaler again(GradScalerOptions().init_scale(4));
  const at::Tensor v = at::zeros({2}, at::kDouble).requires_grad_(true);
  v.mutable_grad() = at::zeros({2}, at::kDouble).to_sparse();
  CATCH_CHECK_THROWS_WITH(again.unscale({v}), gpipe_test::contains("sparse gradients"));
  v.mutable_grad() = at::full({2}, 8.0, at::kDouble);
  CATCH_CHECK_FALSE(again.unscale({v}));
  CATCH_CHECK(max_diff(v.grad(), at::full({2}, 2.0, at::kDouble)) == 0);
}

nn::Sequential mlp() {
  at::manual_seed(4);
  nn::Sequential seq(nn::Linear(6, 16), nn::Tanh(), nn::Linear(16, 16), nn::Tanh(),
                     nn::Linear(16, 3));
  seq->to(at::kDouble);
  return seq;
}

CATCH_TEST_CASE("A step with an inf in one partition is skipped on every partition, and training "
                "with a forced scale equals training without",
                "[grad_scaler]") {
  const int64_t bad_partition = GENERATE(0, 1);
  CATCH_CAPTURE(bad_partition);
  nn::Sequential plain = mlp();
  GPipe model(mlp(), GPipeOptions({2, 3}).devices({at::kCPU, at::kCPU}).chunks(3));
  torch::optim::Adam adam1(plain->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam adam2(model->parameters(), torch::optim::AdamOptions(0.01));
  GradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(2));
  // An inf in one gradient of the chosen partition at step 2.
  bool poison = false;
  const at::Tensor victim = model->partitions()[bad_partition]->parameters()[0];
  victim.register_hook([&poison](const at::Tensor& g) {
    return poison ? g * std::numeric_limits<double>::infinity() : g;
  });
  for (int step = 0; step < 5; ++step) {
    CATCH_INFO("step " << step);
    const at::Tensor x = at::randn({6, 6}, at::kDouble);
    const at::Tensor y = at::randn({6, 3}, at::kDouble);
    poison = step == 2;
    adam1.zero_grad();
    adam2.zero_grad();
    (plain->forward(x) - y).pow(2).mean().backward();
    scaler.scale((model->forward(x) - y).pow(2).mean()).backward();
    std::vector<at::Tensor> before;
    for (const at::Tensor& p : model->parameters()) before.push_back(p.detach().clone());
    const double scale = scaler.scale_value();
    const bool stepped = scaler.step(adam2, model->parameters());
    scaler.update();
    CATCH_CHECK(stepped == !poison);
    if (poison) {
      // Every partition's parameters are as they were, and the scale backed off.
      for (size_t k = 0; k < before.size(); ++k) {
        CATCH_CHECK(max_diff(before[k], model->parameters()[k]) == 0);
      }
      CATCH_CHECK(scaler.scale_value() == scale / 2);
      continue;  // the plain model skips the step too
    }
    adam1.step();
    for (size_t k = 0; k < before.size(); ++k) {
      CATCH_CHECK(max_diff(plain->parameters()[k], model->parameters()[k]) <= 1e-12);
    }
  }
  CATCH_CHECK(scaler.skipped() == 1);
}

CATCH_TEST_CASE("A GradScaler's state is saved and loaded with the model",
                "[grad_scaler][saving]") {
  const auto dir = std::filesystem::temp_directory_path() /
                   absl::StrCat("gpipe_scaler_", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "run.pt").string();
  GPipe model(mlp(), GPipeOptions({2, 3}).devices({at::kCPU, at::kCPU}));
  torch::optim::Adam adam(model->parameters());
  GradScaler scaler(GradScalerOptions().init_scale(64).growth_interval(5));
  for (int step = 0; step < 3; ++step) {  // 3 clean steps: tracker 3
    adam.zero_grad();
    scaler.scale(model->forward(at::randn({4, 6}, at::kDouble)).sum()).backward();
    scaler.step(adam, model->parameters());
    scaler.update();
  }
  save_training(path, *model, &adam, 3, &scaler);
  GradScaler loaded;
  GPipe other(mlp(), GPipeOptions({2, 3}).devices({at::kCPU, at::kCPU}));
  torch::optim::Adam adam2(other->parameters());
  CATCH_CHECK(load_training(path, *other, &adam2, &loaded) == 3);
  CATCH_CHECK(loaded.scale_value() == 64);
  CATCH_CHECK(loaded.growth_tracker() == 3);
  CATCH_CHECK(loaded.skipped() == 0);
  std::filesystem::remove_all(dir);
}

CATCH_TEST_CASE("float16 training with loss scaling on CUDA follows float32 training",
                "[grad_scaler][cuda]") {
  const c10::Device gpu("cuda:0");
  const auto make = [&] {
    at::manual_seed(6);
    nn::Sequential seq(nn::Linear(32, 64), nn::Tanh(), nn::Linear(64, 64), nn::Tanh(),
                       nn::Linear(64, 4));
    return seq;
  };
  GPipe full(make(), GPipeOptions({2, 3}).devices({gpu, gpu}).chunks(4));
  GPipe half(make(), GPipeOptions({2, 3}).devices({gpu, gpu}).chunks(4));
  torch::optim::Adam adam32(full->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam adam16(half->parameters(), torch::optim::AdamOptions(1e-3));
  GradScaler scaler;
  const at::Tensor x = at::randn({64, 32}, gpu);
  const at::Tensor y = at::randn({64, 4}, gpu);
  double l32 = 0, l16 = 0;
  for (int step = 0; step < 50; ++step) {
    adam32.zero_grad();
    adam16.zero_grad();
    at::Tensor a = (full->forward(x) - y).pow(2).mean();
    a.backward();
    adam32.step();
    at::Tensor b;
    {
      Autocast autocast(c10::kCUDA, c10::kHalf);
      b = (half->forward(x).to(at::kFloat) - y).pow(2).mean();
    }
    scaler.scale(b).backward();
    scaler.step(adam16, half->parameters());
    scaler.update();
    l32 = a.item<double>();
    l16 = b.item<double>();
  }
  CATCH_CHECK(std::abs(l16 - l32) <= 0.05 * l32);
  CATCH_CHECK(scaler.skipped() < 10);  // the first steps at 65536 may overflow, each halving it
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
