// A pipeline stage in one process: one stage is the plain model, a stage split into partitions on
// threads of their own (skips within and across them, a GPU beside the CPU), wrong stages and
// failing layers refused with clear errors.
#include "tests/distributed/stage_test_util.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers

CATCH_TEST_CASE("one stage in one process is the plain model, and wrong stages are refused "
                "naming the value",
                "[distributed][stage][errors]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), PipelineStageOptions({3, 3}), group),
                          gpipe_test::contains("the balance has 2 stages ({3, 3}) but the process "
                                               "group has 1 ranks"));
  CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), PipelineStageOptions({2, 4}), group),
                          gpipe_test::contains("the skip 'skip' is stashed in one stage and "
                                               "popped in another"));
  CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), PipelineStageOptions({6}).chunks(0), group),
                          gpipe_test::contains("chunks must be at least 1, got 0"));
  // A device this machine does not have (cuda:<number of GPUs>) is refused before it is used.
  const c10::Device gpu(c10::kCUDA, static_cast<c10::DeviceIndex>(cuda_device_count()));
  CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), PipelineStageOptions({6}).devices({gpu}), group),
                          gpipe_test::contains("PipelineStage: the stage's device is on " +
                                               gpu.str() + ", but "));
  CATCH_CHECK_THROWS_WITH(
      PipelineStage(make_model(),
                    PipelineStageOptions({6}).local_balance({3, 3}).devices({at::kCPU, gpu}),
                    group),
      gpipe_test::contains("PipelineStage: local partition 1 is on " + gpu.str() + ", but "));
  // A warning only where a checkpointed CPU partition beside another draws random numbers (Note
  // [Random numbers in concurrent partitions]).
  auto warnings = [&](nn::Sequential model, Checkpoint mode) {
    testing::CaptureWarnings capture;
    PipelineStage stage(std::move(model),
                        PipelineStageOptions({4}).local_balance({2, 2}).chunks(2).checkpoint(mode),
                        group);
    return capture.messages;
  };
  const auto warned = warnings(
      nn::Sequential(nn::Linear(4, 4), nn::Dropout(0.5), nn::Linear(4, 4), nn::Tanh()),
      Checkpoint::kExceptLast);
  CATCH_REQUIRE(warned.size() == 1);
  CATCH_CHECK_THAT(warned[0], gpipe_test::contains("PipelineStage (stage 0): partition 0 holds "
                                                   "'1' (torch::nn::DropoutImpl)"));
  CATCH_CHECK(warnings(nn::Sequential(nn::Linear(4, 4), nn::Dropout(0.5), nn::Linear(4, 4),
                                      nn::Tanh()),
                       Checkpoint::kNever)
                  .empty());
  CATCH_CHECK(warnings(nn::Sequential(nn::Linear(4, 4), nn::ReLU(), nn::Linear(4, 4), nn::Tanh()),
                       Checkpoint::kExceptLast)
                  .empty());
  auto [x, y] = batch(0);
  PipelineStage no_loss(make_model(), PipelineStageOptions({6}).chunks(2), group);
  CATCH_CHECK_THROWS_WITH(no_loss->step(Batch(x), y),
                          gpipe_test::contains("needs a loss function"));
  PipelineStage stage(make_model(), PipelineStageOptions({6}).chunks(kChunks), group);
  // Recording is a switch: a stage that did not record says so (on every stage: a collective).
  CATCH_CHECK_THROWS_WITH(stage->gather_timeline(),
                          gpipe_test::contains("stage 0 recorded no timeline; call "
                                               "record_timeline(true) on every stage"));
  stage->record_timeline(true);
  {
    // The deprecated option (Note [One schedule option]) starts the stage recording.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    PipelineStage recording(make_model(), PipelineStageOptions({6}).chunks(2).record_timeline(true),
                            group);
#pragma GCC diagnostic pop
    CATCH_CHECK(recording->is_recording_timeline());
    CATCH_CHECK(!no_loss->is_recording_timeline());
  }
  CATCH_CHECK_THROWS_WITH(stage->step(no_input(), y, mse),
                          gpipe_test::contains("stage 0 needs the mini-batch as input"));
  nn::Sequential plain = make_model();
  at::Tensor expected = nn::functional::mse_loss(plain->forward(x), y);
  expected.backward();
  const at::Tensor loss = stage->step(Batch(x), y, mse);
  CATCH_CHECK(at::allclose(loss, expected, 0, 1e-12));
  const auto got = stage->parameters();
  const auto want = plain->parameters();
  CATCH_REQUIRE(got.size() == want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    CATCH_CHECK(at::allclose(got[k].grad(), want[k].grad(), 0, 1e-12));
  }
  // The stage's own schedule: each micro-batch forward in order, then backward in reverse.
  std::vector<std::pair<int, int64_t>> order;
  for (const TimelineEvent& e : stage->timeline()->events()) {
    order.emplace_back(e.kind == TimelineEvent::Kind::kCompute ? 0 : 1, e.microbatch);
  }
  const std::vector<std::pair<int, int64_t>> expected_order{{0, 0}, {0, 1}, {0, 2},
                                                            {1, 2}, {1, 1}, {1, 0}};
  CATCH_CHECK(order == expected_order);
}

CATCH_TEST_CASE("a stage's step and evaluate take the loss as an argument, and a last stage given "
                "none is refused",
                "[distributed][stage]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  auto [x, y] = batch(0);
  PipelineStage stage(make_model(), PipelineStageOptions({6}).chunks(kChunks), group);
  nn::Sequential plain = make_model();
  at::Tensor expected = nn::functional::mse_loss(plain->forward(x), y);
  expected.backward();
  CATCH_CHECK(at::allclose(stage->step(Batch(x), y, mse), expected, 0, 1e-12));
  const auto got = stage->parameters();
  const auto want = plain->parameters();
  CATCH_REQUIRE(got.size() == want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    CATCH_CHECK(at::allclose(got[k].grad(), want[k].grad(), 0, 1e-12));
  }
  stage->eval();
  CATCH_CHECK(at::allclose(stage->evaluate(Batch(x), y, mse).loss, expected.detach(), 0, 1e-12));
  PipelineStage no_loss(make_model(), PipelineStageOptions({6}).chunks(kChunks), group);
  CATCH_CHECK_THROWS_WITH(no_loss->step(Batch(x), y, nullptr),
                          gpipe_test::contains("needs a loss function: pass it to step(input, "
                                               "target, loss)"));
}

// The only use of the deprecated PipelineStageOptions::loss: a loss other than mse, so that which
// loss a step used shows in its value.
CATCH_TEST_CASE("the deprecated loss option is the loss of a step() or evaluate() given none, "
                "and their own loss takes precedence",
                "[distributed][stage]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  auto [x, y] = batch(0);
  const LossFunction doubled = [](const Batch& out, const at::Tensor& target) {
    return 2 * nn::functional::mse_loss(out.tensor(), target);
  };
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  PipelineStage stage(make_model(), PipelineStageOptions({6}).chunks(kChunks).loss(doubled), group);
#pragma GCC diagnostic pop
  nn::Sequential plain = make_model();
  const at::Tensor expected = nn::functional::mse_loss(plain->forward(x), y).detach();
  // Without a loss, or with an empty one, the option's; with one, that one.
  CATCH_CHECK(at::allclose(stage->step(Batch(x), y), 2 * expected, 0, 1e-12));
  CATCH_CHECK(at::allclose(stage->step(Batch(x), y, nullptr), 2 * expected, 0, 1e-12));
  CATCH_CHECK(at::allclose(stage->step(Batch(x), y, mse), expected, 0, 1e-12));
  // evaluate() likewise.
  stage->eval();
  CATCH_CHECK(at::allclose(stage->evaluate(Batch(x), y).loss, 2 * expected, 0, 1e-12));
  CATCH_CHECK(at::allclose(stage->evaluate(Batch(x), y, mse).loss, expected, 0, 1e-12));
}

CATCH_TEST_CASE("a stage with three partitions in one process trains with a skip within or "
                "across partitions as the plain model over several steps, and local balances "
                "that cannot work are refused naming the value",
                "[distributed][stage][partitions][errors]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  const auto refused = [&](PipelineStageOptions options) {
    PipelineStage(make_model(), options, group);
  };
  CATCH_CHECK_THROWS_WITH(refused(PipelineStageOptions({6}).local_balance({1, 2})),
                          gpipe_test::contains("local_balance {1, 2} adds up to 3 layers, but "
                                               "stage 0 has 6"));
  CATCH_CHECK_THROWS_WITH(refused(PipelineStageOptions({6}).local_balance({6, 0})),
                          gpipe_test::contains("local_balance {6, 0} has a non-positive entry 0"));
  CATCH_CHECK_THROWS_WITH(
      refused(PipelineStageOptions({6}).local_balance({3, 3}).devices({at::kCPU, at::kCPU,
                                                                        at::kCPU})),
      gpipe_test::contains("devices has 3 devices but local_balance {3, 3} has 2 "
                           "partitions"));
  CATCH_CHECK_THROWS_WITH(refused(PipelineStageOptions({6}).devices({at::kCPU, at::kCPU})),
                          gpipe_test::contains("devices has 2 devices but local_balance is "
                                               "empty"));
  // One device for a stage of several partitions: every partition on it.
  {
    PipelineStage one_device(
        make_model(), PipelineStageOptions({6}).local_balance({3, 3}).devices({at::kCPU}), group);
    CATCH_CHECK(one_device->partitions() == 2);
  }

  // {1, 2, 3}: Linear | Stash, PopPair | PairLinear, First, Linear, the skip within the second
  // partition; {2, 1, 3}: the skip from the first partition to the second. The pair crosses into
  // the third. Four steps with momentum, every checkpoint mode.
  const std::vector<int64_t> local =
      GENERATE(std::vector<int64_t>{1, 2, 3}, std::vector<int64_t>{2, 1, 3});
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_INFO("local balance {" << local[0] << ", " << local[1] << ", " << local[2]
                               << "}, checkpoint mode " << static_cast<int>(mode));
  PipelineStage stage(
      make_model(), PipelineStageOptions({6}).local_balance(local).chunks(kChunks).checkpoint(mode),
      group);
  stage->record_timeline(true);
  CATCH_CHECK(stage->partitions() == 3);
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    losses.push_back(stage->step(Batch(x), y, mse).detach());
    sgd.step();
  }
  const Oracle oracle = plain_training({6});
  const at::Tensor state = flat(stage->parameters());
  CATCH_REQUIRE(state.sizes() == oracle.stage_states[0].sizes());
  CATCH_CHECK(at::allclose(state, oracle.stage_states[0], 0, 1e-10));
  CATCH_CHECK(at::allclose(flat(losses), oracle.losses, 0, 1e-12));
  check_schedule(stage->gather_timeline(), 3);
}

// The 6-layer model with a Tanh between the stash and the pop, so that a skip can jump over a
// partition: Linear, Stash | Tanh | PopPair, PairLinear, First, Linear.
nn::Sequential make_jump_model() {
  torch::manual_seed(13);
  nn::Sequential seq(nn::Linear(6, 8), skippable(Stash(), SkippableOptions().stash({"skip"})),
                     nn::Tanh(), skippable(PopPair(), SkippableOptions().pop({"skip"})),
                     PairLinear(), First(), nn::Linear(8, 3));
  seq->to(at::kDouble);
  return seq;
}

CATCH_TEST_CASE("a stage of partitions in one process jumps a skip over a partition, gives "
                "layers before it their gradients, and infers the plain model's output",
                "[distributed][stage][partitions]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kNever);
  CATCH_INFO("checkpoint mode " << static_cast<int>(mode));
  // A Linear before the stage (outside it), trained with it.
  torch::manual_seed(17);
  nn::Linear before(6, 6);
  before->to(at::kDouble);
  auto before_plain = std::dynamic_pointer_cast<nn::LinearImpl>(before->clone());
  nn::Sequential plain = make_jump_model();
  PipelineStage stage(
      make_jump_model(),
      PipelineStageOptions({7}).local_balance({2, 1, 4}).chunks(kChunks).checkpoint(mode), group);
  std::vector<at::Tensor> params = stage->parameters();
  for (const at::Tensor& p : before->parameters()) params.push_back(p);
  std::vector<at::Tensor> plain_params = plain->parameters();
  for (const at::Tensor& p : before_plain->parameters()) plain_params.push_back(p);
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD plain_sgd(plain_params, torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    plain_sgd.zero_grad();
    const at::Tensor loss = stage->step(Batch(before(x)), y, mse);
    const at::Tensor plain_loss =
        nn::functional::mse_loss(plain->forward(before_plain->forward(x)), y);
    plain_loss.backward();
    CATCH_CHECK(at::allclose(loss, plain_loss, 0, 1e-12));
    sgd.step();
    plain_sgd.step();
  }
  CATCH_CHECK(at::allclose(flat(params), flat(plain_params), 0, 1e-10));
  // Inference: forward only, the output gathered on the stage.
  auto [x, y] = batch(kSteps);
  {
    at::NoGradGuard no_grad;
    stage->step(Batch(x), y, mse);
  }
  CATCH_CHECK(at::allclose(stage->output().tensor(), plain->forward(x).detach(), 0, 1e-12));
}

// A layer that throws on its `call`-th forward (not counting recomputations) or, with `backward`,
// in its `call`-th backward; with call 0 it passes its input on.
struct FailOnImpl : nn::Module {
  FailOnImpl(bool backward, int call) : backward(backward), call(call) {}
  at::Tensor forward(const at::Tensor& x) {
    if (!backward && call > 0 && !is_recomputing() && ++calls == call) {
      TORCH_CHECK(false, "layer failed in forward on call ", call);
    }
    at::Tensor y = x.clone();
    if (backward && call > 0 && y.requires_grad()) {
      y.register_hook([this](const at::Tensor& g) {
        TORCH_CHECK(++backward_calls != call, "layer failed in backward on call ", call);
        return g;
      });
    }
    return y;
  }
  bool backward;
  int call;
  int calls = 0;
  std::atomic<int> backward_calls{0};
};
TORCH_MODULE(FailOn);

CATCH_TEST_CASE("a layer that fails in any partition of a stage in forward or backward makes "
                "step() throw its error instead of hanging the other partitions",
                "[distributed][stage][partitions][errors]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  // Linear, F | Tanh, F | Linear, F in three partitions; one F fails (checkpointed micro-batches:
  // the backward failure comes in a recomputed forward's graph).
  const auto [where, backward, call] = GENERATE(table<int, bool, int>(
      {{0, false, 2}, {1, false, 1}, {2, false, 3}, {0, true, 1}, {1, true, 2}, {2, true, 1}}));
  CATCH_INFO("partition " << where << (backward ? " backward" : " forward") << ", call " << call);
  torch::manual_seed(3);
  const auto fail = [&, where = where, backward = backward, call = call](int partition) {
    return FailOn(backward, partition == where ? call : 0);
  };
  nn::Sequential seq(nn::Linear(6, 8), fail(0), nn::Tanh(), fail(1), nn::Linear(8, 3), fail(2));
  seq->to(at::kDouble);
  PipelineStage stage(seq, PipelineStageOptions({6}).local_balance({2, 2, 2}).chunks(kChunks),
                      group);
  auto [x, y] = batch(0);
  const std::string what = std::string("layer failed in ") + (backward ? "backward" : "forward") +
                           " on call " + std::to_string(call);
  CATCH_CHECK_THROWS_WITH(stage->step(Batch(x), y, mse), gpipe_test::contains(what));
  CATCH_CHECK_THROWS_WITH(stage->step(Batch(x), y, mse),
                          gpipe_test::contains("an earlier step failed on this stage"));
}

CATCH_TEST_CASE("a stage with a partition on the GPU and one on the CPU trains with a skip "
                "across devices as the plain model",
                "[distributed][stage][partitions][cuda]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  // Linear, Stash on cuda:0 | the rest on the CPU: the skip crosses devices.
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kNever);
  CATCH_INFO("checkpoint mode " << static_cast<int>(mode));
  const c10::Device gpu("cuda:0");
  PipelineStage stage(make_model(),
                      PipelineStageOptions({6})
                          .local_balance({2, 4})
                          .devices({gpu, c10::Device(c10::kCPU)})
                          .chunks(kChunks)
                          .checkpoint(mode),
                      group);
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    losses.push_back(stage->step(Batch(x.to(gpu)), y, mse).detach().cpu());
    sgd.step();
  }
  const Oracle oracle = plain_training({6});
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : stage->parameters()) params.push_back(p.cpu());
  CATCH_CHECK(at::allclose(flat(params), oracle.stage_states[0], 0, 1e-10));
  CATCH_CHECK(at::allclose(flat(losses), oracle.losses, 0, 1e-10));
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
