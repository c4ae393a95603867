// Concurrent use: servers call one GPipe from several threads, a task that cannot be handed to a
// worker fails the forward instead of hanging it, and partitions on threads of their own do not
// wait for each other's clock ticks. Results are compared with the plain model.
#include "tests/gpipe/test_util.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <new>
#include <thread>

#include "gpipe/internal/partition_threads.h"
#include "gpipe/internal/stage_backward.h"
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
  GPipe model(build(conv_model, 41),
              gpipe::internal::with_partition_threads(GPipeOptions({2, 2, 2})
                                                          .devices({at::kCPU, at::kCPU, at::kCPU})
                                                          .chunks(4)
                                                          .checkpoint(mode),
                                                      threads));
  const at::Tensor x = at::randn({8, 3, 5, 5}, at::kDouble);
  const at::Tensor expected = plain->forward(x);
  expected.sum().backward();
  if (warm) {
    model->forward(x).sum().backward();
    for (auto& p : model->parameters()) p.mutable_grad().zero_();
  }
  constexpr int kSteps = 6;
  const int64_t cuts = gpipe::internal::cut_backwards();
  CATCH_CHECK(train_from_two_threads(model, x, expected, kSteps) == 0);
  // With a thread per partition, both threads' backwards ran each partition's backward on its
  // worker, the two interleaved there (Note [Stage-local backward in one process]).
  CATCH_CHECK(model->stage_local_backward() == threads);
  CATCH_CHECK(gpipe::internal::cut_backwards() == cuts + (threads ? 2 * kSteps : 0));
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
  GPipe model(build(conv_model, 42),
              gpipe::internal::with_partition_threads(
                  GPipeOptions({3, 3}).devices({at::kCPU, at::kCPU}).chunks(3), true));
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
  // A forward hands each of its two worker threads one job (its lane of tasks): the first or the
  // second cannot be handed over.
  const int fail_at = GENERATE(0, 1);
  CATCH_CAPTURE(fail_at);
  nn::Sequential plain = build(conv_model, 43);
  GPipe model(build(conv_model, 43),
              gpipe::internal::with_partition_threads(
                  GPipeOptions({2, 2, 2}).devices({at::kCPU, at::kCPU, at::kCPU}).chunks(3), true));
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

// Counts the micro-batches partition 0 has computed, and lets partition 1 wait for a count.
struct Progress {
  std::mutex mu;
  std::condition_variable changed;
  int64_t computed = 0;
};

// y = x; counts each call in `progress`.
struct CountImpl : nn::Module {
  explicit CountImpl(std::shared_ptr<Progress> progress) : progress(std::move(progress)) {}
  at::Tensor forward(const at::Tensor& x) {
    {
      std::lock_guard<std::mutex> lock(progress->mu);
      ++progress->computed;
    }
    progress->changed.notify_all();
    return x * 1.0;
  }
  std::shared_ptr<Progress> progress;
};
TORCH_MODULE(Count);

// y = x; its first call waits until `progress` has counted `until` calls, and throws if that has
// not happened within a minute.
struct AwaitImpl : nn::Module {
  AwaitImpl(std::shared_ptr<Progress> progress, int64_t until)
      : progress(std::move(progress)), until(until) {}
  at::Tensor forward(const at::Tensor& x) {
    std::unique_lock<std::mutex> lock(progress->mu);
    const bool reached = progress->changed.wait_for(
        lock, std::chrono::seconds(60), [this] { return progress->computed >= until; });
    TORCH_CHECK(reached, "partition 0 computed ", progress->computed, " micro-batches, not ",
                until);
    return x * 1.0;
  }
  std::shared_ptr<Progress> progress;
  int64_t until;
};
TORCH_MODULE(Await);

CATCH_TEST_CASE("with a thread per partition, a partition runs ahead of the clock ticks as far as "
                "its inputs allow",
                "[concurrency][executor]") {
  // Partition 1's first micro-batch waits until partition 0 has computed all four: with each
  // clock tick a barrier (micro-batch 1 enters partition 0 only with micro-batch 0 entering
  // partition 1), that would never happen.
  const int64_t chunks = 4;
  auto progress = std::make_shared<Progress>();
  GPipe model(nn::Sequential(Count(progress), Await(progress, chunks)),
              gpipe::internal::with_partition_threads(GPipeOptions({1, 1})
                                                          .devices({at::kCPU, at::kCPU})
                                                          .chunks(chunks)
                                                          .checkpoint(Checkpoint::kNever),
                                                      true));
  const at::Tensor x = at::randn({8, 3}, at::kDouble).requires_grad_(true);
  at::Tensor y;
  within(120, [&] { y = model->forward(x); });
  CATCH_CHECK(max_diff(y, x) == 0);
  y.sum().backward();
  CATCH_CHECK(max_diff(x.grad(), at::ones_like(x)) == 0);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
