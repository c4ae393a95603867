// Tests of the GPipe module's API: construction, clear errors on bad input, module behaviour
// (parameters, modes, serialization, optimizers, dtype and device moves) and thread state.
#include <ATen/autocast_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/cuda.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/version.h>

#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "gpipe/internal/partition_threads.h"
#include "gpipe/thread_state.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

nn::Sequential mlp() {
  return nn::Sequential(nn::Linear(4, 6), nn::ReLU(), nn::Linear(6, 6), nn::Tanh(),
                        nn::Linear(6, 2));
}

GPipeOptions cpu(std::vector<int64_t> balance) {
  const size_t n = balance.size();
  return GPipeOptions(std::move(balance)).devices(std::vector<c10::Device>(n, at::kCPU));
}

CATCH_TEST_CASE("GPipe reports its configuration", "[gpipe][api]") {
  GPipe model(build(mlp, 1), cpu({2, 3}).chunks(4).checkpoint(Checkpoint::kNever));
  CATCH_CHECK(model->balance() == std::vector<int64_t>{2, 3});
  CATCH_CHECK(model->devices() == std::vector<c10::Device>{at::kCPU, at::kCPU});
  CATCH_CHECK(model->chunks() == 4);
  CATCH_CHECK(model->checkpoint() == Checkpoint::kNever);
  CATCH_CHECK(model->partitions().size() == 2);
  CATCH_CHECK(model->partitions()[0]->size() == 2);
  CATCH_CHECK(model->partitions()[1]->size() == 3);
  CATCH_CHECK(model->size() == 5);
}

CATCH_TEST_CASE("GPipe prints its configuration", "[gpipe][api]") {
  GPipe model(build(mlp, 1), cpu({2, 3}).chunks(4).deferred_batch_norm(true));
  std::ostringstream out;
  model->pretty_print(out);
  CATCH_CHECK(out.str() == "gpipe::GPipe(balance={2, 3}, devices={cpu, cpu}, chunks=4, "
                           "checkpoint=except_last, deferred_batch_norm=true)");
}

CATCH_TEST_CASE("GPipe defaults to one micro-batch, kExceptLast and every GPU, else the CPU",
                "[gpipe][api]") {
  const size_t gpus = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
  if (gpus == 1) {
    // As in the reference: the default devices are the GPUs, one per partition.
    CATCH_CHECK_THROWS_WITH(GPipe(build(mlp, 1), GPipeOptions({3, 2})),
                            gpipe_test::contains("2 partitions, but only 1 devices"));
    return;
  }
  GPipe model(build(mlp, 1), GPipeOptions({3, 2}));
  CATCH_CHECK(model->chunks() == 1);
  CATCH_CHECK(model->checkpoint() == Checkpoint::kExceptLast);
  CATCH_CHECK(model->devices().size() == 2);
  const c10::Device first = gpus == 0 ? c10::Device(at::kCPU) : c10::Device(at::kCUDA, 0);
  CATCH_CHECK(model->devices()[0] == first);
}

CATCH_TEST_CASE("GPipe ignores devices beyond the number of partitions", "[gpipe][api]") {
  GPipe model(build(mlp, 1), GPipeOptions({5}).devices({at::kCPU, at::kCPU, at::kCPU}));
  CATCH_CHECK(model->devices().size() == 1);
}

CATCH_TEST_CASE("GPipe refuses a device this machine does not have before using it, naming it",
                "[gpipe][api][errors]") {
  const auto [gpu, reason] = unavailable_cuda();
  CATCH_CAPTURE(gpu, reason);
  CATCH_CHECK_THROWS_WITH(GPipe(build(mlp, 1), GPipeOptions({3, 2}).devices({at::kCPU, gpu})),
                          gpipe_test::contains("GPipe: partition 1 is on " + gpu.str() + ", " +
                                               reason));
  // Only the devices of partitions are checked.
  GPipe model(build(mlp, 1), GPipeOptions({5}).devices({at::kCPU, gpu}));
  CATCH_CHECK(model->devices().size() == 1);
}

CATCH_TEST_CASE("GPipe warns of random numbers in concurrent CPU partitions only where a "
                "checkpointed partition draws them",
                "[gpipe][api]") {
  auto with_dropout = [] {
    return nn::Sequential(nn::Linear(4, 6), nn::ReLU(), nn::Dropout(0.5), nn::Linear(6, 2));
  };
  auto without = [] {
    return nn::Sequential(nn::Linear(4, 6), nn::ReLU(), nn::Tanh(), nn::Linear(6, 2));
  };
  auto warnings = [](nn::Sequential model, GPipeOptions options) {
    CaptureWarnings capture;
    GPipe pipe(std::move(model), std::move(options));
    return capture.messages;
  };
  const GPipeOptions threads = gpipe::internal::with_partition_threads(cpu({2, 2}).chunks(2), true);
  const auto warned = warnings(with_dropout(), threads);
  CATCH_REQUIRE(warned.size() == 1);
  CATCH_CHECK_THAT(warned[0], gpipe_test::contains("GPipe: partition 1 holds '2' "
                                                   "(torch::nn::DropoutImpl), which draws random "
                                                   "numbers"));
  // Nothing random, nothing checkpointed, or no partitions running at the same time: no warning.
  CATCH_CHECK(warnings(without(), threads).empty());
  CATCH_CHECK(
      warnings(with_dropout(), GPipeOptions(threads).checkpoint(Checkpoint::kNever)).empty());
  CATCH_CHECK(warnings(with_dropout(), GPipeOptions(threads).chunks(1)).empty());
  CATCH_CHECK(warnings(with_dropout(),
                       gpipe::internal::with_partition_threads(GPipeOptions(threads), false))
                  .empty());
  CATCH_CHECK(
      warnings(with_dropout(), gpipe::internal::with_partition_threads(cpu({4}).chunks(2), true))
          .empty());
}

CATCH_TEST_CASE("GPipe names parameters by partition and layer", "[gpipe][api]") {
  GPipe model(build(mlp, 1), cpu({2, 3}));
  auto params = model->named_parameters();
  CATCH_CHECK(params.contains("partitions.0.0.weight"));
  CATCH_CHECK(params.contains("partitions.1.4.bias"));
  CATCH_CHECK(params.size() == 6);
}

CATCH_TEST_CASE("GPipe holds the user's layer objects", "[gpipe][api]") {
  nn::Sequential seq = build(mlp, 1);
  GPipe model(seq, cpu({2, 3}));
  CATCH_CHECK(model->partitions()[1]->ptr(0).get() == seq->ptr(2).get());
}

CATCH_TEST_CASE("GPipe of an empty Sequential returns its input", "[gpipe][api]") {
  GPipe model(nn::Sequential(), GPipeOptions(std::vector<int64_t>{}));
  at::Tensor x = at::randn({3, 2});
  CATCH_CHECK(model->forward(x).equal(x));
  CATCH_CHECK(model->partitions().empty());
  // A schedule for no partitions is no schedule: nothing to check, nothing refused.
  GPipe interleaved(nn::Sequential(), GPipeOptions(std::vector<int64_t>{})
                                          .schedule(PipelineSchedule::interleaved(2)));
  CATCH_CHECK(interleaved->forward(x).equal(x));
}

CATCH_TEST_CASE("train and eval reach every partition's layers", "[gpipe][api]") {
  GPipe model(build(mlp, 1), cpu({2, 3}));
  model->eval();
  for (const auto& m : model->modules()) CATCH_CHECK_FALSE(m->is_training());
  model->train();
  for (const auto& m : model->modules()) CATCH_CHECK(m->is_training());
}

CATCH_TEST_CASE("an optimizer over a GPipe trains it exactly as the plain model",
                "[gpipe][api]") {
  nn::Sequential plain = build(mlp, 2);
  GPipe model(build(mlp, 2), cpu({1, 2, 2}).chunks(3));
  torch::optim::SGD opt1(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD opt2(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    at::Tensor x = at::randn({6, 4}, at::kDouble);
    opt1.zero_grad();
    opt2.zero_grad();
    plain->forward(x).pow(2).sum().backward();
    model->forward(x).pow(2).sum().backward();
    opt1.step();
    opt2.step();
  }
  auto p1 = plain->parameters();
  auto p2 = model->parameters();
  CATCH_REQUIRE(p1.size() == p2.size());
  for (size_t k = 0; k < p1.size(); ++k) CATCH_CHECK(max_diff(p1[k], p2[k]) <= 1e-10);
}

CATCH_TEST_CASE("a GPipe saves and loads with torch::save and torch::load", "[gpipe][api]") {
  const std::string path =
      (std::filesystem::temp_directory_path() / "gpipe_test_save.pt").string();
  GPipe saved(build(mlp, 3), cpu({2, 3}));
  torch::save(saved, path);
  GPipe loaded(build(mlp, 4), cpu({2, 3}));
  auto before = loaded->parameters();
  CATCH_CHECK(max_diff(before[0], saved->parameters()[0]) > 0);  // different seeds
  torch::load(loaded, path);
  std::remove(path.c_str());
  auto a = saved->parameters();
  auto b = loaded->parameters();
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(a[k].equal(b[k]));
  at::Tensor x = at::randn({5, 4}, at::kDouble);
  CATCH_CHECK(saved->forward(x).equal(loaded->forward(x)));
}

CATCH_TEST_CASE("a GPipe refuses to move to a device but changes dtype", "[gpipe][api][errors]") {
  GPipe model(build(mlp, 1), cpu({2, 3}));
  CATCH_CHECK_THROWS_WITH(model->to(at::kCPU),
                          gpipe_test::contains("refuses to move") && gpipe_test::contains("GPipeOptions::devices"));
  CATCH_CHECK_THROWS_WITH(model->to(at::kCPU, at::kFloat), gpipe_test::contains("refuses to move"));
  model->to(at::kFloat);
  for (const auto& p : model->parameters()) CATCH_CHECK(p.scalar_type() == at::kFloat);
  CATCH_CHECK(model->forward(at::randn({4, 4})).scalar_type() == at::kFloat);
  // A parent module moving its children is refused too.
  struct Parent : nn::Module {};
  auto parent = std::make_shared<Parent>();
  parent->register_module("pipe", model.ptr());
  CATCH_CHECK_THROWS_WITH(parent->to(at::kCPU), gpipe_test::contains("refuses to move"));
}

CATCH_TEST_CASE("bad balances are refused with a clear error", "[gpipe][errors]") {
  CATCH_CHECK_THROWS_WITH(GPipe(build(mlp, 1), cpu({2, 2})),
                          gpipe_test::contains("balance {2, 2} adds up to 4 layers, but the Sequential "
                                          "has 5") &&
                              gpipe_test::contains("gpipe::balance_by_time"));
  CATCH_CHECK_THROWS_WITH(GPipe(build(mlp, 1), cpu({3, 0, 2})),
                          gpipe_test::contains("non-positive entry 0") &&
                              gpipe_test::contains("balance_by_time"));
  CATCH_CHECK_THROWS_WITH(GPipe(build(mlp, 1), cpu({6, -1})),
                          gpipe_test::contains("non-positive entry -1"));
  CATCH_CHECK_THROWS_WITH(GPipe(build(mlp, 1), GPipeOptions(std::vector<int64_t>{})),
                          gpipe_test::contains("balance is empty, but the Sequential has 5 layers"));
}

CATCH_TEST_CASE("non-positive chunks are refused", "[gpipe][errors]") {
  const int64_t chunks = GENERATE(0, -1);
  CATCH_CHECK_THROWS_WITH(GPipe(build(mlp, 1), cpu({5}).chunks(chunks)),
                          gpipe_test::contains("GPipe: chunks must be at least 1, got " +
                                               std::to_string(chunks)));
}

CATCH_TEST_CASE("fewer devices than partitions are refused", "[gpipe][errors]") {
  CATCH_CHECK_THROWS_WITH(
      GPipe(build(mlp, 1), GPipeOptions({2, 2, 1}).devices({at::kCPU, at::kCPU})),
      gpipe_test::contains("3 partitions, but only 2 devices"));
}

CATCH_TEST_CASE("a module object used twice is refused", "[gpipe][errors]") {
  nn::Linear shared(4, 4);
  nn::Sequential seq(shared, nn::ReLU(), shared);
  CATCH_CHECK_THROWS_WITH(GPipe(seq, cpu({1, 2})),
                          gpipe_test::contains("same module object twice") &&
                              gpipe_test::contains("layer 0 ('0', torch::nn::LinearImpl)") &&
                              gpipe_test::contains("layer 2 ('2'"));
}

// A layer that uses another layer's weight.
// A layer that returns a value of the wrong type.
struct CountRowsImpl : nn::Module {
  int64_t forward(const at::Tensor& x) { return x.size(0); }
};
TORCH_MODULE(CountRows);

CATCH_TEST_CASE("a layer returning something other than tensors is named in the error",
                "[gpipe][errors]") {
  nn::Sequential seq(nn::Linear(4, 4), CountRows(), nn::ReLU());
  GPipe model(seq, cpu({2, 1}).chunks(2));
  CATCH_CHECK_THROWS_WITH(model->forward(at::randn({4, 4})),
                          gpipe_test::contains("layer '1' (") &&
                              gpipe_test::contains("CountRowsImpl) returned a value of type long") && gpipe_test::contains("std::vector<at::Tensor>"));
}

CATCH_TEST_CASE("a layer given a tuple where it takes a tensor is named in the error",
                "[gpipe][errors]") {
  GPipe model(nn::Sequential(nn::Linear(4, 4)), cpu({1}));
  CATCH_CHECK_THROWS_WITH(model->forward(std::vector<at::Tensor>{at::randn({2, 4})}),
                          gpipe_test::contains("layer '0' (torch::nn::LinearImpl)"));
}

CATCH_TEST_CASE("bad inputs are refused with a clear error", "[gpipe][errors]") {
  GPipe model(build(mlp, 1), cpu({2, 3}));
  CATCH_CHECK_THROWS_WITH(model->forward(at::empty({4, 4}, at::kMeta)),
                          gpipe_test::contains("input tensor 0 is on meta") &&
                              gpipe_test::contains("first partition is on cpu"));
  CATCH_CHECK_THROWS_WITH(model->forward(at::Tensor()), gpipe_test::contains("is undefined"));
  CATCH_CHECK_THROWS_WITH(model->forward(at::ones({})), gpipe_test::contains("0-dimensional"));
  CATCH_CHECK_THROWS_WITH(model->forward(std::vector<at::Tensor>{}), gpipe_test::contains("empty vector"));
  CATCH_CHECK_THROWS_WITH(
      model->forward(std::vector<at::Tensor>{at::ones({4, 4}), at::ones({3, 4})}),
      gpipe_test::contains("same size in dimension 0") && gpipe_test::contains("tensor 1 has 3"));
}

CATCH_TEST_CASE("batches smaller than chunks or not divisible by chunks work", "[gpipe][api]") {
  const int64_t rows = GENERATE(1, 2, 5, 7);
  nn::Sequential plain = build(mlp, 5);
  GPipe model(build(mlp, 5), cpu({2, 3}).chunks(4));
  at::Tensor x = at::randn({rows, 4}, at::kDouble);
  CATCH_CHECK(max_diff(plain->forward(x), model->forward(x)) <= 1e-12);
}

// The caller's thread-local state reaches the layers run by worker threads.
struct DtypeSpyImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    seen_inference = c10::InferenceMode::is_enabled();
    seen_grad = at::GradMode::is_enabled();
    return x;
  }
  bool seen_inference = false;
  bool seen_grad = true;
};
TORCH_MODULE(DtypeSpy);

void set_cpu_autocast(bool enabled) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
#else
  at::autocast::set_cpu_enabled(enabled);
#endif
}

CATCH_TEST_CASE("autocast in the caller applies to the layers in the workers",
                "[gpipe][thread_state]") {
  nn::Sequential seq(nn::Linear(4, 8), nn::ReLU(), nn::Linear(8, 2));
  nn::Sequential plain(nn::Linear(4, 8), nn::ReLU(), nn::Linear(8, 2));
  GPipe model(seq, gpipe::internal::with_partition_threads(cpu({1, 2}).chunks(2), true));
  at::Tensor x = at::randn({4, 4});
  set_cpu_autocast(true);
  at::Tensor y = model->forward(x);
  at::Tensor y_plain = plain->forward(x);
  set_cpu_autocast(false);
  CATCH_CHECK(y_plain.scalar_type() == at::kBFloat16);
  CATCH_CHECK(y.scalar_type() == at::kBFloat16);
}

CATCH_TEST_CASE("inference mode and no-grad mode in the caller apply in the workers",
                "[gpipe][thread_state]") {
  DtypeSpy spy;
  GPipe model(nn::Sequential(nn::Linear(4, 4), spy),
              gpipe::internal::with_partition_threads(cpu({1, 1}), true));
  {
    c10::InferenceMode guard;
    at::Tensor y = model->forward(at::randn({2, 4}));
    CATCH_CHECK(y.is_inference());
    CATCH_CHECK(spy->seen_inference);
  }
  {
    at::NoGradGuard no_grad;
    at::Tensor y = model->forward(at::randn({2, 4}));
    CATCH_CHECK_FALSE(y.requires_grad());
    CATCH_CHECK_FALSE(spy->seen_grad);
    CATCH_CHECK_FALSE(spy->seen_inference);
  }
  CATCH_CHECK(model->forward(at::randn({2, 4})).requires_grad());
}

// A piece of debug information, to tell whether a thread state carries it.
struct TestDebugInfo : c10::DebugInfoBase {};

// Counts the operators a thread-local record-function callback saw.
std::atomic<int> seen_by_callback{0};
std::unique_ptr<at::ObserverContext> count_operator(const at::RecordFunction&) {
  ++seen_by_callback;
  return nullptr;
}

// The versions whose thread state gpipe reads (Note [Installing a state that is already there]);
// on others the guard always installs the whole state.
constexpr bool kReadsThreadState = (TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR == 13) ||
                                   (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 6);

CATCH_TEST_CASE("a thread-state guard installs every setting of its state that the thread lacks, "
                "the record-function callbacks by a whole install",
                "[gpipe][thread_state]") {
  // Each kind of setting is on where the state is taken, off where the guard installs it.
  const std::string kind = GENERATE("inference mode", "no grad", "autocast", "below autograd",
                                    "record-function callback", "record functions off",
                                    "debug info");
  CATCH_CAPTURE(kind);
  const bool whole = kind == "record-function callback" || kind == "record functions off";
  std::unique_ptr<ThreadState> state;
  at::CallbackHandle callback = 0;
  {
    c10::InferenceMode inference(kind == "inference mode");
    at::AutoGradMode grad_mode(kind != "no grad" && kind != "inference mode");
    at::RecordFunctionGuard record_functions(kind != "record functions off");
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    std::optional<c10::DebugInfoGuard> debug_info;
    if (kind == "autocast") set_cpu_autocast(true);
    if (kind == "below autograd") below_autograd.emplace();
    if (kind == "record-function callback") {
      callback = at::addThreadLocalCallback(at::RecordFunctionCallback(&count_operator));
    }
    if (kind == "debug info") {
      debug_info.emplace(c10::DebugInfoKind::TEST_INFO, std::make_shared<TestDebugInfo>());
    }
    state = std::make_unique<ThreadState>();
    if (kind == "autocast") set_cpu_autocast(false);
    if (callback != 0) at::removeCallback(callback);
  }
  // Whether the setting is in force on this thread.
  auto in_force = [&] {
    if (kind == "inference mode") return c10::InferenceMode::is_enabled();
    if (kind == "no grad") return !at::GradMode::is_enabled();
    if (kind == "autocast") {
      return at::matmul(at::randn({2, 2}), at::randn({2, 2})).scalar_type() == at::kBFloat16;
    }
    if (kind == "below autograd") {
      return c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::ADInplaceOrView);
    }
    if (kind == "record-function callback") {
      seen_by_callback = 0;
      at::Tensor unused = at::randn({2}) + 1;
      return seen_by_callback > 0;
    }
    if (kind == "record functions off") return !at::isRecordFunctionEnabled();
    return c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::TEST_INFO) != nullptr;
  };
  CATCH_REQUIRE_FALSE(in_force());
  {
    ThreadStateGuard guard(*state);
    CATCH_CHECK(in_force());
    CATCH_CHECK(guard.installed() == (whole || !kReadsThreadState));
  }
  CATCH_CHECK_FALSE(in_force());
}

CATCH_TEST_CASE("a thread-state guard sets a state whose callbacks are in place without a whole "
                "install, and puts the thread's own back",
                "[gpipe][thread_state]") {
  const bool grad = GENERATE(true, false);
  const bool with_callback = GENERATE(false, true);
  CATCH_CAPTURE(grad, with_callback);
  // The same callback where the state is taken and where the guard runs.
  const at::CallbackHandle callback =
      with_callback ? at::addThreadLocalCallback(at::RecordFunctionCallback(&count_operator)) : 0;
  std::unique_ptr<ThreadState> state;
  {
    at::AutoGradMode mode(grad);
    state = std::make_unique<ThreadState>();
  }
  {
    at::AutoGradMode other(!grad);
    {
      ThreadStateGuard guard(*state);
      CATCH_CHECK(at::GradMode::is_enabled() == grad);
      CATCH_CHECK(guard.installed() == !kReadsThreadState);
      seen_by_callback = 0;
      at::Tensor unused = at::randn({2}) + 1;
      CATCH_CHECK((seen_by_callback > 0) == with_callback);
    }
    CATCH_CHECK(at::GradMode::is_enabled() == !grad);
  }
  {
    // Inference mode (which turns grad mode off) where the guard runs, not where the state was
    // taken.
    c10::InferenceMode inference;
    {
      ThreadStateGuard guard(*state);
      CATCH_CHECK_FALSE(c10::InferenceMode::is_enabled());
      CATCH_CHECK_FALSE(at::ones({1}).is_inference());
      CATCH_CHECK(at::GradMode::is_enabled() == grad);
      CATCH_CHECK(guard.installed() == !kReadsThreadState);
    }
    CATCH_CHECK(c10::InferenceMode::is_enabled());
    CATCH_CHECK(at::ones({1}).is_inference());
    CATCH_CHECK_FALSE(at::GradMode::is_enabled());
  }
  if (callback != 0) at::removeCallback(callback);
}

CATCH_TEST_CASE("a thread-state guard takes away a callback its state lacks, by a whole install",
                "[gpipe][thread_state]") {
  const ThreadState state;
  const at::CallbackHandle callback =
      at::addThreadLocalCallback(at::RecordFunctionCallback(&count_operator));
  auto fires = [] {
    seen_by_callback = 0;
    at::Tensor unused = at::randn({2}) + 1;
    return seen_by_callback > 0;
  };
  CATCH_REQUIRE(fires());
  {
    ThreadStateGuard guard(state);
    CATCH_CHECK(guard.installed());
    CATCH_CHECK_FALSE(fires());
  }
  CATCH_CHECK(fires());
  at::removeCallback(callback);
}

// Records the thread each forward of its layer ran on.
struct ThreadLogImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    std::lock_guard<std::mutex> lock(mu);
    threads.insert(std::this_thread::get_id());
    return x;
  }
  std::mutex mu;
  std::set<std::thread::id> threads;
};
TORCH_MODULE(ThreadLog);

CATCH_TEST_CASE("forward() runs CPU partitions on threads of their own, but keeps partitions "
                "that draw random numbers on one",
                "[gpipe][worker]") {
  // Note [Threads of forward()]: the decision, then the threads the layers' forwards ran on, and
  // the result against the plain model (with dropout, in the second partition: the same draws in
  // two seeded runs, and in the checkpoints' recomputation, whose gradients match a run that
  // stores every activation).
  const bool random = GENERATE(false, true);
  CATCH_CAPTURE(random);
  auto make = [random](ThreadLog a, ThreadLog b) {
    torch::manual_seed(5);
    nn::Sequential seq = random ? nn::Sequential(nn::Linear(4, 6), a, nn::Tanh(), nn::Linear(6, 6),
                                                 nn::Dropout(0.5), b, nn::Linear(6, 2))
                                : nn::Sequential(nn::Linear(4, 6), a, nn::Tanh(), nn::Linear(6, 6),
                                                 b, nn::Linear(6, 2));
    seq->to(at::kDouble);
    return seq;
  };
  const std::vector<int64_t> balance =
      random ? std::vector<int64_t>{2, 5} : std::vector<int64_t>{2, 4};
  struct Run {
    bool own = false;
    std::set<std::thread::id> first, second;  // the threads of each partition's forwards
    std::vector<at::Tensor> out;              // the output, then each parameter's gradient
  };
  auto run = [&](Checkpoint mode) {
    ThreadLog a, b;
    GPipe model(make(a, b), cpu(balance).chunks(4).checkpoint(mode));
    Run r;
    r.own = model->partitions_on_own_threads();
    torch::manual_seed(11);
    const at::Tensor x = at::randn({8, 4}, at::kDouble);
    const at::Tensor y = model->forward(x);
    r.first = a->threads;  // before backward, whose recomputations run on the caller
    r.second = b->threads;
    y.pow(2).sum().backward();
    r.out.push_back(y.detach());
    for (const at::Tensor& p : model->parameters()) r.out.push_back(p.grad().clone());
    return r;
  };
  const Run got = run(Checkpoint::kAlways);
  CATCH_CHECK(got.own == !random);
  CATCH_REQUIRE(got.first.size() == 1);
  CATCH_REQUIRE(got.second.size() == 1);
  CATCH_CHECK((*got.first.begin() != *got.second.begin()) == !random);
  if (!random) {
    nn::Sequential plain = make(ThreadLog(), ThreadLog());
    torch::manual_seed(11);
    const at::Tensor x = at::randn({8, 4}, at::kDouble);
    const at::Tensor y = plain->forward(x);
    y.pow(2).sum().backward();
    CATCH_CHECK(at::allclose(got.out[0], y, 1e-12, 1e-12));
    const auto params = plain->parameters();
    CATCH_REQUIRE(got.out.size() == params.size() + 1);
    for (size_t k = 0; k < params.size(); ++k) {
      CATCH_CHECK(at::allclose(got.out[k + 1], params[k].grad(), 1e-12, 1e-12));
    }
    return;
  }
  const Run again = run(Checkpoint::kAlways);
  const Run stored = run(Checkpoint::kNever);
  CATCH_CHECK_FALSE(again.own);
  CATCH_CHECK_FALSE(stored.own);
  CATCH_REQUIRE(got.out.size() == again.out.size());
  CATCH_REQUIRE(got.out.size() == stored.out.size());
  for (size_t k = 0; k < got.out.size(); ++k) {
    CATCH_CHECK(at::equal(got.out[k], again.out[k]));
    CATCH_CHECK(at::allclose(got.out[k], stored.out[k], 1e-12, 1e-12));
  }
  // And the rest of the decision: one partition, stage-local backward, the override.
  CATCH_CHECK_FALSE(GPipe(make(ThreadLog(), ThreadLog()), cpu({7}))->partitions_on_own_threads());
  CATCH_CHECK(GPipe(make(ThreadLog(), ThreadLog()),
                    gpipe::internal::with_stage_local_backward(cpu(balance), true))
                  ->partitions_on_own_threads());
  CATCH_CHECK_FALSE(
      GPipe(build(mlp, 1), gpipe::internal::with_partition_threads(cpu({2, 3}), false))
          ->partitions_on_own_threads());
}

CATCH_TEST_CASE("a GPipe's worker threads end with it", "[gpipe][worker]") {
  const int before = worker_thread_count();
  for (int k = 0; k < 10; ++k) {
    // One thread for the device: the calling thread does all the work.
    GPipe model(build(mlp, 1),
                gpipe::internal::with_partition_threads(cpu({2, 3}).chunks(2), false));
    model->forward(at::randn({4, 4}, at::kDouble)).sum().backward();
    CATCH_CHECK(worker_thread_count() == before);
    // A thread for every partition but the first (each runs its backward there too).
    GPipe threaded(build(mlp, 1),
                   gpipe::internal::with_partition_threads(cpu({1, 1, 3}).chunks(2), true));
    threaded->forward(at::randn({4, 4}, at::kDouble)).sum().backward();
    CATCH_CHECK(worker_thread_count() == before + 2);
  }
  CATCH_CHECK(worker_thread_count() == before);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
