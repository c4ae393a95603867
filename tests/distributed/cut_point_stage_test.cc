// Cut points across processes: a module cut at its cut points trains in 2 pipeline stages, each
// process holding its own sections, as the module itself does (Note [Cut points]).
#include <cmath>
#include <string>

#include <torch/optim/adam.h>

#include "gpipe/cut_point.h"
#include "tests/distributed/stage_test_util.h"
#include "tests/gpipe/cut_model.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers

constexpr const char* kCut =
    "a module cut at its cut points trains in 2 pipeline stages as the module itself";

// Ranks: 2 stages of the 4 sections ({2, 2}, or {1, 3} of 2 merged ones), the schedule and
// checkpoint mode the runner gives, 3 Adam steps against the plain module in each process.
CATCH_TEST_CASE(kCut, "[distributed][stage][cut_point]") {
  if (test_rank() >= 0) {
    const std::string kind = std::getenv("GPIPE_TEST_SCHEDULE");
    const bool merged = std::string(std::getenv("GPIPE_TEST_MERGED")) == "1";
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    cut_test::Net plain = cut_test::make_net();
    cut_test::Net net = cut_test::copy_of(plain);
    nn::Sequential sections =
        merged ? cut(net, cut_test::sample(), {1, 3}) : cut(net, cut_test::sample());
    PipelineStage stage(
        sections,
        PipelineStageOptions(merged ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 2})
            .chunks(3)
            .checkpoint(merged ? Checkpoint::kAlways : Checkpoint::kExceptLast)
            .schedule(schedule_kind(kind)),
        groups.pipeline, groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(0.01));
    for (int step = 0; step < 3; ++step) {
      at::manual_seed(50 + step);
      const at::Tensor x = at::randn({7, 4}, at::kDouble);
      const at::Tensor y = at::randn({7, 3}, at::kDouble);
      adam.zero_grad();
      plain_adam.zero_grad();
      const at::Tensor want = nn::functional::mse_loss(plain->forward(x), y);
      want.backward();
      plain_adam.step();
      const at::Tensor loss =
          stage->is_first() ? stage->step(Batch(x), y, mse) : stage->step(no_input(), y, mse);
      adam.step();
      if (loss.defined()) CATCH_CHECK(std::abs(loss.item<double>() - want.item<double>()) <= 1e-12);
    }
    // This process's sections hold the plain module's parameters.
    const auto want = plain->named_parameters();
    int64_t checked = 0;
    for (const auto& layer : stage->layers()->children()) {
      const auto section = std::dynamic_pointer_cast<SectionImpl>(layer);
      CATCH_REQUIRE(section != nullptr);
      for (const auto& [key, tensor] : section->owned_tensors()) {
        if (key.rfind("buffer ", 0) == 0) continue;
        CATCH_CAPTURE(key);
        CATCH_CHECK((tensor - want[key]).abs().max().item<double>() <= 1e-10);
        ++checked;
      }
    }
    CATCH_CHECK(checked == static_cast<int64_t>(stage->parameters().size()));
    return;
  }
  for (const char* kind : {"gpipe", "1f1b", "zb"}) {
    for (const char* merged : {"0", "1"}) {
      CATCH_CAPTURE(kind, merged);
      check_ranks_pass(kCut, std::string("cut_points_") + kind + merged,
                       {{"GPIPE_TEST_SCHEDULE", kind}, {"GPIPE_TEST_MERGED", merged}});
    }
  }
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
