// Stage-local backward for CPU partitions (Note [Stage-local backward in one process]): the
// engine's decision, the same parameters as the plain model over several optimizer steps, each
// partition's backward on its own worker thread, backwards that are not plain (grad, inputs,
// create_graph) and retained graphs as in the plain model, errors from a partition's backward
// raised by backward(), and the override's limits refused with clear errors.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/sgd.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/internal/stage_backward.h"
#include "gpipe/skippable.h"
#include "gpipe/worker.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace {

namespace nn = torch::nn;
using testing::check_same_grads;
using testing::max_diff;

// Records the thread of each forward and backward through it, by partition.
struct ThreadLog {
  std::mutex mu;
  std::vector<std::set<std::thread::id>> forward{3}, backward{3};
};

// Records the thread of its forward, and with a hook on its output the thread of the backward
// through it (a tensor hook runs on the thread that runs the output's grad_fn). With `fail`, that
// backward throws. (A hook rather than an autograd::Function: GCC 14 at -O3 warns, as an error,
// about an out-of-bounds memmove inlined from LibTorch's Function::apply.)
struct ProbeImpl : nn::Module {
  ProbeImpl(int64_t partition, ThreadLog* log, bool fail = false)
      : partition(partition), log(log), fail(fail) {}
  at::Tensor forward(const at::Tensor& x) {
    if (log != nullptr) {
      std::lock_guard<std::mutex> lock(log->mu);
      log->forward[partition].insert(std::this_thread::get_id());
    }
    at::Tensor y = x.clone();
    if (y.requires_grad()) {
      const bool fail_now = fail && is_training();
      ThreadLog* const backward_log = log;
      const int64_t j = partition;
      y.register_hook([fail_now, backward_log, j](const at::Tensor& grad) {
        TORCH_CHECK(!fail_now, "a layer's backward failed on purpose");
        if (backward_log != nullptr) {
          std::lock_guard<std::mutex> lock(backward_log->mu);
          backward_log->backward[j].insert(std::this_thread::get_id());
        }
        return grad;
      });
    }
    return y;
  }
  int64_t partition;
  ThreadLog* log;
  bool fail;
};
TORCH_MODULE(Probe);

// Three partitions of Linear + Tanh + Probe (float64, seed 3).
nn::Sequential make_model(ThreadLog* log = nullptr, bool fail_first = false) {
  torch::manual_seed(3);
  nn::Sequential seq;
  for (int64_t j = 0; j < 3; ++j) {
    seq->push_back(nn::Linear(6, 6));
    seq->push_back(nn::Tanh());
    seq->push_back(Probe(j, log, fail_first && j == 0));
  }
  seq->to(at::kDouble);
  return seq;
}

// A thread per partition in either mode (the engine's choice for these layers, and with it
// stage-local backward: the overrides keep the tests from depending on it).
GPipeOptions options(Checkpoint checkpoint, bool stage_local = true) {
  return gpipe::internal::with_stage_local_backward(
      gpipe::internal::with_partition_threads(GPipeOptions({3, 3, 3})
                                                  .chunks(4)
                                                  .checkpoint(checkpoint)
                                                  .devices({at::kCPU, at::kCPU, at::kCPU}),
                                              true),
      stage_local);
}

// Four SGD-with-momentum steps of `plain` and `pipe` (the same model) on the same random
// batches of 7 rows (4 micro-batches of 2, 2, 2, 1): parameters' and inputs' gradients, then the
// parameters, equal to 1e-12.
// Each step's backward cut at the Handoffs (the engine's check found nothing against it).
void train_against_plain(nn::Sequential plain, GPipe pipe) {
  CATCH_REQUIRE(pipe->stage_local_backward());
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD pipe_sgd(pipe->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = at::randn({7, 6}, at::kDouble);  // 4 micro-batches of 2, 2, 2, 1
    const at::Tensor y = at::randn({7, 6}, at::kDouble);
    const at::Tensor x1 = x.clone().requires_grad_(true);
    const at::Tensor x2 = x.clone().requires_grad_(true);
    plain_sgd.zero_grad();
    pipe_sgd.zero_grad();
    at::mse_loss(plain->forward(x1), y).backward();
    const int64_t cuts = internal::cut_backwards();
    at::mse_loss(pipe->forward(x2), y).backward();
    CATCH_CHECK(internal::cut_backwards() == cuts + 1);
    check_same_grads(plain->parameters(), pipe->parameters(), 1e-12);
    CATCH_CHECK(max_diff(x1.grad(), x2.grad()) <= 1e-12);
    plain_sgd.step();
    pipe_sgd.step();
  }
  const auto a = plain->parameters();
  const auto b = pipe->parameters();
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(max_diff(a[k], b[k]) <= 1e-12);
}

// After a failed step: two more steps, each from zeroed gradients, give the plain model's
// gradients (1e-12).
void check_next_steps(nn::Sequential plain, GPipe pipe, const at::Tensor& x) {
  for (int step = 0; step < 2; ++step) {
    plain->zero_grad();
    pipe->zero_grad();
    plain->forward(x).sum().backward();
    pipe->forward(x).sum().backward();
    check_same_grads(plain->parameters(), pipe->parameters(), 1e-12);
  }
}

CATCH_TEST_CASE("stage-local backward trains to the plain model's parameters and input gradients",
                "[gpipe][stage_backward]") {
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast,
                                   Checkpoint::kNever);
  CATCH_INFO("checkpoint " << static_cast<int>(mode));
  nn::Sequential plain = make_model();
  GPipe pipe(make_model(), options(mode));
  train_against_plain(plain, pipe);
}

CATCH_TEST_CASE("with stage-local backward each partition runs its backward on its own worker",
                "[gpipe][stage_backward]") {
  const bool stage_local = GENERATE(true, false);
  CATCH_INFO("stage_local_backward " << stage_local);
  ThreadLog log;
  GPipe pipe(make_model(&log), options(Checkpoint::kNever, stage_local));
  const at::Tensor x = at::randn({8, 6}, at::kDouble);
  pipe->forward(x).sum().backward();
  const std::thread::id caller = std::this_thread::get_id();
  // Partition 1 computes its forward on its worker; its backward runs there too with the mode,
  // else on the thread that called backward().
  CATCH_REQUIRE(log.forward[1].size() == 1);
  CATCH_CHECK(*log.forward[1].begin() != caller);
  CATCH_REQUIRE(log.backward[1].size() == 1);
  if (stage_local) {
    CATCH_CHECK(log.backward[1] == log.forward[1]);
  } else {
    CATCH_CHECK(*log.backward[1].begin() == caller);
  }
  // The last partition likewise; partition 0 runs on the calling thread, forward and backward.
  CATCH_REQUIRE(log.backward[2].size() == 1);
  if (stage_local) {
    CATCH_CHECK(log.backward[2] == log.forward[2]);
  } else {
    CATCH_CHECK(*log.backward[2].begin() == caller);
  }
  CATCH_CHECK(log.backward[0] == std::set<std::thread::id>{caller});
}

CATCH_TEST_CASE("an error in a handed-off backward is raised by backward and the next step works",
                "[gpipe][stage_backward][errors]") {
  GPipe failing(make_model(nullptr, /*fail_first=*/true), options(Checkpoint::kExceptLast));
  const at::Tensor x = at::randn({8, 6}, at::kDouble);
  CATCH_CHECK_THROWS_WITH(failing->forward(x).sum().backward(),
                          gpipe_test::contains("a layer's backward failed on purpose"));
  // The same pipeline without the failing layer's failure: eval-mode forward, then training.
  nn::Sequential plain = make_model();
  GPipe pipe(make_model(), options(Checkpoint::kExceptLast));
  check_next_steps(plain, pipe, x);
}

// The graphs a forward built: one token per forward through a Tokens layer, held by a hook on its
// output, lives as long as that part of the graph does.
struct TokenLog {
  std::mutex mu;
  std::vector<std::weak_ptr<int>> tokens;
  int64_t live() {
    std::lock_guard<std::mutex> lock(mu);
    int64_t n = 0;
    for (const auto& token : tokens) n += token.expired() ? 0 : 1;
    return n;
  }
};
struct TokensImpl : nn::Module {
  explicit TokensImpl(TokenLog* log) : log(log) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x.clone();
    if (y.requires_grad()) {
      auto token = std::make_shared<int>(0);
      {
        std::lock_guard<std::mutex> lock(log->mu);
        log->tokens.push_back(token);
      }
      y.register_hook([token](const at::Tensor& grad) { return grad; });
    }
    return y;
  }
  TokenLog* log;
};
TORCH_MODULE(Tokens);

// make_model()'s parameters, with a Tokens layer closing each partition instead of the Probe.
nn::Sequential make_token_model(TokenLog* log) {
  torch::manual_seed(3);
  nn::Sequential seq;
  for (int64_t j = 0; j < 3; ++j) {
    seq->push_back(nn::Linear(6, 6));
    seq->push_back(nn::Tanh());
    seq->push_back(Tokens(log));
  }
  seq->to(at::kDouble);
  return seq;
}

CATCH_TEST_CASE("a backward that fails after handing gradients off leaves no partition's backward "
                "running or holding its graph and the next steps train as the plain model",
                "[gpipe][stage_backward][errors]") {
  TokenLog log;
  nn::Sequential plain = make_model();
  GPipe pipe(make_token_model(&log), options(Checkpoint::kNever));
  const at::Tensor x = at::randn({8, 6}, at::kDouble);
  {
    // A branch of the user's graph made before the pipeline's forward: the engine runs its
    // backward after the Handoffs behind the last partition (later nodes first), so its hook
    // throws once the partitions' backwards have been handed off.
    const at::Tensor w = at::randn({6}, at::kDouble).requires_grad_(true);
    at::Tensor z = w * 2;
    z.register_hook([](const at::Tensor& grad) {
      TORCH_CHECK(false, "the user's backward failed on purpose");
      return grad;
    });
    const at::Tensor out = pipe->forward(x);
    CATCH_REQUIRE(log.live() == 12);  // 3 partitions x 4 micro-batches
    CATCH_CHECK_THROWS_WITH((out.sum() + z.sum()).backward(),
                            gpipe_test::contains("the user's backward failed on purpose"));
  }
  // With the user's tensors gone nothing holds a graph: no backward was left queued or running,
  // none waits for the calling thread, and no partial gradient join keeps its partition's graph.
  CATCH_CHECK(log.live() == 0);
  // The failed step's partial gradients are zeroed; then the pipeline trains as the plain model.
  check_next_steps(plain, pipe, x);
  CATCH_CHECK(log.live() == 0);
}

CATCH_TEST_CASE("a backward whose hand-off to a worker fails raises the error without hanging and "
                "leaves no graph behind",
                "[gpipe][stage_backward][errors]") {
  // The k-th hand-off of the backward (to partition 2's worker from the calling thread, or to
  // partition 1's from partition 2's) cannot be queued (out of memory).
  const int fail_at = GENERATE(0, 1, 2, 5);
  CATCH_CAPTURE(fail_at);
  TokenLog log;
  nn::Sequential plain = make_model();
  GPipe pipe(make_token_model(&log), options(Checkpoint::kNever));
  const at::Tensor x = at::randn({8, 6}, at::kDouble);
  bool threw = false;
  testing::within(120, [&] {
    at::Tensor loss = pipe->forward(x).sum();
    std::atomic<int> calls{0};
    internal::set_submit_hook([&] {
      if (calls++ == fail_at) throw std::bad_alloc();
    });
    try {
      loss.backward();
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    internal::set_submit_hook(nullptr);
  });
  CATCH_CHECK(threw);
  CATCH_CHECK(log.live() == 0);
  check_next_steps(plain, pipe, x);
}

CATCH_TEST_CASE("a stage-local GPipe destroyed between forward and backward still gives the "
                "plain model's gradients",
                "[gpipe][stage_backward]") {
  nn::Sequential plain = make_model();
  nn::Sequential seq = make_model();
  const at::Tensor x = at::randn({8, 6}, at::kDouble);
  at::Tensor out;
  {
    GPipe pipe(seq, options(Checkpoint::kExceptLast));
    out = pipe->forward(x);
  }  // the GPipe and its workers' owner are gone; the graph keeps what it needs
  out.sum().backward();
  plain->forward(x).sum().backward();
  check_same_grads(plain->parameters(), seq->parameters(), 1e-12);
}

// Skips for stage-local backward: stash a layer's input under a name, pop and add it, or pop and
// drop it (no gradient reaches that skip).
struct StashAsImpl : nn::Module {
  explicit StashAsImpl(std::string name) : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) {
    stash(name, 2 * x);
    return at::tanh(x);
  }
  std::string name;
};
TORCH_MODULE(StashAs);
struct PopAddImpl : nn::Module {
  explicit PopAddImpl(std::string name) : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) { return x + pop(name); }
  std::string name;
};
TORCH_MODULE(PopAdd);
struct PopDropImpl : nn::Module {
  explicit PopDropImpl(std::string name) : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) {
    pop(name);
    return x;
  }
  std::string name;
};
TORCH_MODULE(PopDrop);

// Three partitions of four layers: skip "a" from partition 0 over partition 1 into 2, "d" from 0
// into 1, "b" from 1 into 2, "c" from 1 into 2, where it is dropped.
nn::Sequential make_skip_model() {
  torch::manual_seed(5);
  nn::Sequential seq(
      nn::Linear(6, 6), skippable(StashAs("a"), SkippableOptions().stash({"a"})),
      skippable(StashAs("d"), SkippableOptions().stash({"d"})), nn::Linear(6, 6),
      skippable(PopAdd("d"), SkippableOptions().pop({"d"})),
      skippable(StashAs("b"), SkippableOptions().stash({"b"})),
      skippable(StashAs("c"), SkippableOptions().stash({"c"})), nn::Linear(6, 6),
      skippable(PopAdd("a"), SkippableOptions().pop({"a"})),
      skippable(PopAdd("b"), SkippableOptions().pop({"b"})),
      skippable(PopDrop("c"), SkippableOptions().pop({"c"})), nn::Linear(6, 6));
  seq->to(at::kDouble);
  return seq;
}

CATCH_TEST_CASE("stage-local backward trains a model whose skips cross partitions to the plain "
                "model's parameters and input gradients",
                "[gpipe][stage_backward][skip]") {
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast,
                                   Checkpoint::kNever);
  CATCH_INFO("checkpoint " << static_cast<int>(mode));
  nn::Sequential plain = make_skip_model();
  GPipe pipe(make_skip_model(), GPipeOptions({4, 4, 4})
                                    .chunks(4)
                                    .checkpoint(mode)
                                    .devices({at::kCPU, at::kCPU, at::kCPU}));
  CATCH_REQUIRE(pipe->stage_local_backward());  // the engine's decision for these layers
  train_against_plain(plain, pipe);
}

// Backward hooks that show whether partitions overlap: `Started` notes that a backward reached it;
// `WaitOnLast` makes the last of `calls` backwards through it wait (at most 20 s) for that note.
struct StartedImpl : nn::Module {
  explicit StartedImpl(std::shared_ptr<absl::Notification> note) : note(std::move(note)) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x.clone();
    y.register_hook([note = note](const at::Tensor& g) {
      if (!note->HasBeenNotified()) note->Notify();
      return g;
    });
    return y;
  }
  std::shared_ptr<absl::Notification> note;
};
TORCH_MODULE(Started);
struct WaitOnLastImpl : nn::Module {
  WaitOnLastImpl(std::shared_ptr<absl::Notification> note, int calls,
                 std::shared_ptr<std::atomic<bool>> saw)
      : note(std::move(note)), calls(calls), saw(std::move(saw)) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x.clone();
    y.register_hook([this](const at::Tensor& g) {
      if (++seen == calls) *saw = note->WaitForNotificationWithTimeout(absl::Seconds(20));
      return g;
    });
    return y;
  }
  std::shared_ptr<absl::Notification> note;
  int calls;
  std::shared_ptr<std::atomic<bool>> saw;
  std::atomic<int> seen{0};
};
TORCH_MODULE(WaitOnLast);

CATCH_TEST_CASE("a skip that no gradient reaches does not hold its stashing partition's backward "
                "until the others are done",
                "[gpipe][stage_backward][skip]") {
  // Linear | StashAs c, Linear, Started | PopDrop c, WaitOnLast, Linear: partition 1's backward of
  // a micro-batch may start once partition 2's has passed by the Handoff of skip c without
  // reaching it; partition 2's last backward waits for partition 1 to have started one.
  auto note = std::make_shared<absl::Notification>();
  auto saw = std::make_shared<std::atomic<bool>>(false);
  torch::manual_seed(7);
  nn::Sequential seq(nn::Linear(6, 6), skippable(StashAs("c"), SkippableOptions().stash({"c"})),
                     nn::Linear(6, 6), Started(note),
                     skippable(PopDrop("c"), SkippableOptions().pop({"c"})),
                     WaitOnLast(note, 4, saw), nn::Linear(6, 6));
  seq->to(at::kDouble);
  GPipe pipe(seq, GPipeOptions({1, 3, 3})
                      .chunks(4)
                      .checkpoint(Checkpoint::kNever)
                      .devices({at::kCPU, at::kCPU, at::kCPU}));
  CATCH_REQUIRE(pipe->stage_local_backward());
  pipe->forward(at::randn({8, 6}, at::kDouble)).pow(2).sum().backward();
  CATCH_CHECK(saw->load());
}

CATCH_TEST_CASE("an input that comes from layers before a stage-local GPipe gets their "
                "gradients as in the plain model",
                "[gpipe][stage_backward]") {
  // The input's graph runs once: such a forward keeps the one graph.
  torch::manual_seed(9);
  nn::Linear before(6, 6), before_plain(6, 6);
  before->to(at::kDouble);
  before_plain->to(at::kDouble);
  {
    at::NoGradGuard no_grad;
    before_plain->weight.copy_(before->weight);
    before_plain->bias.copy_(before->bias);
  }
  nn::Sequential plain = make_model();
  GPipe pipe(make_model(), options(Checkpoint::kExceptLast));
  for (int step = 0; step < 2; ++step) {
    const at::Tensor x = at::randn({7, 6}, at::kDouble);
    before->zero_grad();
    before_plain->zero_grad();
    pipe->zero_grad();
    plain->zero_grad();
    plain->forward(before_plain(x)).pow(2).sum().backward();
    pipe->forward(before(x)).pow(2).sum().backward();
    check_same_grads(plain->parameters(), pipe->parameters(), 1e-12);
    check_same_grads(before_plain->parameters(), before->parameters(), 1e-12);
  }
}

int openblas_threads() {
  using Get = int (*)();
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : -1;
}

// Records, in each backward through it, the running thread's intra-op threads and OpenBLAS's.
struct BackwardCountsImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x * 1;  // a node of this layer's own, whose hook runs where its backward does
    y.register_hook([this](const at::Tensor& grad) {
      std::lock_guard<std::mutex> lock(mu);
      seen.emplace_back(at::get_num_threads(), openblas_threads());
      return grad;
    });
    return y;
  }
  std::mutex mu;
  std::vector<std::pair<int, int>> seen;
};
TORCH_MODULE(BackwardCounts);

CATCH_TEST_CASE("stage-local backwards share the cores, and the caller gets them back",
                "[gpipe][stage_backward][threads]") {
  // Note [Dividing the cores] in gpipe/worker.h, for the backwards a forward() leaves behind.
  const int intra = at::get_num_threads();
  const int blas = openblas_threads();
  auto set = [](const char* name) {
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0';
  };
  const bool omp_env = set("OMP_NUM_THREADS");
  const bool env = set("OPENBLAS_NUM_THREADS") || omp_env;
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  CATCH_CAPTURE(intra, blas, env, cpus);
  BackwardCounts first, second;
  GPipe pipe(nn::Sequential(nn::Linear(4, 4), first, nn::Linear(4, 2), second),
             GPipeOptions({2, 2})
                 .devices({at::kCPU, at::kCPU})
                 .chunks(2)
                 .checkpoint(Checkpoint::kNever));
  CATCH_REQUIRE(pipe->stage_local_backward());
  pipe->forward(at::randn({4, 4})).sum().backward();
  const int lane_intra = intra == at::intraop_default_num_threads() && intra > 1 && !omp_env
                             ? std::max(1, intra / 2)
                             : intra;
  const int lane_blas = blas > 1 && !env ? std::max(1, std::min(blas, cpus / 2)) : blas;
  for (BackwardCounts counts : {first, second}) {
    CATCH_REQUIRE(counts->seen.size() == 2);
    for (const auto& [seen_intra, seen_blas] : counts->seen) {
      CATCH_CHECK(seen_intra == lane_intra);
      CATCH_CHECK(seen_blas == lane_blas);
    }
  }
  CATCH_CHECK(at::get_num_threads() == intra);
  CATCH_CHECK(openblas_threads() == blas);
}

CATCH_TEST_CASE("the override of stage-local backward refuses what it cannot do, naming it",
                "[gpipe][stage_backward][errors]") {
  CATCH_CHECK_THROWS_WITH(
      GPipe(make_model(),
            gpipe::internal::with_partition_threads(options(Checkpoint::kNever), false)),
      gpipe_test::contains(
          "stage_local_backward runs each partition's backward on the partition's own thread, but "
          "worker_per_partition(false) gives the partitions one thread"));
}

CATCH_TEST_CASE("stage-local backward is the engine's decision: CPU partitions on threads of "
                "their own",
                "[gpipe][stage_backward]") {
  auto cpu = [](std::vector<int64_t> balance) {
    return GPipeOptions(std::move(balance))
        .devices(std::vector<c10::Device>(3, c10::Device(at::kCPU)));
  };
  ThreadLog log;
  GPipe pipe(make_model(&log), cpu({3, 3, 3}).chunks(4));
  CATCH_CHECK(pipe->partitions_on_own_threads());
  CATCH_CHECK(pipe->stage_local_backward());
  pipe->forward(at::randn({8, 6}, at::kDouble)).sum().backward();
  CATCH_REQUIRE(log.forward[2].size() == 1);
  CATCH_CHECK(log.backward[2] == log.forward[2]);  // on partition 2's thread, not the caller's
  // One partition, and partitions that share a thread (a dropout: Note [Threads of forward()]),
  // keep the one graph.
  CATCH_CHECK_FALSE(GPipe(make_model(), cpu({9}))->stage_local_backward());
  torch::manual_seed(3);
  nn::Sequential dropout(nn::Linear(6, 6), nn::Dropout(0.5), nn::Linear(6, 6));
  GPipe shared(dropout, cpu({1, 2}));
  CATCH_CHECK_FALSE(shared->partitions_on_own_threads());
  CATCH_CHECK_FALSE(shared->stage_local_backward());
}

// `params` with `x` after them, for torch::autograd::grad.
std::vector<at::Tensor> with_input(const std::vector<at::Tensor>& params, const at::Tensor& x) {
  std::vector<at::Tensor> all = params;
  all.push_back(x);
  return all;
}

CATCH_TEST_CASE("a backward that is not plain runs through the hand-offs as the one graph: grad, "
                "backward with inputs and create_graph give the plain model's results",
                "[gpipe][stage_backward]") {
  const bool skips = GENERATE(false, true);
  CATCH_CAPTURE(skips);
  ThreadLog log;
  nn::Sequential plain = skips ? make_skip_model() : make_model();
  GPipe pipe(skips ? make_skip_model() : make_model(&log),
             GPipeOptions(skips ? std::vector<int64_t>{4, 4, 4} : std::vector<int64_t>{3, 3, 3})
                 .chunks(4)
                 .checkpoint(Checkpoint::kNever)
                 .devices({at::kCPU, at::kCPU, at::kCPU}));
  CATCH_REQUIRE(pipe->stage_local_backward());
  const at::Tensor x = at::randn({7, 6}, at::kDouble);
  const at::Tensor y = at::randn({7, 6}, at::kDouble);
  auto loss_of = [&](auto& model, const at::Tensor& input) {
    return at::mse_loss(model->forward(input), y);
  };
  {
    // torch::autograd::grad: every parameter and the input, nothing accumulated in .grad.
    const at::Tensor x1 = x.clone().requires_grad_(true);
    const at::Tensor x2 = x.clone().requires_grad_(true);
    const auto a =
        torch::autograd::grad({loss_of(plain, x1)}, with_input(plain->parameters(), x1));
    const auto b =
        torch::autograd::grad({loss_of(pipe, x2)}, with_input(pipe->parameters(), x2));
    CATCH_REQUIRE(a.size() == b.size());
    for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(max_diff(a[k], b[k]) <= 1e-12);
    for (const at::Tensor& p : pipe->parameters()) CATCH_CHECK_FALSE(p.grad().defined());
    if (!skips) {
      // It ran as the one graph: partition 2's backward on the calling thread.
      CATCH_CHECK(log.backward[2] == std::set<std::thread::id>{std::this_thread::get_id()});
    }
  }
  {
    // backward with inputs: only the first and the last layer's weights get gradients.
    const auto pa = plain->parameters();
    const auto pb = pipe->parameters();
    torch::autograd::backward({loss_of(plain, x)}, {}, false, false,
                              {pa.front(), pa[pa.size() - 2]});
    torch::autograd::backward({loss_of(pipe, x)}, {}, false, false,
                              {pb.front(), pb[pb.size() - 2]});
    for (size_t k = 0; k < pa.size(); ++k) {
      const bool chosen = k == 0 || k == pa.size() - 2;
      CATCH_CHECK(pb[k].grad().defined() == chosen);
      if (chosen) CATCH_CHECK(max_diff(pa[k].grad(), pb[k].grad()) <= 1e-12);
    }
    plain->zero_grad();
    pipe->zero_grad();
  }
  {
    // create_graph: a gradient penalty's gradients (second derivatives through every partition).
    auto penalty = [&](auto& model) {
      const auto g = torch::autograd::grad({loss_of(model, x)}, model->parameters(), {},
                                           /*retain_graph=*/true, /*create_graph=*/true);
      at::Tensor sum = at::zeros({}, at::kDouble);
      for (const at::Tensor& t : g) sum = sum + t.pow(2).sum();
      return sum;
    };
    penalty(plain).backward();
    penalty(pipe).backward();
    check_same_grads(plain->parameters(), pipe->parameters(), 1e-12);
  }
}

CATCH_TEST_CASE("a retained graph takes a second stage-local backward and then a grad, as in the "
                "plain model",
                "[gpipe][stage_backward]") {
  const bool skips = GENERATE(false, true);
  CATCH_CAPTURE(skips);
  nn::Sequential plain = skips ? make_skip_model() : make_model();
  GPipe pipe(skips ? make_skip_model() : make_model(),
             GPipeOptions(skips ? std::vector<int64_t>{4, 4, 4} : std::vector<int64_t>{3, 3, 3})
                 .chunks(4)
                 .checkpoint(Checkpoint::kNever)
                 .devices({at::kCPU, at::kCPU, at::kCPU}));
  CATCH_REQUIRE(pipe->stage_local_backward());
  const at::Tensor x = at::randn({7, 6}, at::kDouble);
  const at::Tensor la = plain->forward(x).pow(2).sum();
  const at::Tensor lb = pipe->forward(x).pow(2).sum();
  for (int k = 0; k < 2; ++k) {
    la.backward({}, /*retain_graph=*/true);
    lb.backward({}, /*retain_graph=*/true);
    check_same_grads(plain->parameters(), pipe->parameters(), 1e-12);  // summed over both
  }
  const auto a = torch::autograd::grad({la}, plain->parameters(), {}, /*retain_graph=*/true);
  const auto b = torch::autograd::grad({lb}, pipe->parameters(), {}, /*retain_graph=*/true);
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(max_diff(a[k], b[k]) <= 1e-12);
  // The last backward frees the graph; one more is refused, naming retain_graph.
  la.backward();
  lb.backward();
  check_same_grads(plain->parameters(), pipe->parameters(), 1e-12);
  CATCH_CHECK_THROWS_WITH(lb.backward(), gpipe_test::contains("retain_graph"));
}

// Keeps a loss of its own from inside the partition (h's squares, summed: over the micro-batches
// the same as over the batch).
struct KeepsLossImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(x);
    std::lock_guard<std::mutex> lock(mu);
    kept.push_back(h.pow(2).sum());
    return h * 2;
  }
  at::Tensor kept_sum() {
    std::lock_guard<std::mutex> lock(mu);
    at::Tensor sum = at::zeros({}, at::kDouble);
    for (const at::Tensor& t : kept) sum = sum + t;
    kept.clear();
    return sum;
  }
  std::mutex mu;
  std::vector<at::Tensor> kept;
};
TORCH_MODULE(KeepsLoss);

// Multiplies by a tensor made outside the model (with a history), the same for every micro-batch.
struct ScaledImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x * scale; }
  at::Tensor scale;
};
TORCH_MODULE(Scaled);

CATCH_TEST_CASE("a backward that reaches into a partition by another path, through a tensor that "
                "every micro-batch shares, or to a parameter from outside the pipeline, runs as "
                "the one graph and gives the plain model's gradients",
                "[gpipe][stage_backward]") {
  // A loss a layer keeps, a tensor made outside the model, a penalty on a weight in the loss.
  const int path = GENERATE(0, 1, 2);
  CATCH_CAPTURE(path);
  const bool kept = path == 0;
  auto model = [&](KeepsLoss keeps, Scaled scaled) {
    torch::manual_seed(11);
    nn::Sequential seq(nn::Linear(6, 6), nn::Tanh(), nn::Linear(6, 6));
    if (path == 0) seq->push_back(keeps);
    if (path == 1) seq->push_back(scaled);
    if (path == 2) seq->push_back(nn::Tanh());
    seq->push_back(nn::Linear(6, 6));
    seq->push_back(nn::Tanh());
    seq->to(at::kDouble);
    return seq;
  };
  KeepsLoss keeps_plain, keeps_pipe;
  Scaled scaled_plain, scaled_pipe;
  const at::Tensor w = at::randn({6}, at::kDouble);
  const at::Tensor w_plain = w.clone().requires_grad_(true);
  const at::Tensor w_pipe = w.clone().requires_grad_(true);
  nn::Sequential plain = model(keeps_plain, scaled_plain);
  GPipe pipe(model(keeps_pipe, scaled_pipe), GPipeOptions({2, 2, 2})
                                                 .chunks(4)
                                                 .checkpoint(Checkpoint::kNever)
                                                 .devices({at::kCPU, at::kCPU, at::kCPU}));
  CATCH_REQUIRE(pipe->stage_local_backward());
  for (int step = 0; step < 2; ++step) {
    scaled_plain->scale = w_plain.pow(2);  // a node that keeps w for its backward
    scaled_pipe->scale = w_pipe.pow(2);
    const at::Tensor x = at::randn({7, 6}, at::kDouble);
    at::Tensor a = plain->forward(x).pow(2).sum();
    at::Tensor b = pipe->forward(x).pow(2).sum();
    if (kept) {
      a = a + keeps_plain->kept_sum();
      b = b + keeps_pipe->kept_sum();
    }
    if (path == 2) {
      a = a + plain->parameters().front().pow(2).sum();
      b = b + pipe->parameters().front().pow(2).sum();
    }
    a.backward();
    b.backward();
    check_same_grads(plain->parameters(), pipe->parameters(), 1e-12);
    if (path == 1) CATCH_CHECK(max_diff(w_plain.grad(), w_pipe.grad()) <= 1e-12);
    plain->zero_grad();
    pipe->zero_grad();
  }
}

}  // namespace
}  // namespace gpipe
