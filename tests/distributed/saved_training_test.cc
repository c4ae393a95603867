// Saving and resuming across processes: 2 stages x 2 replicas, and the replicas of a
// DataParallel, resumed by new groups and stages over other parameters, take the saved run's next
// steps bit for bit (Note [Saving and resuming] in gpipe/saved_training.h).
#include "gpipe/distributed/saved_training.h"

#include <filesystem>

#include <torch/optim/adam.h>

#include "tests/distributed/stage_test_util.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers

// Every tensor of `a` equals `b`'s, bit for bit.
void check_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(at::equal(a[k], b[k]));
}

constexpr const char* kStages =
    "replicated pipeline stages resumed from save_training by new groups and stages take the "
    "saved run's next steps bit for bit";

CATCH_TEST_CASE(kStages, "[distributed][stage][save]") {
  if (test_rank() >= 0) {
    const std::string dir = gpipe_test::test_folder() + "/save";
    // Train 3 steps from `first` on; the losses of the last stage.
    const auto train = [](PipelineStage& stage, const PipelineGroups& groups,
                          torch::optim::Optimizer& opt, int first) {
      std::vector<at::Tensor> losses;
      for (int step = first; step < first + 3; ++step) {
        auto [x, y] = batch(step);
        const at::Tensor xs = x.chunk(groups.replicas)[groups.replica];
        const at::Tensor ys = y.chunk(groups.replicas)[groups.replica];
        opt.zero_grad();
        at::Tensor loss =
            stage->is_first() ? stage->step(Batch(xs), ys) : stage->step(no_input(), ys);
        if (loss.defined()) losses.push_back(loss.detach());
        opt.step();
      }
      return losses;
    };
    const auto options =
        PipelineStageOptions(kBalance).chunks(2).loss(mse).checkpoint(Checkpoint::kExceptLast);
    const auto group_options = options_from_env().timeout(std::chrono::seconds(60));
    const PipelineGroups groups = new_pipeline_groups(group_options, 2);
    PipelineStage stage(make_model(7), options, groups.pipeline, groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    train(stage, groups, adam, 0);
    save_training(dir, *stage, &adam, 3);
    const std::vector<at::Tensor> losses = train(stage, groups, adam, 3);

    // New groups and a stage over other parameters, as a restarted run makes them.
    const PipelineGroups again = new_pipeline_groups(group_options, 2);
    PipelineStage resumed(make_model(8), options, again.pipeline, again.replica_group);
    torch::optim::Adam adam2(resumed->parameters(), torch::optim::AdamOptions(0.01));
    CATCH_CHECK(load_training(dir, *resumed, &adam2) == 3);
    check_equal(train(resumed, again, adam2, 3), losses);
    check_equal(resumed->parameters(), stage->parameters());
    return;
  }
  const std::string folder = folder_for("saved_stages");
  const auto results = run_ranks(kStages, 4, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 4; ++r) CATCH_CHECK(results[r].exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kReplicas =
    "the replicas of a DataParallel resumed from save_training take the saved run's next steps "
    "bit for bit";

CATCH_TEST_CASE(kReplicas, "[distributed][save]") {
  if (test_rank() >= 0) {
    const std::string dir = gpipe_test::test_folder() + "/save";
    const int rank = test_rank();
    const auto train = [rank](DataParallel& model, torch::optim::Optimizer& opt, int first) {
      for (int step = first; step < first + 3; ++step) {
        auto [x, y] = batch(step);
        opt.zero_grad();
        mse(Batch(model->forward(x.chunk(2)[rank])), y.chunk(2)[rank]).backward();
        opt.step();
      }
    };
    const auto pipe = [](int seed) {
      return GPipe(make_model(seed), GPipeOptions({3, 3}).chunks(2));
    };
    DataParallel model(pipe(7), join());
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    train(model, sgd, 0);
    save_training(dir, *model, &sgd, 3);
    train(model, sgd, 3);
    DataParallel resumed(pipe(8), join());
    torch::optim::SGD sgd2(resumed->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    CATCH_CHECK(load_training(dir, *resumed, &sgd2) == 3);
    train(resumed, sgd2, 3);
    check_equal(resumed->parameters(), model->parameters());
    return;
  }
  const std::string folder = folder_for("saved_replicas");
  const auto results = run_ranks(kReplicas, 2, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 2; ++r) CATCH_CHECK(results[r].exit_code == 0);
  std::filesystem::remove_all(folder);
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
