// Pipeline stages across processes under the 1F1B, zero-bubble, interleaved and V-shaped
// schedules: training equal to the plain model's, micro-batches in flight, inference without a
// target, and the refusals.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "tests/distributed/stage_test_util.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers

// `balance` as GPIPE_TEST_BALANCE gives it ("3,1,2"; balance_from_env reads it back).
std::string balance_spec(const std::vector<int64_t>& balance) {
  std::string spec;
  for (int64_t b : balance) spec += (spec.empty() ? "" : ",") + std::to_string(b);
  return spec;
}

// A rank's options from the runner's environment: the balance, GPIPE_TEST_CHUNKS micro-batches and
// the checkpoint mode.
PipelineStageOptions options_with_chunks_from_env() {
  return PipelineStageOptions(balance_from_env())
      .chunks(std::stoll(std::getenv("GPIPE_TEST_CHUNKS")))
      .checkpoint(mode_from_env());
}

constexpr const char* kSchedules =
    "two processes train with the 1F1B and zero-bubble schedules to the plain model's parameters "
    "and losses and keep the schedule's micro-batches in flight";

CATCH_TEST_CASE(kSchedules, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()),
                /*record_timeline=*/true);
    return;
  }
  const std::string schedule = GENERATE(as<std::string>(), "1f1b", "zb");
  const std::string mode = GENERATE(as<std::string>(), "always", "except_last", "never");
  const std::string local = GENERATE(as<std::string>(), "", "2,1;2,1");
  CATCH_INFO("schedule " << schedule << ", checkpoint " << mode << ", local balance '" << local
                         << "'");
  std::map<std::string, std::string> env{{"GPIPE_TEST_CHECKPOINT", mode},
                                         {"GPIPE_TEST_SCHEDULE", schedule}};
  // With two partitions per stage, the links go over Gloo instead of shared memory.
  if (!local.empty()) env["GPIPE_TEST_LOCAL"] = local;
  if (!local.empty()) env["GPIPE_TEST_SHARED_MEMORY"] = "0";
  const std::string folder =
      folder_for("schedule_" + schedule + "_" + mode + (local.empty() ? "" : "_local"));
  // The loss is a sum over micro-batches (Note [Losses over micro-batches]): equal up to rounding.
  check_two_stages(kSchedules, folder, env, /*loss_tolerance=*/1e-12);
}

constexpr const char* kManyStages =
    "three and four processes train with each schedule to the plain model's parameters and "
    "losses";

CATCH_TEST_CASE(kManyStages, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(balance_from_env()).chunks(kChunks)
                    .checkpoint(mode_from_env()));
    return;
  }
  const std::string schedule = GENERATE(as<std::string>(), "gpipe", "1f1b", "zb");
  // Stage 0 keeps the skip; the pair crosses one or two stages.
  const std::vector<int64_t> balance =
      GENERATE(std::vector<int64_t>{3, 1, 2}, std::vector<int64_t>{3, 1, 1, 1});
  const std::string spec = balance_spec(balance);
  // Each checkpoint mode twice over the six runs, each schedule under two of them.
  const std::map<std::pair<std::string, size_t>, std::string> modes = {
      {{"gpipe", 3}, "never"},       {{"gpipe", 4}, "always"},
      {{"1f1b", 3}, "always"},       {{"1f1b", 4}, "except_last"},
      {{"zb", 3}, "except_last"},    {{"zb", 4}, "never"}};
  const std::string mode = modes.at({schedule, balance.size()});
  CATCH_INFO("schedule " << schedule << ", balance " << spec << ", checkpoint " << mode);
  const std::string folder =
      folder_for("stages_" + std::to_string(balance.size()) + "_" + schedule);
  check_stages(kManyStages, folder,
               {{"GPIPE_TEST_SCHEDULE", schedule}, {"GPIPE_TEST_BALANCE", spec},
                {"GPIPE_TEST_CHECKPOINT", mode}},
               /*loss_tolerance=*/1e-12, /*frozen=*/"", balance);
}

// This process's stage of the test model over two processes under `schedule` (interleaved or
// V-shaped: two virtual stages each).
PipelineStage two_stages(const std::string& schedule) {
  const bool interleaved = schedule == "interleaved" || v_shaped(schedule_kind(schedule));
  return PipelineStage(make_model(),
                       PipelineStageOptions(interleaved ? std::vector<int64_t>{1, 2, 2, 1}
                                                        : kBalance)
                           .chunks(interleaved ? 4 : kChunks)
                           .schedule(PipelineSchedule::of(schedule_kind(schedule),
                                                          interleaved ? 2 : 1)),
                       join());
}

// A mean over the target's entries that are not NaN (padding), as a token-level loss is over
// the tokens that are not padding.
at::Tensor masked_mse(const Batch& output, const at::Tensor& target) {
  const at::Tensor y = target.to(output.tensor().device());
  const at::Tensor kept = y.isnan().logical_not();
  const at::Tensor diff = (output.tensor() - y.nan_to_num(0)) * kept;
  return diff.pow(2).sum() / kept.sum();
}

at::Tensor count_entries(const at::Tensor& target) { return target.isnan().logical_not().sum(); }

// batch(step) with padding: the second micro-batch (rows 3 to 5) all of it, and parts of others.
std::pair<at::Tensor, at::Tensor> padded_batch(int step) {
  auto [x, y] = batch(step);
  y.narrow(0, 3, 3).fill_(std::numeric_limits<double>::quiet_NaN());
  y[0].narrow(0, 1, 2).fill_(std::numeric_limits<double>::quiet_NaN());
  y[7][0] = std::numeric_limits<double>::quiet_NaN();
  return {x, y};
}

constexpr const char* kMaskedMean =
    "two processes train with a loss that is a mean over unpadded entries under 1F1B and zero "
    "bubble to the plain model's parameters and losses with a micro-batch of padding only";

CATCH_TEST_CASE(kMaskedMean, "[distributed][stage][schedule][loss]") {
  if (test_rank() >= 0) {
    const char* schedule = std::getenv("GPIPE_TEST_SCHEDULE");
    PipelineStage stage(make_model(), PipelineStageOptions(kBalance).chunks(kChunks)
                                          .schedule(schedule_kind(schedule)), join());
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    std::vector<at::Tensor> losses;
    const Loss loss(masked_mse, count_entries);
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = padded_batch(step);
      sgd.zero_grad();
      const at::Tensor l = stage->is_first() ? stage->step(Batch(x), {}, loss)
                                             : stage->step(no_input(), y, loss);
      if (l.defined()) losses.push_back(l.detach());
      sgd.step();
    }
    const std::string folder = gpipe_test::test_folder();
    gpipe_test::write_doubles(folder + "/state" + std::to_string(test_rank()) + ".bin",
                              stage->parameters());
    if (stage->is_last()) gpipe_test::write_doubles(folder + "/loss.bin", losses);
    return;
  }
  const std::string schedule = GENERATE(as<std::string>(), "1f1b", "zb");
  CATCH_INFO("schedule " << schedule);
  const std::string folder = folder_for("masked_mean_" + schedule);
  const auto results = run_ranks(kMaskedMean, 2, folder, {{"GPIPE_TEST_SCHEDULE", schedule}});
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 2; ++r) CATCH_REQUIRE(results[r].exit_code == 0);
  // The plain model on the whole mini-batch.
  nn::Sequential plain = make_model();
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<at::Tensor> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = padded_batch(step);
    sgd.zero_grad();
    const at::Tensor l = masked_mse(Batch(plain->forward(x)), y);
    l.backward();
    losses.push_back(l.detach());
    sgd.step();
  }
  int64_t first = 0;
  for (int r = 0; r < 2; ++r) {
    std::vector<at::Tensor> params;
    for (int64_t k = first; k < first + kBalance[r]; ++k) {
      for (const at::Tensor& p : plain[k]->parameters()) params.push_back(p);
    }
    first += kBalance[r];
    const at::Tensor state =
        gpipe_test::read_doubles(folder + "/state" + std::to_string(r) + ".bin");
    CATCH_REQUIRE(state.sizes() == flat(params).sizes());
    CATCH_CHECK(at::allclose(state, flat(params), 0, 1e-10));
  }
  CATCH_CHECK(at::allclose(gpipe_test::read_doubles(folder + "/loss.bin"), flat(losses), 0,
                           1e-12));
  std::filesystem::remove_all(folder);
}

constexpr const char* kInference =
    "under NoGradGuard a step without a target gives the last stage the plain model's output and "
    "never calls the loss";

CATCH_TEST_CASE(kInference, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    const char* name = std::getenv("GPIPE_TEST_SCHEDULE");
    LossFunction never = [](const Batch&, const at::Tensor&) -> at::Tensor {
      TORCH_CHECK(false, "the loss was called");
      return at::Tensor();
    };
    PipelineStage stage = two_stages(name);
    nn::Sequential plain = make_model();
    auto [x, y] = batch(0);
    at::NoGradGuard no_grad;
    for (int step = 0; step < 2; ++step) {
      const at::Tensor loss = stage->step(stage->is_first() ? Batch(x) : no_input(), {}, never);
      CATCH_CHECK(!loss.defined());
      if (stage->is_last()) {
        CATCH_CHECK(at::allclose(stage->output().tensor(), plain->forward(x), 0, 1e-12));
      }
    }
    return;
  }
  const std::string schedule = GENERATE(as<std::string>(), "gpipe", "1f1b", "zb", "interleaved");
  CATCH_INFO("schedule " << schedule);
  check_ranks_pass(kInference, "inference_" + schedule, {{"GPIPE_TEST_SCHEDULE", schedule}});
}

constexpr const char* kEvaluate =
    "evaluate gives every stage the last stage's output and loss of the plain model";

CATCH_TEST_CASE(kEvaluate, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    PipelineStage stage = two_stages(std::getenv("GPIPE_TEST_SCHEDULE"));
    nn::Sequential plain = make_model();
    auto [x, y] = batch(0);
    stage->eval();
    // With a target (on every rank: only the last stage's counts), and without.
    const auto with = stage->evaluate(stage->is_first() ? Batch(x) : no_input(), y, mse);
    const at::Tensor expected = plain->forward(x);
    CATCH_CHECK(at::allclose(with.output.tensor(), expected, 0, 1e-12));
    CATCH_REQUIRE(with.loss.defined());
    CATCH_CHECK(std::abs(with.loss.item<double>() -
                         nn::functional::mse_loss(expected, y).item<double>()) < 1e-12);
    const auto without = stage->evaluate(stage->is_first() ? Batch(x) : no_input(), {}, mse);
    CATCH_CHECK(at::allclose(without.output.tensor(), expected, 0, 1e-12));
    CATCH_CHECK(!without.loss.defined());
    return;
  }
  // (zbv: stage 0 holds the last partition and broadcasts its output and loss.)
  const std::string schedule = GENERATE(as<std::string>(), "gpipe", "interleaved", "zbv");
  CATCH_INFO("schedule " << schedule);
  check_ranks_pass(kEvaluate, "evaluate_" + schedule, {{"GPIPE_TEST_SCHEDULE", schedule}});
}

constexpr const char* kScheduleInOrder =
    "1F1B and zero bubble on a group that matches transfers in posting order as NCCL does train "
    "to the plain model's parameters and losses";

CATCH_TEST_CASE(kScheduleInOrder, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(balance_from_env()).chunks(kChunks)
                    .checkpoint(mode_from_env()));
    return;
  }
  // (schedule, balance, local balance, checkpoint mode): two and three processes, one and two
  // partitions per stage, each mode.
  using Run = std::tuple<std::string, std::vector<int64_t>, std::string, std::string>;
  const Run run = GENERATE(Run{"1f1b", {3, 3}, "2,1;2,1", "always"},
                           Run{"1f1b", {3, 1, 2}, "", "never"},
                           Run{"zb", {3, 3}, "", "except_last"},
                           Run{"zb", {3, 1, 2}, "", "always"});
  const auto& [schedule, balance, local, mode] = run;
  const std::string spec = balance_spec(balance);
  CATCH_INFO("schedule " << schedule << ", balance " << spec << ", local '" << local
                         << "', checkpoint " << mode);
  std::map<std::string, std::string> env{{"GPIPE_TEST_IN_ORDER", "1"},
                                         {"GPIPE_TEST_SCHEDULE", schedule},
                                         {"GPIPE_TEST_BALANCE", spec},
                                         {"GPIPE_TEST_CHECKPOINT", mode}};
  if (!local.empty()) env["GPIPE_TEST_LOCAL"] = local;
  const std::string folder =
      folder_for("in_order_" + schedule + "_" + std::to_string(balance.size()));
  check_stages(kScheduleInOrder, folder, env, /*loss_tolerance=*/1e-12, /*frozen=*/"", balance);
}

constexpr const char* kInterleaved =
    "two three and four processes train with the interleaved schedule to the plain model's "
    "parameters and losses and keep each virtual stage's micro-batches in flight";

CATCH_TEST_CASE(kInterleaved, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    train_stage(options_with_chunks_from_env().schedule(PipelineSchedule::interleaved(2)),
                /*record_timeline=*/true);
    return;
  }
  // (balance of the virtual stages, chunks, checkpoint mode, micro-batch group). The skip stays
  // in virtual stage 1; the tuple crosses from it to virtual stage 2 (with two processes: from
  // the last stage back to the first). The last run groups 4 micro-batches per virtual stage
  // (Note [Micro-batch groups]). The links: shared memory, or (second run) shared memory with
  // the activations over Gloo (their records larger than 4 KiB) and the gradients in the rings,
  // or (third run) Gloo alone.
  using Run = std::tuple<std::vector<int64_t>, int64_t, std::string, int64_t, std::string>;
  const Run run = GENERATE(Run{{1, 2, 2, 1}, 4, "always", 0, "shared"},
                           Run{{1, 2, 1, 1, 1, 1}, 3, "except_last", 0, "mixed"},
                           Run{{1, 2, 1, 1, 1, 1, 1, 1}, 4, "never", 0, "gloo"},
                           Run{{1, 2, 2, 1}, 4, "except_last", 4, "shared"});
  const auto& [balance, chunks, mode, group, links] = run;
  const std::string spec = balance_spec(balance);
  CATCH_INFO("balance " << spec << ", chunks " << chunks << ", checkpoint " << mode
                        << ", micro-batch group " << group << ", links " << links);
  const std::string folder = folder_for("interleaved_" + std::to_string(balance.size() / 2) +
                                        (group > 0 ? "_group" : ""));
  std::map<std::string, std::string> env{
      {"GPIPE_TEST_SCHEDULE", "interleaved"}, {"GPIPE_TEST_BALANCE", spec},
      {"GPIPE_TEST_CHUNKS", std::to_string(chunks)}, {"GPIPE_TEST_CHECKPOINT", mode},
      {"GPIPE_TEST_GROUP", std::to_string(group)}};
  if (links == "mixed") env["GPIPE_TEST_SHARED_LIMIT"] = "4096";
  if (links == "gloo") env["GPIPE_TEST_SHARED_MEMORY"] = "0";
  check_stages(kInterleaved, folder, env, /*loss_tolerance=*/1e-12, /*frozen=*/"", balance,
               /*virtual_stages=*/2);
}

constexpr const char* kInterleavedZeroBubble =
    "two and three processes train with interleaved zero bubble (zb1p) to the plain model's "
    "parameters and losses within its in-flight bound";

CATCH_TEST_CASE(kInterleavedZeroBubble, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    train_stage(
        options_with_chunks_from_env().schedule(PipelineSchedule::interleaved_zero_bubble(2)),
        /*record_timeline=*/true);
    return;
  }
  // (balance of the virtual stages, chunks, checkpoint mode, links), as kInterleaved's.
  using Run = std::tuple<std::vector<int64_t>, int64_t, std::string, std::string>;
  const Run run = GENERATE(Run{{1, 2, 2, 1}, 4, "except_last", "shared"},
                           Run{{1, 2, 1, 1, 1, 1}, 3, "never", "gloo"});
  const auto& [balance, chunks, mode, links] = run;
  const std::string spec = balance_spec(balance);
  CATCH_INFO("balance " << spec << ", chunks " << chunks << ", checkpoint " << mode << ", links "
                        << links);
  std::map<std::string, std::string> env{{"GPIPE_TEST_SCHEDULE", "zb1p"},
                                         {"GPIPE_TEST_BALANCE", spec},
                                         {"GPIPE_TEST_CHUNKS", std::to_string(chunks)},
                                         {"GPIPE_TEST_CHECKPOINT", mode}};
  if (links == "gloo") env["GPIPE_TEST_SHARED_MEMORY"] = "0";
  check_stages(kInterleavedZeroBubble, folder_for("zb1p_" + std::to_string(balance.size() / 2)),
               env, /*loss_tolerance=*/1e-12, /*frozen=*/"", balance, /*virtual_stages=*/2);
}

constexpr const char* kVShaped =
    "two and three processes train with the V-shaped schedules zbv and dualpipev to the plain "
    "model's parameters and losses in the schedule's order within its in-flight bound";

CATCH_TEST_CASE(kVShaped, "[distributed][stage][schedule]") {
  if (test_rank() >= 0) {
    // The kind comes from GPIPE_TEST_SCHEDULE; a V-shaped kind has two virtual stages.
    train_stage(options_with_chunks_from_env(),
                /*record_timeline=*/true);
    return;
  }
  // (schedule, balance of the virtual stages, chunks, checkpoint mode, links). Stage r holds
  // virtual stages r and 2n - 1 - r; the skip stays in virtual stage 1, and the tuple crosses
  // from it to virtual stage 2: with two processes on stage 1, the V's turn, where the two are
  // joined in the process; with three, from stage 1 to stage 2. Chunks 3 split the 8 samples
  // unevenly (3, 3, 2); dualpipev with m >= 2n - 1 runs DeepSeek's steps (the first and third
  // dualpipev runs), with fewer zbv's order (the last).
  using Run = std::tuple<std::string, std::vector<int64_t>, int64_t, std::string, std::string>;
  const Run run = GENERATE(Run{"zbv", {1, 2, 2, 1}, 4, "except_last", "shared"},
                           Run{"zbv", {1, 2, 1, 1, 1, 1}, 3, "never", "gloo"},
                           Run{"dualpipev", {1, 2, 2, 1}, 3, "never", "shared"},
                           Run{"dualpipev", {1, 2, 1, 1, 1, 1}, 8, "always", "shared"},
                           Run{"dualpipev", {1, 2, 1, 1, 1, 1}, 3, "except_last", "gloo"});
  const auto& [schedule, balance, chunks, mode, links] = run;
  const std::string spec = balance_spec(balance);
  CATCH_INFO("schedule " << schedule << ", balance " << spec << ", chunks " << chunks
                         << ", checkpoint " << mode << ", links " << links);
  std::map<std::string, std::string> env{{"GPIPE_TEST_SCHEDULE", schedule},
                                         {"GPIPE_TEST_BALANCE", spec},
                                         {"GPIPE_TEST_CHUNKS", std::to_string(chunks)},
                                         {"GPIPE_TEST_CHECKPOINT", mode}};
  if (links == "gloo") env["GPIPE_TEST_SHARED_MEMORY"] = "0";
  check_stages(kVShaped,
               folder_for(schedule + "_" + std::to_string(balance.size() / 2) + "_" + mode), env,
               /*loss_tolerance=*/1e-12, /*frozen=*/"", balance, /*virtual_stages=*/2,
               /*v_shape=*/true);
}

constexpr const char* kInterleavedCuda =
    "two processes on the GPU train with the interleaved schedule to the plain model's parameters "
    "and losses";

CATCH_TEST_CASE(kInterleavedCuda, "[distributed][stage][schedule][cuda]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(balance_from_env())
                    .chunks(4)
                    .checkpoint(mode_from_env())
                    .schedule(PipelineSchedule::interleaved(2)), /*record_timeline=*/true);
    return;
  }
  // Both processes on cuda:0, each with two virtual stages on it (Gloo carries the tensors
  // through the CPU); the skip stays in virtual stage 1, the tuple crosses to virtual stage 2.
  const std::string mode = GENERATE(as<std::string>(), "always", "except_last");
  CATCH_INFO("checkpoint " << mode);
  const std::vector<int64_t> balance{1, 2, 2, 1};
  check_stages(kInterleavedCuda, folder_for("interleaved_cuda_" + mode),
               {{"GPIPE_TEST_SCHEDULE", "interleaved"}, {"GPIPE_TEST_BALANCE", "1,2,2,1"},
                {"GPIPE_TEST_CHECKPOINT", mode}, {"GPIPE_TEST_DEVICE", "cuda:0"}},
               /*loss_tolerance=*/1e-10, /*frozen=*/"", balance, /*virtual_stages=*/2);
}

constexpr const char* kInterleavedRefused =
    "interleaving across processes refuses what it cannot run naming the option";

CATCH_TEST_CASE(kInterleavedRefused, "[distributed][stage][schedule][errors]") {
  if (test_rank() >= 0) {
    ProcessGroup gloo = join();
    const auto options = [] {
      return PipelineStageOptions({1, 2, 2, 1})
          .chunks(4)
          .schedule(PipelineSchedule::interleaved(2));
    };
    // On a group that matches in posting order (NCCL's way).
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), options(),
                      c10::make_intrusive<gpipe_test::InOrderGroup>(gloo)),
        gpipe_test::contains("needs a group that matches transfers by tag"));
    CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), options().chunks(3), gloo),
                            gpipe_test::contains("chunks to be a multiple of the number of "
                                                 "stages (2), got 3"));
    CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), options().local_balance({1, 1}), gloo),
                            gpipe_test::contains("local_balance and several devices cannot split"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), options().balance({3, 3}), gloo),
        gpipe_test::contains("the balance has 2 entries ({3, 3}) but the process group has 2 "
                             "ranks of 2 virtual stages each"));
    // The V-shaped kinds: the same refusals, naming the kind.
    const auto v_shaped = [&options](ScheduleKind kind) { return options().schedule(kind); };
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), v_shaped(ScheduleKind::kZeroBubbleV),
                      c10::make_intrusive<gpipe_test::InOrderGroup>(gloo)),
        gpipe_test::contains("the V-shaped zbv schedule across processes needs a group that "
                             "matches transfers by tag"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), v_shaped(ScheduleKind::kDualPipeV).local_balance({1, 1}), gloo),
        gpipe_test::contains("with the V-shaped dualpipev schedule each of a stage's virtual "
                             "stages is a partition of its own"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), v_shaped(ScheduleKind::kZeroBubbleV).balance({3, 3}), gloo),
        gpipe_test::contains("the balance has 2 entries ({3, 3}) but the process group has 2 "
                             "ranks of 2 virtual stages each"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), options().schedule(ScheduleKind::k1F1B), gloo),
        gpipe_test::contains("virtual_stages is 2 but the schedule is 1f1b"));
    CATCH_CHECK_THROWS_WITH(PipelineStage(make_model(), options().schedule(PipelineSchedule::of(
        ScheduleKind::kInterleaved,
        0)),
                                          gloo),
                            gpipe_test::contains("virtual_stages must be between 1 and 64, got 0"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), options().schedule(PipelineSchedule::interleaved(2, 1)), gloo),
        gpipe_test::contains("microbatch_group is 1; it must be at least the number of ranks (2: "
                             "4 partitions, 2 virtual stages per rank) and divide chunks (4), or "
                             "be 0 for 2"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), options().schedule(PipelineSchedule::interleaved(2, 3)), gloo),
        gpipe_test::contains("microbatch_group is 3; it must be at least"));
    // A group need not be a multiple of the stages: 3 of 2 stages, chunks 3.
    CATCH_CHECK_NOTHROW(
        PipelineStage(make_model(),
                      options().schedule(PipelineSchedule::interleaved(2, 3)).chunks(3), gloo));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(),
                      options().schedule(PipelineSchedule::of(ScheduleKind::kInterleaved, 2, -2)),
                      gloo),
        gpipe_test::contains("microbatch_group must be 0 (the number of ranks) or more, got -2"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(),
                      options().schedule(PipelineSchedule::text("0F0 0B0\n1F0 1B0\n")), gloo),
        gpipe_test::contains("a schedule written as text is for gpipe::GPipe"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(),
                      options().balance({3, 3})
                          .schedule(PipelineSchedule::of(ScheduleKind::k1F1B, 1, 2)),
                      gloo),
        gpipe_test::contains("microbatch_group is 2 but the schedule is 1f1b"));
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), options().balance({1, 1, 2, 2}), gloo),
        gpipe_test::contains("is stashed in one virtual stage and popped in another"));
    // A mini-batch of 6 samples makes 3 micro-batches of chunks 4: stage 0 refuses the step, and
    // stage 1 hears it (Note [Failing fast across processes]).
    PipelineStage stage(make_model(), options(), gloo);
    auto [x, y] = batch(0);
    const char* odd = "the mini-batch of 6 samples splits into 3 micro-batches (chunks 4)";
    const std::string done = gpipe_test::test_folder() + "/heard";
    if (stage->is_first()) {
      CATCH_CHECK_THROWS_WITH(stage->step(Batch(x.slice(0, 0, 6)), {}, mse),
                              gpipe_test::contains(odd));
      // Alive until stage 1 has heard.
      for (int k = 0; k < 3000 && !std::filesystem::exists(done); ++k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } else {
      CATCH_CHECK_THROWS_WITH(
          stage->step(no_input(), y.slice(0, 0, 6), mse),
          gpipe_test::contains("stage 0 of 2 failed: ") && gpipe_test::contains(odd));
      std::ofstream{done};
    }
    return;
  }
  check_ranks_pass(kInterleavedRefused, "interleaved_refused");
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
