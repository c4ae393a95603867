// Failing fast across processes: a stage that fails while its process stays alive makes every
// other stage's step throw its error at once (Note [Failing fast across processes] in
// gpipe/distributed/internal/fault.h), under each schedule, wherever the failure is.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "gpipe/distributed/internal/fault.h"
#include "tests/distributed/stage_test_util.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers

// Set in the failing process only, before the step that fails.
std::atomic<bool> armed{false};

// Fails when armed: in its forward, or (in_backward) in the backward of its output.
struct FaultImpl : nn::Module {
  explicit FaultImpl(bool in_backward) : in_backward(in_backward) {}
  at::Tensor forward(const at::Tensor& x) {
    if (!armed) return x;
    if (!in_backward) TORCH_CHECK(false, "the layer broke in forward");
    at::Tensor y = x * 1.0;
    y.register_hook([](const at::Tensor&) -> at::Tensor {
      TORCH_CHECK(false, "the layer broke in backward");
      return at::Tensor();
    });
    return y;
  }
  bool in_backward;
};
TORCH_MODULE(Fault);

// Stage 0 fails by a bad input (no mini-batch), stage 1 by a layer in forward, stage 2 by a layer
// in backward; interleaved (one layer per virtual stage, stage s holding layers s and s + 3),
// stage 1 in backward and stage 2 in forward.
const char* fault_message(int64_t stage, bool interleaved) {
  const char* forward = "the layer broke in forward";
  const char* backward = "the layer broke in backward";
  return stage == 0   ? "stage 0 needs the mini-batch as input"
         : stage == 1 ? (interleaved ? backward : forward)
                      : (interleaved ? forward : backward);
}

void mark_done(int rank) { std::ofstream(gpipe_test::test_folder() + "/done" + std::to_string(rank)); }

// The failing rank stays alive until every other rank has seen its error (or a minute passed).
void wait_for_others(int world, int failing) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int r = 0; r < world; ++r) {
    if (r == failing) continue;
    const std::string path = gpipe_test::test_folder() + "/done" + std::to_string(r);
    while (!std::filesystem::exists(path) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

constexpr const char* kFailFast =
    "a stage that fails makes every other stage's step throw its error at once";

CATCH_TEST_CASE(kFailFast, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    const int failing = std::stoi(std::getenv("GPIPE_TEST_FAILING"));
    const std::string schedule = std::getenv("GPIPE_TEST_SCHEDULE");
    torch::manual_seed(7);
    nn::Sequential seq(nn::Linear(6, 8), nn::Tanh(), Fault(false), nn::Linear(8, 8),
                       Fault(true), nn::Linear(8, 3));
    seq->to(at::kDouble);
    // The group's timeout (60 s, join()) is what the others would wait for without the channel.
    const bool interleaved = schedule == "interleaved";
    PipelineStage stage(
        seq,
        PipelineStageOptions(interleaved ? std::vector<int64_t>(6, 1)
                                         : std::vector<int64_t>{2, 2, 2})
            .chunks(interleaved ? 3 : 4)
            .checkpoint(Checkpoint::kNever)
            .schedule(PipelineSchedule::of(schedule_kind(schedule), interleaved ? 2 : 1)),
        join());
    const auto step = [&](bool bad_input) {
      auto [x, y] = batch(0);
      if (stage->is_first()) return stage->step(bad_input ? no_input() : Batch(x), {}, mse);
      return stage->step(no_input(), y, mse);
    };
    step(false);  // a step that works first
    const int rank = test_rank();
    const auto start = std::chrono::steady_clock::now();
    if (rank == failing) {
      armed = true;
      CATCH_CHECK_THROWS_WITH(step(rank == 0),
                              gpipe_test::contains(fault_message(rank, interleaved)));
      wait_for_others(3, failing);
    } else {
      CATCH_CHECK_THROWS_WITH(
          step(false), gpipe_test::contains(absl::StrCat("stage ", failing, " of 3 failed: ")) &&
                           gpipe_test::contains(fault_message(failing, interleaved)));
      mark_done(rank);
      std::printf("rank %d threw after %.2f s\n", rank,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      CATCH_CHECK_THROWS_WITH(step(false), gpipe_test::contains("an earlier step failed"));
    }
    return;
  }
  for (const std::string schedule : {"gpipe", "1f1b", "zb", "interleaved"}) {
    for (const std::string failing : {"0", "1", "2"}) {
      CATCH_INFO(schedule << ", stage " << failing << " fails");
      const std::string folder = folder_for("fail_fast");
      const auto results = run_ranks(kFailFast, 3, folder, {{"GPIPE_TEST_SCHEDULE", schedule},
                                                           {"GPIPE_TEST_FAILING", failing}});
      CATCH_INFO(gpipe_test::outputs(results));
      for (const auto& r : results) CATCH_CHECK(r.exit_code == 0);
      std::filesystem::remove_all(folder);
    }
  }
}

constexpr const char* kNextStep =
    "a failure in the next step does not fail a step another stage is still finishing";

CATCH_TEST_CASE(kNextStep, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    const std::string schedule = std::getenv("GPIPE_TEST_SCHEDULE");
    PipelineStage stage(make_model(),
                        PipelineStageOptions(kBalance).chunks(4).schedule(schedule_kind(schedule)),
                        join());
    auto [x, y] = batch(0);
    const std::string failed = gpipe_test::test_folder() + "/failed";
    if (stage->is_first()) {
      CATCH_CHECK_NOTHROW(stage->step(Batch(x), {}, mse));
      // Step 1 fails at once (no input) while stage 1 is still in step 0.
      CATCH_CHECK_THROWS_WITH(stage->step(no_input(), {}, mse),
                              gpipe_test::contains("stage 0 needs the mini-batch as input"));
      std::ofstream{failed};
      wait_for_others(2, 0);
    } else {
      // Stage 1 holds step 0 before its last waits until stage 0 has failed step 1 and told it.
      internal::set_step_end_hook([&](int64_t index) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (index == 0 && !std::filesystem::exists(failed) &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        if (index == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      });
      CATCH_CHECK_NOTHROW(stage->step(no_input(), y, mse));  // step 0 happened on both stages
      internal::set_step_end_hook(nullptr);
      CATCH_CHECK_THROWS_WITH(stage->step(no_input(), y, mse),
                              gpipe_test::contains("stage 0 of 2 failed: ") &&
                                  gpipe_test::contains("stage 0 needs the mini-batch as input"));
      mark_done(1);
    }
    return;
  }
  for (const std::string schedule : {"gpipe", "zb"}) {
    CATCH_INFO(schedule);
    check_ranks_pass(kNextStep, "next_step", {{"GPIPE_TEST_SCHEDULE", schedule}});
  }
}

constexpr const char* kGradModes =
    "stages under different grad modes fail with an error naming both on every stage";

CATCH_TEST_CASE(kGradModes, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    PipelineStage stage(make_model(), PipelineStageOptions(kBalance).chunks(2), join());
    auto [x, y] = batch(0);
    // Seen by stage 1, which receives stage 0's activations with their grad mode.
    const char* mismatch = "stage 0 runs with grad but stage 1 without it";
    if (stage->is_first()) {
      CATCH_CHECK_THROWS_WITH(
          stage->step(Batch(x), {}, mse),
          gpipe_test::contains("stage 1 of 2 failed: ") && gpipe_test::contains(mismatch));
      mark_done(0);
      CATCH_CHECK_THROWS_WITH(stage->step(Batch(x), {}, mse),
                              gpipe_test::contains("an earlier step failed on this stage"));
    } else {
      {
        at::NoGradGuard no_grad;
        CATCH_CHECK_THROWS_WITH(stage->step(no_input(), y, mse), gpipe_test::contains(mismatch));
      }
      wait_for_others(2, 1);
    }
    return;
  }
  check_ranks_pass(kGradModes, "grad_modes");
}


constexpr const char* kTrainEval =
    "stages in train and eval modes that differ fail with an error naming both on every stage";

CATCH_TEST_CASE(kTrainEval, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    PipelineStage stage(make_model(), PipelineStageOptions(kBalance).chunks(2), join());
    auto [x, y] = batch(0);
    // Seen by stage 1, which receives stage 0's activations with its mode.
    const char* mismatch = "stage 0 is in train mode but stage 1 in eval mode";
    if (stage->is_first()) {
      CATCH_CHECK_THROWS_WITH(
          stage->step(Batch(x), {}, mse),
          gpipe_test::contains("stage 1 of 2 failed: ") && gpipe_test::contains(mismatch));
      mark_done(0);
    } else {
      stage->eval();
      CATCH_CHECK_THROWS_WITH(stage->step(no_input(), y, mse), gpipe_test::contains(mismatch));
      wait_for_others(2, 1);
    }
    return;
  }
  check_ranks_pass(kTrainEval, "train_eval");
}

constexpr const char* kReplicaFails =
    "a stage that fails in one replica makes the other replicas' stages throw its error at once "
    "(with and without deferred batch norm; also where a stage heard it before its step)";

CATCH_TEST_CASE(kReplicaFails, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    torch::manual_seed(7);
    // With deferred batch norm, stage 1 of replica 0 waits for the statistics' all-gather
    // before the gradients' all-reduce.
    const bool batch_norm = std::getenv("GPIPE_TEST_BATCH_NORM") != nullptr;
    nn::Sequential seq(nn::Linear(6, 8), nn::Tanh(), nn::Linear(8, 8), Fault(false));
    if (batch_norm) seq->push_back(nn::BatchNorm1d(8));
    seq->push_back(nn::Linear(8, 3));
    seq->to(at::kDouble);
    PipelineStage stage(seq,
                        PipelineStageOptions({2, batch_norm ? 4 : 3})
                            .chunks(2)
                            .deferred_batch_norm(batch_norm),
                        groups.pipeline, groups.replica_group);
    const auto step = [&] {
      auto [x, y] = batch(0);
      const at::Tensor xs = x.chunk(2)[groups.replica], ys = y.chunk(2)[groups.replica];
      return stage->is_first() ? stage->step(Batch(xs), {}, mse) : stage->step(no_input(), ys, mse);
    };
    step();  // a step that works first
    // Stage 1 of replica 1 (rank 3) fails in forward; its stage 0 hears it from the pipeline, and
    // replica 0's stages, waiting for their gradients' all-reduce, from their replicas. Late:
    // stage 1 of replica 0 (rank 1) starts its step only once rank 3 failed, so it throws at
    // once and tells its stage 0 nothing: rank 0, waiting for gradients that will not come, must
    // hear it from its replica (rank 2).
    const bool late = std::getenv("GPIPE_TEST_LATE") != nullptr;
    const std::string failed = gpipe_test::test_folder() + "/failed3";
    if (rank == 3) armed = true;
    if (rank == 1 && late) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!std::filesystem::exists(failed) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    const char* broke = "the layer broke in forward";
    if (rank == 3) {
      CATCH_CHECK_THROWS_WITH(step(), gpipe_test::contains(broke));
      std::ofstream{failed};  // its failure told (raise() waited for the others to take it)
    } else if (rank == 2) {
      CATCH_CHECK_THROWS_WITH(step(), gpipe_test::contains("stage 1 of 2 failed: ") &&
                                          gpipe_test::contains(broke));
    } else {
      CATCH_CHECK_THROWS_WITH(step(), gpipe_test::contains("of replica 1 of 2 failed: ") &&
                                          gpipe_test::contains(broke));
    }
    mark_done(rank);
    wait_for_others(4, rank);
    return;
  }
  // (deferred batch norm, rank 1 late)
  const auto [batch_norm, late] =
      GENERATE(std::pair{false, false}, std::pair{true, false}, std::pair{false, true});
  CATCH_INFO((batch_norm ? "with" : "without") << " deferred batch norm"
                                               << (late ? ", rank 1 late" : ""));
  const std::string folder = folder_for(batch_norm ? "replica_fails_bn"
                                        : late     ? "replica_fails_late"
                                                   : "replica_fails");
  std::map<std::string, std::string> env;
  if (batch_norm) env["GPIPE_TEST_BATCH_NORM"] = "1";
  if (late) env["GPIPE_TEST_LATE"] = "1";
  const auto results = run_ranks(kReplicaFails, 4, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  for (const auto& r : results) CATCH_CHECK(r.exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kRecovery =
    "after a failed step the same processes make new groups and stages and train on to the plain "
    "model's parameters and losses";

CATCH_TEST_CASE(kRecovery, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    const PipelineStageOptions options =
        PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(Checkpoint::kExceptLast);
    nn::Sequential model = make_model();
    // The failed stage and its group stay alive beside the new ones, as in a program that keeps
    // them in scope; rank 0 serves the store once for both groups (Note [One store per process]).
    std::vector<PipelineStage> stages;
    stages.emplace_back(model, options, join());
    torch::optim::SGD sgd(stages.back()->parameters(),
                          torch::optim::SGDOptions(0.1).momentum(0.9));
    std::vector<at::Tensor> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      if (step == 1 && stages.size() == 1) {
        // Stage 0 gives no mini-batch: its step fails, stage 1 hears it, and both make anew.
        PipelineStage& failed = stages.back();
        CATCH_CHECK_THROWS_WITH(failed->is_first() ? failed->step(no_input(), {}, mse)
                                                   : failed->step(no_input(), y, mse),
                                gpipe_test::contains("stage 0 needs the mini-batch as input"));
        mark_done(rank);
        wait_for_others(2, rank);
        stages.emplace_back(model, options, join());
        // The new stage holds the same layers, so the optimizer goes on with it.
        const auto before = stages.front()->parameters(), after = stages.back()->parameters();
        CATCH_REQUIRE(before.size() == after.size());
        for (size_t k = 0; k < before.size(); ++k) CATCH_REQUIRE(before[k].is_same(after[k]));
      }
      PipelineStage& stage = stages.back();
      sgd.zero_grad();
      at::Tensor loss =
          stage->is_first() ? stage->step(Batch(x), {}, mse) : stage->step(no_input(), y, mse);
      if (loss.defined()) losses.push_back(loss.detach());
      sgd.step();
    }
    const std::string folder = gpipe_test::test_folder();
    gpipe_test::write_doubles(folder + "/state" + std::to_string(rank) + ".bin",
                              stages.back()->parameters());
    if (stages.back()->is_last()) gpipe_test::write_doubles(folder + "/loss.bin", losses);
    return;
  }
  check_stages(kRecovery, folder_for("recovery"), {}, /*loss_tolerance=*/1e-12);
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
