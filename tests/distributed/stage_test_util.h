// Shared by the pipeline stage tests: the model every test trains (a skip, a tuple with an
// integer tensor), its batches, how a test rank joins its group and trains its stage, and the
// plain model's training as the oracle.
#pragma once

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

#include <algorithm>
#include <atomic>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include "gpipe/checkpoint.h"
#include "gpipe/device.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/internal/shared_memory.h"
#include "gpipe/schedule_check.h"
#include "gpipe/skippable.h"
#include "gpipe/thread_state.h"
#include "tests/catch.h"
#include "tests/distributed/in_order_group.h"
#include "tests/distributed/multiprocess.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace distributed {
namespace stage_test {

namespace nn = torch::nn;
using gpipe_test::flat;
using gpipe_test::run_ranks;
using gpipe_test::test_rank;

constexpr int kSteps = 4;
constexpr int64_t kBatch = 8;
constexpr int64_t kChunks = 3;  // 3, 3 and 2 samples

inline std::string folder_for(const std::string& name) { return gpipe_test::folder_for("stage", name); }

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
// replicas that must take replica 0's parameters); `layers` > 6 adds Linear(3, 3) layers at the
// end (for balances of more stages).
inline nn::Sequential make_model(int seed = 7, int64_t layers = 6) {
  torch::manual_seed(seed);
  nn::Sequential seq(nn::Linear(6, 8), skippable(Stash(), SkippableOptions().stash({"skip"})),
                     skippable(PopPair(), SkippableOptions().pop({"skip"})), PairLinear(), First(),
                     nn::Linear(8, 3));
  for (int64_t k = 6; k < layers; ++k) seq->push_back(nn::Linear(3, 3));
  seq->to(at::kDouble);
  return seq;
}
const std::vector<int64_t> kBalance{3, 3};

inline at::Tensor mse(const Batch& output, const at::Tensor& target) {
  // (The target on the output's device: a stage's last partition may be on another.)
  return nn::functional::mse_loss(output.tensor(), target.to(output.tensor().device()));
}

inline std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor x = at::randn({kBatch, 6}, gen, at::kDouble);
  at::Tensor y = at::randn({kBatch, 3}, gen, at::kDouble);
  return {x, y};
}

// Fine-tuning: which parameters a test freezes (GPIPE_TEST_FREEZE): "stage0" every layer of stage
// 0 (no gradient crosses back), "layer0" only the first layer, "stage1" every layer of stage 1
// (gradients still cross it to stage 0); anything else freezes nothing.
inline void freeze(nn::Sequential seq, const std::string& which) {
  int64_t first = 0, end = 0;
  if (which == "stage0") end = kBalance[0];
  if (which == "layer0") end = 1;
  if (which == "stage1") first = kBalance[0], end = kBalance[0] + kBalance[1];
  for (int64_t k = first; k < end; ++k) {
    for (at::Tensor& p : seq[k]->parameters()) p.requires_grad_(false);
  }
}

inline std::string freeze_from_env() {
  const char* which = std::getenv("GPIPE_TEST_FREEZE");
  return which ? which : "";
}

// Each stage's own split into partitions (GPIPE_TEST_LOCAL: "1,2;2,1" gives stage 0 {1, 2} and
// stage 1 {2, 1}); empty when unset: one partition per stage.
inline std::vector<int64_t> local_balance_from_env(int64_t stage) {
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
inline ProcessGroup join() {
  const char* backend = std::getenv("GPIPE_TEST_BACKEND");
  if (backend != nullptr) {
    return new_process_group(
        options_from_env().timeout(std::chrono::seconds(60)).backend(backend));
  }
  ProcessGroup gloo = new_gloo_group(options_from_env().timeout(std::chrono::seconds(60)));
  if (std::getenv("GPIPE_TEST_IN_ORDER") == nullptr) return gloo;
  return c10::make_intrusive<gpipe_test::InOrderGroup>(gloo);
}

inline Checkpoint mode_from_env() {
  const char* mode = std::getenv("GPIPE_TEST_CHECKPOINT");
  const std::string m = mode ? mode : "except_last";
  return m == "always" ? Checkpoint::kAlways : m == "never" ? Checkpoint::kNever
                                                           : Checkpoint::kExceptLast;
}

// The last step's schedule across the processes, on the host's clock, with `partitions`
// partitions in all: each micro-batch's forward reaches partition j + 1 after partition j computed
// it, and its backward reaches partition j after partition j + 1's; each partition runs the
// forwards in order and the backwards in reverse.
inline void check_schedule(const std::vector<TimelineEvent>& events, int64_t partitions = 2) {
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
inline void train_stage(PipelineStageOptions options, bool record_timeline = false) {
  // "cuda:rank": each rank on the GPU of its number.
  const char* device_name = std::getenv("GPIPE_TEST_DEVICE");
  const std::string name = device_name != nullptr ? device_name : "cpu";
  const c10::Device device(name == "cuda:rank" ? "cuda:" + std::to_string(test_rank()) : name);
  const std::vector<int64_t>& balance = options.balance();
  nn::Sequential model = make_model(7, std::accumulate(balance.begin(), balance.end(), 0));
  freeze(model, freeze_from_env());
  ProcessGroup group = join();
  const std::vector<int64_t> local = local_balance_from_env(group->getRank());
  // Two partitions on a GPU stage: the second on the CPU (one GPU each).
  std::vector<c10::Device> devices{device};
  if (local.size() == 2 && device.is_cuda()) devices = {device, c10::Device(c10::kCPU)};
  const char* schedule_name = std::getenv("GPIPE_TEST_SCHEDULE");
  const std::string schedule = schedule_name != nullptr ? schedule_name : "gpipe";
  // The caller's virtual stages, with the kind and group the test runner gives.
  PipelineSchedule chosen = options.schedule();
  chosen.set_kind(schedule_kind(schedule));
  if (const char* group = std::getenv("GPIPE_TEST_GROUP")) {
    chosen.set_microbatch_group(std::stoll(group));
  }
  // Note [Shared memory between stages on one host]: its rings (the default), none, or rings
  // whose larger messages (over GPIPE_TEST_SHARED_LIMIT bytes) go over the group.
  if (const char* bytes = std::getenv("GPIPE_TEST_SHARED_MEMORY")) {
    options.shared_memory(std::stoll(bytes));
  }
  if (const char* limit = std::getenv("GPIPE_TEST_SHARED_LIMIT")) {
    internal::set_shared_message_limit(std::stoll(limit));
  }
  // GPIPE_TEST_SHARED_FAILS: rings that cannot be made (too large for the host), which each rank
  // says in a warning.
  const bool fails = std::getenv("GPIPE_TEST_SHARED_FAILS") != nullptr;
  std::optional<gpipe::testing::CaptureWarnings> warnings;
  if (fails) warnings.emplace();
  PipelineStage stage(model, options.devices(devices).local_balance(local).schedule(chosen), group);
  stage->record_timeline(record_timeline);
  if (fails) {
    CATCH_REQUIRE(warnings->messages.size() == 1);
    CATCH_CHECK_THAT(warnings->messages[0],
                     gpipe_test::contains("rank " + std::to_string(group->getRank()) +
                                          " could not set up shared memory") &&
                         gpipe_test::contains("go over the process group"));
    warnings.reset();
  }
  // Every link of a Gloo pipeline on one host passes through shared memory, unless it is off.
  const bool shared = options.shared_memory() > 0 && !carries_device_tensors(group) &&
                      std::getenv("GPIPE_TEST_IN_ORDER") == nullptr && !fails;
  CATCH_CHECK((stage->shared_memory_links() > 0) == shared);
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    // (On a V, stage 0 is both: it takes the mini-batch and the target.)
    at::Tensor loss = stage->step(stage->is_first() ? Batch(x.to(device)) : no_input(),
                                  stage->is_last() ? y.to(device) : at::Tensor(), mse);
    CATCH_CHECK(loss.defined() == stage->is_last());
    if (loss.defined()) losses.push_back(loss.detach());
    sgd.step();
  }
  if (stage->is_recording_timeline()) {
    const char* spec = std::getenv("GPIPE_TEST_LOCAL");
    const int64_t per_stage = spec != nullptr ? 2 : 1;
    const std::vector<TimelineEvent> events = stage->gather_timeline();
    if (schedule == "gpipe") {
      check_schedule(events, 2 * per_stage);  // two per stage, or one
    } else if (chosen.virtual_stages() > 1) {
      // Interleaved, zb1p, zbv, dualpipev: each virtual stage keeps at most what the schedule's
      // definition says (its simulation).
      // (m: the micro-batches the mini-batch split into, chunks or fewer.)
      const int64_t n = stage->stages(), v = chosen.virtual_stages();
      int64_t m = 0;
      for (const TimelineEvent& e : events) m = std::max(m, e.microbatch + 1);
      const int64_t group = schedule == "interleaved" ? chosen.microbatch_group() : 0;
      const ScheduleSimulation ideal =
          simulate_schedule(make_schedule(chosen.kind(), n, m, v, group));
      const std::map<int64_t, int64_t> peak = gpipe::testing::peak_in_flight(events);
      CATCH_CHECK(peak.size() == static_cast<size_t>(n * v));
      for (const auto& [p, most] : peak) {
        CATCH_CAPTURE(p);
        CATCH_CHECK(most <= ideal.stage_peak_in_flight.at(static_cast<size_t>(p)));
      }
      // Each process ran its forwards and backwards (split ones: I and W) in the schedule's
      // order (with a micro-batch group: the group's, Note [Micro-batch groups]); a checkpointed
      // micro-batch's backward is not split (its I runs it whole, its W nothing).
      const Schedule planned = make_schedule(chosen.kind(), n, m, v, group);
      const int64_t stop = checkpoint_stop(options.checkpoint(), m);
      using Kind = TimelineEvent::Kind;
      const std::map<Kind, ActionType> types{{Kind::kCompute, ActionType::kForward},
                                             {Kind::kBackward, ActionType::kBackward},
                                             {Kind::kBackwardInput, ActionType::kBackwardInput},
                                             {Kind::kBackwardWeight, ActionType::kBackwardWeight}};
      for (int64_t r = 0; r < n; ++r) {
        std::vector<const TimelineEvent*> mine;
        for (const TimelineEvent& e : events) {
          if (types.count(e.kind) != 0 && planned.stage_ranks.at(e.partition) == r) {
            mine.push_back(&e);
          }
        }
        std::sort(mine.begin(), mine.end(), [](const TimelineEvent* a, const TimelineEvent* b) {
          return a->start_us < b->start_us;
        });
        std::vector<std::string> ran, order;
        for (const TimelineEvent* e : mine) {
          ran.push_back(to_string(Action{types.at(e->kind), e->partition, e->microbatch}));
        }
        for (const Action& a : planned.ranks[static_cast<size_t>(r)]) {
          if (a.type == ActionType::kBackwardWeight && a.microbatch < stop) continue;
          if (!is_communication(a.type)) order.push_back(to_string(a));
        }
        CATCH_CAPTURE(r);
        CATCH_CHECK(ran == order);
      }
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
  // GPIPE_TEST_EVALUATE: then evaluate() on the next batch, whose output and loss every rank gets
  // (broadcast on the group's wire: a GPU's on NCCL).
  if (std::getenv("GPIPE_TEST_EVALUATE") != nullptr) {
    auto [x, y] = batch(kSteps);
    const auto evaluated = stage->evaluate(stage->is_first() ? Batch(x.to(device)) : no_input(),
                                           stage->is_last() ? y.to(device) : at::Tensor(), mse);
    CATCH_REQUIRE(evaluated.loss.defined());
    gpipe_test::write_doubles(folder + "/evaluated" + r + ".bin",
                              {evaluated.output.tensor(), evaluated.loss});
  }
}

// The plain model's parameters of each stage's layers and losses after the same steps.
struct Oracle {
  std::vector<at::Tensor> stage_states;
  at::Tensor losses;
  /// The trained model's output and loss on the next batch (what evaluate() gives).
  at::Tensor evaluated;
};
// With `virtual_stages` v, balance has one entry per virtual stage, and stage r holds virtual
// stages r, r + n, ... (Note [Interleaving across processes]), or with `v_shape`, r and
// 2n - 1 - r (Note [V-shaped placement]).
inline Oracle plain_training(const std::vector<int64_t>& balance = kBalance,
                             const std::string& frozen = "", int64_t virtual_stages = 1,
                             bool v_shape = false) {
  nn::Sequential plain = make_model(7, std::accumulate(balance.begin(), balance.end(), 0));
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
  std::vector<std::vector<at::Tensor>> chunks;
  int64_t first = 0;
  for (int64_t b : balance) {
    std::vector<at::Tensor> params;
    for (int64_t k = first; k < first + b; ++k) {
      for (const at::Tensor& p : plain[k]->parameters()) params.push_back(p);
    }
    chunks.push_back(std::move(params));
    first += b;
  }
  const size_t n = balance.size() / static_cast<size_t>(virtual_stages);
  for (size_t r = 0; r < n; ++r) {
    std::vector<at::Tensor> params;
    std::vector<size_t> held;
    for (size_t k = r; k < chunks.size(); k += n) held.push_back(k);
    if (v_shape) held = {r, 2 * n - 1 - r};
    for (size_t k : held) params.insert(params.end(), chunks[k].begin(), chunks[k].end());
    oracle.stage_states.push_back(flat(params));
  }
  oracle.losses = flat(losses);
  {
    at::NoGradGuard no_grad;
    auto [x, y] = batch(kSteps);
    const at::Tensor out = plain->forward(x);
    oracle.evaluated = flat({out, nn::functional::mse_loss(out, y)});
  }
  return oracle;
}

// Runs test `test` in two stage processes (train_stage with `env`) and checks what they wrote to
// `folder` (each stage's parameters after kSteps steps, rank 1's losses; with GPIPE_TEST_EVALUATE
// each rank's evaluation after them) against the plain model's training (parameters to 1e-10);
// removes the folder.
inline void check_stages(const char* test, const std::string& folder,
                         const std::map<std::string, std::string>& env, double loss_tolerance,
                         const std::string& frozen = "",
                         const std::vector<int64_t>& balance = kBalance, int64_t virtual_stages = 1,
                         bool v_shape = false) {
  const int ranks = static_cast<int>(balance.size() / static_cast<size_t>(virtual_stages));
  const auto results = run_ranks(test, ranks, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < ranks; ++r) CATCH_REQUIRE(results[r].exit_code == 0);
  const Oracle oracle = plain_training(balance, frozen, virtual_stages, v_shape);
  for (int r = 0; r < ranks; ++r) {
    const at::Tensor state = gpipe_test::read_doubles(folder + "/state" + std::to_string(r) +
                                                      ".bin");
    CATCH_REQUIRE(state.sizes() == oracle.stage_states[r].sizes());
    CATCH_CHECK(at::allclose(state, oracle.stage_states[r], 0, 1e-10));
  }
  const at::Tensor losses = gpipe_test::read_doubles(folder + "/loss.bin");
  CATCH_REQUIRE(losses.sizes() == oracle.losses.sizes());
  CATCH_CHECK(at::allclose(losses, oracle.losses, 0, loss_tolerance));
  if (env.count("GPIPE_TEST_EVALUATE") != 0) {
    for (int r = 0; r < ranks; ++r) {
      CATCH_CAPTURE(r);
      const at::Tensor evaluated =
          gpipe_test::read_doubles(folder + "/evaluated" + std::to_string(r) + ".bin");
      CATCH_REQUIRE(evaluated.sizes() == oracle.evaluated.sizes());
      CATCH_CHECK(at::allclose(evaluated, oracle.evaluated, 0, 1e-10));
    }
  }
  std::filesystem::remove_all(folder);
}

inline void check_two_stages(const char* test, const std::string& folder,
                             const std::map<std::string, std::string>& env,
                             double loss_tolerance, const std::string& frozen = "") {
  check_stages(test, folder, env, loss_tolerance, frozen);
}

// The balance a test's ranks use (GPIPE_TEST_BALANCE: "3,1,2"), else kBalance.
inline std::vector<int64_t> balance_from_env() {
  const char* spec = std::getenv("GPIPE_TEST_BALANCE");
  if (spec == nullptr) return kBalance;
  std::vector<int64_t> out;
  std::stringstream all(spec);
  for (std::string b; std::getline(all, b, ',');) out.push_back(std::stoll(b));
  return out;
}

// Runs test `test` in two ranks with `env`, in folder_for(`name`), and checks that both exited
// with 0 (every check in the ranks held); removes the folder.
inline void check_ranks_pass(const char* test, const std::string& name,
                             const std::map<std::string, std::string>& env = {}) {
  const std::string folder = folder_for(name);
  const auto results = run_ranks(test, 2, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[0].exit_code == 0);
  CATCH_CHECK(results[1].exit_code == 0);
  std::filesystem::remove_all(folder);
}

}  // namespace stage_test
}  // namespace distributed
}  // namespace gpipe
