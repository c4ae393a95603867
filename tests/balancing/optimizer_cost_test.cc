// The optimizer's step as the planner predicts it (balancing/optimizer_cost.h, Note [The
// optimizer's step]): measured per kind of device, stepped on the CPU one tensor after another,
// launched by the host and run per GPU, each process its own; a plan's prediction counted from the
// model's own parameters, ranked with the step, and kept in profiles and plans.
#include "tests/gpipe/test_util.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "balancing/optimizer_cost.h"
#include "balancing/plan.h"
#include "examples/training/choices.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;
using gpipe_test::Approx;

// Round numbers: a tensor costs `tensor_us`, a byte 1 / `bytes_per_us`.
OptimizerStats stats(c10::Device device, OptimizerKind kind, double tensor_us,
                     double bytes_per_us) {
  OptimizerStats s;
  s.device = device;
  s.optimizer = kind;
  s.tensor_us = tensor_us;
  s.bytes_per_us = bytes_per_us;
  return s;
}

const c10::Device kCpu(c10::kCPU);
const c10::Device kGpu0(c10::kCUDA, 0);
const c10::Device kGpu1(c10::kCUDA, 1);

CATCH_TEST_CASE("profile_optimizers measures every optimizer kind once per kind of device",
                "[balancing][optimizer]") {
  const std::vector<OptimizerStats> measured = profile_optimizers({kCpu, kCpu});
  CATCH_REQUIRE(measured.size() == 4);
  std::vector<std::string> kinds;
  for (const OptimizerStats& s : measured) {
    CATCH_CHECK(s.device == kCpu);
    CATCH_CHECK(s.tensor_us > 0);
    CATCH_CHECK(s.bytes_per_us > 0);
    kinds.push_back(optimizer_kind_name(s.optimizer));
  }
  CATCH_CHECK(kinds == (std::vector<std::string>{"sgd", "momentum", "adam", "adamw"}));
  for (const OptimizerStats& s : measured) {
    CATCH_CHECK(optimizer_kind(optimizer_kind_name(s.optimizer)) == s.optimizer);
  }
  CATCH_CHECK_THROWS_WITH(profile_optimizers({c10::Device(c10::kCUDA, 7)}),
                          gpipe_test::contains("profile_optimizers"));
  for (const OptimizerStats& s : measured) CATCH_CHECK(s.layer_us.empty());  // no model given
}

CATCH_TEST_CASE("profile_optimizers steps each layer's own trainable parameters, given the model",
                "[balancing][optimizer]") {
  nn::Sequential model(nn::Linear(16, 32), nn::Tanh(), nn::Linear(32, 4));
  model[2]->as<nn::Linear>()->weight.set_requires_grad(false);
  model[2]->as<nn::Linear>()->bias.set_requires_grad(false);  // frozen: nothing to step
  const at::Tensor before = model[0]->as<nn::Linear>()->weight.clone();
  const std::vector<OptimizerStats> measured = profile_optimizers({kCpu}, &model);
  CATCH_REQUIRE(measured.size() == 4);
  for (const OptimizerStats& s : measured) {
    CATCH_REQUIRE(s.layer_us.size() == 3);
    CATCH_CHECK(s.layer_us[0] > 0);
    CATCH_CHECK(s.layer_us[1] == 0);  // a Tanh
    CATCH_CHECK(s.layer_us[2] == 0);  // frozen
  }
  // On copies: the model's parameters are untouched, and have no gradients.
  CATCH_CHECK(at::equal(model[0]->as<nn::Linear>()->weight, before));
  CATCH_CHECK(!model[0]->as<nn::Linear>()->weight.grad().defined());
}

CATCH_TEST_CASE("profile_optimizers measures a GPU beside the CPU",
                "[balancing][optimizer][cuda]") {
  const std::vector<OptimizerStats> measured = profile_optimizers({kGpu0, kCpu, kGpu0});
  CATCH_REQUIRE(measured.size() == 8);
  for (size_t k = 0; k < measured.size(); ++k) {
    CATCH_CHECK(measured[k].device == (k < 4 ? kGpu0 : kCpu));
    CATCH_CHECK(measured[k].bytes_per_us > 0);
  }
}

CATCH_TEST_CASE("The CPU steps its stages' tensors one after another, each process its own",
                "[balancing][optimizer]") {
  const std::vector<OptimizerStats> s = {stats(kCpu, OptimizerKind::kAdam, 10, 1000),
                                         stats(kCpu, OptimizerKind::kSGD, 2, 4000),
                                         stats(kCpu, OptimizerKind::kAdamW, 11, 800)};
  const std::vector<SteppedParameters> stages = {
      {kCpu, 0, 4, 100000}, {kCpu, 1, 6, 50000}, {kCpu, 0, 2, 30000}};
  // Adam: (4 + 6 + 2) tensors x 10 us + 180000 B / 1000 B/us.
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, stages, false) ==
              Approx(12 * 10 + 180.0));
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kSGD, stages, false) ==
              Approx(12 * 2 + 45.0));
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdamW, stages, false) ==
              Approx(12 * 11 + 225.0));  // its own measurement, not Adam's
  // A process per worker: worker 0 steps 6 tensors and 130000 B, worker 1 6 and 50000 B.
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, stages, true) ==
              Approx(6 * 10 + 130.0));
  // Unmeasured: momentum, or a kind of device the stats lack.
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kMomentum, stages, false) == 0);
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, {{kGpu0, 0, 1, 4}}, false) == 0);
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, {}, false) == 0);
  // A stage's layers measured themselves: their sum instead of tensors and bytes.
  std::vector<SteppedParameters> measured = stages;
  measured[1].measured_us = 42;
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, measured, false) ==
              Approx(6 * 10 + 130.0 + 42));
}

CATCH_TEST_CASE("GPUs run their own updates while the host launches every tensor's",
                "[balancing][optimizer]") {
  const std::vector<OptimizerStats> s = {stats(kCpu, OptimizerKind::kAdam, 10, 1000),
                                         stats(kGpu0, OptimizerKind::kAdam, 5, 100000)};
  // Many small tensors: the launches (30 x 5 us) are longer than either GPU's bytes.
  const std::vector<SteppedParameters> small = {{kGpu0, 0, 10, 1000000}, {kGpu1, 1, 20, 2000000}};
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, small, false) == Approx(150));
  // Few large tensors: the busiest GPU's bytes (cuda:1, 40 MB at 100000 B/us) are.
  const std::vector<SteppedParameters> large = {
      {kGpu0, 0, 2, 10000000}, {kGpu1, 1, 2, 30000000}, {kGpu1, 2, 2, 10000000}};
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, large, false) == Approx(400));
  // GPUs' stages measured themselves: cuda:1's 2 x 250 us now the longest.
  std::vector<SteppedParameters> measured = large;
  measured[1].measured_us = measured[2].measured_us = 250;
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, measured, false) == Approx(500));
  // A CPU stage's part comes before: 3 x 10 us + 5000 B / 1000 B/us.
  std::vector<SteppedParameters> mixed = large;
  mixed.push_back({kCpu, 3, 3, 5000});
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, mixed, false) == Approx(35 + 400));
  // A process per worker: the slowest (cuda:1's worker 1, 300 us).
  CATCH_CHECK(optimizer_step_us(s, OptimizerKind::kAdam, large, true) == Approx(300));
}

// A profile of `model` on the CPU at one micro-batch size (no calibration), with `stats`.
PipelineProfile profile_of(const nn::Sequential& model, const at::Tensor& x,
                           std::vector<OptimizerStats> stats) {
  PipelineProfile p;
  p.sizes = {profile_layers(model, x, ProfileOptions().timeout(std::chrono::milliseconds(10)))};
  p.devices = {kCpu, kCpu};
  p.batch = x.size(0);
  p.input_bytes = static_cast<int64_t>(x.nbytes());
  p.cores = 2;
  p.optimizers = std::move(stats);
  return p;
}

// A link between processes of round numbers, for plans with a process per worker.
void add_link(PipelineProfile& profile) {
  profile.process_link.latency_us = 50;
  profile.process_link.bytes_per_us = 1000;
  profile.process_link.allreduce_step_us = 20;
  profile.process_link.allreduce_bytes_per_us = 500;
}

// A plan of `balance` on CPU workers, `chunks` micro-batches, no checkpointing.
PipelinePlan cpu_plan(std::vector<int64_t> balance, int64_t chunks) {
  PipelinePlan p;
  p.devices.assign(balance.size(), kCpu);
  p.balance = std::move(balance);
  p.chunks = chunks;
  p.checkpoint = Checkpoint::kNever;
  return p;
}

// The trainable tensors and bytes of layers [first, first + count) of `model`, from the
// parameters themselves.
std::pair<int64_t, int64_t> trainable(const nn::Sequential& model, int64_t first, int64_t count) {
  int64_t tensors = 0, bytes = 0;
  for (int64_t k = first; k < first + count; ++k) {
    for (const at::Tensor& p : model->children()[k]->parameters()) {
      if (!p.requires_grad()) continue;
      ++tensors;
      bytes += static_cast<int64_t>(p.nbytes());
    }
  }
  return {tensors, bytes};
}

CATCH_TEST_CASE("A plan's optimizer step is counted from each stage's trainable parameters",
                "[balancing][optimizer][plan]") {
  nn::Sequential model(nn::Linear(32, 64), nn::Tanh(), nn::Linear(64, 64), nn::Tanh(),
                       nn::Linear(64, 8));
  model[2]->as<nn::Linear>()->bias.set_requires_grad(false);  // frozen: not stepped
  const at::Tensor x = at::randn({8, 32});
  PipelineProfile profile = profile_of(model, x, {stats(kCpu, OptimizerKind::kAdam, 7, 500)});
  PipelinePlan p = cpu_plan({2, 3}, 2);
  predict(profile, p, OptimizerKind::kAdam);
  const auto [t0, b0] = trainable(model, 0, 2);
  const auto [t1, b1] = trainable(model, 2, 3);
  CATCH_CHECK(t0 + t1 == 5);  // six parameters, one frozen
  CATCH_CHECK(p.optimizer_us == Approx(7.0 * (t0 + t1) + static_cast<double>(b0 + b1) / 500));
  // Unmeasured (momentum): none predicted, and the step is unchanged.
  PipelinePlan q = p;
  predict(profile, q, OptimizerKind::kMomentum);
  CATCH_CHECK(q.optimizer_us == 0);
  CATCH_CHECK(q.step_us == Approx(p.step_us));
  // A process per worker: each steps its own stage.
  add_link(profile);
  p.processes = true;
  predict(profile, p, OptimizerKind::kAdam);
  CATCH_CHECK(p.optimizer_us == Approx(std::max(7.0 * t0 + static_cast<double>(b0) / 500,
                                                7.0 * t1 + static_cast<double>(b1) / 500)));
}

CATCH_TEST_CASE("A plan says which optimizer it was predicted for, and a trainer's report says "
                "when it steps another",
                "[balancing][optimizer][plan]") {
  nn::Sequential model(nn::Linear(8, 8), nn::Tanh(), nn::Linear(8, 2));
  const PipelineProfile profile = profile_of(model, at::randn({4, 8}),
                                             {stats(kCpu, OptimizerKind::kAdam, 7, 500)});
  PipelinePlan p = cpu_plan({1, 2}, 2);
  CATCH_CHECK(!p.optimizer.has_value());  // not predicted yet
  predict(profile, p, OptimizerKind::kAdamW);
  CATCH_REQUIRE(p.optimizer.has_value());
  CATCH_CHECK(*p.optimizer == OptimizerKind::kAdamW);
  CATCH_CHECK(p.optimizer_us == 0);  // AdamW unmeasured in this profile: not Adam's numbers
  predict(profile, p, OptimizerKind::kAdam);
  CATCH_CHECK(*p.optimizer == OptimizerKind::kAdam);
  const PipelinePlan back = PipelinePlan::from_json(p.to_json());
  CATCH_REQUIRE(back.optimizer.has_value());
  CATCH_CHECK(*back.optimizer == OptimizerKind::kAdam);
  // A file without it (written before): unknown, and the report says nothing of it.
  std::string text = p.to_json();
  const std::string field = ",\n  \"optimizer\": \"adam\"";
  CATCH_REQUIRE(text.find(field) != std::string::npos);
  text.erase(text.find(field), field.size());
  CATCH_CHECK(!PipelinePlan::from_json(text).optimizer.has_value());
  // The trainers' report (examples/training/choices.h), from the plan's file.
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("gpipe_optimizer_cost_test_plan_" + std::to_string(::getpid()) +
                             ".json")).string();
  std::ofstream(path) << p.to_json();
  const training::PipelineShape shape = training::apply_plan({}, path);
  std::filesystem::remove(path);
  CATCH_CHECK(shape.planned_optimizer == "adam");
  training::LoopTimes times;
  times.step_ms = {10};
  times.optimizer_ms = {1};
  times.loop_ms = {12};
  const std::string same = training::plan_report(shape, times, "adam");
  const std::string other = training::plan_report(shape, times, "adamw");
  CATCH_CHECK(same.find("the plan predicted") == std::string::npos);
  CATCH_CHECK_THAT(other, gpipe_test::contains("; the plan predicted adam's step and memory, but "
                                               "this trainer steps adamw (plan with balance "
                                               "--optimizer=adamw)"));
  CATCH_CHECK(other.rfind(same, 0) == 0);  // the same report before it
}

CATCH_TEST_CASE("A plan's optimizer step sums its stages' layers' own steps where they were "
                "measured",
                "[balancing][optimizer][plan]") {
  nn::Sequential model(nn::Linear(8, 8), nn::Tanh(), nn::Linear(8, 8), nn::Linear(8, 2));
  const at::Tensor x = at::randn({4, 8});
  OptimizerStats adam = stats(kCpu, OptimizerKind::kAdam, 7, 500);
  adam.layer_us = {30, 0, 50, 20};
  PipelineProfile profile = profile_of(model, x, {adam});
  PipelinePlan p = cpu_plan({2, 2}, 2);
  predict(profile, p, OptimizerKind::kAdam);
  CATCH_CHECK(p.optimizer_us == Approx(30 + 0 + 50 + 20));
  add_link(profile);
  p.processes = true;
  predict(profile, p, OptimizerKind::kAdam);
  CATCH_CHECK(p.optimizer_us == Approx(70));  // the second worker's 50 + 20
  // Layer 2 as if in bfloat16 with float32 master weights: the step over the masters adds their
  // extra bytes (4 per element less the narrow ones) at the large tensor's 500 bytes per us.
  PipelineProfile narrow = profile;
  LayerStats& l2 = narrow.sizes.front().layers[2];
  l2.narrow_param_elements = 72;
  l2.narrow_param_bytes = 144;
  ParameterMemory masters;
  masters.optimizer = OptimizerKind::kAdam;
  masters.master_weights = true;
  p.processes = false;
  predict(narrow, p, masters);
  CATCH_CHECK(p.optimizer_us == Approx(30 + 0 + 50 + 20 + (4.0 * 72 - 144) / 500));
  masters.master_weights = false;
  predict(narrow, p, masters);
  CATCH_CHECK(p.optimizer_us == Approx(100));
  p.processes = true;
  const PipelineProfile back = PipelineProfile::from_json(profile.to_json());
  CATCH_CHECK(back.optimizers[0].layer_us == adam.layer_us);
  std::string text = profile.to_json();
  const size_t at = text.find("20.0");
  CATCH_REQUIRE(at != std::string::npos);
  text.replace(at, 4, "20.0, 5.0");
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(text),
                          gpipe_test::contains("an optimizer's layer_us has 5 entries for 4 "
                                               "layers; give one per layer, or none"));
}

CATCH_TEST_CASE("On a V each process steps both of its stages", "[balancing][optimizer][plan]") {
  nn::Sequential model;
  for (int k = 0; k < 4; ++k) model->push_back(nn::Linear(16 * (k + 1), 16 * (k + 2)));
  const at::Tensor x = at::randn({4, 16});
  PipelineProfile profile = profile_of(model, x, {stats(kCpu, OptimizerKind::kSGD, 3, 100)});
  add_link(profile);
  PipelinePlan p = cpu_plan({1, 1, 1, 1}, 4);
  p.schedule = ScheduleKind::kZeroBubbleV;
  p.virtual_stages = 2;
  p.processes = true;
  predict(profile, p, OptimizerKind::kSGD);
  // Worker 0 holds layers 0 and 3, worker 1 layers 1 and 2.
  const auto cost = [&](std::initializer_list<int64_t> layers) {
    double us = 0;
    for (int64_t k : layers) {
      const auto [t, b] = trainable(model, k, 1);
      us += 3.0 * t + static_cast<double>(b) / 100;
    }
    return us;
  };
  CATCH_CHECK(p.optimizer_us == Approx(std::max(cost({0, 3}), cost({1, 2}))));
  CATCH_CHECK(cost({0, 3}) != Approx(cost({1, 2})));  // (the two workers differ)
}

CATCH_TEST_CASE("Plans are ranked by the step and the optimizer's step after it",
                "[balancing][optimizer][plan]") {
  // One CPU and one GPU that compute alike, but the CPU steps the parameters 100 times slower: the
  // one-partition plans differ only in the optimizer's step, and the GPU's comes first.
  nn::Sequential model(nn::Linear(64, 64), nn::Tanh(), nn::Linear(64, 64));
  const at::Tensor x = at::randn({8, 64});
  PipelineProfile profile = profile_of(model, x, {stats(kCpu, OptimizerKind::kAdam, 100, 10),
                                                  stats(kGpu0, OptimizerKind::kAdam, 1, 1000)});
  profile.devices = {kCpu, kGpu0};
  PipelineProfile::DeviceKind gpu;
  gpu.device = kGpu0;
  gpu.sizes = profile.sizes;
  gpu.sizes[0].device = kGpu0;
  profile.other_kinds = {gpu};
  profile.copies = {{kCpu, kGpu0, 20, 10000}, {kGpu0, kCpu, 20, 10000}};
  const std::vector<PipelinePlan> plans =
      plan(profile,
           PlanOptions().partitions({1}).optimizer(OptimizerKind::kAdam).search(false).top(100));
  CATCH_REQUIRE(plans.size() >= 2);
  CATCH_CAPTURE(plans.front().describe());
  CATCH_CHECK(plans.front().devices == std::vector<c10::Device>{kGpu0});
  for (const PipelinePlan& p : plans) {
    CATCH_CHECK(plans.front().step_us + plans.front().optimizer_us <=
                p.step_us + p.optimizer_us);
  }
  const auto on_cpu = std::find_if(plans.begin(), plans.end(), [](const PipelinePlan& p) {
    return p.devices == std::vector<c10::Device>{kCpu};
  });
  CATCH_REQUIRE(on_cpu != plans.end());
  CATCH_CHECK(on_cpu->optimizer_us > 50 * plans.front().optimizer_us);
}

CATCH_TEST_CASE("Optimizer measurements and predictions survive JSON, and bad ones are named",
                "[balancing][optimizer][json]") {
  nn::Sequential model(nn::Linear(8, 8), nn::Tanh(), nn::Linear(8, 2));
  const at::Tensor x = at::randn({4, 8});
  const PipelineProfile profile = profile_of(model, x,
                                             {stats(kCpu, OptimizerKind::kAdam, 7, 500),
                                              stats(kCpu, OptimizerKind::kSGD, 2, 900)});
  const PipelineProfile back = PipelineProfile::from_json(profile.to_json());
  CATCH_REQUIRE(back.optimizers.size() == 2);
  CATCH_CHECK(optimizer_kind_name(back.optimizers[0].optimizer) == "adam");
  CATCH_CHECK(optimizer_kind_name(back.optimizers[1].optimizer) == "sgd");
  CATCH_CHECK(back.optimizers[1].tensor_us == 2);
  CATCH_CHECK(back.optimizers[1].bytes_per_us == 900);
  CATCH_CHECK(back.sizes[0].layers[0].trainable_tensors == 2);
  PipelinePlan p;
  p.balance = {3};
  p.devices = {kCpu};
  p.chunks = 2;
  predict(back, p, OptimizerKind::kAdam);
  CATCH_CHECK(p.optimizer_us > 0);
  CATCH_CHECK(p.describe().find("ms optimizer") != std::string::npos);
  CATCH_CHECK(PipelinePlan::from_json(p.to_json()).optimizer_us == Approx(p.optimizer_us));

  std::string text = profile.to_json();
  const std::string adam = "\"optimizer\": \"adam\"";
  CATCH_REQUIRE(text.find(adam) != std::string::npos);
  std::string renamed = text;
  renamed.replace(renamed.find(adam), adam.size(), "\"optimizer\": \"lion\"");
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(renamed),
                          gpipe_test::contains("unknown optimizer 'lion'; give sgd, momentum, "
                                               "adam or adamw"));
  const std::string rate = "\"bytes_per_us\": 900.0";
  CATCH_REQUIRE(text.find(rate) != std::string::npos);
  text.replace(text.find(rate), rate.size(), "\"bytes_per_us\": 0.0");
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(text),
                          gpipe_test::contains("an optimizer's tensor_us must not be negative and "
                                               "its bytes_per_us must be positive, got 2 and 0"));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
