// Pipeline stages in processes of their own on c10d: two processes on loopback (Gloo, float64),
// each owning a range of a Sequential's layers, train with tuple batches, skips and every
// checkpoint mode to the parameters and losses of the plain model; a stage that dies or is
// configured differently makes the others fail with a clear error.
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>

#include <atomic>
#include <map>
#include <sstream>
#include <thread>
#include <tuple>

#include "gpipe/checkpoint.h"
#include "gpipe/device.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/skippable.h"
#include "gpipe/thread_state.h"
#include "tests/catch.h"
#include "tests/distributed/in_order_group.h"
#include "tests/distributed/multiprocess.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace distributed {
namespace {

namespace nn = torch::nn;
using gpipe_test::flat;
using gpipe_test::run_ranks;
using gpipe_test::test_rank;

constexpr int kSteps = 4;
constexpr int64_t kBatch = 8;
constexpr int64_t kChunks = 3;  // 3, 3 and 2 samples

std::string folder_for(const std::string& name) { return gpipe_test::folder_for("stage", name); }

// Stage 0's layers stash a skip and pop it, and hand a pair (activations, an integer tensor) to
// stage 1, which uses both.
struct StashImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    stash("skip", x);
    return at::tanh(x);
  }
};
TORCH_MODULE(Stash);

struct PopPairImpl : nn::Module {
  PopPairImpl() : linear(register_module("linear", nn::Linear(8, 8))) {}
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    return {linear(x) + pop("skip"), (x > 0).sum(1)};
  }
  nn::Linear linear;
};
TORCH_MODULE(PopPair);

struct PairLinearImpl : nn::Module {
  PairLinearImpl() : linear(register_module("linear", nn::Linear(8, 8))) {}
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& xs) {
    return {at::tanh(linear(xs[0])) * (1 + xs[1].unsqueeze(1).to(at::kDouble) / 8), xs[1]};
  }
  nn::Linear linear;
};
TORCH_MODULE(PairLinear);

struct FirstImpl : nn::Module {
  at::Tensor forward(const std::vector<at::Tensor>& xs) { return xs[0]; }
};
TORCH_MODULE(First);

// The model every test trains: 6 layers, the same in every process (seed 7; other seeds for
// replicas that must take replica 0's parameters).
nn::Sequential make_model(int seed = 7) {
  torch::manual_seed(seed);
  nn::Sequential seq(nn::Linear(6, 8), skippable(Stash(), SkippableOptions().stash({"skip"})),
                     skippable(PopPair(), SkippableOptions().pop({"skip"})), PairLinear(), First(),
                     nn::Linear(8, 3));
  seq->to(at::kDouble);
  return seq;
}
const std::vector<int64_t> kBalance{3, 3};

at::Tensor mse(const Batch& output, const at::Tensor& target) {
  // (The target on the output's device: a stage's last partition may be on another.)
  return nn::functional::mse_loss(output.tensor(), target.to(output.tensor().device()));
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor x = at::randn({kBatch, 6}, gen, at::kDouble);
  at::Tensor y = at::randn({kBatch, 3}, gen, at::kDouble);
  return {x, y};
}

// Fine-tuning: which parameters a test freezes (GPIPE_TEST_FREEZE): "stage0" every layer of stage
// 0 (no gradient crosses back), "layer0" only the first layer, "stage1" every layer of stage 1
// (gradients still cross it to stage 0); anything else freezes nothing.
void freeze(nn::Sequential seq, const std::string& which) {
  int64_t first = 0, end = 0;
  if (which == "stage0") end = kBalance[0];
  if (which == "layer0") end = 1;
  if (which == "stage1") first = kBalance[0], end = kBalance[0] + kBalance[1];
  for (int64_t k = first; k < end; ++k) {
    for (at::Tensor& p : seq[k]->parameters()) p.requires_grad_(false);
  }
}

std::string freeze_from_env() {
  const char* which = std::getenv("GPIPE_TEST_FREEZE");
  return which ? which : "";
}

// Each stage's own split into partitions (GPIPE_TEST_LOCAL: "1,2;2,1" gives stage 0 {1, 2} and
// stage 1 {2, 1}); empty when unset: one partition per stage.
std::vector<int64_t> local_balance_from_env(int64_t stage) {
  const char* spec = std::getenv("GPIPE_TEST_LOCAL");
  if (spec == nullptr) return {};
  std::vector<std::string> stages;
  std::stringstream all(spec);
  for (std::string s; std::getline(all, s, ';');) stages.push_back(s);
  std::vector<int64_t> out;
  std::stringstream one(stages.at(static_cast<size_t>(stage)));
  for (std::string b; std::getline(one, b, ',');) out.push_back(std::stoll(b));
  return out;
}

// The pipeline's group: Gloo, or with GPIPE_TEST_IN_ORDER Gloo matching its point-to-point
// operations in posting order as NCCL does (in_order_group.h).
// With GPIPE_TEST_BACKEND=nccl, NCCL.
ProcessGroup join() {
  const char* backend = std::getenv("GPIPE_TEST_BACKEND");
  if (backend != nullptr) {
    return new_process_group(
        options_from_env().timeout(std::chrono::seconds(60)).backend(backend));
  }
  ProcessGroup gloo = new_gloo_group(options_from_env().timeout(std::chrono::seconds(60)));
  if (std::getenv("GPIPE_TEST_IN_ORDER") == nullptr) return gloo;
  return c10::make_intrusive<gpipe_test::InOrderGroup>(gloo);
}

Checkpoint mode_from_env() {
  const char* mode = std::getenv("GPIPE_TEST_CHECKPOINT");
  const std::string m = mode ? mode : "except_last";
  return m == "always" ? Checkpoint::kAlways : m == "never" ? Checkpoint::kNever
                                                           : Checkpoint::kExceptLast;
}

// The last step's schedule across the processes, on the host's clock, with `partitions`
// partitions in all: each micro-batch's forward reaches partition j + 1 after partition j computed
// it, and its backward reaches partition j after partition j + 1's; each partition runs the
// forwards in order and the backwards in reverse.
void check_schedule(const std::vector<TimelineEvent>& events, int64_t partitions = 2) {
  std::map<std::tuple<int, int64_t, int64_t>, std::pair<double, double>> at;  // kind, i, j
  for (const TimelineEvent& e : events) {
    at[{e.kind == TimelineEvent::Kind::kCompute ? 0 : 1, e.microbatch, e.partition}] = {
        e.start_us, e.end_us};
  }
  CATCH_CHECK(events.size() == 2 * static_cast<size_t>(partitions * kChunks));
  CATCH_CHECK(at.size() == events.size());
  for (int64_t i = 0; i < kChunks; ++i) {
    for (int64_t j = 0; j < partitions; ++j) {
      if (j > 0) CATCH_CHECK(at[{0, i, j}].first >= at[{0, i, j - 1}].second);
      if (j > 0) CATCH_CHECK(at[{1, i, j - 1}].first >= at[{1, i, j}].second);
      if (i > 0) CATCH_CHECK(at[{0, i, j}].first >= at[{0, i - 1, j}].second);
      if (i > 0) CATCH_CHECK(at[{1, i - 1, j}].first >= at[{1, i, j}].second);
    }
  }
}

// One rank's training: kSteps SGD steps with momentum; writes its stage's parameters and, on the
// last stage, the losses.
void train_stage(PipelineStageOptions options) {
  // "cuda:rank": each rank on the GPU of its number.
  const char* device_name = std::getenv("GPIPE_TEST_DEVICE");
  const std::string name = device_name != nullptr ? device_name : "cpu";
  const c10::Device device(name == "cuda:rank" ? "cuda:" + std::to_string(test_rank()) : name);
  nn::Sequential model = make_model();
  freeze(model, freeze_from_env());
  ProcessGroup group = join();
  const std::vector<int64_t> local = local_balance_from_env(group->getRank());
  // Two partitions on a GPU stage: the second on the CPU (one GPU each).
  std::vector<c10::Device> local_devices;
  if (local.size() == 2 && device.is_cuda()) local_devices = {device, c10::Device(c10::kCPU)};
  const char* schedule_name = std::getenv("GPIPE_TEST_SCHEDULE");
  const std::string schedule = schedule_name != nullptr ? schedule_name : "gpipe";
  PipelineStage stage(model, options.loss(mse).device(device).local_balance(local)
                                 .local_devices(local_devices)
                                 .schedule(schedule_kind(schedule)), group);
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    at::Tensor loss = stage->is_first() ? stage->step(Batch(x.to(device)))
                                        : stage->step(no_input(), y.to(device));
    CATCH_CHECK(loss.defined() == stage->is_last());
    if (loss.defined()) losses.push_back(loss.detach());
    sgd.step();
  }
  if (options.record_timeline()) {
    const char* spec = std::getenv("GPIPE_TEST_LOCAL");
    const int64_t per_stage = spec != nullptr ? 2 : 1;
    const std::vector<TimelineEvent> events = stage->gather_timeline();
    if (schedule == "gpipe") {
      check_schedule(events, 2 * per_stage);  // two per stage, or one
    } else {
      // 1F1B and ZB-H1 keep at most n - s micro-batches in flight on stage s of n = 2 (ZB-H1's
      // W may keep one more: n in all).
      for (const auto& [p, peak] : gpipe::testing::peak_in_flight(events)) {
        const int64_t s = p / per_stage;
        CATCH_CHECK(peak <= (schedule == "zb" ? 2 : 2 - s));
      }
    }
  }
  const std::string folder = gpipe_test::test_folder();
  const std::string r = std::to_string(test_rank());
  gpipe_test::write_doubles(folder + "/state" + r + ".bin", stage->parameters());
  if (stage->is_last()) gpipe_test::write_doubles(folder + "/loss.bin", losses);
}

// The plain model's parameters of each stage's layers and losses after the same steps.
struct Oracle {
  std::vector<at::Tensor> stage_states;
  at::Tensor losses;
};
Oracle plain_training(const std::vector<int64_t>& balance = kBalance,
                      const std::string& frozen = "") {
  nn::Sequential plain = make_model();
  freeze(plain, frozen);
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    at::Tensor loss = nn::functional::mse_loss(plain->forward(x), y);
    loss.backward();
    losses.push_back(loss.detach());
    sgd.step();
  }
  Oracle oracle;
  int64_t first = 0;
  for (int64_t b : balance) {
    std::vector<at::Tensor> params;
    for (int64_t k = first; k < first + b; ++k) {
      for (const at::Tensor& p : plain[k]->parameters()) params.push_back(p);
    }
    oracle.stage_states.push_back(flat(params));
    first += b;
  }
  oracle.losses = flat(losses);
  return oracle;
}

// Runs test `test` in two stage processes (train_stage with `env`) and checks what they wrote to
// `folder` (each stage's parameters after kSteps steps, rank 1's losses) against the plain model's
// training (parameters to 1e-10); removes the folder.
void check_two_stages(const char* test, const std::string& folder,
                      const std::map<std::string, std::string>& env, double loss_tolerance,
                      const std::string& frozen = "") {
  const auto results = run_ranks(test, 2, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_REQUIRE(results[0].exit_code == 0);
  CATCH_REQUIRE(results[1].exit_code == 0);
  const Oracle oracle = plain_training(kBalance, frozen);
  for (int r = 0; r < 2; ++r) {
    const at::Tensor state = gpipe_test::read_doubles(folder + "/state" + std::to_string(r) +
                                                      ".bin");
    CATCH_REQUIRE(state.sizes() == oracle.stage_states[r].sizes());
    CATCH_CHECK(at::allclose(state, oracle.stage_states[r], 0, 1e-10));
  }
  const at::Tensor losses = gpipe_test::read_doubles(folder + "/loss.bin");
  CATCH_REQUIRE(losses.sizes() == oracle.losses.sizes());
  CATCH_CHECK(at::allclose(losses, oracle.losses, 0, loss_tolerance));
  std::filesystem::remove_all(folder);
}

constexpr const char* kTransparency =
    "two processes with one stage each train a model with tuples and skips to the plain model's "
    "parameters and losses";

CATCH_TEST_CASE(kTransparency, "[distributed][stage]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env())
                    .record_timeline(true));
    return;
  }
  const std::string mode = GENERATE(as<std::string>(), "always", "except_last", "never");
  CATCH_INFO("checkpoint " << mode);
  const std::string folder = folder_for("transparency_" + mode);
  check_two_stages(kTransparency, folder, {{"GPIPE_TEST_CHECKPOINT", mode}},
                   /*loss_tolerance=*/1e-12);
}

constexpr const char* kLocalPartitions =
    "two processes with two partitions each on threads of their own train a model with tuples "
    "and skips within or across partitions to the plain model's parameters and losses";

CATCH_TEST_CASE(kLocalPartitions, "[distributed][stage][partitions]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env())
                    .record_timeline(true));
    return;
  }
  // "1,2": stage 0 Linear | Stash, PopPair (the skip within a partition), stage 1 PairLinear |
  // First, Linear (the pair with its integer tensor crosses between the partitions). "2,1":
  // stage 0 Linear, Stash | PopPair (the skip crosses between the partitions), stage 1
  // PairLinear, First | Linear.
  const std::string local = GENERATE(as<std::string>(), "1,2", "2,1");
  const std::string mode = GENERATE(as<std::string>(), "always", "except_last", "never");
  CATCH_INFO("local balance " << local << " in each stage, checkpoint " << mode);
  const std::string folder = folder_for("local_" + local.substr(0, 1) + "_" + mode);
  check_two_stages(kLocalPartitions, folder,
                   {{"GPIPE_TEST_CHECKPOINT", mode}, {"GPIPE_TEST_LOCAL", local + ";" + local}},
                   /*loss_tolerance=*/1e-12);
}

constexpr const char* kSchedules =
    "two processes train with the 1F1B and zero-bubble schedules to the plain model's parameters "
    "and losses and keep the schedule's micro-batches in flight";

CATCH_TEST_CASE(kSchedules, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env())
                    .record_timeline(true));
    return;
  }
  const std::string schedule = GENERATE(as<std::string>(), "1f1b", "zb");
  const std::string mode = GENERATE(as<std::string>(), "always", "except_last", "never");
  const std::string local = GENERATE(as<std::string>(), "", "2,1;2,1");
  CATCH_INFO("schedule " << schedule << ", checkpoint " << mode << ", local balance '" << local
                         << "'");
  std::map<std::string, std::string> env{{"GPIPE_TEST_CHECKPOINT", mode},
                                         {"GPIPE_TEST_SCHEDULE", schedule}};
  if (!local.empty()) env["GPIPE_TEST_LOCAL"] = local;
  const std::string folder =
      folder_for("schedule_" + schedule + "_" + mode + (local.empty() ? "" : "_local"));
  // The loss is a sum over micro-batches (Note [Losses over micro-batches]): equal up to rounding.
  check_two_stages(kSchedules, folder, env, /*loss_tolerance=*/1e-12);
}

constexpr const char* kScheduleInOrder =
    "1F1B and zero bubble on a group that matches transfers in posting order are refused";

CATCH_TEST_CASE(kScheduleInOrder, "[distributed][stage][schedule][errors]") {
  if (test_rank() >= 0) {
    // One group for the three: refused before any transfer.
    ProcessGroup group = join();
    for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
      CATCH_CHECK_THROWS_WITH(
          PipelineStage(make_model(),
                        PipelineStageOptions(kBalance).chunks(2).loss(mse).schedule(kind), group),
          gpipe_test::contains("needs a group that matches transfers by tag"));
    }
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(),
                      PipelineStageOptions(kBalance).loss(mse).schedule(ScheduleKind::kInterleaved),
                      group),
        gpipe_test::contains("interleaved schedule needs several stages per process"));
    return;
  }
  const std::string folder = folder_for("schedule_in_order");
  const auto results = run_ranks(kScheduleInOrder, 2, folder, {{"GPIPE_TEST_IN_ORDER", "1"}});
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[0].exit_code == 0);
  CATCH_CHECK(results[1].exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kInOrder =
    "two stages whose transfers are matched in posting order as NCCL matches them train to the "
    "plain model's parameters and losses";

CATCH_TEST_CASE(kInOrder, "[distributed][stage][order]") {
  if (test_rank() >= 0) {
    // (The schedule is checked where both stages run backward.)
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env())
                    .record_timeline(freeze_from_env() != "stage0"));
    return;
  }
  // Note [Point-to-point order]: the stages post in an order both agree on, so a group that
  // ignores tags (NCCL) pairs each send with its receive and never waits on a gradient that
  // needs activations queued behind it. With one partition per stage, and with two (the skip
  // across stage 0's partitions, the tuple across stage 1's); frozen stage 1 (gradients still
  // cross) and frozen stage 0 (none cross).
  const auto [local, mode, frozen] = GENERATE(table<std::string, std::string, std::string>(
      {{"", "never", ""}, {"", "always", ""}, {"2,1;2,1", "except_last", ""},
       {"", "always", "stage1"}, {"", "always", "stage0"}}));
  CATCH_INFO("local balance '" << local << "', checkpoint " << mode << ", frozen '" << frozen
                               << "'");
  std::map<std::string, std::string> env{{"GPIPE_TEST_IN_ORDER", "1"},
                                         {"GPIPE_TEST_CHECKPOINT", mode},
                                         {"GPIPE_TEST_FREEZE", frozen}};
  if (!local.empty()) env["GPIPE_TEST_LOCAL"] = local;
  const std::string folder =
      folder_for("in_order_" + mode + "_" + std::to_string(local.size()) + "_" + frozen);
  check_two_stages(kInOrder, folder, env, /*loss_tolerance=*/1e-12, frozen);
}

constexpr const char* kFineTuning =
    "fine-tuning with frozen layers in either stage trains to the plain model's parameters and "
    "losses";

CATCH_TEST_CASE(kFineTuning, "[distributed][stage]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()));
    return;
  }
  // Frozen stage 0: nothing of stage 0 requires grad, so no gradient crosses back; frozen stage 1:
  // its inputs' gradients still go to stage 0.
  // (Checkpointing everywhere for a frozen stage 0: micro-batches whose graph needs no backward.)
  const auto [frozen, mode] = GENERATE(table<std::string, std::string>(
      {{"stage0", "always"}, {"layer0", "never"}, {"stage1", "always"}}));
  CATCH_INFO("frozen " << frozen << ", checkpoint " << mode);
  const std::string folder = folder_for("frozen_" + frozen + "_" + mode);
  // The frozen parameters are compared too: they must not have moved.
  check_two_stages(kFineTuning, folder,
                   {{"GPIPE_TEST_CHECKPOINT", mode}, {"GPIPE_TEST_FREEZE", frozen}},
                   /*loss_tolerance=*/1e-12, frozen);
}

constexpr const char* kCudaStages =
    "two processes with one stage each on the GPU train to the plain model's parameters and "
    "losses";

CATCH_TEST_CASE(kCudaStages, "[distributed][stage][cuda]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env())
                    .record_timeline(true));
    return;
  }
  // Both processes on cuda:0 (one GPU is enough: Gloo carries the tensors through the CPU).
  const std::string mode = GENERATE(as<std::string>(), "always", "never");
  CATCH_INFO("checkpoint " << mode);
  const std::string folder = folder_for("cuda_" + mode);
  check_two_stages(kCudaStages, folder,
                   {{"GPIPE_TEST_CHECKPOINT", mode}, {"GPIPE_TEST_DEVICE", "cuda:0"}},
                   /*loss_tolerance=*/1e-10);
}

constexpr const char* kNccl =
    "two processes with one stage each on a GPU of their own train over NCCL to the plain "
    "model's parameters and losses";

CATCH_TEST_CASE(kNccl, "[distributed][stage][cuda][gpus2]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env())
                    .record_timeline(true));
    return;
  }
  // The activations and gradients go from GPU to GPU, on NCCL's streams (Note [Point-to-point
  // order]); with one partition per stage, and with two (both on the stage's GPU would share its
  // generator: the second partition of each stage on the CPU).
  CATCH_REQUIRE(built_with_nccl());
  const auto [mode, local] = GENERATE(table<std::string, std::string>(
      {{"always", ""}, {"never", ""}, {"except_last", "2,1;2,1"}}));
  CATCH_INFO("checkpoint " << mode << ", local balance '" << local << "'");
  std::map<std::string, std::string> env{{"GPIPE_TEST_CHECKPOINT", mode},
                                         {"GPIPE_TEST_DEVICE", "cuda:rank"},
                                         {"GPIPE_TEST_BACKEND", "nccl"}};
  if (!local.empty()) env["GPIPE_TEST_LOCAL"] = local;
  const std::string folder = folder_for("nccl_" + mode);
  check_two_stages(kNccl, folder, env, /*loss_tolerance=*/1e-10);
}

constexpr const char* kReplicas =
    "replicated pipelines on shards of each batch train to the plain model's parameters and "
    "losses on the whole batch";

CATCH_TEST_CASE(kReplicas, "[distributed][stage]") {
  if (test_rank() >= 0) {
    const int stages = std::atoi(std::getenv("GPIPE_TEST_STAGES"));
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), stages);
    const std::vector<int64_t> balance = stages == 1 ? std::vector<int64_t>{6} : kBalance;
    // Replicas start apart: replica 0's parameters must reach the others.
    PipelineStage stage(make_model(7 + 100 * groups.replica),
                        PipelineStageOptions(balance).chunks(2).loss(mse), groups.pipeline,
                        groups.replica_group);
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    std::vector<at::Tensor> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      const at::Tensor xs = x.chunk(groups.replicas)[groups.replica];
      const at::Tensor ys = y.chunk(groups.replicas)[groups.replica];
      sgd.zero_grad();
      at::Tensor loss =
          stage->is_first() ? stage->step(Batch(xs), ys) : stage->step(no_input(), ys);
      if (loss.defined()) losses.push_back(loss.detach());
      sgd.step();
    }
    const std::string folder = gpipe_test::test_folder();
    gpipe_test::write_doubles(folder + "/state" + std::to_string(test_rank()) + ".bin",
                              stage->parameters());
    if (stage->is_last()) {
      gpipe_test::write_doubles(folder + "/loss" + std::to_string(groups.replica) + ".bin",
                                losses);
    }
    return;
  }
  const auto [stages, replicas] = GENERATE(std::make_pair(1, 2), std::make_pair(2, 2));
  CATCH_INFO(stages << " stages x " << replicas << " replicas");
  const int world = stages * replicas;
  const std::string folder = folder_for("replicas_" + std::to_string(stages));
  const auto results = run_ranks(kReplicas, world, folder,
                                 {{"GPIPE_TEST_STAGES", std::to_string(stages)}});
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < world; ++r) CATCH_REQUIRE(results[r].exit_code == 0);
  const Oracle oracle = plain_training(stages == 1 ? std::vector<int64_t>{6} : kBalance);
  for (int r = 0; r < world; ++r) {
    const at::Tensor state = gpipe_test::read_doubles(folder + "/state" + std::to_string(r) +
                                                      ".bin");
    CATCH_REQUIRE(state.sizes() == oracle.stage_states[r % stages].sizes());
    CATCH_CHECK(at::allclose(state, oracle.stage_states[r % stages], 0, 1e-10));
  }
  // Equal shards: the mini-batch's mean loss is the mean of the replicas' losses.
  at::Tensor mean = gpipe_test::read_doubles(folder + "/loss0.bin");
  for (int q = 1; q < replicas; ++q) {
    mean = mean + gpipe_test::read_doubles(folder + "/loss" + std::to_string(q) + ".bin");
  }
  mean = mean / replicas;
  CATCH_REQUIRE(mean.sizes() == oracle.losses.sizes());
  CATCH_CHECK(at::allclose(mean, oracle.losses, 0, 1e-12));
  std::filesystem::remove_all(folder);
}

// BatchNorms in stages (Note [Pipeline stages and batch norm]): a model with a BatchNorm in each
// of two stages, trained over kSteps checkpointed steps in S x R processes, 4 micro-batches of 2
// rows per mini-batch in all (each replica takes a shard of 4 rows in 4 / R micro-batches).
nn::Sequential make_bn_model(bool frozen) {
  torch::manual_seed(11);
  nn::Sequential seq(nn::Linear(6, 8), nn::BatchNorm1d(8), nn::Tanh(), nn::Linear(8, 8),
                     nn::BatchNorm1d(8), nn::Linear(8, 3));
  seq->to(at::kDouble);
  if (frozen) {  // fine-tuning: the BatchNorms in eval mode inside a training model
    seq[1]->eval();
    seq[4]->eval();
  }
  return seq;
}
constexpr int64_t kBnMicrobatches = 4;

// What each stage's layers hold after training: parameters and buffers, flattened.
struct StageState {
  at::Tensor params, buffers;
};

// The plain model on the same micro-batches, each forward on its own (as BatchNorm normalises
// them in a pipeline), the loss over the whole mini-batch. Running statistics: per micro-batch,
// in order ("micro"); with `replicas` > 1 each replica's from replica 0's at the start of the step
// and its own micro-batches; once per mini-batch from all its micro-batches ("deferred"); never
// ("frozen"). Returns per replica, per stage, the state.
std::vector<std::vector<StageState>> plain_bn_training(const std::string& bn, int replicas) {
  nn::Sequential plain = make_bn_model(bn == "frozen");
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto buffers_of = [](const nn::Sequential& model) {
    std::vector<at::Tensor> copy;
    for (const at::Tensor& b : model->buffers()) copy.push_back(b.clone());
    return copy;
  };
  const auto set_buffers = [](const nn::Sequential& model, const std::vector<at::Tensor>& values) {
    at::NoGradGuard no_grad;
    const auto buffers = model->buffers();
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(values[k]);
  };
  // The running statistics come from a copy of the model with this step's parameters, run
  // without grad on the micro-batches that move them: the model that computes the gradients
  // must not have its buffers overwritten before its backward (BatchNorm's backward keeps them).
  const auto statistics_after = [&](const std::vector<at::Tensor>& start,
                                    const std::vector<at::Tensor>& inputs) {
    auto copy = std::dynamic_pointer_cast<nn::SequentialImpl>(plain->clone());
    set_buffers(nn::Sequential(copy), start);
    at::NoGradGuard no_grad;
    for (const at::Tensor& x : inputs) copy->forward(x);
    return buffers_of(nn::Sequential(copy));
  };
  // Deferred: each BatchNorm moves once, by the statistics of all the inputs it saw in the
  // micro-batches' forwards (normalised per micro-batch by the layers before it).
  const auto deferred_statistics_after = [&](const std::vector<at::Tensor>& start,
                                             const std::vector<at::Tensor>& inputs) {
    auto stats = std::dynamic_pointer_cast<nn::SequentialImpl>(plain->clone());
    auto run = std::dynamic_pointer_cast<nn::SequentialImpl>(plain->clone());
    set_buffers(nn::Sequential(stats), start);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> h = inputs;
    auto layer = run->begin();
    for (size_t k = 0; k < stats->size(); ++k, ++layer) {
      if (auto* bn = stats->ptr(k)->as<nn::BatchNorm1dImpl>()) bn->forward(at::cat(h));
      for (at::Tensor& t : h) t = layer->forward(t);
    }
    return buffers_of(nn::Sequential(stats));
  };
  std::vector<std::vector<at::Tensor>> replica_buffers(replicas, buffers_of(plain));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    // Every replica starts the step from replica 0's statistics (the same, when deferred).
    const std::vector<at::Tensor> start = replica_buffers[0];
    const std::vector<at::Tensor> micro = x.chunk(kBnMicrobatches);
    const int64_t per_replica = kBnMicrobatches / replicas;
    for (int q = 0; q < replicas; ++q) {
      replica_buffers[q] =
          bn == "deferred"
              ? deferred_statistics_after(start, micro)
              : statistics_after(start, std::vector<at::Tensor>(
                                            micro.begin() + q * per_replica,
                                            micro.begin() + (q + 1) * per_replica));
    }
    std::vector<at::Tensor> outputs;
    for (const at::Tensor& m : micro) outputs.push_back(plain->forward(m));
    sgd.zero_grad();
    nn::functional::mse_loss(at::cat(outputs), y).backward();
    sgd.step();
  }
  std::vector<std::vector<StageState>> states(replicas);
  for (int q = 0; q < replicas; ++q) {
    set_buffers(plain, replica_buffers[q]);
    int64_t first = 0;
    for (int64_t b : kBalance) {
      std::vector<at::Tensor> params, buffers;
      for (int64_t k = first; k < first + b; ++k) {
        for (const at::Tensor& p : plain[k]->parameters()) params.push_back(p);
        for (const at::Tensor& t : plain[k]->buffers()) buffers.push_back(t);
      }
      states[q].push_back({flat(params), flat(buffers)});
      first += b;
    }
  }
  return states;
}

constexpr const char* kBatchNorm =
    "batch norms in stages and their replicas train to the plain model's parameters and running "
    "statistics on the same micro-batches";

CATCH_TEST_CASE(kBatchNorm, "[distributed][stage][batchnorm]") {
  if (test_rank() >= 0) {
    const std::string bn = std::getenv("GPIPE_TEST_BN");
    const int replicas = std::atoi(std::getenv("GPIPE_TEST_REPLICAS"));
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    const PipelineStageOptions options =
        PipelineStageOptions(kBalance).chunks(kBnMicrobatches / replicas).loss(mse)
            .checkpoint(Checkpoint::kExceptLast).deferred_batch_norm(bn == "deferred")
            .local_balance(local_balance_from_env(groups.stage));
    PipelineStage stage = replicas == 1
        ? PipelineStage(make_bn_model(bn == "frozen"), options, groups.pipeline)
        : PipelineStage(make_bn_model(bn == "frozen"), options, groups.pipeline,
                        groups.replica_group);
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      const at::Tensor xs = x.chunk(replicas)[groups.replica];
      const at::Tensor ys = y.chunk(replicas)[groups.replica];
      sgd.zero_grad();
      if (stage->is_first()) {
        stage->step(Batch(xs));
      } else {
        stage->step(no_input(), ys);
      }
      sgd.step();
    }
    const std::string folder = gpipe_test::test_folder();
    const std::string r = std::to_string(test_rank());
    gpipe_test::write_doubles(folder + "/params" + r + ".bin", stage->parameters());
    gpipe_test::write_doubles(folder + "/buffers" + r + ".bin", stage->buffers());
    return;
  }
  // With "local", each stage has two partitions: Linear, BatchNorm | Tanh and Linear |
  // BatchNorm, Linear.
  const auto [bn, replicas, local] = GENERATE(table<std::string, int, bool>(
      {{"micro", 1, false}, {"deferred", 1, false}, {"frozen", 1, false}, {"micro", 2, false},
       {"deferred", 2, false}, {"micro", 1, true}, {"deferred", 2, true}}));
  CATCH_INFO("batch norm " << bn << ", 2 stages x " << replicas << " replicas"
                           << (local ? ", 2 partitions per stage" : ""));
  const int world = 2 * replicas;
  const std::string folder = folder_for("batchnorm_" + bn + std::to_string(replicas) +
                                        (local ? "_local" : ""));
  std::map<std::string, std::string> env{
      {"GPIPE_TEST_BN", bn}, {"GPIPE_TEST_REPLICAS", std::to_string(replicas)}};
  if (local) env.emplace("GPIPE_TEST_LOCAL", "2,1;1,2");
  const auto results = run_ranks(kBatchNorm, world, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < world; ++r) CATCH_REQUIRE(results[r].exit_code == 0);
  const auto oracle = plain_bn_training(bn, replicas);
  for (int r = 0; r < world; ++r) {
    CATCH_INFO("rank " << r);
    const StageState& want = oracle[r / 2][r % 2];  // ranks: replica-major (new_pipeline_groups)
    const std::string name = std::to_string(r) + ".bin";
    const at::Tensor params = gpipe_test::read_doubles(folder + "/params" + name);
    const at::Tensor buffers = gpipe_test::read_doubles(folder + "/buffers" + name);
    CATCH_REQUIRE(params.sizes() == want.params.sizes());
    CATCH_REQUIRE(buffers.sizes() == want.buffers.sizes());
    CATCH_CHECK(at::allclose(params, want.params, 0, 1e-10));
    CATCH_CHECK(at::allclose(buffers, want.buffers, 0, 1e-10));
  }
  std::filesystem::remove_all(folder);
}

// The model for autocast: float32 (autocast computes Linear in bfloat16 on the CPU).
nn::Sequential make_float_model() {
  torch::manual_seed(5);
  return nn::Sequential(nn::Linear(6, 16), nn::Tanh(), nn::Linear(16, 16), nn::Tanh(),
                        nn::Linear(16, 3));
}
constexpr double kAutocastBound = 5e-4;

// The plain model's parameters after kSteps SGD steps under CPU autocast, each micro-batch's
// forward on its own (as in the pipeline), with the loss over the mini-batch.
std::vector<at::Tensor> plain_autocast_training(int64_t chunks) {
  nn::Sequential plain = make_float_model();
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.05));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    at::Tensor loss;
    {
      Autocast autocast;
      std::vector<at::Tensor> outputs;
      for (const at::Tensor& m : x.to(at::kFloat).chunk(chunks)) {
        outputs.push_back(plain->forward(m));
      }
      loss = nn::functional::mse_loss(at::cat(outputs), y.to(at::kFloat));
    }
    loss.backward();
    sgd.step();
  }
  return plain->parameters();
}

constexpr const char* kAutocast =
    "stages under CPU autocast train over several steps to the plain model's parameters under "
    "autocast";

CATCH_TEST_CASE(kAutocast, "[distributed][stage][autocast]") {
  if (test_rank() >= 0) {
    ProcessGroup group = join();
    PipelineStage stage(make_float_model(),
                        PipelineStageOptions({3, 2}).chunks(kChunks).checkpoint(mode_from_env())
                            .loss([](const Batch& out, const at::Tensor& target) {
                              return nn::functional::mse_loss(out.tensor(), target);
                            })
                            .local_balance(local_balance_from_env(group->getRank())),
                        group);
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      sgd.zero_grad();
      {
        Autocast autocast;  // around the step on every stage, as around a forward
        if (stage->is_first()) {
          stage->step(Batch(x.to(at::kFloat)));
        } else {
          stage->step(no_input(), y.to(at::kFloat));
        }
      }
      sgd.step();
    }
    gpipe_test::write_doubles(gpipe_test::test_folder() + "/state" +
                                  std::to_string(test_rank()) + ".bin",
                              stage->parameters());
    return;
  }
  // With "local", two partitions per stage: autocast reaches the partitions' own threads.
  const auto [mode, local] = GENERATE(table<std::string, bool>(
      {{"except_last", false}, {"never", false}, {"except_last", true}}));
  CATCH_INFO("checkpoint " << mode << (local ? ", 2 partitions per stage" : ""));
  const std::string folder = folder_for("autocast_" + mode + (local ? "_local" : ""));
  std::map<std::string, std::string> env{{"GPIPE_TEST_CHECKPOINT", mode}};
  if (local) env.emplace("GPIPE_TEST_LOCAL", "2,1;1,1");
  const auto results = run_ranks(kAutocast, 2, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_REQUIRE(results[0].exit_code == 0);
  CATCH_REQUIRE(results[1].exit_code == 0);
  const std::vector<at::Tensor> params = plain_autocast_training(kChunks);
  const std::vector<at::Tensor> first(params.begin(), params.begin() + 4);  // two Linears
  const std::vector<at::Tensor> last(params.begin() + 4, params.end());
  const at::Tensor got = at::cat({gpipe_test::read_doubles(folder + "/state0.bin"),
                                  gpipe_test::read_doubles(folder + "/state1.bin")});
  const at::Tensor want = at::cat({flat(first), flat(last)});
  CATCH_REQUIRE(got.sizes() == want.sizes());
  // bfloat16 keeps 8 bits: the stages may differ from the plain model by rounding (the plain
  // model sums weight gradients behind one cached cast per region), far less than a step moves.
  const double gap = (got - want).abs().max().item<double>();
  CATCH_INFO("largest difference " << gap);
  CATCH_CHECK(gap <= kAutocastBound);
  const at::Tensor initial = flat(make_float_model()->parameters());
  CATCH_CHECK((want - initial).abs().max().item<double>() >= 10 * kAutocastBound);
  std::filesystem::remove_all(folder);
}

constexpr const char* kThreads =
    "steps called from two threads of each stage run one after the other and accumulate both "
    "steps' gradients";

CATCH_TEST_CASE(kThreads, "[distributed][stage][threads]") {
  if (test_rank() >= 0) {
    PipelineStage stage(make_model(), PipelineStageOptions(kBalance).chunks(kChunks).loss(mse),
                        join());
    // A server's two request threads, each running a step on the same batch: whichever step of a
    // stage runs first meets the other stage's first.
    auto [x, y] = batch(0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, x = x, y = y] {
        if (stage->is_first()) {
          stage->step(Batch(x));
        } else {
          stage->step(no_input(), y);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : stage->parameters()) grads.push_back(p.grad());
    gpipe_test::write_doubles(gpipe_test::test_folder() + "/grad" + std::to_string(test_rank()) +
                                  ".bin",
                              grads);
    return;
  }
  const std::string folder = folder_for("threads");
  const auto results = run_ranks(kThreads, 2, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_REQUIRE(results[0].exit_code == 0);
  CATCH_REQUIRE(results[1].exit_code == 0);
  nn::Sequential plain = make_model();
  auto [x, y] = batch(0);
  for (int t = 0; t < 2; ++t) nn::functional::mse_loss(plain->forward(x), y).backward();
  int64_t first = 0;
  for (int r = 0; r < 2; ++r) {
    std::vector<at::Tensor> want;
    for (int64_t k = first; k < first + kBalance[r]; ++k) {
      for (const at::Tensor& p : plain[k]->parameters()) want.push_back(p.grad());
    }
    first += kBalance[r];
    const at::Tensor got = gpipe_test::read_doubles(folder + "/grad" + std::to_string(r) + ".bin");
    CATCH_REQUIRE(got.sizes() == flat(want).sizes());
    CATCH_CHECK(at::allclose(got, flat(want), 0, 1e-12));
  }
  std::filesystem::remove_all(folder);
}

// Stage 1's layer that ends its process during the second micro-batch of the first step.
struct DieImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    if (++calls == 2) std::_Exit(3);
    return x;
  }
  int calls = 0;
};
TORCH_MODULE(Die);

constexpr const char* kDeadStage =
    "a stage that dies mid-step makes the other's step fail with an error that says so";

CATCH_TEST_CASE(kDeadStage, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    torch::manual_seed(7);
    nn::Sequential seq(nn::Linear(6, 8), nn::Tanh(), Die(), nn::Linear(8, 3));
    seq->to(at::kDouble);
    PipelineStage stage(seq, PipelineStageOptions({2, 2}).chunks(4).loss(mse), join());
    auto [x, y] = batch(0);
    if (stage->is_first()) {
      CATCH_CHECK_THROWS_WITH(stage->step(Batch(x)),
                              gpipe_test::contains("failed on rank 0 of 2") &&
                                  gpipe_test::contains("another process may have died"));
    } else {
      stage->step(no_input(), y);
    }
    return;
  }
  const std::string folder = folder_for("dead");
  const auto results = run_ranks(kDeadStage, 2, folder, {{"GPIPE_TIMEOUT_S", "20"}});
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[1].exit_code == 3);
  CATCH_CHECK(results[0].exit_code == 0);  // it saw the error it expected, within the timeout
  std::filesystem::remove_all(folder);
}

constexpr const char* kGradModes =
    "stages under different grad modes fail with an error naming both and refuse further steps";

CATCH_TEST_CASE(kGradModes, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    PipelineStage stage(make_model(), PipelineStageOptions(kBalance).chunks(2).loss(mse), join());
    auto [x, y] = batch(0);
    if (stage->is_first()) {
      // Its gradients never come: stage 1 stops at the first micro-batch and its process ends.
      CATCH_CHECK_THROWS_WITH(stage->step(Batch(x)), gpipe_test::contains("failed on rank 0"));
      CATCH_CHECK_THROWS_WITH(stage->step(Batch(x)),
                              gpipe_test::contains("an earlier step failed on this stage"));
    } else {
      at::NoGradGuard no_grad;
      CATCH_CHECK_THROWS_WITH(stage->step(no_input(), y),
                              gpipe_test::contains("stage 0 runs with grad but stage 1 without "
                                                   "it"));
    }
    return;
  }
  const std::string folder = folder_for("grad_modes");
  const auto results = run_ranks(kGradModes, 2, folder, {{"GPIPE_TIMEOUT_S", "20"}});
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[0].exit_code == 0);
  CATCH_CHECK(results[1].exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kMismatch = "stages configured differently are refused at construction";

CATCH_TEST_CASE(kMismatch, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    const int64_t chunks = test_rank() == 0 ? 2 : 4;
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), PipelineStageOptions(kBalance).chunks(chunks).loss(mse),
                      join()),
        gpipe_test::contains("rank 1's stage differs from rank 0's: chunks: 4 (rank 0: 2)"));
    return;
  }
  const std::string folder = folder_for("mismatch");
  const auto results = run_ranks(kMismatch, 2, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[0].exit_code == 0);
  CATCH_CHECK(results[1].exit_code == 0);
  std::filesystem::remove_all(folder);
}

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
  CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), PipelineStageOptions({6}).device(gpu), group),
                          gpipe_test::contains("PipelineStage: the stage's device is on " +
                                               gpu.str() + ", but "));
  CATCH_CHECK_THROWS_WITH(
      PipelineStage(make_model(),
                    PipelineStageOptions({6}).local_balance({3, 3}).local_devices({at::kCPU, gpu}),
                    group),
      gpipe_test::contains("PipelineStage: local partition 1 is on " + gpu.str() + ", but "));
  // A warning only where a checkpointed CPU partition beside another draws random numbers (Note
  // [Random numbers in concurrent CPU partitions]).
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
  CATCH_CHECK_THAT(warned[0], gpipe_test::contains("local partition 0 of stage 0 holds '1' "
                                                   "(torch::nn::DropoutImpl)"));
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
  PipelineStage stage(make_model(),
                      PipelineStageOptions({6}).chunks(kChunks).loss(mse).record_timeline(true),
                      group);
  CATCH_CHECK_THROWS_WITH(stage->step(no_input(), y),
                          gpipe_test::contains("stage 0 needs the mini-batch as input"));
  nn::Sequential plain = make_model();
  at::Tensor expected = nn::functional::mse_loss(plain->forward(x), y);
  expected.backward();
  const at::Tensor loss = stage->step(Batch(x), y);
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

CATCH_TEST_CASE("a stage with three partitions in one process trains with a skip within or "
                "across partitions as the plain model over several steps, and local balances "
                "that cannot work are refused naming the value",
                "[distributed][stage][partitions][errors]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  const auto refused = [&](PipelineStageOptions options) {
    PipelineStage(make_model(), options.loss(mse), group);
  };
  CATCH_CHECK_THROWS_WITH(refused(PipelineStageOptions({6}).local_balance({1, 2})),
                          gpipe_test::contains("local_balance {1, 2} adds up to 3 layers, but "
                                               "stage 0 has 6"));
  CATCH_CHECK_THROWS_WITH(refused(PipelineStageOptions({6}).local_balance({6, 0})),
                          gpipe_test::contains("local_balance {6, 0} has a non-positive entry 0"));
  CATCH_CHECK_THROWS_WITH(
      refused(PipelineStageOptions({6}).local_balance({3, 3}).local_devices({at::kCPU})),
      gpipe_test::contains("local_devices has 1 devices but local_balance {3, 3} has 2 "
                           "partitions"));
  CATCH_CHECK_THROWS_WITH(refused(PipelineStageOptions({6}).local_devices({at::kCPU})),
                          gpipe_test::contains("local_devices has 1 devices but local_balance is "
                                               "empty"));

  // {1, 2, 3}: Linear | Stash, PopPair | PairLinear, First, Linear, the skip within the second
  // partition; {2, 1, 3}: the skip from the first partition to the second. The pair crosses into
  // the third. Four steps with momentum, every checkpoint mode.
  const std::vector<int64_t> local =
      GENERATE(std::vector<int64_t>{1, 2, 3}, std::vector<int64_t>{2, 1, 3});
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_INFO("local balance {" << local[0] << ", " << local[1] << ", " << local[2]
                               << "}, checkpoint mode " << static_cast<int>(mode));
  PipelineStage stage(make_model(),
                      PipelineStageOptions({6}).local_balance(local).chunks(kChunks)
                          .checkpoint(mode).loss(mse).record_timeline(true),
                      group);
  CATCH_CHECK(stage->partitions() == 3);
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    losses.push_back(stage->step(Batch(x), y).detach());
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
  PipelineStage stage(make_jump_model(),
                      PipelineStageOptions({7}).local_balance({2, 1, 4}).chunks(kChunks)
                          .checkpoint(mode).loss(mse),
                      group);
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
    const at::Tensor loss = stage->step(Batch(before(x)), y);
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
    stage->step(Batch(x), y);
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
  PipelineStage stage(seq,
                      PipelineStageOptions({6}).local_balance({2, 2, 2}).chunks(kChunks).loss(mse),
                      group);
  auto [x, y] = batch(0);
  const std::string what = std::string("layer failed in ") + (backward ? "backward" : "forward") +
                           " on call " + std::to_string(call);
  CATCH_CHECK_THROWS_WITH(stage->step(Batch(x), y), gpipe_test::contains(what));
  CATCH_CHECK_THROWS_WITH(stage->step(Batch(x), y),
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
                      PipelineStageOptions({6}).local_balance({2, 4})
                          .local_devices({gpu, c10::Device(c10::kCPU)}).chunks(kChunks)
                          .checkpoint(mode).loss(mse),
                      group);
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    losses.push_back(stage->step(Batch(x.to(gpu)), y).detach().cpu());
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
