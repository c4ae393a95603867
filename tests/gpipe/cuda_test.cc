// GPipe on CUDA: streams, copies between devices, skips between devices, synchronisation, the
// CUDA random generator in recomputation and deferred batch norm. Tagged [cuda]: skipped where no
// CUDA device is present.
#include "tests/gpipe/test_util.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>

#include <map>
#include <optional>

#include "gpipe/internal/partition_threads.h"
#include "gpipe/skippable.h"
#include "gpipe/internal/stream.h"

#ifdef GPIPE_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

nn::Sequential cuda_model() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 8, 3).padding(1)), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(8, 8, 3).padding(1)), nn::Tanh(),
                        nn::Flatten(), nn::Linear(8 * 6 * 6, 16), nn::Dropout(0.25), nn::ReLU(),
                        nn::Linear(16, 4));
}

// One training step with the generators seeded; returns the output and the gradients (on CPU).
std::vector<at::Tensor> step(const std::function<at::Tensor(const at::Tensor&)>& forward,
                             const std::vector<at::Tensor>& params, const at::Tensor& x) {
  at::manual_seed(5);
  at::Tensor y = forward(x);
  (y * y).sum().backward();
  std::vector<at::Tensor> out{y.detach().cpu()};
  for (const auto& p : params) out.push_back(p.grad().cpu());
  return out;
}

CATCH_TEST_CASE("on one GPU, GPipe equals the plain Sequential with streams and copies",
                "[cuda][transparency]") {
  const int64_t chunks = GENERATE(1, 3, 4);
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(chunks, static_cast<int>(mode));
  const c10::Device gpu(at::kCUDA, 0);
  auto make = [] { return cuda_model(); };
  nn::Sequential plain = build(make, 3);
  plain->to(gpu);
  plain->eval();  // no dropout: the micro-batch split changes the random draws
  GPipe model(build(make, 3),
              GPipeOptions({2, 3, 4}).devices({gpu, gpu, gpu}).chunks(chunks).checkpoint(mode));
  model->train();
  for (auto& m : model->modules()) {
    if (dynamic_cast<nn::DropoutImpl*>(m.get())) m->eval();
  }
  const at::Tensor x = at::randn({7, 3, 6, 6}, at::TensorOptions(at::kDouble).device(gpu));
  const auto a = step([&](const at::Tensor& in) { return plain->forward(in); }, plain->parameters(), x);
  const auto b = step([&](const at::Tensor& in) { return model->forward(in); }, model->parameters(), x);
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(max_diff(a[k], b[k]) <= 1e-10);
}

CATCH_TEST_CASE("a pipeline from the CPU to a GPU copies activations and gradients across",
                "[cuda][copy]") {
  const c10::Device gpu(at::kCUDA, 0);
  auto make = [] { return cuda_model(); };
  nn::Sequential plain = build(make, 4);
  plain->eval();
  GPipe model(build(make, 4), GPipeOptions({4, 5}).devices({at::kCPU, gpu}).chunks(3));
  model->eval();
  const at::Tensor x = at::randn({6, 3, 6, 6}, at::kDouble);
  at::Tensor y = model->forward(x);
  CATCH_CHECK(y.device() == gpu);
  CATCH_CHECK(model->partitions()[0]->parameters()[0].device().is_cpu());
  const auto a = step([&](const at::Tensor& in) { return plain->forward(in); }, plain->parameters(), x);
  const auto b = step([&](const at::Tensor& in) { return model->forward(in); }, model->parameters(), x);
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(max_diff(a[k], b[k]) <= 1e-10);
}

CATCH_TEST_CASE("on a GPU, recomputation replays the CUDA generator: dropout masks match",
                "[cuda][checkpoint]") {
  const c10::Device gpu(at::kCUDA, 0);
  const at::Tensor x = at::randn({8, 3, 6, 6}, at::TensorOptions(at::kDouble).device(gpu));
  auto run = [&](Checkpoint mode) {
    GPipe model(build([] { return cuda_model(); }, 6),
                GPipeOptions({4, 5}).devices({gpu, gpu}).chunks(4).checkpoint(mode));
    model->train();
    return step([&](const at::Tensor& in) { return model->forward(in); }, model->parameters(), x);
  };
  const auto never = run(Checkpoint::kNever);
  const auto always = run(Checkpoint::kAlways);
  // Equal up to the order in which the GPU sums (a different dropout mask is off by far more).
  for (size_t k = 0; k < never.size(); ++k) CATCH_CHECK(max_diff(never[k], always[k]) <= 1e-12);
}

CATCH_TEST_CASE("on a GPU, deferred batch norm matches a full-batch BatchNorm",
                "[cuda][batchnorm]") {
  const c10::Device gpu(at::kCUDA, 0);
  auto make = [] {
    return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 4, 3).padding(1)), nn::BatchNorm2d(4));
  };
  nn::Sequential plain = build(make, 2);
  plain->to(gpu);
  GPipe model(build(make, 2), GPipeOptions({1, 1}).devices({gpu, gpu}).chunks(4).deferred_batch_norm(true));
  // The BatchNorm is the second partition's only layer and sees the first layer's output, which
  // does not depend on the split into micro-batches.
  const at::Tensor x = at::randn({8, 3, 5, 5}, at::TensorOptions(at::kDouble).device(gpu));
  plain->forward(x);
  model->forward(x);
  auto expected = plain->named_buffers();
  auto actual = model->named_buffers();
  for (const auto& b : expected) {
    CATCH_CHECK(max_diff(b.value(), actual["partitions.1." + b.key()]) <= 1e-6);
  }
}

CATCH_TEST_CASE("memory statistics are reported for CUDA devices", "[cuda][stream]") {
  const c10::Device gpu(at::kCUDA, 0);
  const int64_t before = gpipe::internal::memory_allocated(gpu);
  at::Tensor t = at::empty({1 << 20}, at::TensorOptions(at::kFloat).device(gpu));
  CATCH_CHECK(gpipe::internal::memory_allocated(gpu) >= before + (4 << 20));
  CATCH_CHECK(gpipe::internal::memory_allocated(at::kCPU) == -1);
}

// CUDA device k, or cuda:0 where there are not that many devices.
c10::Device cuda_device(size_t k) {
  const size_t count = torch::cuda::device_count();
  return c10::Device(at::kCUDA, static_cast<c10::DeviceIndex>(k < count ? k : 0));
}

// Queues `rounds` products of two 2048 x 2048 float matrices on `device`'s current stream and
// returns the last one: 17 GFLOP a round, a quarter of a millisecond on the fastest GPUs and more
// on others.
at::Tensor busy_work(const c10::Device& device, int64_t rounds) {
  const at::Tensor a =
      at::full({2048, 2048}, 1.0 / 2048, at::TensorOptions(at::kFloat).device(device));
  at::Tensor product = at::empty_like(a);
  for (int64_t k = 0; k < rounds; ++k) {
    at::mm_out(product, a, a);
  }
  return product;
}

// y = x, but only once `rounds` rounds of busy work on x's device are done (y adds zero times
// their result). Keeps the GPU well behind the host, so that a copy that did not wait for the
// work before it would read memory that is not written yet.
struct BusyImpl : nn::Module {
  explicit BusyImpl(int64_t rounds) : rounds(rounds) {}
  at::Tensor forward(const at::Tensor& x) {
    return x + busy_work(x.device(), rounds).sum().to(x.scalar_type()) * 0;
  }
  int64_t rounds;
};
TORCH_MODULE(Busy);

// Stashes 2 * x under `name` and passes x on.
struct SaveImpl : nn::Module {
  explicit SaveImpl(std::string name) : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) {
    stash(name, x * 2);
    return x;
  }
  std::string name;
};
TORCH_MODULE(Save);

// Adds what was stashed under `name`.
struct AddImpl : nn::Module {
  explicit AddImpl(std::string name) : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) { return x + pop(name); }
  std::string name;
};
TORCH_MODULE(Add);

Skippable<SaveImpl> save(const std::string& name) {
  return skippable(Save(name), SkippableOptions().stash({name}));
}
Skippable<AddImpl> add(const std::string& name) {
  return skippable(Add(name), SkippableOptions().pop({name}));
}

// 12 layers, in 4 partitions of 3: skip "a" from partition 0 to 3, over two partitions, and skip
// "b" from partition 1 to 2; each is stashed right after busy work.
nn::Sequential skip_model() {
  return nn::Sequential(nn::Linear(5, 6), Busy(8), save("a"),              //
                        nn::Linear(6, 6), Busy(8), save("b"),              //
                        nn::Linear(6, 6), add("b"), nn::Tanh(),            //
                        nn::Linear(6, 6), add("a"), nn::Linear(6, 3));
}

CATCH_TEST_CASE("skips between GPUs arrive complete: GPipe equals the plain Sequential",
                "[cuda][skip]") {
  const int64_t chunks = GENERATE(1, 3, 4);
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(chunks, static_cast<int>(mode));
  // Partitions alternate between two GPUs, so "a" goes from the first to the second and "b" the
  // other way (with one GPU, between partitions of cuda:0).
  const c10::Device first = cuda_device(0);
  const c10::Device second = cuda_device(1);
  nn::Sequential plain = build(skip_model, 3);
  plain->to(first);
  GPipe model(build(skip_model, 3), GPipeOptions({3, 3, 3, 3})
                                        .devices({first, second, first, second})
                                        .chunks(chunks)
                                        .checkpoint(mode));
  model->record_timeline(true);
  plain->train();
  model->train();
  const at::Tensor x = at::randn({8, 5}, at::TensorOptions(at::kDouble).device(first));
  at::Tensor x1 = x.clone().requires_grad_(true);
  at::Tensor x2 = x.clone().requires_grad_(true);
  const at::Tensor y1 = plain->forward(x1);
  const at::Tensor y2 = model->forward(x2);
  CATCH_CHECK(y2.device() == second);
  CATCH_CHECK(max_diff(y1, y2) <= 1e-10);
  // Both skips were moved, once per micro-batch.
  int64_t skip_copies = 0;
  for (const TimelineEvent& e : model->last_timeline()) {
    if (e.kind == TimelineEvent::Kind::kSkipCopy) ++skip_copies;
  }
  CATCH_CHECK(skip_copies == 2 * chunks);
  const at::Tensor w = at::rand_like(y1);
  (y1 * w).sum().backward();
  (y2 * w.to(y2.device())).sum().backward();
  check_same_grads(plain->parameters(), model->parameters(), 1e-10);
  CATCH_CHECK(max_diff(x1.grad(), x2.grad()) <= 1e-10);
}

CATCH_TEST_CASE("synchronize(device) waits for every stream of that device, whatever is current",
                "[cuda][stream]") {
  const c10::Device gpu = cuda_device(0);
  const c10::Stream side = gpipe::internal::new_stream(gpu);
  CATCH_REQUIRE(side != gpipe::internal::current_stream(gpu));
  // The calling thread's current device: the synchronised one, then another one if there is one.
  for (const c10::Device current : {cuda_device(0), cuda_device(1)}) {
    CATCH_CAPTURE(current);
    at::Tensor product;
    {
      c10::StreamGuard on_side(side);
      product = busy_work(gpu, 200);
    }
    // 200 rounds keep any GPU busy well past this point; if the work is somehow done already,
    // the check below proves nothing and is skipped rather than failed.
    if (side.query()) {
      CATCH_WARN("the side stream finished before synchronize(); nothing to check");
      continue;
    }
    {
      c10::DeviceGuard guard(current);
      gpipe::internal::synchronize(gpu);
    }
    CATCH_CHECK(side.query());
  }
}

CATCH_TEST_CASE("torch::kCUDA without an index means the current CUDA device, as in LibTorch",
                "[cuda][gpipe]") {
  const c10::Device last = cuda_device(torch::cuda::device_count() - 1);
  c10::DeviceGuard guard(last);
  GPipe model(nn::Sequential(nn::Linear(4, 4), nn::Linear(4, 2)),
              GPipeOptions({1, 1}).devices({at::kCUDA, at::kCUDA}));
  CATCH_CHECK(model->devices()[0] == last);
  CATCH_CHECK(model->devices()[1] == last);
  for (const auto& p : model->parameters()) CATCH_CHECK(p.device() == last);
}

CATCH_TEST_CASE("Partitions of two threads that share a GPU are refused only where a "
                "checkpointed one draws random numbers",
                "[cuda][gpipe]") {
  // Note [Random numbers in concurrent partitions], for every path that runs partitions at once.
  const c10::Device gpu = cuda_device(0);
  auto with_dropout = [] {
    return nn::Sequential(nn::Linear(4, 4), nn::Dropout(0.5), nn::Linear(4, 2));
  };
  const GPipeOptions two_on_one = GPipeOptions({2, 1}).devices({gpu, gpu}).chunks(2);
  CATCH_CHECK_THROWS_WITH(
      GPipe(with_dropout(),
            gpipe::internal::with_partition_threads(GPipeOptions(two_on_one), true)),
      gpipe_test::contains("GPipe: partition 0 holds '1'") && gpipe_test::contains("its own GPU"));
  const at::Tensor x = at::randn({4, 4}, gpu);
  const at::Tensor y = at::randn({4, 2}, gpu);
  auto mse = [](const Batch& out, const at::Tensor& target) {
    return torch::nn::functional::mse_loss(out[0], target);
  };
  GPipe lanes(with_dropout(), two_on_one);
  CATCH_CHECK_THROWS_WITH(lanes->step(x, y, mse),
                          gpipe_test::contains("GPipe::step: partition 0") &&
                              gpipe_test::contains("its own GPU"));
  // Nothing random, or nothing checkpointed: the partitions share the GPU (and the unchecked one
  // trains).
  GPipe plain_layers(nn::Sequential(nn::Linear(4, 4), nn::ReLU(), nn::Linear(4, 2)),
                     gpipe::internal::with_partition_threads(GPipeOptions(two_on_one), true));
  CATCH_CHECK(plain_layers->devices()[1] == gpu);
  GPipe unchecked(with_dropout(), GPipeOptions(two_on_one).checkpoint(Checkpoint::kNever));
  CATCH_CHECK(unchecked->step(x, y, mse).defined());
}

namespace {

// Two steps of SGD of `model` (its first partition on `first`) against `plain`, on random
// batches of 8 rows of `features` made with `options`: the losses and the gradients to 1e-10.
void two_steps_against_plain(nn::Sequential plain, GPipe model, int64_t features,
                             const at::TensorOptions& options, c10::Device first) {
  auto mse = [](const Batch& out, const at::Tensor& target) {
    return torch::nn::functional::mse_loss(out[0], target.to(out[0].device()));
  };
  for (int step = 0; step < 2; ++step) {
    CATCH_INFO("step " << step);
    const at::Tensor x = at::randn({8, features}, options);
    const at::Tensor y = at::randn({8, 4}, options);
    plain->zero_grad();
    model->zero_grad();
    const at::Tensor expected = torch::nn::functional::mse_loss(plain->forward(x), y);
    expected.backward();
    const at::Tensor loss = model->step(x.to(first), y, mse);
    CATCH_CHECK(std::abs(loss.item<double>() - expected.item<double>()) <= 1e-10);
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    torch::NoGradGuard no_grad;
    const auto want = plain->parameters();
    const auto got = model->parameters();
    for (size_t p = 0; p < want.size(); ++p) {
      want[p].sub_(want[p].grad() * 0.1);
      got[p].sub_(got[p].grad() * 0.1);
    }
  }
}

// A step of an MLP whose partitions sit on `devices` under `kind`, against the plain model: loss
// and gradients after two steps of SGD.
void check_step_across(const std::vector<c10::Device>& devices, ScheduleKind kind) {
  auto make = [] {
    return nn::Sequential(nn::Linear(12, 16), nn::Tanh(), nn::Linear(16, 16), nn::ReLU(),
                          nn::Linear(16, 4));
  };
  two_steps_against_plain(build(make, 3),
                          GPipe(build(make, 3),
                                GPipeOptions({2, 3}).devices(devices).chunks(4).schedule(kind)),
                          12, at::TensorOptions(at::kDouble), devices.front());
}

// Whether some activation copy of a step ran on a GPU while that GPU computed another micro-batch
// (gpipe::copy_overlap, by the device times of the step's timeline). On the compute stream, a
// copy and a computation of one GPU would never overlap. Large activations and a heavy first
// partition on a GPU: each micro-batch's copy out of it takes long enough on the device to be
// seen beside the GPU's next computation.
bool step_overlaps(const std::vector<c10::Device>& devices, ScheduleKind kind) {
  nn::Sequential model;
  for (int k = 0; k < 8; ++k) {
    model->push_back(nn::Linear(2048, 2048));
    model->push_back(nn::ReLU());
  }
  model->push_back(nn::Tanh());
  const std::vector<int64_t> balance{16, 1};
  GPipe pipe(model, GPipeOptions(balance).devices(devices).chunks(8).schedule(kind)
                        .checkpoint(Checkpoint::kNever));
  pipe->record_timeline(true);
  auto loss = [](const Batch& out, const at::Tensor& target) {
    return (out[0] - target.to(out[0].device())).pow(2).mean();
  };
  const at::Tensor x = at::randn({8 * 512, 2048}, devices.front());
  const at::Tensor y = at::randn({8 * 512, 2048});
  for (int k = 0; k < 2; ++k) pipe->step(x, y, loss);  // the first warms up
  gpipe::internal::synchronize(c10::Device(c10::kCUDA, 0));
  return copy_overlap(pipe->last_timeline(), devices).overlapped_us > 0;
}

}  // namespace

CATCH_TEST_CASE("GPipe::step across a GPU and the CPU equals the plain model under GPipe and 1F1B",
                "[cuda][copy][step]") {
  const ScheduleKind kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B);
  const bool gpu_first = GENERATE(true, false);
  CATCH_CAPTURE(static_cast<int>(kind), gpu_first);
  const c10::Device gpu = cuda_device(0);
  check_step_across(gpu_first ? std::vector<c10::Device>{gpu, at::kCPU}
                              : std::vector<c10::Device>{at::kCPU, gpu},
                    kind);
}

CATCH_TEST_CASE("GPipe::step copies from a GPU to the CPU on copy streams, overlapping the GPU's "
                "next computation",
                "[cuda][copy][step]") {
  // Note [Links on copy streams] in link.h: with copies on the compute streams no copy would run
  // while the GPU computes another micro-batch. (From the CPU to a GPU, whether a copy overlaps
  // depends on the host's pace as well: on an H100 the GPU partition's first forward often began
  // only once most copies had landed, benchmarks/copy_overlap; no overlap is asserted there.)
  const ScheduleKind kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B);
  CATCH_CAPTURE(static_cast<int>(kind));
  CATCH_CHECK(step_overlaps({cuda_device(0), at::kCPU}, kind));
}

CATCH_TEST_CASE("GPipe::step across two GPUs equals the plain model and overlaps copies with "
                "computation",
                "[cuda][gpus2][copy][step]") {
  const ScheduleKind kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B);
  CATCH_CAPTURE(static_cast<int>(kind));
  const std::vector<c10::Device> gpus{cuda_device(0), cuda_device(1)};
  check_step_across(gpus, kind);
  CATCH_CHECK(step_overlaps(gpus, kind));
}

// Where the partitions go: all on one GPU (the caller issues every task), or a first partition on
// the CPU and the rest on a GPU with a worker thread each (the GPU's work runs on a worker). The
// first layer only flattens, so the plain model on the GPU does the same arithmetic.
struct Placement {
  std::vector<int64_t> balance;
  std::vector<c10::Device> devices;
  bool threads;
};

Placement placement(bool cpu_first) {
  const c10::Device gpu(at::kCUDA, 0);
  if (cpu_first) return {{1, 5}, {at::kCPU, gpu}, true};
  return {{3, 2, 1}, {gpu, gpu, gpu}, false};
}

nn::Sequential autocast_mlp() {
  return nn::Sequential(nn::Flatten(), nn::Linear(16, 32), nn::ReLU(), nn::Linear(32, 32),
                        nn::Tanh(), nn::Linear(32, 4));
}

CATCH_TEST_CASE("CUDA autocast training over several optimizer steps equals the plain model "
                "under autocast at every step",
                "[cuda][autocast]") {
  const at::ScalarType dtype = GENERATE(at::kHalf, at::kBFloat16);
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const int64_t chunks = GENERATE(1, 3);
  const bool cpu_first = GENERATE(false, true);
  CATCH_CAPTURE(dtype, static_cast<int>(mode), chunks, cpu_first);
  const c10::Device gpu(at::kCUDA, 0);
  const Placement where = placement(cpu_first);
  at::manual_seed(3);
  nn::Sequential plain = autocast_mlp();
  plain->to(gpu);
  at::manual_seed(3);
  GPipe model(
      autocast_mlp(),
      gpipe::internal::with_partition_threads(
          GPipeOptions(where.balance).devices(where.devices).chunks(chunks).checkpoint(mode),
          where.threads));
  const at::Tensor x = at::randn({6, 16}, gpu);
  const at::Tensor w = at::randn({6, 4}, gpu);
  for (int step = 0; step < 4; ++step) {
    CATCH_INFO("step " << step);
    at::Tensor y1, y2;
    {
      Autocast autocast(at::kCUDA, dtype);
      y1 = plain_by_microbatch(plain, x, chunks);
      y2 = model->forward(x.to(where.devices.front()));
    }
    // Half and bfloat16 rounding apart, as in the CPU test; a layer computing with a weight cast
    // before the last step is off by far more.
    CATCH_CHECK(y2.scalar_type() == y1.scalar_type());
    CATCH_CHECK(max_diff(y1, y2) <= 2e-2);
    (y1.to(at::kFloat) * w).sum().backward();
    (y2.to(at::kFloat) * w).sum().backward();
    // Gradients summed over micro-batches: bfloat16 keeps 8 bits, so allow its relative
    // rounding too (each micro-batch casts the weights itself in the pipeline; the plain model
    // sums the micro-batches' gradients in low precision behind one cached cast).
    check_same_grads(plain->parameters(), model->parameters(), 2e-2, 1e-2);
    sgd_step(plain->parameters(), 0.05);
    sgd_step(model->parameters(), 0.05);
  }
}

CATCH_TEST_CASE("Two threads training through one GPipe on a GPU get the plain model's results",
                "[cuda][concurrency]") {
  const bool cpu_first = GENERATE(false, true);
  const Checkpoint mode = GENERATE(Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(cpu_first, static_cast<int>(mode));
  const c10::Device gpu(at::kCUDA, 0);
  const Placement where = placement(cpu_first);
  auto make = [] { return autocast_mlp(); };
  nn::Sequential plain = build(make, 44);
  plain->to(gpu);
  GPipe model(build(make, 44),
              gpipe::internal::with_partition_threads(
                  GPipeOptions(where.balance).devices(where.devices).chunks(4).checkpoint(mode),
                  where.threads));
  const at::Tensor x = at::randn({8, 16}, at::TensorOptions(at::kDouble).device(gpu));
  const at::Tensor expected = plain->forward(x);
  expected.sum().backward();
  const at::Tensor input = x.to(where.devices.front());
  constexpr int kSteps = 6;
  CATCH_CHECK(train_from_two_threads(model, input, expected, kSteps) == 0);
  auto plain_params = plain->parameters();
  auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    CATCH_CHECK(max_diff(params[k].grad(), plain_params[k].grad() * (2 * kSteps)) <= 1e-9);
  }
}

// Note [Slow kernels expose missing stream waits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Small test tensors make every kernel finish long before the host issues the next one, so a
// copy or a computation that forgets to wait for the stream producing its input still reads the
// right values. A layer that spins the GPU for a while (at::cuda::sleep, as PyTorch's own stream
// tests do) on its stream before producing its output, in forward and in backward, leaves the
// output unwritten for that long: any consumer on another stream that does not wait for it reads
// garbage.
// x.clone(), after spinning the GPU for about 10 ms on the current stream when x is on a GPU.
at::Tensor spin_then_copy(const at::Tensor& x) {
#ifdef GPIPE_WITH_CUDA
  if (x.is_cuda()) {
    c10::DeviceGuard guard(x.device());
    at::cuda::sleep(20'000'000);  // cycles
  }
#endif
  return x.clone();
}

// Spins before producing its output in forward, and before passing the gradient on in backward.
struct SlowImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = spin_then_copy(x);
    if (y.requires_grad()) {
      y.register_hook([](const at::Tensor& grad) { return spin_then_copy(grad); });
    }
    return y;
  }
};
TORCH_MODULE(Slow);

// Stashes its (slow) input under "skip" and passes it on.
struct KeepSlowImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = Slow()->forward(x);
    stash("skip", y);
    return y;
  }
};
TORCH_MODULE(KeepSlow);

// Adds the stashed tensor.
struct AddSkipImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x + pop("skip"); }
};
TORCH_MODULE(AddSkip);

// Slow layers and a skip: as partitions {2, 3, 5}, {Linear, Slow} | {Keep, Tanh, Slow} | {Linear,
// Slow, Add, Slow, Linear}, the skip crosses from the second partition to the third.
nn::Sequential slow_skip_model() {
  nn::Sequential seq(nn::Linear(8, 16), Slow());
  seq->push_back(skippable(KeepSlow(), SkippableOptions().stash({"skip"})));
  seq->push_back(nn::Tanh());
  seq->push_back(Slow());
  seq->push_back(nn::Linear(16, 16));
  seq->push_back(Slow());
  seq->push_back(skippable(AddSkip(), SkippableOptions().pop({"skip"})));
  seq->push_back(Slow());
  seq->push_back(nn::Linear(16, 4));
  return seq;
}

CATCH_TEST_CASE("With slow kernels on every stream, GPipe on a GPU still equals the plain "
                "Sequential: every copy and skip waits for its producer",
                "[cuda][stream]") {
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  // Where the three partitions go. On one GPU every partition computes on the same stream, so
  // only the boundaries with the CPU can show a missing wait there (copies that do not block: Note
  // [Copy streams] in gpipe/internal/copy.h); with two GPUs the GPU-to-GPU copies and skips can
  // too. The skip crosses from the second partition to the third: from the CPU in {gpu, cpu, gpu},
  // to it in {cpu, gpu, cpu}. (Where a skip goes from a GPU to the CPU with the activations, its
  // blocking copy on the same copy stream lands them too: only {gpu, cpu, gpu} shows whether the
  // CPU partition waits for its activations.)
  const int placement = GENERATE(0, 1, 2, 3, 4, 5);
  // Anomaly detection reads each backward node's outputs as soon as it returns; a stream of the
  // caller's own is the partitions' compute stream on every thread (the copies' results are
  // recorded on it where it waits for them).
  const std::string variant = GENERATE("default", "anomaly detection", "the caller's stream");
  CATCH_CAPTURE(static_cast<int>(mode), placement, variant);
  const c10::Device gpu(at::kCUDA, 0);
  const c10::Device cpu(at::kCPU);
  const c10::Device last_gpu(at::kCUDA,
                             static_cast<c10::DeviceIndex>(torch::cuda::device_count() - 1));
  const std::vector<std::vector<c10::Device>> placements{
      {gpu, gpu, gpu}, {cpu, gpu, gpu}, {gpu, gpu, cpu}, {gpu, last_gpu, gpu},
      {gpu, cpu, gpu}, {cpu, gpu, cpu}};
  const std::vector<c10::Device>& devices = placements[placement];
  const auto make = slow_skip_model;
  nn::Sequential plain = build(make, 45);
  plain->to(gpu);
  // Partitions: {Linear, Slow} | {Keep, Tanh, Slow} | {Linear, Slow, Add, Slow, Linear}: the skip
  // crosses from the second partition to the third.
  GPipe model(build(make, 45),
              GPipeOptions({2, 3, 5}).devices(devices).chunks(4).checkpoint(mode));
  const at::Tensor x = at::randn({8, 8}, at::TensorOptions(at::kDouble).device(gpu));
  at::Tensor x1 = x.clone().requires_grad_(true);
  at::Tensor x2 = x.to(devices.front()).requires_grad_(true);
  std::optional<c10::StreamGuard> caller_stream;
  if (variant == "the caller's stream") {
    gpipe::internal::synchronize(gpu);  // the set-up's work, on the default stream, is done
    caller_stream.emplace(gpipe::internal::new_stream(gpu));
  }
  for (int step = 0; step < 2; ++step) {
    CATCH_INFO("step " << step);
    std::optional<torch::autograd::DetectAnomalyGuard> detect;
    if (variant == "anomaly detection") detect.emplace();
    at::Tensor y1 = plain->forward(x1);
    at::Tensor y2 = model->forward(x2);
    CATCH_CHECK(max_diff(y1, y2) <= 1e-10);
    at::Tensor w = at::rand_like(y1);
    (y1 * w).sum().backward();
    (y2 * w.to(y2.device())).sum().backward();
    check_same_grads(plain->parameters(), model->parameters(), 1e-10);
    CATCH_CHECK(max_diff(x1.grad(), x2.grad()) <= 1e-10);
  }
}

CATCH_TEST_CASE("With slow kernels, GPipe::step with a skip equals the plain model under each "
                "schedule, the skip's gradient starting from its copy",
                "[cuda][stream][step][skip]") {
  const ScheduleKind kind =
      GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZeroBubble);
  const Checkpoint mode = GENERATE(Checkpoint::kExceptLast, Checkpoint::kNever);
  // The skip goes from the second partition to the third: within one GPU, from the CPU to a GPU,
  // from a GPU to the CPU, and between two GPUs (one, where there is one). Under step() the
  // stashing partition's backward starts from the skip's copy, not from the fence's wait (Note
  // [Skip copy streams] in gpipe/skip_tracker.cc): a gradient read before the popping
  // partition's slow backward wrote it, or copied to the wrong place, shows here.
  const int placement = GENERATE(0, 1, 2, 3);
  CATCH_CAPTURE(static_cast<int>(kind), static_cast<int>(mode), placement);
  const c10::Device gpu(at::kCUDA, 0);
  const c10::Device cpu(at::kCPU);
  const c10::Device last_gpu(at::kCUDA,
                             static_cast<c10::DeviceIndex>(torch::cuda::device_count() - 1));
  const std::vector<std::vector<c10::Device>> placements{
      {gpu, gpu, gpu}, {gpu, cpu, gpu}, {cpu, gpu, cpu}, {gpu, gpu, last_gpu}};
  const std::vector<c10::Device>& devices = placements[placement];
  nn::Sequential plain = build(slow_skip_model, 46);
  plain->to(gpu);
  GPipe model(build(slow_skip_model, 46), GPipeOptions({2, 3, 5})
                                              .devices(devices)
                                              .chunks(4)
                                              .checkpoint(mode)
                                              .schedule(kind));
  two_steps_against_plain(plain, model, 8, at::TensorOptions(at::kDouble).device(gpu),
                          devices.front());
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
