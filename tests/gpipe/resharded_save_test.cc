// Saves that outlive their layout: a GPipe's save resumes in a GPipe of another balance,
// schedule and chunks and in the plain Sequential (and the plain Sequential's in a GPipe), taking
// the uninterrupted plain run's next steps; ties keep their optimizer state; a save that does not
// fit is refused, changing nothing (Note [Saves that outlive their layout] in
// gpipe/saved_training.h).
#include "gpipe/saved_training.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/resharding.h"
#include "tests/gpipe/test_util.h"
#include "tests/gpipe/tied_model.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;
namespace fs = std::filesystem;

// x + offset, the offset a buffer: a layer whose state is not all parameters.
struct ShiftImpl : nn::Cloneable<ShiftImpl> {
  ShiftImpl() { reset(); }
  void reset() override { offset = register_buffer("offset", at::randn({8}, at::kDouble)); }
  at::Tensor forward(const at::Tensor& x) { return x + offset; }
  at::Tensor offset;
};
TORCH_MODULE(Shift);

nn::Sequential make_model(uint64_t seed) {
  return build(
      [] {
        return nn::Sequential(nn::Linear(6, 8), Shift(), nn::Tanh(), nn::Linear(8, 8),
                              nn::Linear(8, 3));
      },
      seed);
}

std::pair<at::Tensor, at::Tensor> data(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({8, 6}, gen, at::kDouble), at::randn({8, 3}, gen, at::kDouble)};
}

at::Tensor mse(const Batch& out, const at::Tensor& target) {
  return nn::functional::mse_loss(out[0], target);
}

// The optimizer of a test: Adam, or SGD with momentum.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<at::Tensor> params) {
  if (kind == "Adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

// Steps [first, end) of the plain model; the losses.
std::vector<double> train_plain(nn::Sequential& model, torch::optim::Optimizer& opt, int first,
                                int end) {
  std::vector<double> losses;
  for (int step = first; step < end; ++step) {
    const auto [x, y] = data(step);
    opt.zero_grad();
    const at::Tensor loss = nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

std::vector<double> train_pipe(GPipe& model, torch::optim::Optimizer& opt, int first, int end) {
  std::vector<double> losses;
  for (int step = first; step < end; ++step) {
    const auto [x, y] = data(step);
    opt.zero_grad();
    losses.push_back(model->step(x, y, mse).item<double>());
    opt.step();
  }
  return losses;
}

// Every parameter and buffer of `a` against `b`'s, in order (a GPipe lists its layers' in the
// Sequential's order).
void check_state(const nn::Module& a, const nn::Module& b, double tol) {
  std::vector<at::Tensor> x = a.parameters(), y = b.parameters();
  for (const at::Tensor& t : a.buffers()) x.push_back(t);
  for (const at::Tensor& t : b.buffers()) y.push_back(t);
  CATCH_REQUIRE(x.size() == y.size());
  for (size_t k = 0; k < x.size(); ++k) {
    CATCH_CHECK(x[k].sizes() == y[k].sizes());
    CATCH_CHECK(max_diff(x[k], y[k]) <= tol);
  }
}

void check_losses(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(std::abs(a[k] - b[k]) <= tol);
}

std::string temp_file(const std::string& name) {
  return (fs::temp_directory_path() / absl::StrCat("gpipe_resharded_", name, "_", ::getpid()))
      .string();
}

CATCH_TEST_CASE(
    "a GPipe's save resumes in a GPipe of another balance, schedule and chunks and in the plain "
    "Sequential, each taking the uninterrupted plain run's next steps, and the plain "
    "Sequential's save resumes in a GPipe",
    "[save][resharding]") {
  const std::string kind = GENERATE(std::string("Adam"), std::string("SGD"));
  CATCH_INFO(kind);
  const std::string file = temp_file("gpipe"), plain_file = temp_file("plain");
  // The oracle: the plain model, 5 steps uninterrupted.
  nn::Sequential oracle = make_model(1);
  auto oracle_opt = make_optimizer(kind, oracle->parameters());
  const std::vector<double> oracle_losses = train_plain(oracle, *oracle_opt, 0, 5);

  GPipe saved(make_model(1), GPipeOptions({2, 3}).chunks(2));
  auto saved_opt = make_optimizer(kind, saved->parameters());
  train_pipe(saved, *saved_opt, 0, 3);
  save_training(file, *saved, saved_opt.get(), 3);

  // Another balance, schedule and number of micro-batches, over other initial parameters.
  GPipe other(make_model(9), GPipeOptions({1, 4}).chunks(4).schedule(ScheduleKind::k1F1B));
  auto other_opt = make_optimizer(kind, other->parameters());
  CATCH_CHECK(load_training(file, *other, other_opt.get()) == 3);
  check_state(*other, *saved, 0);  // the saved tensors, bit for bit
  check_losses(train_pipe(other, *other_opt, 3, 5), {oracle_losses[3], oracle_losses[4]}, 1e-12);
  check_state(*other, *oracle, 1e-12);

  nn::Sequential plain = make_model(9);
  auto plain_opt = make_optimizer(kind, plain->parameters());
  CATCH_CHECK(load_training(file, *plain, plain_opt.get()) == 3);
  check_losses(train_plain(plain, *plain_opt, 3, 5), {oracle_losses[3], oracle_losses[4]}, 1e-12);
  check_state(*plain, *oracle, 1e-12);

  // Back: the plain Sequential's save (step 5) into a GPipe, which goes on as the plain model.
  save_training(plain_file, *plain, plain_opt.get(), 5);
  GPipe back(make_model(9), GPipeOptions({3, 2}).chunks(2));
  auto back_opt = make_optimizer(kind, back->parameters());
  CATCH_CHECK(load_training(plain_file, *back, back_opt.get()) == 5);
  check_state(*back, *plain, 0);
  const std::vector<double> more = train_plain(plain, *plain_opt, 5, 7);
  check_losses(train_pipe(back, *back_opt, 5, 7), more, 1e-12);
  check_state(*back, *plain, 1e-12);
  fs::remove(file);
  fs::remove(plain_file);
}

CATCH_TEST_CASE(
    "a GPipe with a tie across partitions resumes in a GPipe of another balance with the tie's "
    "optimizer state and goes on as the plain model with one shared weight",
    "[save][resharding][tied]") {
  using tied_test::each_once;
  using tied_test::tied_model;
  const std::string file = temp_file("tied");
  const auto x_of = [](int step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
    return std::make_pair(at::randn({6, tied_test::kVocab}, gen, at::kDouble),
                          at::randn({6, tied_test::kVocab}, gen, at::kDouble));
  };
  nn::Sequential oracle = tied_model(true);
  torch::optim::Adam oracle_opt(each_once(oracle->parameters()), torch::optim::AdamOptions(0.01));
  std::vector<double> oracle_losses;
  for (int step = 0; step < 5; ++step) {
    const auto [x, y] = x_of(step);
    oracle_opt.zero_grad();
    const at::Tensor loss = nn::functional::mse_loss(oracle->forward(x), y);
    loss.backward();
    oracle_opt.step();
    oracle_losses.push_back(loss.item<double>());
  }
  // Two tensors named as one: the second is a copy the save holds too.
  const TiedNames tie{{"0.weight", "4.weight"}};
  const auto train = [&x_of](GPipe& model, torch::optim::Adam& opt, int first, int end) {
    std::vector<double> losses;
    for (int step = first; step < end; ++step) {
      const auto [x, y] = x_of(step);
      opt.zero_grad();
      losses.push_back(model->step(x, y, mse).item<double>());
      opt.step();
    }
    return losses;
  };
  GPipe saved(tied_model(false), GPipeOptions({2, 3}).chunks(2).tied_parameters(tie));
  torch::optim::Adam saved_opt(saved->parameters(), torch::optim::AdamOptions(0.01));
  train(saved, saved_opt, 0, 3);
  save_training(file, *saved, &saved_opt, 3);
  GPipe resumed(tied_model(false), GPipeOptions({4, 1}).chunks(3).tied_parameters(tie));
  torch::optim::Adam resumed_opt(resumed->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(load_training(file, *resumed, &resumed_opt) == 3);
  check_losses(train(resumed, resumed_opt, 3, 5), {oracle_losses[3], oracle_losses[4]}, 1e-12);
  const auto want = each_once(oracle->parameters());
  const auto got = resumed->parameters();
  CATCH_REQUIRE(want.size() == got.size());
  for (size_t k = 0; k < want.size(); ++k) CATCH_CHECK(max_diff(want[k], got[k]) <= 1e-12);
  fs::remove(file);
}

// Every parameter and buffer of `module`, and the Adam state of each parameter that has one.
std::vector<at::Tensor> everything(const nn::Module& module, torch::optim::Adam& adam) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : module.parameters()) out.push_back(t.detach().clone());
  for (const at::Tensor& t : module.buffers()) out.push_back(t.detach().clone());
  for (const auto& item : adam.state()) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*item.second);
    out.push_back(s.exp_avg().clone());
    out.push_back(at::tensor({s.step()}, at::kLong));
  }
  return out;
}

CATCH_TEST_CASE(
    "a save of another layout that does not fit the model or the optimizer is refused naming "
    "what differs, and changes nothing",
    "[save][resharding]") {
  const std::string file = temp_file("refused");
  GPipe saved(make_model(1), GPipeOptions({2, 3}).chunks(2));
  torch::optim::Adam saved_adam(saved->parameters(), torch::optim::AdamOptions(0.01));
  train_pipe(saved, saved_adam, 0, 2);
  save_training(file, *saved, &saved_adam, 2);

  const auto refused = [&file](nn::Module& module, torch::optim::Optimizer* opt,
                               torch::optim::Adam& witness, const std::string& text) {
    const std::vector<at::Tensor> before = everything(module, witness);
    CATCH_CHECK_THROWS_WITH(load_training(file, module, opt), gpipe_test::contains(text));
    const std::vector<at::Tensor> after = everything(module, witness);
    CATCH_REQUIRE(before.size() == after.size());
    for (size_t k = 0; k < before.size(); ++k) CATCH_CHECK(at::equal(before[k], after[k]));
  };
  // A wider first layer: its weight's shape differs.
  nn::Sequential wider = build(
      [] {
        return nn::Sequential(nn::Linear(7, 8), Shift(), nn::Tanh(), nn::Linear(8, 8),
                              nn::Linear(8, 3));
      },
      2);
  torch::optim::Adam wider_adam(wider->parameters(), torch::optim::AdamOptions(0.01));
  refused(*wider, &wider_adam, wider_adam, "'0.weight' in '");
  // A model of fewer layers: the save holds tensors it does not have.
  nn::Sequential shorter = build(
      [] { return nn::Sequential(nn::Linear(6, 8), Shift(), nn::Tanh(), nn::Linear(8, 8)); }, 2);
  torch::optim::Adam shorter_adam(shorter->parameters(), torch::optim::AdamOptions(0.01));
  refused(*shorter, &shorter_adam, shorter_adam, "'4.weight', which the module does not have");
  // An optimizer of another kind.
  GPipe other(make_model(3), GPipeOptions({1, 4}));
  torch::optim::Adam witness(other->parameters(), torch::optim::AdamOptions(0.01));
  train_pipe(other, witness, 0, 1);
  torch::optim::SGD sgd(other->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  refused(*other, &sgd, witness,
          "holds the state of the optimizer Adam, but it is loaded into an SGD");
  // A part of the model (as a stage loads its layers) refuses a save of more layers than the
  // model has: the save is of another model.
  internal::ReshardedLoad part(*shorter, internal::layer_names(*shorter), {}, nullptr, nullptr,
                               /*whole=*/false, /*layers=*/4);
  part.read(file);
  CATCH_CHECK_THROWS_WITH(part.check(),
                          gpipe_test::contains("'4.bias', of layer 4, but the model has 4 layers"));
  // A save without an optimizer, loaded with one.
  const std::string bare = temp_file("bare");
  save_training(bare, *saved, nullptr, 2);
  GPipe again(make_model(3), GPipeOptions({1, 4}));
  torch::optim::Adam again_adam(again->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK_THROWS_WITH(load_training(bare, *again, &again_adam),
                          gpipe_test::contains("the save was made without an optimizer"));
  fs::remove(bare);
  fs::remove(file);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
