// Training as people train: several optimizer steps under autocast, BatchNorms frozen or changed
// between steps, InferenceMode, a GPipe dropped before its backward, layers that detach. Every
// result is compared with the plain Sequential doing the same.
#include "tests/gpipe/test_util.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "absl/strings/str_cat.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/internal/stage_backward.h"
#include "gpipe/saved_training.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

nn::Sequential mlp() {
  return nn::Sequential(nn::Linear(16, 32), nn::ReLU(), nn::Linear(32, 32), nn::Tanh(),
                        nn::Linear(32, 4));
}

CATCH_TEST_CASE("Autocast training over several optimizer steps equals the plain model under "
                "autocast at every step",
                "[training][autocast]") {
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const int64_t chunks = GENERATE(1, 3);
  const bool threads = GENERATE(false, true);
  CATCH_CAPTURE(static_cast<int>(mode), chunks, threads);
  at::manual_seed(3);
  nn::Sequential plain = mlp();
  at::manual_seed(3);
  GPipe model(mlp(),
              gpipe::internal::with_partition_threads(GPipeOptions({2, 2, 1})
                                                          .devices({at::kCPU, at::kCPU, at::kCPU})
                                                          .chunks(chunks)
                                                          .checkpoint(mode),
                                                      threads));
  CATCH_REQUIRE(model->stage_local_backward() == threads);
  const at::Tensor x = at::randn({6, 16});
  const at::Tensor w = at::randn({6, 4});
  for (int step = 0; step < 4; ++step) {
    CATCH_INFO("step " << step);
    at::Tensor y1, y2;
    {
      Autocast autocast;
      y1 = plain_by_microbatch(plain, x, chunks);
      y2 = model->forward(x);
    }
    // bfloat16 keeps 8 bits: the pipeline may differ from the plain model by its rounding (each
    // micro-batch casts the weights itself, so weight gradients are summed in float32 where the
    // plain model sums them in bfloat16 behind its one cached cast). A stale weight after a step
    // of 0.05 is off by far more.
    CATCH_CHECK(y2.scalar_type() == y1.scalar_type());
    CATCH_CHECK(max_diff(y1, y2) <= 2e-2);
    (y1.to(at::kFloat) * w).sum().backward();
    const int64_t cuts = gpipe::internal::cut_backwards();
    (y2.to(at::kFloat) * w).sum().backward();
    // With a thread per CPU partition each partition's backward ran on its own thread under the
    // forward's autocast state (Note [Stage-local backward in one process]).
    CATCH_CHECK(gpipe::internal::cut_backwards() == cuts + (threads ? 1 : 0));
    check_same_grads(plain->parameters(), model->parameters(), 2e-2);
    // A step large enough that a layer computing with the weights of an earlier step is far off,
    // small enough that bfloat16 rounding differences do not grow into divergence.
    sgd_step(plain->parameters(), 0.05);
    sgd_step(model->parameters(), 0.05);
  }
}

CATCH_TEST_CASE("Autocast regions opened by workers and recomputations close and leave no stale "
                "weight casts behind",
                "[training][autocast]") {
  // The same model stepped twice: once with a weight update between two forwards inside one
  // GPipe, once rebuilt fresh with the updated weights. Equal outputs mean no cached cast of an
  // old weight survived on any thread.
  at::manual_seed(5);
  GPipe model(mlp(), gpipe::internal::with_partition_threads(GPipeOptions({1, 4})
                                                                 .devices({at::kCPU, at::kCPU})
                                                                 .chunks(2)
                                                                 .checkpoint(Checkpoint::kAlways),
                                                             true));
  const at::Tensor x = at::randn({4, 16});
  {
    Autocast autocast;
    model->forward(x).to(at::kFloat).sum().backward();
  }
  sgd_step(model->parameters(), 1.0);
  at::Tensor after;
  {
    Autocast autocast;
    after = model->forward(x);
  }
  at::manual_seed(5);
  nn::Sequential fresh = mlp();
  {
    at::NoGradGuard no_grad;
    auto src = model->parameters();
    auto dst = fresh->parameters();
    for (size_t k = 0; k < src.size(); ++k) dst[k].copy_(src[k]);
  }
  at::Tensor expected;
  {
    Autocast autocast;
    expected = plain_by_microbatch(fresh, x, 2);
  }
  CATCH_CHECK(max_diff(after, expected) <= 2e-2);
}

// A convolutional model with BatchNorms, one of which can be frozen (eval mode).
nn::Sequential bn_model() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)), nn::BatchNorm2d(4),
                        nn::ReLU(), nn::Conv2d(nn::Conv2dOptions(4, 4, 3).padding(1)),
                        nn::BatchNorm2d(4), nn::ReLU(), nn::Flatten(), nn::Linear(4 * 5 * 5, 3));
}

CATCH_TEST_CASE("A BatchNorm in eval mode inside a training GPipe normalises with its running "
                "statistics and is never updated",
                "[training][batchnorm]") {
  const bool deferred = GENERATE(false, true);
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kNever);
  CATCH_CAPTURE(deferred, static_cast<int>(mode));
  auto prepare = [](nn::Sequential seq) {
    // Non-trivial running statistics, then freeze the first BatchNorm.
    auto* bn = seq[1]->as<nn::BatchNorm2d>();
    bn->running_mean.uniform_(-1, 1);
    bn->running_var.uniform_(0.5, 2);
    return seq;
  };
  nn::Sequential plain = prepare(build(bn_model, 11));
  nn::Sequential inner = prepare(build(bn_model, 11));
  GPipe model(inner, GPipeOptions({3, 5})
                         .devices({at::kCPU, at::kCPU})
                         .chunks(2)
                         .checkpoint(mode)
                         .deferred_batch_norm(deferred));
  plain->train();
  model->train();
  plain[1]->eval();
  inner[1]->eval();
  const std::vector<at::Tensor> frozen = running_stats(*plain[1]);
  const at::Tensor x = at::randn({4, 3, 5, 5}, at::kDouble);
  for (int step = 0; step < 2; ++step) {
    plain->forward(x).sum().backward();
    model->forward(x).sum().backward();
    sgd_step(model->parameters(), 0.1);
    sgd_step(plain->parameters(), 0.1);
    if (deferred && step == 0) {
      // The training BatchNorm's statistics follow the whole mini-batch, as in the plain model
      // (whose later steps differ: its micro-batches normalise on their own statistics).
      check_same(running_stats(*inner[4]), running_stats(*plain[4]), 1e-10);
    }
  }
  check_same(running_stats(*inner[1]), frozen, 0.0);
  CATCH_CHECK_FALSE(inner[1]->is_training());
}

CATCH_TEST_CASE("A frozen BatchNorm inside a training GPipe gives the plain model's outputs and "
                "gradients",
                "[training][batchnorm]") {
  // Only the frozen BatchNorm normalises: the other layers have none, so micro-batches do not
  // matter and the plain model is the exact oracle.
  const bool deferred = GENERATE(false, true);
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(deferred, static_cast<int>(mode));
  auto make = [] {
    return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)), nn::BatchNorm2d(4),
                          nn::ReLU(), nn::Flatten(), nn::Linear(4 * 5 * 5, 3));
  };
  auto prepare = [](nn::Sequential seq) {
    auto* bn = seq[1]->as<nn::BatchNorm2d>();
    bn->running_mean.uniform_(-1, 1);
    bn->running_var.uniform_(0.5, 2);
    seq->train();
    bn->eval();
    return seq;
  };
  nn::Sequential plain = prepare(build(make, 12));
  nn::Sequential inner = prepare(build(make, 12));
  GPipe model(inner, GPipeOptions({2, 3})
                         .devices({at::kCPU, at::kCPU})
                         .chunks(3)
                         .checkpoint(mode)
                         .deferred_batch_norm(deferred));
  const at::Tensor x = at::randn({6, 3, 5, 5}, at::kDouble);
  for (int step = 0; step < 3; ++step) {
    CATCH_INFO("step " << step);
    at::Tensor y1 = plain->forward(x);
    at::Tensor y2 = model->forward(x);
    CATCH_CHECK(max_diff(y1, y2) <= 1e-10);
    y1.pow(2).sum().backward();
    y2.pow(2).sum().backward();
    check_same_grads(plain->parameters(), model->parameters(), 1e-8);
    sgd_step(plain->parameters(), 0.05);
    sgd_step(model->parameters(), 0.05);
  }
  check_same(running_stats(*inner), running_stats(*plain), 0.0);
}

// One BatchNorm, first: its input is the same in the plain model and in a pipeline, so the plain
// model on the whole mini-batch is the oracle of its statistics, and in eval mode of everything.
nn::Sequential one_bn_model() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)), nn::BatchNorm2d(4),
                        nn::ReLU(), nn::Conv2d(nn::Conv2dOptions(4, 4, 3).padding(1)), nn::Tanh(),
                        nn::Flatten(), nn::Linear(4 * 5 * 5, 3));
}

// The deferred-batch-norm oracle: the plain model on the whole mini-batch.
struct DeferredPair {
  nn::Sequential plain = build(one_bn_model, 21);
  nn::Sequential inner = build(one_bn_model, 21);
  GPipe model;
  explicit DeferredPair(Checkpoint mode, int64_t chunks = 2)
      : model(inner, GPipeOptions({3, 4})
                         .devices({at::kCPU, at::kCPU})
                         .chunks(chunks)
                         .checkpoint(mode)
                         .deferred_batch_norm(true)) {}
};

CATCH_TEST_CASE("Between forwards the user's BatchNorms hold their real running statistics",
                "[training][batchnorm]") {
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kNever);
  CATCH_CAPTURE(static_cast<int>(mode));
  DeferredPair p(mode);
  const at::Tensor x = at::randn({4, 3, 5, 5}, at::kDouble);
  p.plain->forward(x).sum().backward();
  p.model->forward(x).sum().backward();
  // The members the layer uses, not just the registered buffers.
  {
    auto* a = p.plain[1]->as<nn::BatchNorm2d>();
    auto* b = p.inner[1]->as<nn::BatchNorm2d>();
    CATCH_CHECK(b->running_mean.unsafeGetTensorImpl() ==
                b->named_buffers(false)["running_mean"].unsafeGetTensorImpl());
    CATCH_CHECK(max_diff(a->running_mean, b->running_mean) <= 1e-12);
    CATCH_CHECK(max_diff(a->running_var, b->running_var) <= 1e-12);
  }
  check_same(running_stats(*p.model), running_stats(*p.plain), 1e-12);
  // The user's own Sequential, used directly, trains its real statistics.
  const at::Tensor x2 = at::randn({4, 3, 5, 5}, at::kDouble);
  p.plain->forward(x2);
  p.inner->forward(x2);
  check_same(running_stats(*p.inner), running_stats(*p.plain), 1e-12);
  // And eval mode uses them.
  p.plain->eval();
  p.model->eval();
  CATCH_CHECK(max_diff(p.plain->forward(x), p.model->forward(x)) <= 1e-10);
}

CATCH_TEST_CASE("A GPipe destroyed before its backward leaves the running statistics as one "
                "forward made them",
                "[training][batchnorm]") {
  const bool deferred = GENERATE(false, true);
  CATCH_CAPTURE(deferred);
  nn::Sequential plain = build(one_bn_model, 22);
  nn::Sequential inner = build(one_bn_model, 22);
  const at::Tensor x = at::randn({4, 3, 5, 5}, at::kDouble);
  at::Tensor y;
  {
    GPipe model(inner, GPipeOptions({3, 4})
                           .devices({at::kCPU, at::kCPU})
                           .chunks(deferred ? 2 : 1)
                           .checkpoint(Checkpoint::kAlways)
                           .deferred_batch_norm(deferred));
    y = model->forward(x);
  }
  const std::vector<at::Tensor> after_forward = running_stats(*inner);
  at::Tensor y1 = plain->forward(x);
  check_same(after_forward, running_stats(*plain), 1e-12);
  y.sum().backward();  // recomputes both partitions
  y1.sum().backward();
  check_same(running_stats(*inner), after_forward, 0.0);
  if (!deferred) {  // (with deferral the micro-batches normalise on their own statistics)
    check_same_grads(plain->parameters(), inner->parameters(), 1e-10);
  }
}

CATCH_TEST_CASE("Checkpointed micro-batches update BatchNorm statistics once, not again in "
                "backward",
                "[training][batchnorm]") {
  // Without deferral, each micro-batch updates the statistics as the plain model run on that
  // micro-batch would: the oracle is the plain model run on the micro-batches in turn.
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast);
  CATCH_CAPTURE(static_cast<int>(mode));
  nn::Sequential plain = build(bn_model, 23);
  GPipe model(build(bn_model, 23),
              GPipeOptions({3, 5}).devices({at::kCPU, at::kCPU}).chunks(2).checkpoint(mode));
  const at::Tensor x = at::randn({4, 3, 5, 5}, at::kDouble);
  for (int step = 0; step < 2; ++step) {
    plain_by_microbatch(plain, x, 2).sum().backward();
    model->forward(x).sum().backward();
    check_same(running_stats(*model), running_stats(*plain), 1e-12);
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
  }
}

CATCH_TEST_CASE("A training forward under InferenceMode, then a normal step, equal the plain "
                "model",
                "[training][batchnorm]") {
  const bool deferred = GENERATE(false, true);
  CATCH_CAPTURE(deferred);
  nn::Sequential plain = build(bn_model, 24);
  GPipe model(build(bn_model, 24), GPipeOptions({3, 5})
                                       .devices({at::kCPU, at::kCPU})
                                       .chunks(1)
                                       .deferred_batch_norm(deferred));
  const at::Tensor x = at::randn({4, 3, 5, 5}, at::kDouble);
  {
    c10::InferenceMode inference;
    CATCH_CHECK(max_diff(plain->forward(x), model->forward(x)) <= 1e-10);
  }
  check_same(running_stats(*model), running_stats(*plain), 1e-12);
  check_same_step(plain, model, x);
  check_same(running_stats(*model), running_stats(*plain), 1e-12);
}

CATCH_TEST_CASE("A BatchNorm momentum changed after construction takes effect at the next step",
                "[training][batchnorm]") {
  DeferredPair p(Checkpoint::kExceptLast, 3);
  const at::Tensor x = at::randn({6, 3, 5, 5}, at::kDouble);
  for (double momentum : {0.1, 0.7}) {
    p.plain[1]->as<nn::BatchNorm2d>()->options.momentum(momentum);
    p.inner[1]->as<nn::BatchNorm2d>()->options.momentum(momentum);
    p.plain->forward(x).sum().backward();
    p.model->forward(x).sum().backward();
    check_same(running_stats(*p.model), running_stats(*p.plain), 1e-12);
  }
}

// y = x.detach() * 2: cuts the gradient, as a frozen feature extractor's output would.
struct DetachImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x.detach() * 2; }
};
TORCH_MODULE(Detach);

CATCH_TEST_CASE("An output that needs no gradient in the plain model needs none in GPipe",
                "[training][autograd]") {
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const int64_t chunks = GENERATE(1, 3);
  CATCH_CAPTURE(static_cast<int>(mode), chunks);
  auto make = [] { return nn::Sequential(nn::Linear(4, 4), nn::Tanh(), Detach(), nn::Linear(4, 2)); };
  auto frozen = [](nn::Sequential seq) {
    for (auto& p : seq[3]->parameters()) p.set_requires_grad(false);
    return seq;
  };
  nn::Sequential plain = frozen(build(make, 31));
  GPipe model(frozen(build(make, 31)),
              GPipeOptions({2, 2}).devices({at::kCPU, at::kCPU}).chunks(chunks).checkpoint(mode));
  const at::Tensor x = at::randn({6, 4}, at::kDouble).requires_grad_(true);
  for (int step = 0; step < 2; ++step) {
    at::Tensor y1 = plain->forward(x);
    at::Tensor y2 = model->forward(x);
    CATCH_CHECK_FALSE(y1.requires_grad());
    CATCH_CHECK(y2.requires_grad() == y1.requires_grad());
    CATCH_CHECK(max_diff(y1, y2) <= 1e-10);
    CATCH_CHECK_THROWS_AS(y2.sum().backward(), c10::Error);
  }
  // Unfreezing the last layer makes the output need a gradient again, as in the plain model.
  for (auto& p : plain[3]->parameters()) p.set_requires_grad(true);
  torch::nn::Sequential last = model->partitions()[1];
  for (auto& p : last[1]->parameters()) p.set_requires_grad(true);
  at::Tensor y1 = plain->forward(x);
  at::Tensor y2 = model->forward(x);
  CATCH_CHECK(y1.requires_grad());
  CATCH_CHECK(y2.requires_grad());
  y1.sum().backward();
  y2.sum().backward();
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
}


// A GPipe with dropout (random numbers, replayed by checkpointed micro-batches) and batch norm
// (buffers), under Adam: `steps` steps from step `first` on, returning the losses.
std::vector<at::Tensor> train_steps(GPipe& model, torch::optim::Adam& adam, int first, int steps) {
  std::vector<at::Tensor> losses;
  for (int step = first; step < first + steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    const at::Tensor x = at::randn({8, 6}, gen, at::kDouble);
    const at::Tensor y = at::randn({8, 3}, gen, at::kDouble);
    adam.zero_grad();
    at::Tensor loss = nn::functional::mse_loss(model->forward(x), y);
    const int64_t cuts = gpipe::internal::cut_backwards();
    loss.backward();
    // Where the engine chose it, each partition's backward ran on its own thread, a checkpointed
    // micro-batch's recomputation there (a backward that fell back to the one graph would pass
    // the equalities that follow without testing it).
    CATCH_CHECK(gpipe::internal::cut_backwards() == cuts + (model->stage_local_backward() ? 1 : 0));
    adam.step();
    losses.push_back(loss.detach());
  }
  return losses;
}

// With `dropout` (a random layer) the partitions share forward()'s thread; without, each has its
// own and runs its backward there (Note [Threads of forward()]).
GPipe resumable_model(int seed, bool dropout) {
  at::manual_seed(seed);
  nn::Sequential seq(nn::Linear(6, 8));
  if (dropout) {
    seq->push_back(nn::Dropout(0.3));
  } else {
    seq->push_back(nn::Identity());
  }
  seq->push_back(nn::Tanh());
  seq->push_back(nn::Linear(8, 8));
  seq->push_back(nn::BatchNorm1d(8));
  seq->push_back(nn::Tanh());
  seq->push_back(nn::Linear(8, 3));
  seq->to(at::kDouble);
  return GPipe(seq, GPipeOptions({3, 4}).chunks(2).checkpoint(Checkpoint::kExceptLast));
}

std::vector<at::Tensor> state_of(nn::Module& module) {
  std::vector<at::Tensor> out = module.parameters();
  for (const at::Tensor& b : module.buffers()) out.push_back(b);
  return out;
}

CATCH_TEST_CASE("A run resumed from save_training takes the saved run's next steps bit for bit",
                "[training][save]") {
  const std::string path =
      (std::filesystem::temp_directory_path() / absl::StrCat("gpipe_resume_", ::getpid(), ".pt"))
          .string();
  const bool dropout = GENERATE(true, false);
  CATCH_CAPTURE(dropout);
  GPipe first = resumable_model(1, dropout);
  CATCH_CHECK(first->stage_local_backward() == !dropout);
  torch::optim::Adam adam(first->parameters(), torch::optim::AdamOptions(0.01));
  train_steps(first, adam, 0, 3);
  save_training(path, *first, &adam, 3);
  const std::vector<at::Tensor> losses = train_steps(first, adam, 3, 3);

  // Another model, other random numbers drawn meanwhile: the load puts back all of it.
  GPipe second = resumable_model(2, dropout);
  torch::optim::Adam adam2(second->parameters(), torch::optim::AdamOptions(0.01));
  at::manual_seed(99);
  at::randn({10});
  CATCH_CHECK(load_training(path, *second, &adam2) == 3);
  const std::vector<at::Tensor> resumed = train_steps(second, adam2, 3, 3);
  for (size_t k = 0; k < losses.size(); ++k) CATCH_CHECK(at::equal(losses[k], resumed[k]));
  const auto a = state_of(*first), b = state_of(*second);
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(at::equal(a[k], b[k]));

  // Refused, naming what differs: another model, a file that is not there.
  at::manual_seed(3);
  nn::Sequential other(nn::Linear(6, 8), nn::Tanh(), nn::Linear(8, 4));
  other->to(at::kDouble);
  // (The plain Sequential: a save of another layout, loaded by layer.)
  CATCH_CHECK_THROWS_WITH(load_training(path, *other, nullptr),
                          gpipe_test::contains("no file of the save holds '2.weight' (the "
                                               "module's '2.weight'); load a save of the same "
                                               "model"));
  CATCH_CHECK_THROWS_WITH(load_training(path + ".missing", *second, nullptr),
                          gpipe_test::contains("cannot read '" + path + ".missing'"));
  // The reader's error quoted without its backtrace (a trainer's --resume prints the message).
  try {
    load_training(path + ".missing", *second, nullptr);
  } catch (const c10::Error& e) {
    CATCH_CHECK(std::string(e.what_without_backtrace()).find("frame #") == std::string::npos);
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
