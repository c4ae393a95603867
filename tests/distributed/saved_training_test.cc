// Saving and resuming across processes: 2 stages x 2 replicas, and the replicas of a
// DataParallel, resumed by new groups and stages over other parameters, take the saved run's next
// steps bit for bit (Note [Saving and resuming] in gpipe/saved_training.h); a save killed before
// its manifest leaves the previous one loadable, and a load refuses a missing manifest, a torn
// file and a folder that mixes saves, changing nothing (Note [Atomic saves]).
#include "gpipe/distributed/saved_training.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>

#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gpipe/internal/atomic_file.h"
#include "tests/distributed/stage_test_util.h"
#include "tests/gpipe/tied_model.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers
namespace fs = std::filesystem;

// Every tensor of `a` equals `b`'s, bit for bit.
void check_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(at::equal(a[k], b[k]));
}

// `tensors` flattened into one float64 tensor, as read_doubles reads what write_doubles wrote.
at::Tensor flat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> parts;
  for (const at::Tensor& t : tensors) parts.push_back(t.detach().to(at::kDouble).reshape(-1));
  return at::cat(parts);
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : tensors) out.push_back(t.detach().clone());
  return out;
}

// Trains `count` steps from `first` on, each replica on its shard of the batch, with mse; the
// losses of the last stage.
std::vector<at::Tensor> train_steps(PipelineStage& stage, const PipelineGroups& groups,
                                    torch::optim::Optimizer& opt, int first, int count) {
  std::vector<at::Tensor> losses;
  for (int step = first; step < first + count; ++step) {
    auto [x, y] = batch(step);
    const at::Tensor xs = x.chunk(groups.replicas)[groups.replica];
    const at::Tensor ys = y.chunk(groups.replicas)[groups.replica];
    opt.zero_grad();
    at::Tensor loss =
        stage->is_first() ? stage->step(Batch(xs), ys, mse) : stage->step(no_input(), ys, mse);
    if (loss.defined()) losses.push_back(loss.detach());
    opt.step();
  }
  return losses;
}

// Runs test `test` in `world` ranks with `env`, in folder_for(`name`), checks that every rank
// exited with 0 (every check in the ranks held), and returns the folder: a later phase loads what
// this one saved there.
std::string run_phase(const char* test, int world, const std::string& name,
                      const std::map<std::string, std::string>& env) {
  const std::string folder = folder_for(name);
  const auto results = run_ranks(test, world, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < world; ++r) CATCH_CHECK(results[r].exit_code == 0);
  return folder;
}

// A GradScaler that took clean steps and skipped one: scale 32, growth tracker 2, 1 skipped.
GradScaler used_scaler() {
  GradScaler scaler(GradScalerOptions().init_scale(64).growth_interval(5));
  at::Tensor w = at::zeros({2}, at::kDouble).requires_grad_();
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  for (double g : {1.0, static_cast<double>(INFINITY), 1.0, 1.0}) {
    w.mutable_grad() = at::full({2}, g, at::kDouble);
    scaler.step(sgd, {w});
    scaler.update();
  }
  return scaler;
}

void check_used_scaler(const GradScaler& scaler) {
  CATCH_CHECK(scaler.scale_value() == 32);
  CATCH_CHECK(scaler.growth_tracker() == 2);
  CATCH_CHECK(scaler.skipped() == 1);
}

// Runs a commit hook for as long as it lives (internal::set_commit_hook).
struct CommitHook {
  explicit CommitHook(std::function<void(const std::string&)> hook) {
    gpipe::internal::set_commit_hook(std::move(hook));
  }
  ~CommitHook() { gpipe::internal::set_commit_hook(nullptr); }
};

constexpr const char* kStages =
    "replicated pipeline stages resumed from save_training by new groups and stages take the "
    "saved run's next steps bit for bit";

CATCH_TEST_CASE(kStages, "[distributed][stage][save]") {
  if (test_rank() >= 0) {
    const std::string dir = gpipe_test::test_folder() + "/save";
    const auto options =
        PipelineStageOptions(kBalance).chunks(2).checkpoint(Checkpoint::kExceptLast);
    const auto group_options = options_from_env().timeout(std::chrono::seconds(60));
    const PipelineGroups groups = new_pipeline_groups(group_options, 2);
    PipelineStage stage(make_model(7), options, groups.pipeline, groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    train_steps(stage, groups, adam, 0, 3);
    save_training(dir, *stage, &adam, 3);
    const std::vector<at::Tensor> losses = train_steps(stage, groups, adam, 3, 3);

    // New groups and a stage over other parameters, as a restarted run makes them.
    const PipelineGroups again = new_pipeline_groups(group_options, 2);
    PipelineStage resumed(make_model(8), options, again.pipeline, again.replica_group);
    torch::optim::Adam adam2(resumed->parameters(), torch::optim::AdamOptions(0.01));
    CATCH_CHECK(load_training(dir, *resumed, &adam2) == 3);
    check_equal(train_steps(resumed, again, adam2, 3, 3), losses);
    check_equal(resumed->parameters(), stage->parameters());
    return;
  }
  const std::string folder = folder_for("saved_stages");
  const auto results = run_ranks(kStages, 4, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 4; ++r) CATCH_CHECK(results[r].exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kOtherReplicas =
    "a save of 2 stages x 2 replicas resumes on 2 stages x 1 replica with the saved parameters "
    "and generators exactly and trains on as the 2 replicas did up to summation order and a "
    "save of 2 x 1 resumes on 2 x 2 with every replica taking replica 0's generators";

// One draw of this rank's CPU generator, written to (or compared with) `path`.
void write_draw(const std::string& path) {
  gpipe_test::write_doubles(path, {at::randn({4}, at::kDouble)});
}
void check_draw(const std::string& path) {
  CATCH_CHECK(at::equal(gpipe_test::read_doubles(path), at::randn({4}, at::kDouble)));
}

// Phase 1, in 4 ranks (2 x 2): saves at step 3, draws, trains 3 more steps; each stage's
// replica 0 writes its parameters at the save and at the end. Phase 2, in 2 ranks (2 x 1;
// GPIPE_TEST_SAVED: phase 1's folder): loads that save, draws as phase 1's replica 0 did, trains
// the same 3 steps on the whole batch, saves at step 6 and draws. Phase 3, in 4 ranks again
// (GPIPE_TEST_RESAVED: phase 2's folder): both replicas load phase 2's parameters and its draw.
CATCH_TEST_CASE(kOtherReplicas, "[distributed][stage][save]") {
  if (test_rank() >= 0) {
    const char* saved = std::getenv("GPIPE_TEST_SAVED");
    const char* resaved = std::getenv("GPIPE_TEST_RESAVED");
    const std::string mine = gpipe_test::test_folder();
    const auto options = PipelineStageOptions(kBalance).chunks(2);
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    PipelineStage stage(make_model(saved != nullptr ? 8 : 7), options, groups.pipeline,
                        groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    const auto file = [&groups](const std::string& folder, const std::string& what, int replica) {
      return absl::StrCat(folder, "/", what, "_stage", groups.stage, "_replica", replica);
    };
    if (resaved != nullptr) {  // phase 3
      CATCH_REQUIRE(groups.replicas == 2);
      CATCH_CHECK(load_training(std::string(resaved) + "/save", *stage, &adam) == 6);
      check_draw(file(resaved, "draw", 0));
      CATCH_CHECK(at::equal(gpipe_test::read_doubles(file(resaved, "parameters", 0)),
                            flat(stage->parameters())));
      return;
    }
    if (saved == nullptr) {  // phase 1
      train_steps(stage, groups, adam, 0, 3);
      save_training(mine + "/save", *stage, &adam, 3);
      write_draw(file(mine, "draw", groups.replica));
      if (groups.replica == 0)
        gpipe_test::write_doubles(file(mine, "at_save", 0), stage->parameters());
      train_steps(stage, groups, adam, 3, 3);
      if (groups.replica == 0)
        gpipe_test::write_doubles(file(mine, "at_end", 0), stage->parameters());
      return;
    }
    CATCH_REQUIRE(groups.replicas == 1);  // phase 2
    CATCH_CHECK(load_training(std::string(saved) + "/save", *stage, &adam) == 3);
    check_draw(file(saved, "draw", 0));
    CATCH_CHECK(
        at::equal(gpipe_test::read_doubles(file(saved, "at_save", 0)), flat(stage->parameters())));
    train_steps(stage, groups, adam, 3, 3);
    CATCH_CHECK(at::allclose(gpipe_test::read_doubles(file(saved, "at_end", 0)),
                             flat(stage->parameters()), 1e-9, 1e-12));
    save_training(mine + "/save", *stage, &adam, 6);
    write_draw(file(mine, "draw", 0));
    gpipe_test::write_doubles(file(mine, "parameters", 0), stage->parameters());
    return;
  }
  const auto run = [](int world, const std::string& name,
                      const std::map<std::string, std::string>& env) {
    return run_phase(kOtherReplicas, world, name, env);
  };
  const std::string four = run(4, "replicas_four", {});
  const std::string two = run(2, "replicas_two", {{"GPIPE_TEST_SAVED", four}});
  const std::string again = run(4, "replicas_again", {{"GPIPE_TEST_RESAVED", two}});
  for (const std::string& folder : {four, two, again}) std::filesystem::remove_all(folder);
}

constexpr const char* kResharded =
    "a save of 2 stages resumes in 2 interleaved stages of another balance and in a GPipe and in "
    "the plain Sequential and in 2 V-shaped stages and a GPipe's save in 2 stages and each takes "
    "the plain run's next steps";

// The plain model of 8 layers after `steps` Adam steps on the whole batch: the oracle.
nn::Sequential adam_oracle(int steps) {
  nn::Sequential plain = make_model(7, 8);
  torch::optim::Adam adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    adam.zero_grad();
    nn::functional::mse_loss(plain->forward(x), y).backward();
    adam.step();
  }
  return plain;
}

// The parameters of `layers` (in order) against the oracle's layers `indices`.
void check_layers(nn::Sequential layers, nn::Sequential oracle, const std::vector<int64_t>& indices,
                  double tol) {
  CATCH_REQUIRE(layers->size() == indices.size());
  for (size_t k = 0; k < indices.size(); ++k) {
    const auto mine = layers[k]->parameters();
    const auto want = oracle[indices[k]]->parameters();
    CATCH_REQUIRE(mine.size() == want.size());
    for (size_t p = 0; p < mine.size(); ++p) {
      CATCH_CHECK((mine[p] - want[p]).abs().max().item<double>() <= tol);
    }
  }
}

std::vector<int64_t> range(int64_t first, int64_t end) {
  std::vector<int64_t> out;
  for (int64_t k = first; k < end; ++k) out.push_back(k);
  return out;
}

// Phases, 2 ranks each (GPIPE_TEST_PHASE): "save": stages {3, 5} train 3 steps and save;
// "interleaved" (GPIPE_TEST_SAVED: that folder): stages of balance {3, 1, 2, 2}, 2 virtual
// stages each, load it, train 3 more steps against the oracle and save; "v_shaped"
// (GPIPE_TEST_SAVED: the interleaved save) the same under ZBV, stage 0 holding entries 0 and 3 of
// {3, 1, 2, 2}; "one_process" (GPIPE_TEST_SAVED: a GPipe's save file): stages {4, 4} load it and
// train on.
CATCH_TEST_CASE(kResharded, "[distributed][stage][save][resharding]") {
  if (test_rank() >= 0) {
    const std::string phase = std::getenv("GPIPE_TEST_PHASE");
    const char* saved = std::getenv("GPIPE_TEST_SAVED");
    const std::string mine = gpipe_test::test_folder();
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    auto options = PipelineStageOptions({3, 5}).chunks(2);
    std::vector<int64_t> indices = groups.stage == 0 ? range(0, 3) : range(3, 8);
    if (phase == "interleaved") {
      options =
          PipelineStageOptions({3, 1, 2, 2}).chunks(2).schedule(PipelineSchedule::interleaved(2));
      indices =
          groups.stage == 0 ? std::vector<int64_t>{0, 1, 2, 4, 5} : std::vector<int64_t>{3, 6, 7};
    } else if (phase == "v_shaped") {
      options = PipelineStageOptions({3, 1, 2, 2}).chunks(3).schedule(ScheduleKind::kZeroBubbleV);
      indices =
          groups.stage == 0 ? std::vector<int64_t>{0, 1, 2, 6, 7} : std::vector<int64_t>{3, 4, 5};
    } else if (phase == "one_process") {
      options = PipelineStageOptions({4, 4}).chunks(3);
      indices = groups.stage == 0 ? range(0, 4) : range(4, 8);
    }
    PipelineStage stage(make_model(phase == "save" ? 7 : 8, 8), options, groups.pipeline,
                        groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    if (phase == "save") {
      train_steps(stage, groups, adam, 0, 3);
      save_training(mine + "/save", *stage, &adam, 3);
      return;
    }
    CATCH_REQUIRE(saved != nullptr);
    const int from = phase == "v_shaped" ? 6 : 3;
    CATCH_CHECK(load_training(saved, *stage, &adam) == from);
    check_layers(stage->layers(), adam_oracle(from), indices, from == 3 ? 1e-12 : 1e-10);
    train_steps(stage, groups, adam, from, 3);
    check_layers(stage->layers(), adam_oracle(from + 3), indices, 1e-10);
    if (phase != "one_process") save_training(mine + "/save", *stage, &adam, from + 3);
    return;
  }
  const auto run = [](const std::string& name, const std::map<std::string, std::string>& env) {
    return run_phase(kResharded, 2, name, env);
  };
  const std::string stages = run("resharded_stages", {{"GPIPE_TEST_PHASE", "save"}});
  // The stages' save in the plain Sequential, which trains on as the oracle.
  nn::Sequential plain = make_model(9, 8);
  torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(gpipe::load_training(stages + "/save", *plain, &plain_adam) == 3);
  check_layers(plain, adam_oracle(3), range(0, 8), 1e-12);
  for (int step = 3; step < 6; ++step) {
    auto [x, y] = batch(step);
    plain_adam.zero_grad();
    nn::functional::mse_loss(plain->forward(x), y).backward();
    plain_adam.step();
  }
  check_layers(plain, adam_oracle(6), range(0, 8), 1e-10);
  // In interleaved stages of another balance, whose save loads into a GPipe.
  const std::string interleaved =
      run("resharded_interleaved",
          {{"GPIPE_TEST_PHASE", "interleaved"}, {"GPIPE_TEST_SAVED", stages + "/save"}});
  GPipe pipe(make_model(9, 8), GPipeOptions({5, 3}).chunks(2));
  torch::optim::Adam pipe_adam(pipe->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(gpipe::load_training(interleaved + "/save", *pipe, &pipe_adam) == 6);
  nn::Sequential flat_pipe;
  for (const nn::Sequential& p : pipe->partitions()) flat_pipe->extend(*p);
  check_layers(flat_pipe, adam_oracle(6), range(0, 8), 1e-10);
  // In V-shaped stages (ZBV), whose save loads into the plain Sequential.
  const std::string v_shaped =
      run("resharded_v_shaped",
          {{"GPIPE_TEST_PHASE", "v_shaped"}, {"GPIPE_TEST_SAVED", interleaved + "/save"}});
  nn::Sequential after_v = make_model(9, 8);
  torch::optim::Adam after_v_adam(after_v->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(gpipe::load_training(v_shaped + "/save", *after_v, &after_v_adam) == 9);
  check_layers(after_v, adam_oracle(9), range(0, 8), 1e-10);
  // A GPipe's save of one process in 2 stages.
  GPipe first(make_model(7, 8), GPipeOptions({3, 5}).chunks(2));
  torch::optim::Adam first_adam(first->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    first_adam.zero_grad();
    first->step(x, y, mse);
    first_adam.step();
  }
  const std::string file = folder_for("resharded_file") + ".pt";
  gpipe::save_training(file, *first, &first_adam, 3);
  run("resharded_one_process", {{"GPIPE_TEST_PHASE", "one_process"}, {"GPIPE_TEST_SAVED", file}});
  for (const std::string& f : {stages, interleaved, v_shaped}) fs::remove_all(f);
  fs::remove(file);
}

// Trains 3 steps from `first` on, this rank (of 2 replicas) on its half of each batch, with mse.
void train_replicas(DataParallel& model, torch::optim::Optimizer& opt, int first) {
  const int rank = test_rank();
  for (int step = first; step < first + 3; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    mse(Batch(model->forward(x.chunk(2)[rank])), y.chunk(2)[rank]).backward();
    opt.step();
  }
}

constexpr const char* kReplicas =
    "the replicas of a DataParallel resumed from save_training take the saved run's next steps "
    "bit for bit and get the GradScaler's state back";

CATCH_TEST_CASE(kReplicas, "[distributed][save]") {
  if (test_rank() >= 0) {
    const std::string dir = gpipe_test::test_folder() + "/save";
    const auto pipe = [](int seed) {
      return GPipe(make_model(seed), GPipeOptions({3, 3}).chunks(2));
    };
    DataParallel model(pipe(7), join());
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    train_replicas(model, sgd, 0);
    const GradScaler scaler = used_scaler();
    save_training(dir, *model, &sgd, 3, &scaler);
    train_replicas(model, sgd, 3);
    DataParallel resumed(pipe(8), join());
    torch::optim::SGD sgd2(resumed->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    GradScaler loaded;
    CATCH_CHECK(load_training(dir, *resumed, &sgd2, &loaded) == 3);
    check_used_scaler(loaded);
    train_replicas(resumed, sgd2, 3);
    check_equal(resumed->parameters(), model->parameters());
    return;
  }
  const std::string folder = folder_for("saved_replicas");
  const auto results = run_ranks(kReplicas, 2, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 2; ++r) CATCH_CHECK(results[r].exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kReplicasResharded =
    "a DataParallel's save resumes by layer in a GPipe of another balance whose save resumes in a "
    "DataParallel of a GPipe and each takes the plain run's next steps";

// `model`'s layers in order, a GPipe's partitions joined (for check_layers).
nn::Sequential flat_layers(const std::shared_ptr<nn::Module>& model) {
  if (const auto* pipe = dynamic_cast<const GPipeImpl*>(model.get())) {
    nn::Sequential flat;
    for (const nn::Sequential& p : pipe->partitions()) flat->extend(*p);
    return flat;
  }
  return nn::Sequential(std::dynamic_pointer_cast<nn::SequentialImpl>(model));
}

// Phases, 2 ranks each (GPIPE_TEST_PHASE): "save": the replicas of the plain 8-layer model train
// 3 steps, each on its half of the batch, and save; "load" (GPIPE_TEST_SAVED, at step
// GPIPE_TEST_FROM): the replicas of a GPipe {3, 5} load it (by layer: a one-process file, or a
// DataParallel's save of another module under the same layout), train 3 steps and save.
CATCH_TEST_CASE(kReplicasResharded, "[distributed][save][resharding]") {
  if (test_rank() >= 0) {
    const std::string phase = std::getenv("GPIPE_TEST_PHASE");
    const std::string dir = gpipe_test::test_folder() + "/save";
    if (phase == "save") {
      DataParallel model(make_model(7, 8), join());
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
      train_replicas(model, adam, 0);
      save_training(dir, *model, &adam, 3);
      return;
    }
    const int from = std::atoi(std::getenv("GPIPE_TEST_FROM"));
    DataParallel model(GPipe(make_model(8, 8), GPipeOptions({3, 5}).chunks(2)), join());
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    CATCH_CHECK(load_training(std::getenv("GPIPE_TEST_SAVED"), *model, &adam) == from);
    check_layers(flat_layers(model->module()), adam_oracle(from), range(0, 8), 1e-12);
    train_replicas(model, adam, from);
    check_layers(flat_layers(model->module()), adam_oracle(from + 3), range(0, 8), 1e-10);
    save_training(dir, *model, &adam, from + 3);
    return;
  }
  const auto run = [](const std::string& name, const std::map<std::string, std::string>& env) {
    return run_phase(kReplicasResharded, 2, name, env);
  };
  const std::string replicas = run("replicas_resharded", {{"GPIPE_TEST_PHASE", "save"}});
  // In a GPipe of one process, which trains on as the oracle and saves.
  GPipe pipe(make_model(9, 8), GPipeOptions({5, 3}).chunks(2));
  torch::optim::Adam pipe_adam(pipe->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(gpipe::load_training(replicas + "/save", *pipe, &pipe_adam) == 3);
  check_layers(flat_layers(pipe.ptr()), adam_oracle(3), range(0, 8), 1e-12);
  for (int step = 3; step < 6; ++step) {
    auto [x, y] = batch(step);
    pipe_adam.zero_grad();
    pipe->step(x, y, mse);
    pipe_adam.step();
  }
  check_layers(flat_layers(pipe.ptr()), adam_oracle(6), range(0, 8), 1e-10);
  const std::string file = folder_for("replicas_resharded_file") + ".pt";
  gpipe::save_training(file, *pipe, &pipe_adam, 6);
  // The GPipe's file in replicas of a GPipe of another balance, whose save loads into the plain
  // Sequential.
  const std::string of_file =
      run("replicas_from_file",
          {{"GPIPE_TEST_PHASE", "load"}, {"GPIPE_TEST_SAVED", file}, {"GPIPE_TEST_FROM", "6"}});
  nn::Sequential plain = make_model(10, 8);
  torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(gpipe::load_training(of_file + "/save", *plain, &plain_adam) == 9);
  check_layers(plain, adam_oracle(9), range(0, 8), 1e-10);
  // The plain replicas' save in replicas of a GPipe: the same layout ("a DataParallel of 2
  // replicas") over other tensor names loads by layer.
  const std::string of_replicas =
      run("replicas_from_replicas", {{"GPIPE_TEST_PHASE", "load"},
                                     {"GPIPE_TEST_SAVED", replicas + "/save"},
                                     {"GPIPE_TEST_FROM", "3"}});
  for (const std::string& f : {replicas, of_file, of_replicas}) fs::remove_all(f);
  fs::remove(file);
}

constexpr const char* kTiedAlias =
    "a GPipe's save of a tie across partitions resumes in 2 stages that the tie spans and the "
    "second stage's copy takes the tie's optimizer state";

// Tied-model data of a step.
std::pair<at::Tensor, at::Tensor> tied_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  return {at::randn({6, tied_test::kVocab}, gen, at::kDouble),
          at::randn({6, tied_test::kVocab}, gen, at::kDouble)};
}

// The plain model with one shared weight after each of 5 Adam steps: its losses, and its
// parameters (each once) at the end.
std::pair<std::vector<double>, std::vector<at::Tensor>> tied_oracle() {
  nn::Sequential oracle = tied_test::tied_model(true);
  torch::optim::Adam adam(tied_test::each_once(oracle->parameters()),
                          torch::optim::AdamOptions(0.01));
  std::vector<double> losses;
  for (int step = 0; step < 5; ++step) {
    const auto [x, y] = tied_batch(step);
    adam.zero_grad();
    const at::Tensor loss = nn::functional::mse_loss(oracle->forward(x), y);
    loss.backward();
    adam.step();
    losses.push_back(loss.item<double>());
  }
  return {losses, tied_test::each_once(oracle->parameters())};
}

// Ranks: stages {3, 2} of the tied model (the tie's owner, layer 0, in stage 0; its copy, layer
// 4, in stage 1) load GPIPE_TEST_SAVED (a GPipe {2, 3}'s file at step 3, whose optimizer holds
// the tie under the owner's name only) and train steps 3 and 4 as the oracle did.
CATCH_TEST_CASE(kTiedAlias, "[distributed][stage][save][resharding][tied]") {
  const TiedNames tie{{"0.weight", "4.weight"}};
  if (test_rank() >= 0) {
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    PipelineStage stage(tied_test::tied_model(false),
                        PipelineStageOptions({3, 2}).chunks(2).tied_parameters(tie),
                        groups.pipeline, groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    CATCH_CHECK(load_training(std::getenv("GPIPE_TEST_SAVED"), *stage, &adam) == 3);
    const auto [losses, parameters] = tied_oracle();
    for (int step = 3; step < 5; ++step) {
      const auto [x, y] = tied_batch(step);
      adam.zero_grad();
      const at::Tensor loss =
          stage->is_first() ? stage->step(Batch(x), y, mse) : stage->step(no_input(), y, mse);
      adam.step();
      if (loss.defined()) CATCH_CHECK(std::abs(loss.item<double>() - losses[step]) <= 1e-12);
    }
    // Stage 1's layers 3 and 4 (b and the copy) against the oracle's (parameters 4, 5 and 0).
    if (stage->stage() == 1) {
      const auto mine = stage->parameters();
      const std::vector<at::Tensor> want{parameters[3], parameters[4], parameters[0]};
      CATCH_REQUIRE(mine.size() == want.size());
      for (size_t k = 0; k < want.size(); ++k) {
        CATCH_CHECK((mine[k] - want[k]).abs().max().item<double>() <= 1e-12);
      }
    }
    return;
  }
  GPipe saved(tied_test::tied_model(false), GPipeOptions({2, 3}).chunks(2).tied_parameters(tie));
  torch::optim::Adam adam(saved->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    const auto [x, y] = tied_batch(step);
    adam.zero_grad();
    saved->step(x, y, mse);
    adam.step();
  }
  const std::string file = folder_for("tied_alias_file") + ".pt";
  gpipe::save_training(file, *saved, &adam, 3);
  const std::string folder = folder_for("tied_alias");
  const auto results = run_ranks(kTiedAlias, 2, folder, {{"GPIPE_TEST_SAVED", file}});
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 2; ++r) CATCH_CHECK(results[r].exit_code == 0);
  fs::remove_all(folder);
  fs::remove(file);
}

// This rank's file of generators of a save, by name (Note [Atomic saves]).
std::string random_file(const std::string& dir, const PipelineGroups& groups, int64_t step,
                        int64_t save) {
  return absl::StrCat(dir, "/random_stage", groups.stage, "_replica", groups.replica, ".step",
                      std::string(6 - std::to_string(step).size(), '0'), step, ".save", save,
                      ".pt");
}

constexpr const char* kInterrupted =
    "a save across processes killed before its manifest leaves the previous save loadable with "
    "its state exactly and the next save replaces it";

CATCH_TEST_CASE(kInterrupted, "[distributed][stage][save]") {
  if (test_rank() >= 0) {
    const std::string dir = gpipe_test::test_folder() + "/save";
    const auto options = PipelineStageOptions(kBalance).chunks(2);
    const auto group_options = options_from_env().timeout(std::chrono::seconds(60));
    const PipelineGroups groups = new_pipeline_groups(group_options, 2);
    PipelineStage stage(make_model(7), options, groups.pipeline, groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    const GradScaler scaler = used_scaler();
    train_steps(stage, groups, adam, 0, 2);
    save_training(dir, *stage, &adam, 2, &scaler);
    const std::vector<at::Tensor> at_step_2 = copies(stage->parameters());
    const std::vector<at::Tensor> losses = train_steps(stage, groups, adam, 2, 2);

    // Killed while one rank writes its files: every rank hears that nothing was committed.
    {
      CommitHook crash([](const std::string& path) {
        if (absl::StrContains(path, "/random_stage1_replica1.")) {
          throw std::runtime_error("killed while writing");
        }
      });
      const bool killed = groups.stage == 1 && groups.replica == 1;
      CATCH_CHECK_THROWS_WITH(
          save_training(dir, *stage, &adam, 4, &scaler),
          gpipe_test::contains(killed ? "killed while writing"
                                      : "stage 1's replica 1 could not write its files"));
    }
    // Killed after every data file, before the manifest.
    {
      CommitHook crash([](const std::string& path) {
        if (absl::EndsWith(path, "/manifest.txt")) {
          throw std::runtime_error("killed before the manifest");
        }
      });
      CATCH_CHECK_THROWS_WITH(save_training(dir, *stage, &adam, 4, &scaler),
                              gpipe_test::contains("the save of step 4 into '" + dir +
                                                   "' is not committed"));
    }
    CATCH_CHECK(fs::exists(random_file(dir, groups, 4, 2)));  // written, never committed
    CATCH_CHECK(fs::exists(random_file(dir, groups, 2, 1)));
    CATCH_CHECK(saved_step(dir) == 2);  // the committed save is still the newest
    CATCH_CHECK(saved_step(dir + "/none") == -1);

    // A restarted run: new groups and a stage over other parameters load step 2 exactly.
    const PipelineGroups again = new_pipeline_groups(group_options, 2);
    PipelineStage resumed(make_model(8), options, again.pipeline, again.replica_group);
    torch::optim::Adam adam2(resumed->parameters(), torch::optim::AdamOptions(0.01));
    GradScaler loaded;
    CATCH_CHECK(load_training(dir, *resumed, &adam2, &loaded) == 2);
    check_equal(resumed->parameters(), at_step_2);
    check_used_scaler(loaded);
    check_equal(train_steps(resumed, again, adam2, 2, 2), losses);

    // Saved again into the folder: committed, and the older files removed.
    save_training(dir, *resumed, &adam2, 4, &loaded);
    CATCH_CHECK(saved_step(dir) == 4);
    CATCH_CHECK(load_training(dir, *resumed, &adam2, &loaded) == 4);
    CATCH_CHECK(fs::exists(random_file(dir, again, 4, 2)));
    CATCH_CHECK_FALSE(fs::exists(random_file(dir, again, 2, 1)));
    return;
  }
  const std::string folder = folder_for("save_interrupted");
  const auto results = run_ranks(kInterrupted, 4, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 4; ++r) CATCH_CHECK(results[r].exit_code == 0);
  std::filesystem::remove_all(folder);
}

// Lists `name`'s entry of `dir`'s manifest with the length and checksum of `bytes`, and the
// manifest's own checksum made anew: a manifest that mixes two saves.
void relist(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::istringstream in(gpipe::internal::read_whole_file(dir + "/manifest.txt", "relist"));
  std::string text;
  const auto hex = [](uint64_t v) { return absl::StrCat(absl::Hex(v, absl::kZeroPad16)); };
  for (std::string line; std::getline(in, line);) {
    if (absl::StartsWith(line, "checksum ")) continue;
    if (absl::StartsWith(line, "file " + name + " ")) {
      line = absl::StrCat("file ", name, " ", bytes.size(), " ",
                          hex(gpipe::internal::checksum(bytes.data(), bytes.size())));
    }
    absl::StrAppend(&text, line, "\n");
  }
  absl::StrAppend(&text, "checksum ", hex(gpipe::internal::checksum(text.data(), text.size())),
                  "\n");
  gpipe::internal::write_atomically(dir + "/manifest.txt", text, "relist");
}

// Both stages' loads of save `a` (step 3) after stage 1's file is torn, then replaced by its
// file of save `b` (step 5), then listed so in the manifest: stage 1 refuses each, naming the
// file; stage 0, whose files are whole, refuses with it (every rank loads, or none); both stages
// stay as they were.
void check_refused(const std::string& a, const std::string& b, PipelineStageImpl& stage,
                   torch::optim::Optimizer& optimizer, const ProcessGroup& pipeline) {
  const std::vector<at::Tensor> before = copies(stage.parameters());
  const std::string name = "stage1.step000003.save1.pt";
  const std::string mine = a + "/" + name, later = b + "/stage1.step000005.save1.pt";
  const bool damaged = stage.stage() == 1;
  const auto round = [&](const std::function<void()>& damage, const std::string& why) {
    if (damaged) damage();
    pipeline->barrier()->wait();  // stage 0 reads after the damage
    CATCH_CHECK_THROWS_WITH(
        load_training(a, stage, &optimizer),
        gpipe_test::contains(damaged ? why
                                     : "stage 1's replica 0 refused to load '" + a + "'"));
    check_equal(stage.parameters(), before);
  };
  // Torn: half of it on the disk.
  round([&] { fs::resize_file(mine, fs::file_size(mine) / 2); },
        "'" + mine + "' is torn or was replaced");
  // Replaced by stage 1's file of the save of step 5.
  round([&] { fs::copy_file(later, mine, fs::copy_options::overwrite_existing); },
        "'" + mine + "' is torn or was replaced");
  // ... and listed by the manifest of step 3: the stages' steps differ.
  round([&] { relist(a, name, gpipe::internal::read_whole_file(later, "relist")); },
        "'" + mine + "' holds step 5, but '" + a + "/manifest.txt' commits step 3");
}

constexpr const char* kRefused =
    "a load across processes refuses a missing manifest and a torn or mixed stage file naming "
    "the file and leaves the stage as it was";

CATCH_TEST_CASE(kRefused, "[distributed][stage][save]") {
  if (test_rank() >= 0) {
    const std::string a = gpipe_test::test_folder() + "/a", b = gpipe_test::test_folder() + "/b";
    const auto options = PipelineStageOptions(kBalance).chunks(2);
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    PipelineStage stage(make_model(7), options, groups.pipeline, groups.replica_group);
    torch::optim::Adam adam(stage->parameters(), torch::optim::AdamOptions(0.01));
    CATCH_CHECK_THROWS_WITH(load_training(a, *stage, &adam),
                            gpipe_test::contains("'" + a + "' holds no manifest.txt"));
    train_steps(stage, groups, adam, 0, 1);
    save_training(a, *stage, &adam, 3);
    train_steps(stage, groups, adam, 1, 1);
    save_training(b, *stage, &adam, 5);
    CATCH_CHECK(load_training(a, *stage, &adam) == 3);  // every file whole: both load
    check_refused(a, b, *stage, adam, groups.pipeline);
    groups.pipeline->barrier()->wait();
    // A manifest that is there but cannot be read: the next save refuses on every rank, before
    // writing anything (numbering it from 0 again could overwrite committed files).
    if (groups.stage == 0) std::ofstream(a + "/manifest.txt", std::ios::trunc) << "not a save\n";
    groups.pipeline->barrier()->wait();
    CATCH_CHECK_THROWS_WITH(save_training(a, *stage, &adam, 7),
                            gpipe_test::contains("the manifest in '" + a +
                                                 "' is there but cannot be read"));
    groups.pipeline->barrier()->wait();
    return;
  }
  const std::string folder = folder_for("save_refused");
  const auto results = run_ranks(kRefused, 2, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 2; ++r) CATCH_CHECK(results[r].exit_code == 0);
  std::filesystem::remove_all(folder);
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
