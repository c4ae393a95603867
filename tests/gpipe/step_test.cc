// GPipe::step: every schedule, run by the executor, trains as the plain Sequential does — several
// optimizer steps, every checkpoint mode, skips across partitions, BatchNorm, tuple batches,
// dropout and uneven micro-batches — and keeps in flight what its schedule says.
#include "tests/gpipe/test_util.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <map>
#include <thread>

#include <ATen/Parallel.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/cuda.h>
#include <torch/optim/sgd.h>

#include "benchmarks/memory_meter.h"
#include "gpipe/clip_grad.h"
#include "gpipe/internal/executor.h"
#include "gpipe/internal/link.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_search.h"
#include "gpipe/worker.h"
#include "gpipe/schedule_text.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

// Stashes tanh(x) under "a" and passes x on.
struct StashImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    stash("a", at::tanh(x));
    return x;
  }
};
TORCH_MODULE(Stash);

// Adds what was stashed under "a".
struct PopImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x + pop("a"); }
};
TORCH_MODULE(Pop);

// Throws in training forwards once armed.
struct FailingImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    TORCH_CHECK(!armed, "failing layer: armed");
    return x;
  }
  bool armed = false;
};
TORCH_MODULE(Failing);

// 8 layers with a skip from layer 1 to layer 5 (across partitions for every balance below) and a
// BatchNorm (training mode: each micro-batch normalised with its own statistics).
nn::Sequential skip_model() {
  return nn::Sequential(nn::Linear(5, 6), skippable(Stash(), SkippableOptions().stash({"a"})),
                        nn::Tanh(), nn::Linear(6, 6), nn::BatchNorm1d(6),
                        skippable(Pop(), SkippableOptions().pop({"a"})), nn::ReLU(),
                        nn::Linear(6, 3));
}

// Tuple batches: {x, b} through Mix layers, then the first tensor.
struct FirstImpl : nn::Module {
  std::vector<at::Tensor> forward(std::vector<at::Tensor> x) { return {x[0]}; }
};
TORCH_MODULE(First);

nn::Sequential tuple_model() {
  return nn::Sequential(Mix(5, 3, 6), Mix(6, 3, 6), Mix(6, 3, 6), Mix(6, 3, 6), Mix(6, 3, 6),
                        Mix(6, 3, 6), Mix(6, 3, 3), First());
}

std::vector<int64_t> balance_of(int64_t partitions) {
  switch (partitions) {
    case 2: return {4, 4};
    case 3: return {2, 3, 3};
    default: return {2, 2, 2, 2};
  }
}

at::Tensor mse(const Batch& out, const at::Tensor& target) {
  return (out[0] - target).pow(2).mean();
}

// The oracle's step: the plain model on each micro-batch (as scatter splits it), its loss
// weighted by the micro-batch's share of the samples (Note [Losses over micro-batches]), or with
// `whole` (the GPipe schedule) the loss of the outputs put together.
double plain_step(nn::Sequential& plain, const Batch& x, const at::Tensor& y, int64_t chunks,
                  bool whole = false) {
  const std::vector<Batch> parts = scatter(x, chunks);
  std::vector<at::Tensor> outs;
  double total = 0;
  int64_t row = 0;
  for (const Batch& part : parts) {
    const int64_t rows = part[0].size(0);
    at::Tensor out = part.atomic() ? plain->forward(part.tensor())
                                   : plain->forward<std::vector<at::Tensor>>(part.values())[0];
    outs.push_back(out);
    if (whole) continue;
    at::Tensor loss = mse(Batch(out), y.narrow(0, row, rows)) *
                      (static_cast<double>(rows) / static_cast<double>(y.size(0)));
    loss.backward();
    total += loss.item<double>();
    row += rows;
  }
  if (whole) {
    at::Tensor loss = mse(Batch(at::cat(outs)), y);
    loss.backward();
    total = loss.item<double>();
  }
  return total;
}

std::unique_ptr<torch::optim::Optimizer> optimizer(const std::string& kind,
                                                   std::vector<at::Tensor> params) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(params,
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// Stages per rank for `kind` over `partitions` partitions in these tests: 2 for the interleaved
// schedules (3 over 3 partitions); zbv and dualpipev always have 2.
int64_t stages_per_rank(const std::string& kind, int64_t partitions) {
  if (kind != "interleaved" && kind != "zb1p") return 1;
  return partitions == 3 ? 3 : 2;
}

// One intra-op thread for the plain model and the partitions alike while it lives: LibTorch's
// reductions sum in an order that depends on the thread count, and with two threads for the
// plain model and one per partition the float64 gradients came out 1.2-1.8e-10 apart (LibTorch
// 2.6, 2 cores; passing with OMP_NUM_THREADS=1), after Adam 1e-9.
struct OneIntraOpThread {
  int before = at::get_num_threads();
  OneIntraOpThread() { at::set_num_threads(1); }
  ~OneIntraOpThread() { at::set_num_threads(before); }
};

CATCH_TEST_CASE("Every schedule trains as the plain Sequential: four optimizer steps equal",
                "[gpipe][step][transparency]") {
  const OneIntraOpThread one_thread;
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const int64_t partitions = GENERATE(2, 3, 4);
  const std::string opt = GENERATE("sgd", "adam");
  const bool tuple = GENERATE(false, true);
  CATCH_CAPTURE(kind, static_cast<int>(mode), partitions, opt, tuple);
  if ((kind == "zbv" || kind == "dualpipev") && partitions % 2 != 0) return;  // two per rank
  auto make = [tuple] { return tuple ? tuple_model() : skip_model(); };
  nn::Sequential plain = build(make, 3);
  const int64_t v = stages_per_rank(kind, partitions);
  const int64_t chunks = 4;
  GPipe model(build(make, 3), GPipeOptions(balance_of(partitions))
                                  .devices(std::vector<c10::Device>(partitions, at::kCPU))
                                  .chunks(chunks)
                                  .checkpoint(mode)
                                  .schedule(PipelineSchedule::of(schedule_kind(kind), v)));
  auto plain_opt = optimizer(opt, plain->parameters());
  auto pipe_opt = optimizer(opt, model->parameters());
  for (int step = 0; step < 4; ++step) {
    at::manual_seed(100 + step);
    // 11 samples in 4 micro-batches: 3, 3, 3, 2.
    const at::Tensor x = at::randn({11, 5}, at::kDouble);
    const Batch input = tuple ? Batch({x, at::randn({11, 3}, at::kDouble)}) : Batch(x);
    const at::Tensor y = at::randn({11, 3}, at::kDouble);
    plain_opt->zero_grad();
    pipe_opt->zero_grad();
    const double expected = plain_step(plain, input, y, chunks, kind == "gpipe");
    const at::Tensor loss = model->step(input, y, mse);
    CATCH_CHECK(loss.item<double>() == gpipe_test::Approx(expected).epsilon(1e-12));
    CATCH_CHECK(!loss.requires_grad());
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    plain_opt->step();
    pipe_opt->step();
  }
  check_same(plain->parameters(), model->parameters(), 1e-10);
  check_same(running_stats(*plain), running_stats(*model), 1e-10);
}

CATCH_TEST_CASE("Interleaved with a micro-batch group of 4 trains as the plain Sequential",
                "[gpipe][step][transparency]") {
  const Checkpoint mode = GENERATE(Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(static_cast<int>(mode));
  nn::Sequential plain = build(skip_model, 3);
  const int64_t chunks = 8;
  GPipe model(build(skip_model, 3), GPipeOptions(balance_of(4))
                                        .devices(std::vector<c10::Device>(4, at::kCPU))
                                        .chunks(chunks)
                                        .checkpoint(mode)
                                        .schedule(PipelineSchedule::of(ScheduleKind::kInterleaved,
                                                                       2, 4)));
  CATCH_CHECK(schedule_text(model->schedule(chunks)) ==
              schedule_text(interleaved_schedule(2, chunks, 2, 4)));
  auto plain_opt = optimizer("sgd", plain->parameters());
  auto pipe_opt = optimizer("sgd", model->parameters());
  for (int step = 0; step < 4; ++step) {
    at::manual_seed(300 + step);
    const at::Tensor x = at::randn({16, 5}, at::kDouble);
    const at::Tensor y = at::randn({16, 3}, at::kDouble);
    plain_opt->zero_grad();
    pipe_opt->zero_grad();
    const double expected = plain_step(plain, Batch(x), y, chunks, /*whole=*/false);
    CATCH_CHECK(model->step(x, y, mse).item<double>() ==
                gpipe_test::Approx(expected).epsilon(1e-12));
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    plain_opt->step();
    pipe_opt->step();
  }
  check_same(plain->parameters(), model->parameters(), 1e-10);
  // What it refuses, naming the option.
  const auto options = [](PipelineSchedule schedule) {
    return GPipeOptions(balance_of(4)).devices(std::vector<c10::Device>(4, at::kCPU)).chunks(8)
        .schedule(std::move(schedule));
  };
  CATCH_CHECK_THROWS_WITH(GPipe(build(skip_model, 3), options(PipelineSchedule::interleaved(2, 3))),
                          gpipe_test::contains("gpipe::GPipe: microbatch_group is 3; it must be "
                                               "at least the number of ranks (2: 4 partitions, 2 "
                                               "virtual stages per rank) and divide chunks (8), "
                                               "or be 0 for 2"));
  CATCH_CHECK_THROWS_WITH(GPipe(build(skip_model, 3), options(PipelineSchedule::interleaved(1, 4))),
                          gpipe_test::contains("gpipe::GPipe: microbatch_group is 4 but the "
                                               "schedule is interleaved with 1 virtual stage; "
                                               "micro-batch groups are for the interleaved "
                                               "schedule with 2 or more virtual stages"));
  CATCH_CHECK_THROWS_WITH(PipelineSchedule::interleaved(2, -1),
                          gpipe_test::contains("PipelineSchedule::interleaved: microbatch_group "
                                               "must be 0 (the number of ranks) or more, got -1"));
  CATCH_CHECK_THROWS_WITH(PipelineSchedule::interleaved(0),
                          gpipe_test::contains("PipelineSchedule::interleaved: virtual_stages "
                                               "must be at least 1, got 0"));
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 3), options(PipelineSchedule::of(ScheduleKind::k1F1B, 1, 4))),
      gpipe_test::contains("gpipe::GPipe: microbatch_group is 4 but the schedule is 1f1b"));
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 3), options(PipelineSchedule::of(ScheduleKind::k1F1B, 2))),
      gpipe_test::contains("gpipe::GPipe: virtual_stages is 2 but the schedule is 1f1b; virtual "
                           "stages are for the interleaved schedules: "
                           "PipelineSchedule::interleaved(2)"));
}

// The spellings that schedule() replaced (Note [One schedule option]) stay one release; each sets
// one field of the schedule, in whatever order with schedule(kind).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
CATCH_TEST_CASE("the deprecated schedule options set one field of the schedule each, in any order",
                "[gpipe][step][schedule]") {
  const auto cpus = std::vector<c10::Device>(4, at::kCPU);
  GPipe before(build(skip_model, 3), GPipeOptions(balance_of(4)).devices(cpus).chunks(8)
                                         .virtual_stages(2).microbatch_group(4)
                                         .schedule(ScheduleKind::kInterleaved));
  GPipe after(build(skip_model, 3), GPipeOptions(balance_of(4)).devices(cpus).chunks(8)
                                        .schedule(ScheduleKind::kInterleaved)
                                        .microbatch_group(4).virtual_stages(2));
  const std::string expected = schedule_text(interleaved_schedule(2, 8, 2, 4));
  CATCH_CHECK(schedule_text(before->schedule(8)) == expected);
  CATCH_CHECK(schedule_text(after->schedule(8)) == expected);
  const std::string text = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n";
  GPipe written(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(2)
                                          .schedule_text(text));
  CATCH_CHECK(schedule_text(written->schedule(2)) == schedule_text(parse_schedule(text)));
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(2)
                                      .schedule_text(text).microbatch_group(4)),
      gpipe_test::contains("gpipe::GPipe: the schedule is written as text, which sets its own "
                           "order, but virtual_stages is 1 and microbatch_group 4"));
  // record_timeline as an option: the model starts recording.
  GPipe recording(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU})
                                            .chunks(2).record_timeline(true));
  CATCH_CHECK(recording->is_recording_timeline());
  CATCH_CHECK(!written->is_recording_timeline());
  recording->forward(at::randn({4, 5}, at::kDouble));
  CATCH_CHECK(recording->last_timeline().size() >= 4);  // 2 micro-batches x 2 partitions at least
  // worker_per_partition overrides forward()'s thread decision (Note [Threads of forward()]).
  const GPipeOptions two = GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU});
  CATCH_CHECK(GPipe(build(skip_model, 8), two)->partitions_on_own_threads());
  CATCH_CHECK_FALSE(GPipe(build(skip_model, 8), GPipeOptions(two).worker_per_partition(false))
                        ->partitions_on_own_threads());
  CATCH_CHECK_FALSE(GPipe(build(skip_model, 8), GPipeOptions({8}).devices({at::kCPU}))
                        ->partitions_on_own_threads());
  CATCH_CHECK(GPipe(build(skip_model, 8), GPipeOptions({8}).devices({at::kCPU})
                                              .worker_per_partition(true))
                  ->partitions_on_own_threads());
}
#pragma GCC diagnostic pop

CATCH_TEST_CASE("step's input gradient reaches layers before the GPipe as in the plain model",
                "[gpipe][step]") {
  const std::string kind = GENERATE("gpipe", "1f1b", "zb");
  CATCH_CAPTURE(kind);
  nn::Sequential plain = build(skip_model, 5);
  GPipe model(build(skip_model, 5), GPipeOptions({3, 5}).devices({at::kCPU, at::kCPU}).chunks(3)
                                        .schedule(schedule_kind(kind)));
  at::manual_seed(2);
  const at::Tensor x = at::randn({6, 5}, at::kDouble);
  const at::Tensor y = at::randn({6, 3}, at::kDouble);
  at::Tensor x1 = x.clone().requires_grad_(true);
  at::Tensor x2 = x.clone().requires_grad_(true);
  plain_step(plain, Batch(x1 * 2), y, 3, kind == "gpipe");
  model->step(x2 * 2, y, mse);
  CATCH_CHECK(max_diff(x1.grad(), x2.grad()) <= 1e-10);
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
}

CATCH_TEST_CASE("step with deferred batch norm updates running statistics as the whole batch",
                "[gpipe][step][batchnorm]") {
  const std::string kind = GENERATE("gpipe", "1f1b", "zb");
  CATCH_CAPTURE(kind);
  nn::Sequential plain = build(skip_model, 6);
  GPipe model(build(skip_model, 6), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(3)
                                        .deferred_batch_norm(true)
                                        .schedule(schedule_kind(kind)));
  at::manual_seed(4);
  const at::Tensor x = at::randn({9, 5}, at::kDouble);
  const at::Tensor y = at::randn({9, 3}, at::kDouble);
  model->step(x, y, mse);
  {
    at::NoGradGuard no_grad;
    plain->forward(x);  // training mode: one update from the whole batch
  }
  check_same(running_stats(*plain), running_stats(*model), 1e-10);
}

CATCH_TEST_CASE("step leaves a frozen BatchNorm (eval mode in a training model) alone",
                "[gpipe][step][batchnorm]") {
  const std::string kind = GENERATE("gpipe", "1f1b", "zb");
  const bool deferred = GENERATE(false, true);
  CATCH_CAPTURE(kind, deferred);
  nn::Sequential plain = build(skip_model, 6);
  nn::Sequential seq = build(skip_model, 6);
  GPipe model(seq, GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(3)
                       .deferred_batch_norm(deferred).schedule(schedule_kind(kind)));
  // Fine-tuning: the BatchNorm normalises with its running statistics and keeps them.
  for (nn::Sequential s : {plain, seq}) {
    for (const auto& m : s->modules(/*include_self=*/false)) {
      if (m->as<nn::BatchNorm1d>() != nullptr) m->eval();
    }
  }
  torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD pipe_opt(model->parameters(), torch::optim::SGDOptions(0.1));
  const std::vector<at::Tensor> before = running_stats(*plain);
  for (int step = 0; step < 3; ++step) {
    at::manual_seed(40 + step);
    const at::Tensor x = at::randn({9, 5}, at::kDouble);
    const at::Tensor y = at::randn({9, 3}, at::kDouble);
    plain_opt.zero_grad();
    pipe_opt.zero_grad();
    const double expected = plain_step(plain, Batch(x), y, 3, kind == "gpipe");
    CATCH_CHECK(model->step(x, y, mse).item<double>() ==
                gpipe_test::Approx(expected).epsilon(1e-12));
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    plain_opt.step();
    pipe_opt.step();
  }
  check_same(plain->parameters(), model->parameters(), 1e-10);
  check_same(before, running_stats(*model), 0.0);
}

CATCH_TEST_CASE("steps called from two threads at once run one after the other",
                "[gpipe][step][threads]") {
  // "interleaved_g4": interleaved in micro-batch groups of 4 (Note [Micro-batch groups]); zb1p,
  // zbv and dualpipev: two partitions per worker, as interleaved.
  const std::string kind =
      GENERATE("gpipe", "1f1b", "zb", "interleaved", "interleaved_g4", "zb1p", "zbv", "dualpipev");
  CATCH_CAPTURE(kind);
  const bool interleaved = kind.rfind("interleaved", 0) == 0 || kind == "zb1p";
  const bool two_each = interleaved || kind == "zbv" || kind == "dualpipev";
  const int64_t group = kind == "interleaved_g4" ? 4 : 0;
  const int64_t chunks = interleaved ? 4 : 3;  // interleaved: a multiple of the group (2 or 4)
  nn::Sequential plain = build(skip_model, 6);
  GPipe model(build(skip_model, 6),
              GPipeOptions(two_each ? std::vector<int64_t>{2, 2, 2, 2} : std::vector<int64_t>{4, 4})
                  .devices(std::vector<c10::Device>(two_each ? 4 : 2, at::kCPU))
                  .chunks(chunks)
                  .schedule(PipelineSchedule::of(
                      schedule_kind(kind == "interleaved_g4" ? "interleaved" : kind),
                      two_each ? 2 : 1, group)));
  // Evaluation-mode BatchNorm: the two steps' order does not change what they compute.
  plain->eval();
  model->eval();
  std::vector<at::Tensor> xs, ys;
  for (int t = 0; t < 2; ++t) {
    xs.push_back(at::randn({3 * chunks, 5}, at::kDouble));
    ys.push_back(at::randn({3 * chunks, 3}, at::kDouble));
  }
  double expected[2];
  for (int t = 0; t < 2; ++t) {
    expected[t] = plain_step(plain, Batch(xs[t]), ys[t], chunks, kind == "gpipe");
  }
  double got[2] = {0, 0};
  std::exception_ptr errors[2];
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      try {
        got[t] = model->step(xs[t], ys[t], mse).item<double>();
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (int t = 0; t < 2; ++t) CATCH_CHECK(got[t] == gpipe_test::Approx(expected[t]).epsilon(1e-12));
  // Both steps' gradients, accumulated.
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
}

// The most bytes of CPU tensors alive during a step of `model`, beyond those alive before it
// (counted by the allocator: Note [Counting CPU memory] in benchmarks/memory_meter.h). The first
// step, which makes the gradients, is not measured.
int64_t bytes_held_by_step(GPipe& model, const at::Tensor& x, const at::Tensor& y) {
  gpipe_benchmarks::MemoryMeter& meter = gpipe_benchmarks::MemoryMeter::install();
  model->step(x, y, mse);
  const int64_t before = meter.current();
  meter.reset_peak();
  model->step(x, y, mse);
  return meter.peak() - before;
}

CATCH_TEST_CASE("The bytes a step holds are what each schedule promises",
                "[gpipe][step][memory]") {
  // Each partition keeps a micro-batch's activations from its forward to its backward (or W):
  // GPipe all m at once, the others what their schedules keep in flight. Measured in bytes, so
  // an activation that outlives its backward (a release removed) shows.
  const std::string kind = GENERATE("1f1b", "zb", "interleaved", "zbv", "zb1p", "dualpipev");
  CATCH_CAPTURE(kind);
  const int64_t m = 8;
  const int64_t v = kind == "interleaved" || kind == "zb1p" || kind == "zbv" || kind == "dualpipev"
                        ? 2
                        : 1;
  const int64_t parts = 4 * v;
  auto make = [] {
    nn::Sequential seq;
    for (int k = 0; k < 8; ++k) {
      seq->push_back(nn::Linear(64, 64));
      seq->push_back(nn::Tanh());
    }
    return seq;
  };
  auto options = [&](ScheduleKind schedule, int64_t stages) {
    return GPipeOptions(std::vector<int64_t>(parts, 16 / parts))
        .devices(std::vector<c10::Device>(parts, at::kCPU))
        .chunks(m)
        .checkpoint(Checkpoint::kNever)
        .schedule(PipelineSchedule::of(schedule, stages));
  };
  const at::Tensor x = at::randn({m * 256, 64}, at::kDouble);
  const at::Tensor y = at::randn({m * 256, 64}, at::kDouble);
  GPipe all_at_once(build(make, 1), options(ScheduleKind::kGPipe, 1));
  GPipe model(build(make, 1), options(schedule_kind(kind), v));
  const int64_t gpipe_bytes = bytes_held_by_step(all_at_once, x, y);
  const int64_t bytes = bytes_held_by_step(model, x, y);
  // GPipe holds m micro-batches on every partition: a micro-batch-partition's bytes, from it.
  const double unit = static_cast<double>(gpipe_bytes) / static_cast<double>(m * parts);
  const ScheduleSimulation ideal = simulate_schedule(model->schedule(m));
  int64_t promised = 0;
  for (int64_t p = 0; p < parts; ++p) promised += ideal.stage_peak_in_flight[p];
  // Zero bubble keeps more of a micro-batch from I to W: the gradients at each layer's output,
  // which W starts from (Note [One executor] in executor.h).
  const bool split = kind == "zb" || kind == "zbv" || kind == "zb1p" || kind == "dualpipev";
  const double kept_gradients = split ? 4.0 * 256 * 64 * sizeof(double) / v : 0.0;
  CATCH_CAPTURE(gpipe_bytes, bytes, unit, promised, kept_gradients);
  // Every partition's peak at once bounds the step's, and a third more for what is not a
  // partition's (the loss's leaves of every micro-batch, gradients on their way). Measured on the
  // 2-core machine: 1F1B 1.09 of that bound without the third, interleaved 0.71, zero bubble 0.9.
  CATCH_CHECK(static_cast<double>(bytes) <=
              1.35 * (unit + kept_gradients) * static_cast<double>(promised));
  if (!split) {
    CATCH_CHECK(static_cast<double>(bytes) <= 0.6 * static_cast<double>(gpipe_bytes));
  }
  if (kind == "dualpipev") {
    // The same V as zbv, one stage-micro-batch more in flight per rank (9 against 8 here):
    // its whole backwards must release what they hold (measured: 11.4 MB against zbv's 11.9;
    // 23.8 MB when a whole backward kept its layer outputs to the end of the step).
    GPipe zbv(build(make, 1), options(ScheduleKind::kZeroBubbleV, 2));
    CATCH_CHECK(static_cast<double>(bytes) <=
                1.3 * static_cast<double>(bytes_held_by_step(zbv, x, y)));
  }
}

CATCH_TEST_CASE("step runs a schedule given as text, checked at construction",
                "[gpipe][step][schedule]") {
  nn::Sequential plain = build(skip_model, 8);
  const std::string text = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n";
  GPipe model(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(2)
                                        .schedule(PipelineSchedule::text(text)));
  at::manual_seed(9);
  const at::Tensor x = at::randn({4, 5}, at::kDouble);
  const at::Tensor y = at::randn({4, 3}, at::kDouble);
  const double expected = plain_step(plain, Batch(x), y, 2);
  CATCH_CHECK(model->step(x, y, mse).item<double>() == gpipe_test::Approx(expected).epsilon(1e-12));
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
  CATCH_CHECK(schedule_text(model->schedule(2)) == schedule_text(parse_schedule(text)));

  // 0B0 waits for 1B0, which waits for 1F1, which waits for 0F1, behind 0B0: refused.
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(2)
                                      .schedule(PipelineSchedule::text(
                                          "0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1\n"))),
      gpipe_test::contains("deadlock"));
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(3)
                                      .schedule(PipelineSchedule::text(text))),
      gpipe_test::contains("2 micro-batches but chunks is 3"));
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 8), GPipeOptions({2, 3, 3}).devices({at::kCPU, at::kCPU, at::kCPU})
                                      .schedule(PipelineSchedule::of(ScheduleKind::kInterleaved,
                                                                     2))),
      gpipe_test::contains("virtual_stages 2 must divide the number of partitions (3"));
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU})
                                      .schedule(PipelineSchedule::of(ScheduleKind::kGPipe, 2))),
      gpipe_test::contains("virtual stages are for the interleaved schedule"));
  // The V-shaped schedules: two partitions per worker, always.
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(skip_model, 8), GPipeOptions({2, 3, 3}).devices({at::kCPU, at::kCPU, at::kCPU})
                                      .schedule(ScheduleKind::kZeroBubbleV)),
      gpipe_test::contains("the zbv schedule puts two partitions on each rank (r and 2n - 1 - r), "
                           "but there are 3; give an even number"));
  CATCH_CHECK_THROWS_WITH(PipelineSchedule::of(ScheduleKind::kDualPipeV, 3),
                          gpipe_test::contains("the dualpipev schedule always has 2 stages per "
                                               "rank, but virtual_stages is 3; give 1 or 2"));
  CATCH_CHECK_THROWS_WITH(PipelineSchedule::interleaved_zero_bubble(0),
                          gpipe_test::contains("virtual_stages must be at least 1, got 0"));
}

CATCH_TEST_CASE("step runs a searched schedule to the plain model's loss and gradients",
                "[gpipe][step][schedule][search]") {
  // Note [Searching a schedule]: four stages within 1F1B's memory, the search's order run as text
  // (the skip crosses partitions, the batch norm normalises each micro-batch).
  ScheduleSearchOptions options;
  options.stage_costs = std::vector<ActionCosts>(4, ActionCosts{1, 1, 1, 0.3});
  options.max_in_flight = {4, 3, 2, 1};
  const SearchedSchedule found = search_schedule(8, options);
  CATCH_REQUIRE(found.schedule.name == "searched");
  const std::string text = schedule_text(found.schedule);
  nn::Sequential plain = build(skip_model, 8);
  GPipe model(build(skip_model, 8), GPipeOptions(balance_of(4))
                                        .devices(std::vector<c10::Device>(4, at::kCPU))
                                        .chunks(8)
                                        .schedule(PipelineSchedule::text(text)));
  at::manual_seed(9);
  const at::Tensor x = at::randn({16, 5}, at::kDouble);
  const at::Tensor y = at::randn({16, 3}, at::kDouble);
  const double expected = plain_step(plain, Batch(x), y, 8);
  CATCH_CHECK(model->step(x, y, mse).item<double>() == gpipe_test::Approx(expected).epsilon(1e-12));
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
  CATCH_CHECK(schedule_text(model->schedule(8)) == text);
}

CATCH_TEST_CASE("step refuses a target that does not fit and a loss that is not a scalar",
                "[gpipe][step][errors]") {
  GPipe model(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(2)
                                        .schedule(ScheduleKind::k1F1B));
  const at::Tensor x = at::randn({4, 5}, at::kDouble);
  CATCH_CHECK_THROWS_WITH(model->step(x, at::randn({5, 3}, at::kDouble), mse),
                          gpipe_test::contains("the target has 5 rows but the mini-batch has 4"));
  CATCH_CHECK_THROWS_WITH(
      model->step(x, at::randn({4, 3}, at::kDouble),
                  [](const Batch& out, const at::Tensor& t) { return out[0] - t; }),
      gpipe_test::contains("must return a scalar"));
  CATCH_CHECK_THROWS_WITH(model->step(x, at::randn({4, 3}, at::kDouble), nullptr),
                          gpipe_test::contains("loss function is empty"));
  // Still usable.
  CATCH_CHECK(model->step(x, at::randn({4, 3}, at::kDouble), mse).defined());
}

CATCH_TEST_CASE("A layer that throws in any partition fails the step, and the next one works",
                "[gpipe][step][errors]") {
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  const int64_t where = GENERATE(0, 3, 7);  // the failing layer's index: partitions 0, 1, 3
  CATCH_CAPTURE(kind, where);
  nn::Sequential seq;
  for (int64_t k = 0; k < 8; ++k) {
    if (k == where) {
      seq->push_back(Failing());
    } else {
      seq->push_back(nn::Linear(4, 4));
    }
  }
  GPipe model(seq,
              GPipeOptions({2, 2, 2, 2})
                  .devices(std::vector<c10::Device>(4, at::kCPU))
                  .chunks(4)
                  .schedule(PipelineSchedule::of(schedule_kind(kind), stages_per_rank(kind, 4))));
  const at::Tensor x = at::randn({8, 4});
  const at::Tensor y = at::randn({8, 4});
  LossFunction loss = [](const Batch& out, const at::Tensor& t) {
    return (out[0] - t).pow(2).mean();
  };
  seq[where]->as<Failing>()->armed = true;
  within(60, [&] {
    CATCH_CHECK_THROWS_WITH(model->step(x, y, loss), gpipe_test::contains("failing layer: armed"));
  });
  seq[where]->as<Failing>()->armed = false;
  within(60, [&] { CATCH_CHECK(model->step(x, y, loss).defined()); });
}

// Dropout in the first partition only: its lane draws each micro-batch's mask in micro-batch
// order under every schedule, as the plain model does micro-batch by micro-batch. Without
// checkpointing: a checkpointed CPU partition's recomputation sets the one CPU generator back
// while other lanes may draw (Note [Random numbers in concurrent partitions], which GPipe
// warns of; GPUs each have their own generator).
nn::Sequential dropout_model() {
  return nn::Sequential(nn::Linear(5, 8), nn::Dropout(0.5), nn::Tanh(), nn::Linear(8, 8),
                        nn::Tanh(), nn::Linear(8, 3));
}

CATCH_TEST_CASE("Dropout trains under every schedule as in the plain model micro-batch by "
                "micro-batch", "[gpipe][step][transparency]") {
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  const int64_t partitions = GENERATE(2, 4);
  CATCH_CAPTURE(kind, partitions);
  const int64_t v = stages_per_rank(kind, partitions);
  const std::vector<int64_t> balance =
      partitions == 2 ? std::vector<int64_t>{3, 3} : std::vector<int64_t>{3, 1, 1, 1};
  const int64_t chunks = 4;
  nn::Sequential plain = build(dropout_model, 3);
  GPipe model(build(dropout_model, 3),
              GPipeOptions(balance).devices(std::vector<c10::Device>(partitions, at::kCPU))
                  .chunks(chunks).checkpoint(Checkpoint::kNever)
                  .schedule(PipelineSchedule::of(schedule_kind(kind), v)));
  torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD pipe_opt(model->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    at::manual_seed(200 + step);
    const at::Tensor x = at::randn({12, 5}, at::kDouble);
    const at::Tensor y = at::randn({12, 3}, at::kDouble);
    plain_opt.zero_grad();
    pipe_opt.zero_grad();
    at::manual_seed(300 + step);
    const double expected = plain_step(plain, Batch(x), y, chunks, kind == "gpipe");
    at::manual_seed(300 + step);
    const at::Tensor loss = model->step(x, y, mse);
    CATCH_CHECK(loss.item<double>() == gpipe_test::Approx(expected).epsilon(1e-12));
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    if (step == 0) {
      // The masks are really random: other numbers give another loss.
      at::manual_seed(999);
      const double other = model->step(x, y, mse).item<double>();
      CATCH_CHECK(std::abs(other - expected) > 1e-6);
      pipe_opt.zero_grad();
      at::manual_seed(300 + step);
      model->step(x, y, mse);
    }
    plain_opt.step();
    pipe_opt.step();
  }
  check_same(plain->parameters(), model->parameters(), 1e-10);
}

CATCH_TEST_CASE("step under NoGradGuard runs the forwards and returns the loss",
                "[gpipe][step]") {
  const std::string kind = GENERATE("gpipe", "1f1b", "zb");
  nn::Sequential plain = build(skip_model, 8);
  GPipe model(build(skip_model, 8), GPipeOptions({4, 4}).devices({at::kCPU, at::kCPU}).chunks(3)
                                        .schedule(schedule_kind(kind)));
  plain->eval();
  model->eval();
  const at::Tensor x = at::randn({6, 5}, at::kDouble);
  const at::Tensor y = at::randn({6, 3}, at::kDouble);
  at::NoGradGuard no_grad;
  const double expected = mse(Batch(plain->forward(x)), y).item<double>();
  CATCH_CHECK(model->step(x, y, mse).item<double>() == gpipe_test::Approx(expected).epsilon(1e-12));
  for (const at::Tensor& p : model->parameters()) CATCH_CHECK(!p.grad().defined());
}

CATCH_TEST_CASE("step under CPU autocast computes what the plain model computes under autocast",
                "[gpipe][step][autocast]") {
  // interleaved_g4: micro-batch groups of 4 (Note [Micro-batch groups]); zb1p, zbv and dualpipev:
  // two partitions per worker, as interleaved.
  const std::string kind =
      GENERATE("gpipe", "1f1b", "zb", "interleaved", "interleaved_g4", "zb1p", "zbv", "dualpipev");
  CATCH_CAPTURE(kind);
  const bool interleaved =
      kind.rfind("interleaved", 0) == 0 || kind == "zb1p" || kind == "zbv" || kind == "dualpipev";
  auto make = [] {
    at::manual_seed(11);
    return nn::Sequential(nn::Linear(5, 16), nn::ReLU(), nn::Linear(16, 16), nn::Tanh(),
                          nn::Linear(16, 3));
  };
  LossFunction loss = [](const Batch& out, const at::Tensor& y) {
    return (out[0].to(at::kFloat) - y).pow(2).mean();
  };
  nn::Sequential plain = make();
  nn::Sequential exact = make();
  // Interleaved: 2 workers of 2 partitions each, and micro-batches a multiple of the workers.
  const int64_t m = interleaved ? 4 : 3;
  GPipe model(make(), interleaved
                          ? GPipeOptions({1, 1, 1, 2})
                                .devices({at::kCPU, at::kCPU, at::kCPU, at::kCPU})
                                .chunks(m)
                                .schedule(PipelineSchedule::of(
                                    schedule_kind(kind == "interleaved_g4" ? "interleaved" : kind),
                                    2, kind == "interleaved_g4" ? 4 : 0))
                          : GPipeOptions({2, 3})
                                .devices({at::kCPU, at::kCPU})
                                .chunks(m)
                                .schedule(schedule_kind(kind)));
  at::manual_seed(12);
  const at::Tensor x = at::randn({3 * m, 5});
  const at::Tensor y = at::randn({3 * m, 3});
  {
    Autocast autocast(at::kCPU, at::kBFloat16);
    model->step(x, y, loss);
    // The oracle: the plain model on each micro-batch under autocast (one loss for GPipe's), each
    // micro-batch casting the weights anew, so that their gradients are summed in float32 as the
    // pipeline's per-micro-batch backwards sum them (a cached cast would sum them in bfloat16).
    const bool cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    std::vector<at::Tensor> outs;
    for (int64_t i = 0; i < m; ++i) {
      at::Tensor out = plain->forward(x.narrow(0, 3 * i, 3));
      if (kind == "gpipe") {
        outs.push_back(out);
      } else {
        (loss(Batch(out), y.narrow(0, 3 * i, 3)) / static_cast<double>(m)).backward();
      }
    }
    if (kind == "gpipe") loss(Batch(at::cat(outs)), y).backward();
    at::autocast::set_autocast_cache_enabled(cache);
  }
  // Without autocast the gradients differ (bfloat16 rounding): the test sees autocast in lanes.
  loss(Batch(exact->forward(x)), y).backward();
  check_same_grads(plain->parameters(), model->parameters(), 1e-5);
  double far = 0;
  const auto a = exact->parameters();
  const auto b = model->parameters();
  for (size_t k = 0; k < a.size(); ++k) far = std::max(far, max_diff(a[k].grad(), b[k].grad()));
  CATCH_CHECK(far > 1e-4);
}

CATCH_TEST_CASE("Every schedule trains on GPUs as the plain Sequential on the CPU",
                "[gpipe][step][cuda]") {
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  const Checkpoint mode = GENERATE(Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(kind, static_cast<int>(mode));
  // Partitions alternate between two GPUs where there are two (zbv and dualpipev: in a V, rank
  // r's partitions r and 3 - r on one).
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  std::vector<c10::Device> devices;
  for (int64_t j = 0; j < 4; ++j) {
    const int64_t rank = kind == "zbv" || kind == "dualpipev" ? std::min(j, 3 - j) : j;
    devices.emplace_back(at::kCUDA, static_cast<c10::DeviceIndex>(gpus > 1 ? rank % 2 : 0));
  }
  nn::Sequential plain = build(skip_model, 3);
  GPipe model(build(skip_model, 3),
              GPipeOptions({2, 2, 2, 2})
                  .devices(devices)
                  .chunks(4)
                  .checkpoint(mode)
                  .schedule(PipelineSchedule::of(schedule_kind(kind), stages_per_rank(kind, 4))));
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD pipe_sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 2; ++step) {
    at::manual_seed(200 + step);
    const at::Tensor x = at::randn({11, 5}, at::kDouble);
    const at::Tensor y = at::randn({11, 3}, at::kDouble);
    plain_sgd.zero_grad();
    pipe_sgd.zero_grad();
    const double expected = plain_step(plain, Batch(x), y, 4, kind == "gpipe");
    const at::Tensor loss = model->step(x.to(devices.front()), y.to(devices.back()), mse);
    CATCH_CHECK(loss.item<double>() == gpipe_test::Approx(expected).epsilon(1e-10));
    plain_sgd.step();
    pipe_sgd.step();
  }
  std::vector<at::Tensor> on_cpu;
  for (const at::Tensor& p : model->parameters()) on_cpu.push_back(p.cpu());
  check_same(plain->parameters(), on_cpu, 1e-10);
}

CATCH_TEST_CASE("GPipe::step warns of random numbers in its concurrent CPU lanes at its first "
                "checkpointed step only",
                "[gpipe][api]") {
  // step() runs each rank of the schedule on a thread of its own, worker_per_partition or not
  // (Note [Random numbers in concurrent partitions]).
  auto steps = [](nn::Sequential model, GPipeOptions options, int count) {
    GPipe pipe(std::move(model), std::move(options));
    CaptureWarnings capture;
    const at::Tensor x = at::randn({4, 4}, at::kDouble);
    const at::Tensor y = at::randn({4, 2}, at::kDouble);
    for (int k = 0; k < count; ++k) pipe->step(x, y, mse);
    return capture.messages;
  };
  auto with_dropout = [] {
    auto model = nn::Sequential(nn::Linear(4, 6), nn::ReLU(), nn::Dropout(0.5), nn::Linear(6, 2));
    model->to(at::kDouble);
    return model;
  };
  const GPipeOptions two = GPipeOptions({2, 2}).devices({at::kCPU, at::kCPU}).chunks(2);
  const auto warned = steps(with_dropout(), two, 3);
  CATCH_REQUIRE(warned.size() == 1);
  CATCH_CHECK_THAT(warned[0], gpipe_test::contains("GPipe::step: partition 1 holds '2' "
                                                   "(torch::nn::DropoutImpl), which draws random "
                                                   "numbers"));
  CATCH_CHECK(steps(with_dropout(), GPipeOptions(two).checkpoint(Checkpoint::kNever), 2).empty());
  {
    at::NoGradGuard no_grad;  // nothing is checkpointed without grad
    CATCH_CHECK(steps(with_dropout(), two, 2).empty());
  }
  CATCH_CHECK(steps(with_dropout(), GPipeOptions({4}).devices({at::kCPU}).chunks(2), 2).empty());
}


// Records, in each forward, the calling thread's intra-op threads and OpenBLAS's threads.
struct ThreadCountsImpl : nn::Module {
  std::mutex mu;
  std::vector<std::pair<int, int>> seen;
  at::Tensor forward(const at::Tensor& x) {
    std::lock_guard<std::mutex> lock(mu);
    seen.emplace_back(at::get_num_threads(), openblas_threads());
    return x;
  }
  static int openblas_threads() {
    using Get = int (*)();
    auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
    return get != nullptr ? get() : -1;
  }
};
TORCH_MODULE(ThreadCounts);

bool env_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0';
}

// The intra-op threads and OpenBLAS's threads of each of `cpu_lanes` CPU lanes beside `gpu_lanes`
// lanes of GPU partitions, as Note [Dividing the cores] in gpipe/worker.h says: the CPUs of the
// affinity mask less one per GPU lane, divided among the CPU lanes, unless the environment chose.
std::pair<int, int> divided(int cpu_lanes, int gpu_lanes) {
  const int intra = at::get_num_threads();
  const int blas = ThreadCounts::Impl::openblas_threads();
  if (cpu_lanes < 2 && gpu_lanes < 1) return {intra, blas};
  cpu_set_t set;
  CATCH_REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
  const int cpus = std::max(1, CPU_COUNT(&set) - gpu_lanes);
  const bool omp_env = env_set("OMP_NUM_THREADS");
  const bool env = env_set("OPENBLAS_NUM_THREADS") || omp_env;
  CATCH_CAPTURE(intra, blas, omp_env, env, cpus);
  const int lane_intra = intra == at::intraop_default_num_threads() && intra > 1 && !omp_env
                             ? std::max(1, std::min(intra, cpus) / cpu_lanes)
                             : intra;
  const int lane_blas = blas > 1 && !env ? std::max(1, std::min(blas, cpus / cpu_lanes)) : blas;
  return {lane_intra, lane_blas};
}

// Checks that `counts` saw `intra` intra-op and `blas` OpenBLAS threads in each of two forwards,
// and forgets them.
void check_seen(ThreadCounts counts, int intra, int blas) {
  CATCH_REQUIRE(counts->seen.size() == 2);
  for (const auto& [seen_intra, seen_blas] : counts->seen) {
    CATCH_CHECK(seen_intra == intra);
    CATCH_CHECK(seen_blas == blas);
  }
  counts->seen.clear();
}

CATCH_TEST_CASE("A step's CPU lanes share the cores, and a user's thread counts win",
                "[gpipe][step][threads]") {
  // Note [Dividing the cores] in gpipe/worker.h.
  const int intra = at::get_num_threads();
  const int blas = ThreadCounts::Impl::openblas_threads();
  const auto [lane_intra, lane_blas] = divided(2, 0);
  ThreadCounts first, second;
  GPipe model(nn::Sequential(nn::Linear(4, 4), first, nn::Linear(4, 2), second),
              GPipeOptions({2, 2}).devices({at::kCPU, at::kCPU}).chunks(2).checkpoint(
                  Checkpoint::kNever));
  const at::Tensor x = at::randn({4, 4});
  const at::Tensor y = at::randn({4, 2});
  model->step(x, y, mse);
  for (ThreadCounts counts : {first, second}) check_seen(counts, lane_intra, lane_blas);
  // Put back after the step, for the lanes' threads alone: a thread started now gets LibTorch's
  // count.
  CATCH_CHECK(at::get_num_threads() == intra);
  CATCH_CHECK(ThreadCounts::Impl::openblas_threads() == blas);
  int fresh = 0;
  std::thread([&fresh] { fresh = at::get_num_threads(); }).join();
  CATCH_CHECK(fresh == intra);
  // A user's own setting is left alone.
  set_intra_op_threads(2);
  model->step(x, y, mse);
  for (ThreadCounts counts : {first, second}) {
    for (const auto& [seen_intra, seen_blas] : counts->seen) {
      CATCH_CHECK(seen_intra == 2);
      if (blas > 0) CATCH_CHECK(seen_blas == 2);
    }
  }
  at::set_num_threads(intra);
  if (blas > 0) {
    using Set = void (*)(int);
    reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))(blas);
  }
  internal::set_core_share(true);  // forgets the user's setting
}

CATCH_TEST_CASE("A CPU lane beside a lane of GPU partitions leaves one CPU to it, and alone "
                "keeps every core", "[gpipe][step][threads]") {
  // Note [Dividing the cores] in gpipe/worker.h: a GPU's lane must issue its work the moment
  // its input is ready.
  const int intra = at::get_num_threads();
  const int blas = ThreadCounts::Impl::openblas_threads();
  for (const int gpu_lanes : {0, 1, 2}) {
    CATCH_CAPTURE(gpu_lanes);
    const auto [lane_intra, lane_blas] = divided(1, gpu_lanes);
    {
      const internal::CoreShare share(1, gpu_lanes);
      const internal::CoreShare::Lane lane(share);
      CATCH_CHECK(at::get_num_threads() == lane_intra);
      CATCH_CHECK(ThreadCounts::Impl::openblas_threads() == lane_blas);
    }
    CATCH_CHECK(at::get_num_threads() == intra);
    CATCH_CHECK(ThreadCounts::Impl::openblas_threads() == blas);
  }
  // Two CPU lanes and a GPU's: the CPUs less one, halved.
  const auto [lane_intra, lane_blas] = divided(2, 1);
  const internal::CoreShare share(2, 1);
  const internal::CoreShare::Lane lane(share);
  CATCH_CHECK(at::get_num_threads() == lane_intra);
  CATCH_CHECK(ThreadCounts::Impl::openblas_threads() == lane_blas);
}

CATCH_TEST_CASE("A {cpu, cuda:0} step's CPU lane leaves one CPU to the GPU's lane",
                "[gpipe][step][threads][cuda]") {
  const int intra = at::get_num_threads();
  const auto [lane_intra, lane_blas] = divided(1, 1);
  ThreadCounts counts;
  GPipe model(nn::Sequential(nn::Linear(4, 4), counts, nn::Linear(4, 2)),
              GPipeOptions({2, 1}).devices({at::kCPU, at::kCUDA}).chunks(2).checkpoint(
                  Checkpoint::kNever));
  const at::Tensor x = at::randn({4, 4});
  const at::Tensor y = at::randn({4, 2}, at::kCUDA);
  for (const bool through_step : {true, false}) {
    CATCH_CAPTURE(through_step);
    if (through_step) {
      model->step(x, y, mse);
    } else {
      mse(Batch(model->forward(x)), y).backward();
    }
    check_seen(counts, lane_intra, lane_blas);
    CATCH_CHECK(at::get_num_threads() == intra);
  }
}

// Tokens: [sequences, tokens, 5] to logits over 4 classes.
nn::Sequential token_model() {
  return nn::Sequential(nn::Linear(5, 6), nn::Tanh(), nn::Linear(6, 6), nn::Tanh(),
                        nn::Linear(6, 6), nn::Tanh(), nn::Linear(6, 4));
}

// The mean cross-entropy over the targets that are not padding (-1).
at::Tensor token_cross_entropy(const Batch& out, const at::Tensor& y) {
  namespace F = torch::nn::functional;
  return F::cross_entropy(out.tensor().flatten(0, 1), y.flatten(),
                          F::CrossEntropyFuncOptions().ignore_index(-1));
}

// The same mean written by hand: per-token losses times a mask, over the mask's sum. Its
// backward makes NaN of a micro-batch with no tokens (0 / 0) unless the pipeline keeps it out.
at::Tensor masked_mean_cross_entropy(const Batch& out, const at::Tensor& y) {
  namespace F = torch::nn::functional;
  const at::Tensor mask = y.flatten().ne(-1).to(out.tensor().scalar_type());
  const at::Tensor each =
      F::cross_entropy(out.tensor().flatten(0, 1), y.flatten().clamp_min(0),
                       F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (each * mask).sum() / mask.sum();
}

// 12 sequences of 5 tokens, padded with -1 after each one's length: in 4 micro-batches of 3, the
// second is only padding (unless `filled`: then it holds 6 tokens) and the others hold 8, 14 and
// 9 tokens.
at::Tensor padded_targets(int step, bool filled = false) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  at::Tensor y = at::randint(0, 4, {12, 5}, gen, at::kLong);
  const int64_t lengths[12] = {5, 1, 2, 0, 0, 0, 5, 5, 4, 1, 3, 5};
  for (int64_t r = 0; r < 12; ++r) {
    const int64_t length = filled && r >= 3 && r < 6 ? 2 : lengths[r];
    y[r].narrow(0, length, 5 - length).fill_(-1);
  }
  return y;
}

CATCH_TEST_CASE("A token-level loss over padded targets trains as the plain Sequential under "
                "every schedule, also with a micro-batch of padding only",
                "[gpipe][step][loss]") {
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  const Checkpoint mode = GENERATE(Checkpoint::kExceptLast, Checkpoint::kNever);
  const bool by_hand = GENERATE(false, true);  // cross_entropy's ignore_index, or a masked mean
  CATCH_CAPTURE(kind, static_cast<int>(mode), by_hand);
  const LossFunction mean = by_hand ? LossFunction(masked_mean_cross_entropy)
                                    : LossFunction(token_cross_entropy);
  nn::Sequential plain = build(token_model, 5);
  GPipe model(build(token_model, 5),
              GPipeOptions({2, 2, 2, 1})
                  .devices(std::vector<c10::Device>(4, at::kCPU))
                  .chunks(4)
                  .checkpoint(mode)
                  .schedule(PipelineSchedule::of(schedule_kind(kind), stages_per_rank(kind, 4))));
  const Loss loss(mean, count_targets_except(-1));
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD pipe_sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    at::manual_seed(400 + step);
    const at::Tensor x = at::randn({12, 5, 5}, at::kDouble);
    const at::Tensor y = padded_targets(step);
    plain_sgd.zero_grad();
    pipe_sgd.zero_grad();
    const at::Tensor expected = mean(Batch(plain->forward(x)), y);
    expected.backward();
    const at::Tensor got = model->step(x, y, loss);
    CATCH_CHECK(got.item<double>() == gpipe_test::Approx(expected.item<double>()).epsilon(1e-12));
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    if (kind != "gpipe") {
      // The data tells the weights apart: weighted by rows, the micro-batches' means (all
      // finite here) are not the mini-batch's mean.
      at::NoGradGuard no_grad;
      const at::Tensor filled = padded_targets(step, /*filled=*/true);
      const double want = mean(Batch(plain->forward(x)), filled).item<double>();
      CATCH_CHECK(model->step(x, filled, loss).item<double>() ==
                  gpipe_test::Approx(want).epsilon(1e-12));
      const double by_rows = model->step(x, filled, mean).item<double>();
      CATCH_CHECK(std::isfinite(by_rows));
      CATCH_CHECK_FALSE(by_rows == gpipe_test::Approx(want).epsilon(1e-6));
    }
    plain_sgd.step();
    pipe_sgd.step();
  }
  check_same(plain->parameters(), model->parameters(), 1e-10);
}

CATCH_TEST_CASE("A token-level loss with its target on a GPU trains as the plain Sequential, also "
                "with a micro-batch of padding only",
                "[gpipe][step][loss][cuda]") {
  // The counts stay on the GPU (Note [Losses over micro-batches]): weights, the empty
  // micro-batch's 0 and its zeroed gradients are chosen there.
  const std::string kind = GENERATE("1f1b", "zb");
  const bool by_hand = GENERATE(false, true);
  CATCH_CAPTURE(kind, by_hand);
  const LossFunction mean = by_hand ? LossFunction(masked_mean_cross_entropy)
                                    : LossFunction(token_cross_entropy);
  const std::vector<c10::Device> devices{at::kCPU, c10::Device("cuda:0")};
  nn::Sequential plain = build(token_model, 5);
  GPipe model(build(token_model, 5),
              GPipeOptions({4, 3}).devices(devices).chunks(4).schedule(schedule_kind(kind)));
  at::manual_seed(450);
  const at::Tensor x = at::randn({12, 5, 5}, at::kDouble);
  const at::Tensor y = padded_targets(0);
  const at::Tensor expected = mean(Batch(plain->forward(x)), y);
  expected.backward();
  const at::Tensor got =
      model->step(x, y.to(devices.back()), Loss(mean, count_targets_except(-1)));
  CATCH_CHECK(got.item<double>() == gpipe_test::Approx(expected.item<double>()).epsilon(1e-12));
  const auto want = plain->parameters();
  const auto have = model->parameters();
  for (size_t k = 0; k < want.size(); ++k) {
    CATCH_CHECK(max_diff(want[k].grad(), have[k].grad().cpu()) < 1e-10);
  }
}

CATCH_TEST_CASE("A mini-batch of padding only has the plain model's NaN loss and no gradients",
                "[gpipe][step][loss]") {
  const std::string kind = GENERATE("1f1b", "zb");
  CATCH_CAPTURE(kind);
  GPipe model(token_model(), GPipeOptions({4, 3}).chunks(2).schedule(schedule_kind(kind)));
  const at::Tensor x = at::randn({4, 5, 5});
  const at::Tensor y = at::full({4, 5}, -1, at::kLong);
  const at::Tensor l = model->step(x, y, Loss(token_cross_entropy, count_targets_except(-1)));
  CATCH_CHECK(std::isnan(l.item<double>()));
  for (const at::Tensor& p : model->parameters()) {
    CATCH_CHECK((!p.grad().defined() || p.grad().eq(0).all().item<bool>()));
  }
}

CATCH_TEST_CASE("A loss's count must be a scalar", "[gpipe][step][loss][errors]") {
  GPipe model(token_model(), GPipeOptions({4, 3}).chunks(2).schedule(ScheduleKind::k1F1B));
  const at::Tensor x = at::randn({4, 5, 5});
  const at::Tensor y = at::zeros({4, 5}, at::kLong);
  const Loss loss(token_cross_entropy, [](const at::Tensor& rows) { return rows.ne(-1); });
  CATCH_CHECK_THROWS_WITH(model->step(x, y, loss),
                          gpipe_test::contains("the loss's count must return a scalar") &&
                              gpipe_test::contains("[4, 5]"));
}

CATCH_TEST_CASE("clip_grad_norm over a GPipe's partitions clips as LibTorch's over the plain "
                "Sequential",
                "[gpipe][step][clip]") {
  const double norm_type = GENERATE(2.0, 1.0, std::numeric_limits<double>::infinity());
  const double max_norm = GENERATE(0.01, 1e6);  // clips; leaves the gradients as they are
  CATCH_CAPTURE(norm_type, max_norm);
  nn::Sequential plain = build(skip_model, 3);
  GPipe model(build(skip_model, 3), GPipeOptions({2, 2, 2, 2})
                                        .devices(std::vector<c10::Device>(4, at::kCPU))
                                        .chunks(4)
                                        .schedule(ScheduleKind::k1F1B));
  for (int step = 0; step < 2; ++step) {
    at::manual_seed(500 + step);
    const at::Tensor x = at::randn({11, 5}, at::kDouble);
    const at::Tensor y = at::randn({11, 3}, at::kDouble);
    for (const at::Tensor& p : plain->parameters()) p.mutable_grad() = at::Tensor();
    for (const at::Tensor& p : model->parameters()) p.mutable_grad() = at::Tensor();
    plain_step(plain, Batch(x), y, 4);
    model->step(x, y, mse);
    const double expected =
        torch::nn::utils::clip_grad_norm_(plain->parameters(), max_norm, norm_type);
    const at::Tensor got = clip_grad_norm(model->parameters(), max_norm, norm_type);
    CATCH_CHECK(got.item<double>() == gpipe_test::Approx(expected).epsilon(1e-10));
    if (max_norm < 1) CATCH_CHECK(expected > 10 * max_norm);  // it clipped
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
  }
}

CATCH_TEST_CASE("clip_grad_norm refuses a norm type that is not positive and a negative bound",
                "[gpipe][step][clip][errors]") {
  nn::Linear layer(2, 2);
  layer->weight.mutable_grad() = at::ones({2, 2});
  CATCH_CHECK_THROWS_WITH(clip_grad_norm(layer->parameters(), 1.0, 0.0),
                          gpipe_test::contains("norm_type must be positive") &&
                              gpipe_test::contains("got 0"));
  CATCH_CHECK_THROWS_WITH(clip_grad_norm(layer->parameters(), -1.0),
                          gpipe_test::contains("max_norm must be at least 0, got -1"));
  CATCH_CHECK(clip_grad_norm({}, 1.0).item<double>() == 0);
}

CATCH_TEST_CASE("clip_grad_norm over partitions on a GPU and the CPU clips as LibTorch's over "
                "the plain Sequential",
                "[gpipe][step][clip][cuda]") {
  const std::vector<c10::Device> devices{c10::Device("cuda:0"), at::kCPU, c10::Device("cuda:0"),
                                         at::kCPU};
  nn::Sequential plain = build(skip_model, 3);
  GPipe model(build(skip_model, 3),
              GPipeOptions({2, 2, 2, 2}).devices(devices).chunks(4).schedule(ScheduleKind::k1F1B));
  at::manual_seed(600);
  const at::Tensor x = at::randn({11, 5}, at::kDouble);
  const at::Tensor y = at::randn({11, 3}, at::kDouble);
  plain_step(plain, Batch(x), y, 4);
  model->step(x.to(devices.front()), y.to(devices.back()), mse);
  const double expected = torch::nn::utils::clip_grad_norm_(plain->parameters(), 0.01);
  const at::Tensor got = clip_grad_norm(model->parameters(), 0.01);
  CATCH_CHECK(got.device() == devices.front());
  CATCH_CHECK(got.item<double>() == gpipe_test::Approx(expected).epsilon(1e-10));
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : model->parameters()) grads.push_back(p.grad().cpu());
  const auto want = plain->parameters();
  for (size_t k = 0; k < grads.size(); ++k) CATCH_CHECK(max_diff(want[k].grad(), grads[k]) < 1e-10);
}

// An upstream that announces `count` micro-batches (as a peer's header may).
struct Announcing final : gpipe::internal::Upstream {
  explicit Announcing(int64_t count) : count(count) {}
  gpipe::internal::Activation receive() override { return {count, Batch(at::ones({1, 2})), true}; }
  void send_gradients(int64_t, std::vector<at::Tensor>) override {}
  void fail(const std::string&) override {}
  int64_t count;
};

CATCH_TEST_CASE("The executor refuses an upstream that announces more micro-batches than the "
                "stage's chunks, before anything is sized by the count",
                "[gpipe][executor][errors]") {
  std::vector<gpipe::internal::ExecutorPartition> partitions(1);
  partitions[0].layers = nn::Sequential(nn::Linear(2, 2));
  partitions[0].batch_norms =
      std::make_shared<BatchNormLayers>(partitions[0].layers->modules(/*include_self=*/false));
  partitions[0].grad_record = std::make_shared<GradRecord>();
  const int64_t count = GENERATE(int64_t{0}, int64_t{5}, int64_t{1} << 50);
  Announcing up(count);
  gpipe::internal::OutputSink sink;
  gpipe::internal::ExecutorSpec spec;
  spec.who = "a stage";
  spec.partitions = &partitions;
  spec.plan = [](int64_t m) {
    std::vector<Action> lane;
    for (int64_t i = 0; i < m; ++i) lane.push_back(Action{ActionType::kForward, 0, i});
    return std::vector<std::vector<Action>>{lane};
  };
  spec.workers = {nullptr};
  spec.upstream = &up;
  spec.downstream = &sink;
  spec.max_microbatches = 4;
  spec.grad_enabled = false;
  spec.checkpoint_stop = [](int64_t) { return int64_t{0}; };
  at::NoGradGuard no_grad;
  CATCH_CHECK_THROWS_WITH(
      gpipe::internal::run_schedule(spec),
      gpipe_test::contains("a stage: the stage before announced " + std::to_string(count) +
                           " micro-batches") &&
          gpipe_test::contains(count == 0 ? "a step has at least 1" : "takes 1 to 4 (its chunks)"));
}

// A layer that keeps its pre-activation in the user's own map keyed by current_microbatch(), for
// a later layer of the same partition to add back: the saved tensor is inside the layer, not its
// output, so a backward split by layer would miss its path.
using SavedMap = std::map<MicroBatch, at::Tensor>;
struct SaveInnerImpl : nn::Module {
  explicit SaveInnerImpl(std::shared_ptr<SavedMap> saved)
      : saved(std::move(saved)), lin(register_module("lin", nn::Linear(5, 5))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = lin(x);
    (*saved)[current_microbatch()] = h;
    return h.tanh();
  }
  std::shared_ptr<SavedMap> saved;
  nn::Linear lin;
};
TORCH_MODULE(SaveInner);
struct AddSavedImpl : nn::Module {
  explicit AddSavedImpl(std::shared_ptr<SavedMap> saved) : saved(std::move(saved)) {}
  at::Tensor forward(const at::Tensor& x) {
    auto it = saved->find(current_microbatch());
    TORCH_CHECK(it != saved->end(), "nothing saved for ", current_microbatch());
    at::Tensor h = it->second;
    saved->erase(it);
    return x + h;
  }
  std::shared_ptr<SavedMap> saved;
};
TORCH_MODULE(AddSaved);

CATCH_TEST_CASE("A layer's own map keyed by current_microbatch(), read later in its partition, "
                "trains as the plain Sequential under every schedule",
                "[gpipe][step][microbatch]") {
  const OneIntraOpThread one_thread;
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  CATCH_CAPTURE(kind);
  const auto make = [] {
    auto saved = std::make_shared<SavedMap>();
    return nn::Sequential(nn::Linear(4, 5), SaveInner(saved), nn::Linear(5, 5), AddSaved(saved),
                          nn::Linear(5, 3));
  };
  nn::Sequential plain = build(make, 3);
  const int64_t chunks = 4;
  GPipe model(build(make, 3), GPipeOptions({1, 4})
                                  .devices({at::kCPU, at::kCPU})
                                  .chunks(chunks)
                                  .checkpoint(Checkpoint::kNever)
                                  .schedule(PipelineSchedule::of(schedule_kind(kind),
                                                                 stages_per_rank(kind, 2))));
  auto plain_opt = optimizer("sgd", plain->parameters());
  auto pipe_opt = optimizer("sgd", model->parameters());
  for (int step = 0; step < 2; ++step) {
    at::manual_seed(700 + step);
    const at::Tensor x = at::randn({8, 4}, at::kDouble);
    const at::Tensor y = at::randn({8, 3}, at::kDouble);
    plain_opt->zero_grad();
    pipe_opt->zero_grad();
    const double expected = plain_step(plain, Batch(x), y, chunks, kind == "gpipe");
    const at::Tensor loss = model->step(x, y, mse);
    CATCH_CHECK(loss.item<double>() == gpipe_test::Approx(expected).epsilon(1e-12));
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    plain_opt->step();
    pipe_opt->step();
  }
}

CATCH_TEST_CASE("A layer's own map read in a later partition is refused by step(), naming the "
                "partitions, under every schedule",
                "[gpipe][step][microbatch][errors]") {
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  CATCH_CAPTURE(kind);
  auto saved = std::make_shared<SavedMap>();
  GPipe model(nn::Sequential(nn::Linear(4, 5), SaveInner(saved), nn::Linear(5, 5),
                             AddSaved(saved), nn::Linear(5, 3)),
              GPipeOptions({2, 3})
                  .devices({at::kCPU, at::kCPU})
                  .chunks(2)
                  .checkpoint(Checkpoint::kNever)
                  .schedule(PipelineSchedule::of(schedule_kind(kind), stages_per_rank(kind, 2))));
  CATCH_CHECK_THROWS_WITH(
      model->step(at::randn({4, 4}), at::randn({4, 3}), mse),
      gpipe_test::contains("partition 1's output of micro-batch") &&
          gpipe_test::contains("has autograd history into partition 0 (its parameter '") &&
          gpipe_test::contains("gpipe::stash and gpipe::pop"));
  // forward() keeps the one graph: there the pattern trains as the plain model (skip_test).
  saved->clear();
  model->forward(at::randn({4, 4})).sum().backward();
}

CATCH_TEST_CASE("A short last mini-batch, fewer micro-batches than chunks, trains as the plain "
                "Sequential or is refused naming its size, under every schedule",
                "[gpipe][step][errors]") {
  const OneIntraOpThread one_thread;
  const std::string kind =
      GENERATE("gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev");
  CATCH_CAPTURE(kind);
  nn::Sequential plain = build(skip_model, 3);
  GPipe model(build(skip_model, 3),
              GPipeOptions(balance_of(4))
                  .devices(std::vector<c10::Device>(4, at::kCPU))
                  .chunks(4)
                  .schedule(PipelineSchedule::of(schedule_kind(kind), stages_per_rank(kind, 4))));
  // 6 samples in chunks of 2: 3 micro-batches, odd for the two ranks of an interleaved schedule.
  const at::Tensor x = at::randn({6, 5}, at::kDouble);
  const at::Tensor y = at::randn({6, 3}, at::kDouble);
  if (kind == "interleaved" || kind == "zb1p") {
    CATCH_CHECK_THROWS_WITH(model->step(x, y, mse),
                            gpipe_test::contains("the mini-batch of 6 samples splits into only 3 "
                                                 "micro-batches (Tensor::chunk into chunks = 4)") &&
                                gpipe_test::contains("drop_last"));
    return;
  }
  const double expected = plain_step(plain, Batch(x), y, 4, kind == "gpipe");
  CATCH_CHECK(model->step(x, y, mse).item<double>() ==
              gpipe_test::Approx(expected).epsilon(1e-12));
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
