// Concurrent use: servers call one GPipe from several threads, and a task that cannot be handed to
// a worker fails the forward instead of hanging it. Results are compared with the plain model.
#include "tests/gpipe/test_util.h"

#include <atomic>
#include <future>
#include <new>
#include <thread>

#include "gpipe/worker.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

nn::Sequential conv_model() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(4, 4, 3).padding(1)), nn::Tanh(),
                        nn::Flatten(), nn::Linear(4 * 5 * 5, 3));
}

CATCH_TEST_CASE("WorkerPool gives one CPU one worker however it is written", "[concurrency]") {
  const c10::Device cpu("cpu");
  const c10::Device cpu0("cpu:0");
  // Partitions on the calling thread's device run inline: no thread for "cpu:0" after "cpu".
  WorkerPool shared({cpu, cpu0, cpu}, /*worker_per_partition=*/false);
  CATCH_CHECK(shared.size() == 0);
  CATCH_CHECK(shared.runs_inline(1));
  WorkerPool shared0({cpu0, cpu}, /*worker_per_partition=*/false);
  CATCH_CHECK(shared0.size() == 0);
  // A worker per partition: partitions 1 and 2 get one each, whatever their spelling.
  WorkerPool own({cpu, cpu0, cpu}, /*worker_per_partition=*/true);
  CATCH_CHECK(own.size() == 2);
  CATCH_CHECK(own.runs_inline(0));
  CATCH_CHECK(&own.for_partition(1) != &own.for_partition(2));
}

CATCH_TEST_CASE("Two threads training through one GPipe, fresh or warm, get the plain model's "
                "results",
                "[concurrency]") {
  const bool warm = GENERATE(false, true);
  const bool threads = GENERATE(false, true);
  const Checkpoint mode = GENERATE(Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(warm, threads, static_cast<int>(mode));
  nn::Sequential plain = build(conv_model, 41);
  GPipe model(build(conv_model, 41), GPipeOptions({2, 2, 2})
                                         .devices({at::kCPU, at::kCPU, at::kCPU})
                                         .chunks(4)
                                         .checkpoint(mode)
                                         .worker_per_partition(threads));
  const at::Tensor x = at::randn({8, 3, 5, 5}, at::kDouble);
  const at::Tensor expected = plain->forward(x);
  expected.sum().backward();
  if (warm) {
    model->forward(x).sum().backward();
    for (auto& p : model->parameters()) p.mutable_grad().zero_();
  }
  constexpr int kSteps = 6;
  CATCH_CHECK(train_from_two_threads(model, x, expected, kSteps) == 0);
  // Every step's gradients were accumulated: 2 threads x kSteps times the plain model's.
  auto plain_params = plain->parameters();
  auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    CATCH_CHECK(max_diff(params[k].grad(), plain_params[k].grad() * (2 * kSteps)) <= 1e-9);
  }
}

CATCH_TEST_CASE("Threads serving inference from one GPipe get the plain model's outputs",
                "[concurrency]") {
  nn::Sequential plain = build(conv_model, 42);
  GPipe model(build(conv_model, 42), GPipeOptions({3, 3})
                                         .devices({at::kCPU, at::kCPU})
                                         .chunks(3)
                                         .worker_per_partition(true));
  plain->eval();
  model->eval();
  std::atomic<int> wrong{0};
  auto serve = [&](uint64_t seed) {
    for (int k = 0; k < 20; ++k) {
      at::Tensor x = at::randn({3 + k % 4, 3, 5, 5}, at::kDouble);
      at::NoGradGuard no_grad;
      // No Catch2 assertion off the main thread (Catch2 is not thread-safe).
      if ((model->forward(x) - plain->forward(x)).abs().max().item<double>() > 1e-10) ++wrong;
    }
    (void)seed;
  };
  within(300, [&] {
    std::vector<std::thread> threads;
    for (uint64_t t = 0; t < 4; ++t) threads.emplace_back(serve, t);
    for (auto& t : threads) t.join();
  });
  CATCH_CHECK(wrong == 0);
}

CATCH_TEST_CASE("A task that cannot be handed to a worker fails the forward without hanging it",
                "[concurrency][errors]") {
  const int fail_at = GENERATE(0, 1, 3, 5);
  CATCH_CAPTURE(fail_at);
  nn::Sequential plain = build(conv_model, 43);
  GPipe model(build(conv_model, 43), GPipeOptions({2, 2, 2})
                                         .devices({at::kCPU, at::kCPU, at::kCPU})
                                         .chunks(3)
                                         .worker_per_partition(true));
  const at::Tensor x = at::randn({6, 3, 5, 5}, at::kDouble);
  std::atomic<int> calls{0};
  internal::set_submit_hook([&] {
    if (calls++ == fail_at) throw std::bad_alloc();
  });
  bool threw = false;
  within(120, [&] {
    try {
      model->forward(x);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  });
  internal::set_submit_hook(nullptr);
  CATCH_CHECK(threw);
  // The next step is exact.
  check_same_step(plain, model, x);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
