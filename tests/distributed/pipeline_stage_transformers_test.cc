// Transformers' needs across processes: ties across stages (Note [Ties across stages]: a weight
// shared by the first and the last layer, found or named, over 2 and 3 stages, every checkpoint
// mode, 1F1B, interleaving, replicas and gradient accumulation, trained with SGD with momentum
// and Adam with weight decay against the plain Sequential with the weight truly shared), and loss
// scaling (Note [Loss scaling]: an inf in one stage's gradients skips the step on every stage).
#include "tests/distributed/stage_test_util.h"

#include <algorithm>
#include <limits>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/saved_training.h"
#include "gpipe/grad_scaler.h"
#include "tests/gpipe/tied_model.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers
using tied_test::kVocab;

std::string env_or(const char* name, const std::string& otherwise) {
  const char* value = std::getenv(name);
  return value ? value : otherwise;
}

std::pair<at::Tensor, at::Tensor> tied_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  at::Tensor x = at::randn({kBatch, kVocab}, gen, at::kDouble);
  at::Tensor y = at::randn({kBatch, kVocab}, gen, at::kDouble);
  return {x, y};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name,
                                                        const std::vector<at::Tensor>& params) {
  if (name == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(0.01).weight_decay(0.1));
  }
  return std::make_unique<torch::optim::SGD>(params,
                                             torch::optim::SGDOptions(0.05).momentum(0.9));
}

// The layers of each stage (virtual stage k runs on stage k % stages), in order.
std::vector<std::vector<int64_t>> stage_layers(const std::vector<int64_t>& balance, int stages) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(stages));
  int64_t next = 0;
  for (size_t k = 0; k < balance.size(); ++k) {
    for (int64_t i = 0; i < balance[k]; ++i) out[k % static_cast<size_t>(stages)].push_back(next++);
  }
  return out;
}

constexpr const char* kTiedStages =
    "a weight tied between the first and the last stage trains as the plain model's one "
    "parameter across processes";

CATCH_TEST_CASE(kTiedStages, "[distributed][stage][tied]") {
  if (test_rank() >= 0) {
    const int stages = std::stoi(env_or("GPIPE_TEST_STAGES", "2"));
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), stages);
    const bool named = env_or("GPIPE_TEST_NAMED", "0") == "1";
    const std::string schedule = env_or("GPIPE_TEST_SCHEDULE", "gpipe");
    const std::vector<int64_t> balance = balance_from_env();
    auto options = PipelineStageOptions(balance).chunks(4).checkpoint(mode_from_env());
    if (named) options.tied_parameters({{"0.weight", "4.weight"}});
    if (schedule == "1f1b") options.schedule(ScheduleKind::k1F1B);
    if (schedule == "interleaved") options.schedule(PipelineSchedule::of(
        ScheduleKind::kInterleaved,
        2));
    // Named: the last place starts apart and must take the first's value.
    nn::Sequential model = tied_test::tied_model(/*shared=*/!named);
    PipelineStage stage = groups.replicas > 1
                              ? PipelineStage(model, options, groups.pipeline, groups.replica_group)
                              : PipelineStage(model, options, groups.pipeline);
    // Every layout here puts the tie's places on two stages: the first and the last.
    CATCH_CHECK(stage->tied_stages() ==
                std::vector<std::vector<int64_t>>{{0, static_cast<int64_t>(stages) - 1}});
    auto optimizer = make_optimizer(env_or("GPIPE_TEST_OPT", "sgd"), stage->parameters());
    // Gradient accumulation: `accumulate` steps, on parts of the mini-batch, per optimizer step.
    const int accumulate = std::stoi(env_or("GPIPE_TEST_ACCUMULATE", "1"));
    // Clipping by the whole model's gradient norm (0: none).
    const double clip = std::stod(env_or("GPIPE_TEST_CLIP", "0"));
    std::vector<at::Tensor> losses, norms;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = tied_batch(step);
      optimizer->zero_grad();
      for (int a = 0; a < accumulate; ++a) {
        const at::Tensor xs = x.chunk(accumulate)[a].chunk(groups.replicas)[groups.replica];
        const at::Tensor ys = y.chunk(accumulate)[a].chunk(groups.replicas)[groups.replica];
        const at::Tensor loss =
            stage->is_first() ? stage->step(Batch(xs), ys, mse) : stage->step(no_input(), ys, mse);
        if (loss.defined()) losses.push_back(loss.detach());
      }
      if (clip > 0) norms.push_back(stage->clip_grad_norm(clip));
      optimizer->step();
    }
    const std::string folder = gpipe_test::test_folder();
    if (clip > 0) {
      gpipe_test::write_doubles(folder + "/norm" + std::to_string(test_rank()) + ".bin", norms);
    }
    gpipe_test::write_doubles(folder + "/state" + std::to_string(test_rank()) + ".bin",
                              stage->parameters());
    if (stage->is_last()) {
      gpipe_test::write_doubles(folder + "/loss" + std::to_string(groups.replica) + ".bin",
                                losses);
    }
    return;
  }
  struct Case {
    std::string balance, mode, schedule, opt;
    int stages, replicas;
    bool named;
    int accumulate = 1;
    double clip = 0;
  };
  const Case c = GENERATE(Case{"2,3", "always", "gpipe", "sgd", 2, 1, false},
                          Case{"2,3", "except_last", "gpipe", "adam", 2, 1, false},
                          Case{"2,3", "never", "gpipe", "sgd", 2, 1, true},
                          Case{"2,3", "except_last", "gpipe", "adam", 2, 1, true},
                          Case{"2,2,1", "except_last", "gpipe", "adam", 3, 1, false},
                          Case{"2,2,1", "always", "1f1b", "sgd", 3, 1, true},
                          Case{"1,1,1,2", "except_last", "interleaved", "adam", 2, 1, false},
                          Case{"2,3", "except_last", "gpipe", "adam", 2, 2, true},
                          Case{"2,3", "never", "1f1b", "sgd", 2, 1, false, 2},
                          Case{"2,2,1", "except_last", "gpipe", "sgd", 3, 1, true, 2},
                          // Clipped by the whole model's norm, the tie counted once.
                          Case{"2,2,1", "except_last", "1f1b", "adam", 3, 1, true, 1, 0.05},
                          Case{"2,3", "never", "gpipe", "sgd", 2, 2, false, 2, 0.05});
  CATCH_INFO("balance " << c.balance << ", checkpoint " << c.mode << ", " << c.schedule << ", "
                        << c.opt << ", " << c.stages << " stages x " << c.replicas
                        << " replicas, " << (c.named ? "named" : "found") << ", "
                        << c.accumulate << " steps per optimizer step");
  const int world = c.stages * c.replicas;
  const std::string folder = folder_for("tied_" + std::to_string(world) + "_" + c.schedule);
  const auto results = run_ranks(kTiedStages, world, folder,
                                 {{"GPIPE_TEST_STAGES", std::to_string(c.stages)},
                                  {"GPIPE_TEST_BALANCE", c.balance},
                                  {"GPIPE_TEST_CHECKPOINT", c.mode},
                                  {"GPIPE_TEST_SCHEDULE", c.schedule},
                                  {"GPIPE_TEST_OPT", c.opt},
                                  {"GPIPE_TEST_NAMED", c.named ? "1" : "0"},
                                  {"GPIPE_TEST_ACCUMULATE", std::to_string(c.accumulate)},
                                  {"GPIPE_TEST_CLIP", std::to_string(c.clip)}});
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < world; ++r) CATCH_REQUIRE(results[r].exit_code == 0);

  // The plain model, its weight shared, on the whole mini-batch.
  nn::Sequential plain = tied_test::tied_model(/*shared=*/true);
  const std::vector<at::Tensor> unique = tied_test::each_once(plain->parameters());
  auto optimizer = make_optimizer(c.opt, unique);
  std::vector<at::Tensor> losses;
  std::vector<double> norms;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = tied_batch(step);
    optimizer->zero_grad();
    for (int a = 0; a < c.accumulate; ++a) {
      const at::Tensor loss = nn::functional::mse_loss(plain->forward(x.chunk(c.accumulate)[a]),
                                                       y.chunk(c.accumulate)[a]);
      loss.backward();
      losses.push_back(loss.detach());
    }
    if (c.clip > 0) norms.push_back(torch::nn::utils::clip_grad_norm_(unique, c.clip));
    optimizer->step();
  }
  if (c.clip > 0) {
    // Every rank got the whole model's norm, and it was over the bound: the steps were clipped.
    for (int r = 0; r < world; ++r) {
      const at::Tensor got =
          gpipe_test::read_doubles(folder + "/norm" + std::to_string(r) + ".bin");
      CATCH_CHECK(at::allclose(got, at::tensor(norms, at::kDouble), 1e-10, 1e-12));
    }
    CATCH_CHECK(*std::min_element(norms.begin(), norms.end()) > c.clip);
  }
  std::vector<int64_t> balance;
  for (char ch : c.balance) {
    if (ch != ',') balance.push_back(ch - '0');
  }
  const auto layers = stage_layers(balance, c.stages);
  for (int r = 0; r < world; ++r) {
    std::vector<at::Tensor> expected;
    for (int64_t layer : layers[static_cast<size_t>(r % c.stages)]) {
      for (const at::Tensor& p : plain[layer]->parameters()) expected.push_back(p);
    }
    const at::Tensor state =
        gpipe_test::read_doubles(folder + "/state" + std::to_string(r) + ".bin");
    std::vector<at::Tensor> flat;
    for (const at::Tensor& p : expected) flat.push_back(p.detach().reshape(-1));
    const at::Tensor want = at::cat(flat);
    CATCH_REQUIRE(state.sizes() == want.sizes());
    CATCH_CHECK(at::allclose(state, want, 0, 1e-10));
  }
  at::Tensor mean = gpipe_test::read_doubles(folder + "/loss0.bin");
  for (int q = 1; q < c.replicas; ++q) {
    mean = mean + gpipe_test::read_doubles(folder + "/loss" + std::to_string(q) + ".bin");
  }
  mean = mean / c.replicas;
  CATCH_CHECK(at::allclose(mean, at::stack(losses), 0, 1e-12));
  std::filesystem::remove_all(folder);
}

constexpr const char* kPartedTie =
    "a tie that one stage's optimizer steps otherwise is refused by save_training on every stage";

CATCH_TEST_CASE(kPartedTie, "[distributed][stage][tied][saving][errors]") {
  if (test_rank() < 0) {
    // Two stages, both holding the tie; three, the middle one without it.
    const int stages = GENERATE(2, 3);
    CATCH_CAPTURE(stages);
    const std::string folder = folder_for("parted_tie_" + std::to_string(stages));
    const auto results =
        run_ranks(kPartedTie, stages, folder, {{"GPIPE_TEST_STAGES", std::to_string(stages)}});
    CATCH_INFO(gpipe_test::outputs(results));
    for (const auto& r : results) CATCH_CHECK(r.exit_code == 0);
    std::filesystem::remove_all(folder);
    return;
  }
  const int stages = std::stoi(env_or("GPIPE_TEST_STAGES", "2"));
  const std::vector<int64_t> balance =
      stages == 2 ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{2, 2, 1};
  PipelineStage stage(tied_test::tied_model(/*shared=*/true),
                      PipelineStageOptions(balance).chunks(2), join());
  CATCH_REQUIRE(stage->tied_stages() ==
                std::vector<std::vector<int64_t>>{{0, static_cast<int64_t>(stages) - 1}});
  const std::string dir = gpipe_test::test_folder() + "/saves";
  // The same optimizer on every stage: the tie stays one, and saves.
  const auto train = [&](double first_lr, int steps) {
    torch::optim::SGD sgd(stage->parameters(),
                          torch::optim::SGDOptions(stage->is_first() ? first_lr : 0.05));
    for (int step = 0; step < steps; ++step) {
      auto [x, y] = tied_batch(step);
      sgd.zero_grad();
      stage->step(stage->is_first() ? Batch(x) : no_input(), y, mse);
      sgd.step();
    }
  };
  train(0.05, 2);
  stage->check_ties();
  save_training(dir, *stage, nullptr, 2);
  // The first stage with another learning rate: its tie parts from the last stage's.
  train(0.2, 1);
  const auto parted = gpipe_test::contains(
      "tied parameter 0.weight differs between the stages holding it (0, " +
      std::to_string(stages - 1) + "); every stage's optimizer must step it alike");
  CATCH_CHECK_THROWS_WITH(stage->check_ties(), parted);
  CATCH_CHECK_THROWS_WITH(save_training(dir, *stage, nullptr, 3), parted);
  // Nothing was written for the refused step: the last save is still the one to load.
  CATCH_CHECK(load_training(dir, *stage, nullptr) == 2);
}

constexpr const char* kSkipEverywhere =
    "an inf in the last stage's gradients skips the step on every stage and backs the scale off";

CATCH_TEST_CASE(kSkipEverywhere, "[distributed][stage][grad_scaler]") {
  if (test_rank() < 0) {
    check_ranks_pass(kSkipEverywhere, "grad_scaler");
    return;
  }
  GradScaler scaler(GradScalerOptions().init_scale(1024));
  // The last stage's loss, scaled: every micro-batch's backward starts from it.
  const auto scaled = [&scaler](const Batch& out, const at::Tensor& y) {
    return scaler.scale(mse(out, y));
  };
  PipelineStage stage(make_model(), PipelineStageOptions(kBalance).chunks(kChunks), join());
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  bool poison = false;
  if (stage->is_last()) {
    stage->parameters()[0].register_hook([&poison](const at::Tensor& g) {
      return poison ? g * std::numeric_limits<double>::infinity() : g;
    });
  }
  for (int step = 0; step < 3; ++step) {
    CATCH_INFO("step " << step);
    poison = step == 1;
    auto [x, y] = batch(step);
    sgd.zero_grad();
    stage->step(stage->is_first() ? Batch(x) : no_input(), y, scaled);
    std::vector<at::Tensor> before;
    for (const at::Tensor& p : stage->parameters()) before.push_back(p.detach().clone());
    const double scale = scaler.scale_value();
    const bool stepped = scaler.step(sgd, stage->parameters(), [&](bool found) {
      return any_rank(stage->group(), found);
    });
    scaler.update();
    CATCH_CHECK(stepped == (step != 1));
    double moved = 0;
    for (size_t k = 0; k < before.size(); ++k) {
      moved += (before[k] - stage->parameters()[k]).abs().sum().item<double>();
    }
    CATCH_CHECK((moved > 0) == stepped);
    CATCH_CHECK(scaler.scale_value() == (step == 1 ? scale / 2 : scale));
  }
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
