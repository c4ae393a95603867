// Deferred batch norm: with it, BatchNorm's running statistics after a pipelined step equal those
// of the same BatchNorm run on the whole mini-batch, whatever the split into micro-batches.
#include "tests/gpipe/test_util.h"

#include "gpipe/internal/batchnorm_readings.h"
#include "gpipe/internal/partition_threads.h"

#include <algorithm>
#include <cmath>
#include <mutex>

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

// Wraps a BatchNorm and keeps a copy of every input it normalises outside recomputation: the
// inputs the layer saw, to compute what a BatchNorm run on their concatenation would record.
struct TapImpl : nn::Module {
  template <typename BatchNorm>
  explicit TapImpl(BatchNorm bn) : bn(bn) {
    register_module("bn", bn.ptr());
  }
  at::Tensor forward(const at::Tensor& x) {
    if (!is_recomputing()) {
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back(x.detach().clone());
    }
    return bn.forward(x);
  }
  nn::AnyModule bn;
  std::mutex mu;
  std::vector<at::Tensor> seen;
};
TORCH_MODULE(Tap);

// A residual block that calls its BatchNorm through a member, as user code does.
struct BlockImpl : nn::Module {
  explicit BlockImpl(c10::optional<double> momentum) {
    conv = register_module("conv", nn::Conv2d(nn::Conv2dOptions(4, 4, 3).padding(1)));
    bn = register_module("tap", Tap(nn::BatchNorm2d(nn::BatchNorm2dOptions(4).momentum(momentum))));
  }
  at::Tensor forward(const at::Tensor& x) { return at::relu(x + bn(conv(x))); }
  nn::Conv2d conv{nullptr};
  Tap bn{nullptr};
};
TORCH_MODULE(Block);

// A layer holding a Sequential (LibTorch cannot nest Sequentials directly).
struct NestedImpl : nn::Module {
  explicit NestedImpl(nn::Sequential inner) : inner(register_module("inner", std::move(inner))) {}
  at::Tensor forward(const at::Tensor& x) { return inner->forward(x); }
  nn::Sequential inner;
};
TORCH_MODULE(Nested);

nn::Sequential bn_model(c10::optional<double> momentum) {
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)),
      Tap(nn::BatchNorm2d(nn::BatchNorm2dOptions(4).momentum(momentum))), nn::ReLU(),
      Block(momentum),
      Nested(nn::Sequential(nn::Conv2d(nn::Conv2dOptions(4, 4, 1)),
                            Tap(nn::BatchNorm2d(nn::BatchNorm2dOptions(4).momentum(momentum))))),
      nn::Flatten(), nn::Linear(4 * 4 * 4, 6),
      Tap(nn::BatchNorm1d(nn::BatchNorm1dOptions(6).momentum(momentum))), nn::Tanh(),
      nn::Linear(6, 2));
}

c10::optional<double> momentum_of(TapImpl& tap) {
  if (auto* bn = dynamic_cast<nn::BatchNorm2dImpl*>(tap.bn.ptr().get())) return bn->options.momentum();
  auto* bn = dynamic_cast<nn::BatchNorm1dImpl*>(tap.bn.ptr().get());
  CATCH_REQUIRE(bn != nullptr);
  return bn->options.momentum();
}

std::vector<TapImpl*> taps(nn::Module& module) {
  std::vector<TapImpl*> out;
  for (const auto& m : module.modules()) {
    if (auto* tap = dynamic_cast<TapImpl*>(m.get())) out.push_back(tap);
  }
  return out;
}

CATCH_TEST_CASE("deferred batch norm's running statistics equal a full-batch BatchNorm's",
                "[batchnorm]") {
  const int64_t chunks = GENERATE(1, 2, 3, 4);
  const auto momentum = GENERATE(as<c10::optional<double>>{}, 0.1, c10::nullopt);
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways);
  // With threads, each partition's forwards gather on its own worker.
  const bool threads = GENERATE(false, true);
  CATCH_CAPTURE(chunks, momentum.has_value(), static_cast<int>(mode), threads);
  nn::Sequential seq = build([momentum] { return bn_model(momentum); }, 11);
  GPipe model(seq,
              gpipe::internal::with_partition_threads(GPipeOptions({2, 3, 5})
                                                          .devices({at::kCPU, at::kCPU, at::kCPU})
                                                          .chunks(chunks)
                                                          .checkpoint(mode)
                                                          .deferred_batch_norm(true),
                                                      threads));
  model->train();
  const std::vector<TapImpl*> bns = taps(*model);
  CATCH_REQUIRE(bns.size() == 4);  // top-level, member of a block, nested, BatchNorm1d on (N, C)
  for (int step = 0; step < 3; ++step) {
    // The oracle: a copy of each BatchNorm as it was before the step, run on everything the
    // layer saw in this step at once.
    std::vector<nn::AnyModule> oracles;
    for (TapImpl* tap : bns) {
      oracles.push_back(tap->bn.clone());
      oracles.back().ptr()->train();
      tap->seen.clear();
    }
    const at::Tensor x = at::randn({8, 3, 4, 4}, at::kDouble) * (step + 1) + step;
    const int64_t readings = gpipe::internal::sink_readings();
    model->forward(x).sum().backward();  // backward recomputes checkpointed micro-batches
    // Every call read its statistics from the sinks (Note [Statistics from the sinks]): none
    // ran beside a recomputation here.
    CATCH_CHECK(gpipe::internal::sink_readings() - readings == 4 * chunks);
    for (size_t b = 0; b < bns.size(); ++b) {
      // The module's own momentum again (Note [Statistics from the sinks] replaces it in a run).
      CATCH_CHECK(momentum_of(*bns[b]) == momentum);
      CATCH_REQUIRE(static_cast<int64_t>(bns[b]->seen.size()) == chunks);
      oracles[b].forward(at::cat(bns[b]->seen));
      const auto expected = oracles[b].ptr()->named_buffers();
      const auto actual = bns[b]->bn.ptr()->named_buffers();
      CATCH_REQUIRE(expected.size() == 3);
      for (const auto& buffer : expected) {
        CATCH_INFO("step " << step << ", BatchNorm " << b << ", " << buffer.key());
        CATCH_CHECK(max_diff(buffer.value(), actual[buffer.key()]) <= 1e-6);
      }
    }
  }
  // Eval mode uses the registered running statistics: the GPipe computes what its own layers
  // compute when called directly.
  model->eval();
  const at::Tensor x = at::randn({5, 3, 4, 4}, at::kDouble);
  CATCH_CHECK(max_diff(seq->forward(x), model->forward(x)) <= 1e-12);
}

CATCH_TEST_CASE("deferred batch norm normalises each micro-batch with its own statistics",
                "[batchnorm]") {
  // Two micro-batches with very different statistics: a BatchNorm in training mode normalises
  // each one by itself, so the pipelined output equals the plain model's on each half.
  auto make = [] { return nn::Sequential(nn::BatchNorm1d(3)); };
  nn::Sequential plain = build(make, 1);
  GPipe model(build(make, 1), GPipeOptions({1}).devices({at::kCPU}).chunks(2).deferred_batch_norm(true));
  at::Tensor x = at::cat({at::randn({4, 3}, at::kDouble), at::randn({4, 3}, at::kDouble) * 5 + 3});
  at::Tensor expected = at::cat({plain->forward(x.slice(0, 0, 4)), plain->forward(x.slice(0, 4, 8))});
  CATCH_CHECK(max_diff(model->forward(x), expected) <= 1e-10);
}

CATCH_TEST_CASE("without deferred batch norm, running statistics move once per micro-batch",
                "[batchnorm]") {
  auto make = [] { return nn::Sequential(nn::Linear(3, 3), nn::BatchNorm1d(3)); };
  GPipe model(build(make, 1), GPipeOptions({1, 1}).devices({at::kCPU, at::kCPU}).chunks(4));
  model->forward(at::randn({8, 3}, at::kDouble));
  CATCH_CHECK(model->named_buffers()["partitions.1.1.num_batches_tracked"].item<int64_t>() == 4);
  GPipe deferred(build(make, 1),
                 GPipeOptions({1, 1}).devices({at::kCPU, at::kCPU}).chunks(4).deferred_batch_norm(true));
  deferred->forward(at::randn({8, 3}, at::kDouble));
  CATCH_CHECK(deferred->named_buffers()["partitions.1.1.num_batches_tracked"].item<int64_t>() == 1);
}

CATCH_TEST_CASE("a failed step leaves deferred batch norm's statistics untouched",
                "[batchnorm][errors]") {
  struct FailImpl : nn::Module {
    at::Tensor forward(const at::Tensor& x) {
      TORCH_CHECK(!fail, "fail on purpose");
      return x;
    }
    bool fail = true;
  };
  auto fail = std::make_shared<FailImpl>();
  auto make = [] { return nn::Sequential(nn::BatchNorm1d(3)); };
  nn::Sequential seq = build(make, 1);
  seq->push_back(fail);
  GPipe model(seq, GPipeOptions({1, 1}).devices({at::kCPU, at::kCPU}).chunks(2).deferred_batch_norm(true));
  const at::Tensor x = at::randn({6, 3}, at::kDouble);
  CATCH_CHECK_THROWS_WITH(model->forward(x), gpipe_test::contains("fail on purpose"));
  auto buffers = model->named_buffers();
  CATCH_CHECK(buffers["partitions.0.0.num_batches_tracked"].item<int64_t>() == 0);
  CATCH_CHECK(buffers["partitions.0.0.running_mean"].abs().sum().item<double>() == 0);
  // The next step counts only its own micro-batches.
  fail->fail = false;
  model->forward(x);
  nn::Sequential plain = build(make, 1);
  plain->forward(x);
  CATCH_CHECK(max_diff(buffers["partitions.0.0.running_mean"], plain[0]->named_buffers()["running_mean"]) <= 1e-6);
  CATCH_CHECK(buffers["partitions.0.0.num_batches_tracked"].item<int64_t>() == 1);
}

// A layer that normalises with its BatchNorm's buffers through the functional call, with a
// momentum of its own (not the module's forward).
struct FunctionalBatchNormImpl : nn::Module {
  FunctionalBatchNormImpl() { bn = register_module("bn", nn::BatchNorm2d(4)); }
  at::Tensor forward(const at::Tensor& x) {
    return nn::functional::batch_norm(
        x, bn->running_mean, bn->running_var,
        nn::functional::BatchNormFuncOptions().weight(bn->weight).bias(bn->bias).training(
            is_training()).momentum(0.25));
  }
  nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(FunctionalBatchNorm);

CATCH_TEST_CASE("deferred batch norm gathers a functional batch_norm call on a layer's buffers "
                "from its input",
                "[batchnorm]") {
  const int64_t chunks = GENERATE(1, 3);
  CATCH_CAPTURE(chunks);
  at::manual_seed(0);
  nn::Sequential seq(nn::Conv2d(nn::Conv2dOptions(3, 4, 1)), FunctionalBatchNorm(),
                     nn::Flatten(), nn::Linear(4 * 4 * 4, 2));
  seq->to(at::kDouble);
  GPipe model(seq, GPipeOptions({2, 2}).devices({at::kCPU, at::kCPU}).chunks(chunks)
                       .deferred_batch_norm(true));
  model->train();
  auto* layer = dynamic_cast<FunctionalBatchNormImpl*>(seq[1].get());
  CATCH_REQUIRE(layer != nullptr);
  // One update over the whole batch, committed as deferred updates are: with the layer's own
  // momentum (Note [Deferred batch norm without replacing modules]).
  nn::BatchNorm2d oracle = std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(layer->bn->clone());
  const at::Tensor x = at::randn({6, 3, 4, 4}, at::kDouble);
  const at::Tensor before = seq[0]->as<nn::Conv2d>()->forward(x).detach();
  model->forward(x).sum().backward();
  oracle->train();
  oracle->forward(before);
  // The buffers moved once, on the whole batch's statistics.
  CATCH_CHECK(max_diff(layer->bn->running_mean, oracle->running_mean) <= 1e-12);
  CATCH_CHECK(max_diff(layer->bn->running_var, oracle->running_var) <= 1e-12);
}

CATCH_TEST_CASE("a non-finite micro-batch leaves nothing behind for the next forward's statistics",
                "[batchnorm]") {
  at::manual_seed(0);
  nn::Sequential seq(nn::Conv2d(nn::Conv2dOptions(3, 4, 1)), nn::BatchNorm2d(4), nn::Flatten(),
                     nn::Linear(4 * 4 * 4, 2));
  seq->to(at::kDouble);
  GPipe model(seq, GPipeOptions({2, 2}).devices({at::kCPU, at::kCPU}).chunks(2)
                       .deferred_batch_norm(true));
  model->train();
  auto* bn = seq[1]->as<nn::BatchNorm2d>();
  CATCH_REQUIRE(bn != nullptr);
  at::Tensor bad = at::randn({4, 3, 4, 4}, at::kDouble);
  bad[3].fill_(std::nan(""));  // in the second micro-batch
  model->forward(bad);
  CATCH_CHECK(!bn->running_mean.isfinite().all().item<bool>());  // as the plain BatchNorm's
  {
    // The user puts finite statistics back (say, from a checkpoint).
    at::NoGradGuard no_grad;
    bn->running_mean.zero_();
    bn->running_var.fill_(1);
  }
  nn::BatchNorm2d oracle = std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(bn->clone());
  oracle->train();
  const at::Tensor good = at::randn({4, 3, 4, 4}, at::kDouble);
  const at::Tensor before = seq[0]->as<nn::Conv2d>()->forward(good).detach();
  model->forward(good);
  oracle->forward(before);
  CATCH_CHECK(max_diff(bn->running_mean, oracle->running_mean) <= 1e-12);
  CATCH_CHECK(max_diff(bn->running_var, oracle->running_var) <= 1e-12);
}

CATCH_TEST_CASE("deferred batch norm follows a dtype change", "[batchnorm]") {
  auto make = [] { return nn::Sequential(nn::Linear(3, 3), nn::BatchNorm1d(3)); };
  GPipe model(build(make, 1), GPipeOptions({1, 1}).devices({at::kCPU, at::kCPU}).chunks(2).deferred_batch_norm(true));
  model->forward(at::randn({4, 3}, at::kDouble));
  model->to(at::kFloat);
  model->forward(at::randn({4, 3}));
  CATCH_CHECK(model->named_buffers()["partitions.1.1.num_batches_tracked"].item<int64_t>() == 2);
  CATCH_CHECK(model->named_buffers()["partitions.1.1.running_mean"].scalar_type() == at::kFloat);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
