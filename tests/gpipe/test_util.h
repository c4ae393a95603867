// Helpers shared by the gpipe tests: small layers that record what the pipeline does, model
// builders, and comparisons with the plain Sequential (the oracle of every pipeline result).
#pragma once

#include "tests/catch.h"


#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>  // for the tests that include this header
#include <algorithm>
#include <map>
#include <functional>
#include <future>
#include <thread>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/version.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include "gpipe/device.h"
#include "gpipe/gpipe.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace testing {

/// The largest absolute difference between two tensors (both must be defined and alike).
/// A CUDA device this process does not have (cuda:<number of GPUs>), and why, as
/// check_device_available says it: the facts come from LibTorch's device registry.
inline std::pair<c10::Device, std::string> unavailable_cuda() {
  const int64_t count = cuda_device_count();
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(count));
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
    return {device, "but this LibTorch was built without CUDA (CPU only)"};
  }
  if (count == 0) return {device, "but no CUDA device is visible to this process"};
  return {device, "but this machine has " + std::to_string(count) + " CUDA device"};
}

/// Catches the warnings LibTorch's TORCH_WARN sends while it is alive (instead of printing them).
class CaptureWarnings : public c10::WarningHandler {
 public:
  CaptureWarnings() : previous_(get_handler()) { set_handler(this); }
  ~CaptureWarnings() override { set_handler(previous_); }
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  static c10::WarningHandler* get_handler() { return c10::WarningUtils::get_warning_handler(); }
  static void set_handler(c10::WarningHandler* h) { c10::WarningUtils::set_warning_handler(h); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
  static c10::WarningHandler* get_handler() { return c10::Warning::get_warning_handler(); }
  static void set_handler(c10::WarningHandler* h) { c10::Warning::set_warning_handler(h); }
#endif
  std::vector<std::string> messages;

 private:
  c10::WarningHandler* previous_;
};

inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  CATCH_REQUIRE(a.defined());
  CATCH_REQUIRE(b.defined());
  CATCH_REQUIRE(a.sizes() == b.sizes());
  if (a.numel() == 0) {
    return 0.0;
  }
  return (a.to(at::kDouble).cpu() - b.to(at::kDouble).cpu()).abs().max().item<double>();
}

/// Checks that the parameters of `a` and `b` (in order) have gradients within `tol`, plus `rel`
/// times the largest magnitude of `a`'s gradient (for low-precision arithmetic).
inline void check_same_grads(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                             double tol, double rel = 0.0) {
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    CATCH_INFO("parameter " << k);
    CATCH_REQUIRE(a[k].grad().defined() == b[k].grad().defined());
    if (a[k].grad().defined()) {
      const double scale = rel == 0.0 ? 0.0 : a[k].grad().abs().max().item<double>();
      CATCH_CHECK(max_diff(a[k].grad(), b[k].grad()) <= tol + rel * scale);
    }
  }
}

/// One event seen by a Probe layer.
struct Event {
  std::string phase;  // "forward", "checkpoint", "recompute" or "backward"
  int64_t microbatch;
  int64_t partition;
  bool operator==(const Event& o) const {
    return phase == o.phase && microbatch == o.microbatch && partition == o.partition;
  }
};

inline std::ostream& operator<<(std::ostream& os, const Event& e) {
  return os << e.phase << "(" << e.microbatch << "," << e.partition << ")";
}

/// A thread-safe record of events.
struct Log {
  explicit Log(int64_t rows_per_microbatch) : rows_per_microbatch(rows_per_microbatch) {}
  void add(Event e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(std::move(e));
  }
  std::vector<Event> take(const std::string& phase) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<Event> out;
    for (const Event& e : events) {
      if (phase.empty() || e.phase == phase) {
        out.push_back(e);
      }
    }
    return out;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu);
    events.clear();
  }
  const int64_t rows_per_microbatch;
  std::mutex mu;
  std::vector<Event> events;
};

/// An identity layer (y = x * 1) that records which micro-batch it sees, in which phase, and
/// when its output's gradient is computed. The micro-batch is read from the input: column 0 of
/// row 0 holds the row's index in the mini-batch (see rows_input).
struct ProbeImpl : torch::nn::Module {
  ProbeImpl(int64_t partition, std::shared_ptr<Log> log)
      : partition(partition), log(std::move(log)) {}
  at::Tensor forward(const at::Tensor& x) {
    const int64_t mb = static_cast<int64_t>(x[0][0].item<double>()) / log->rows_per_microbatch;
    const char* phase =
        is_recomputing() ? "recompute" : is_checkpointing() ? "checkpoint" : "forward";
    log->add({phase, mb, partition});
    at::Tensor y = x * 1.0;
    if (y.requires_grad()) {
      auto record = log;
      const int64_t j = partition;
      y.register_hook([record, mb, j](const at::Tensor& g) {
        record->add({"backward", mb, j});
        return g;
      });
    }
    return y;
  }
  int64_t partition;
  std::shared_ptr<Log> log;
};
TORCH_MODULE(Probe);

/// y = x * w with a learnable per-column scale initialised to 1: keeps column 0 intact in forward
/// and gives the model parameters.
struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(int64_t features) {
    weight = register_parameter("weight", at::ones({features}, at::kDouble));
  }
  at::Tensor forward(const at::Tensor& x) { return x * weight; }
  at::Tensor weight;
};
TORCH_MODULE(Scale);

/// A mini-batch of `rows` rows and `cols` columns whose column 0 is the row index (float64).
inline at::Tensor rows_input(int64_t rows, int64_t cols) {
  at::Tensor x = at::rand({rows, cols}, at::kDouble);
  x.select(1, 0).copy_(at::arange(rows, at::kDouble));
  return x;
}

/// A layer on tuple batches: {a, b} -> {tanh(A a + B b), b / 2}.
struct MixImpl : torch::nn::Module {
  MixImpl(int64_t a_features, int64_t b_features, int64_t out_features) {
    a = register_module("a", torch::nn::Linear(a_features, out_features));
    b = register_module("b", torch::nn::Linear(b_features, out_features));
  }
  std::vector<at::Tensor> forward(std::vector<at::Tensor> x) {
    return {at::tanh(a(x[0]) + b(x[1])), x[1] / 2};
  }
  torch::nn::Linear a{nullptr};
  torch::nn::Linear b{nullptr};
};
TORCH_MODULE(Mix);

/// Runs `fn` on a fresh model built by `make` (with the same seed each time, so two calls give
/// identical parameters).
template <typename Make>
torch::nn::Sequential build(Make make, uint64_t seed) {
  at::manual_seed(seed);
  torch::nn::Sequential model = make();
  model->to(at::kDouble);
  return model;
}

/// Runs `x` through the plain model and through a GPipe of an identical copy (both built by
/// `make` with the same seed, both put in train or eval mode by `set_mode`), with the same
/// weighted-sum loss, and checks outputs, parameter gradients and input gradients within `tol`.
template <typename Make>
void check_transparent(Make make, const at::Tensor& x, const GPipeOptions& options,
                       const std::function<void(torch::nn::Module&)>& set_mode,
                       double tol = 1e-10) {
  torch::nn::Sequential plain = build(make, 7);
  GPipe model(build(make, 7), options);
  set_mode(*plain);
  set_mode(*model);
  at::Tensor x1 = x.clone().requires_grad_(true);
  at::Tensor x2 = x.clone().requires_grad_(true);
  at::Tensor y1 = plain->forward(x1);
  at::Tensor y2 = model->forward(x2);
  CATCH_CHECK(max_diff(y1, y2) <= tol);
  at::Tensor w = at::rand_like(y1);
  (y1 * w).sum().backward();
  (y2 * w).sum().backward();
  check_same_grads(plain->parameters(), model->parameters(), tol);
  CATCH_CHECK(max_diff(x1.grad(), x2.grad()) <= tol);
}

/// The plain model's forward under the same split as GPipe's: one forward per micro-batch,
/// concatenated. Under autocast this is the plain model's arithmetic on the same shapes, so it
/// equals GPipe's up to the order in which gradients are summed.
inline at::Tensor plain_by_microbatch(torch::nn::Sequential& plain, const at::Tensor& x,
                                     int64_t chunks) {
  std::vector<at::Tensor> outs;
  for (const at::Tensor& mb : x.chunk(chunks)) {
    outs.push_back(plain->forward(mb));
  }
  return at::cat(outs);
}

using gpipe::Autocast;

/// The number of gpipe's worker threads running in this process (internal::running_worker_threads).
/// The threads of OpenMP teams (those a worker starts take its name, and end a moment after it),
/// CUDA and the autograd engine come and go with those libraries and are not counted.
inline int worker_thread_count() { return gpipe::internal::running_worker_threads(); }

/// Runs `fn` on a thread of its own and waits for it at most `seconds` (a watchdog): a hang aborts
/// the test binary with a message instead of stalling the suite (a stuck thread cannot be
/// joined). Exceptions from `fn` are re-thrown here.
template <typename Fn>
void within(int seconds, Fn fn) {
  auto task = std::make_shared<std::packaged_task<void()>>(std::move(fn));
  std::future<void> done = task->get_future();
  std::thread runner([task] { (*task)(); });
  if (done.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "watchdog: hung for %d s\n", seconds);
    std::abort();
  }
  runner.join();
  done.get();
}

/// One training step of the plain model and of the pipeline on copies of `x` (each a leaf that
/// needs a gradient): checks the outputs, the parameters' gradients and the input's gradient
/// within `tol`.
template <typename Plain, typename Pipe>
void check_same_step(Plain& plain, Pipe& model, const at::Tensor& x, double tol = 1e-10) {
  at::Tensor x1 = x.clone().requires_grad_(true);
  at::Tensor x2 = x.clone().requires_grad_(true);
  at::Tensor y1 = plain->forward(x1);
  at::Tensor y2 = model->forward(x2);
  CATCH_CHECK(max_diff(y1, y2) <= tol);
  y1.sum().backward();
  y2.sum().backward();
  check_same_grads(plain->parameters(), model->parameters(), tol);
  CATCH_CHECK(max_diff(x1.grad(), x2.grad()) <= tol);
}

/// Trains `model` from two threads at once, `steps` forward and backward passes each on `input`,
/// and returns how many outputs differed from `expected` by more than 1e-10 (no Catch2 assertion
/// is made off the main thread: Catch2 is not thread-safe).
template <typename Pipe>
int train_from_two_threads(Pipe& model, const at::Tensor& input, const at::Tensor& expected,
                           int steps) {
  std::atomic<int> wrong{0};
  auto train = [&] {
    for (int k = 0; k < steps; ++k) {
      at::Tensor y = model->forward(input);
      if ((y - expected).abs().max().item<double>() > 1e-10) ++wrong;
      y.sum().backward();
    }
  };
  within(300, [&] {
    std::thread a(train);
    std::thread b(train);
    a.join();
    b.join();
  });
  return wrong;
}

/// One SGD step without momentum, in place, as torch::optim::SGD does: p -= lr * p.grad; then
/// the gradients are zeroed.
inline void sgd_step(const std::vector<at::Tensor>& params, double lr) {
  at::NoGradGuard no_grad;
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) {
      const_cast<at::Tensor&>(p).sub_(p.grad() * lr);
      p.mutable_grad().zero_();
    }
  }
}

/// The running statistics of every BatchNorm of `module`, in order (mean, var, count, ...).
inline std::vector<at::Tensor> running_stats(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& buffer : module.named_buffers()) {
    out.push_back(buffer.value().clone());
  }
  return out;
}

// Per partition, the most micro-batches whose forward had ended and whose backward (or W) had
// not, on a real run's timeline.
inline std::map<int64_t, int64_t> peak_in_flight(const std::vector<TimelineEvent>& events) {
  std::map<int64_t, std::vector<std::pair<double, int>>> changes;
  std::map<std::pair<int64_t, int64_t>, bool> split;
  for (const TimelineEvent& e : events) {
    if (e.kind == TimelineEvent::Kind::kBackwardWeight) split[{e.partition, e.microbatch}] = true;
  }
  for (const TimelineEvent& e : events) {
    const bool w = split.count({e.partition, e.microbatch}) > 0;
    if (e.kind == TimelineEvent::Kind::kCompute) changes[e.partition].push_back({e.end_us, +1});
    if ((e.kind == TimelineEvent::Kind::kBackward ||
         e.kind == TimelineEvent::Kind::kBackwardInput) && !w) {
      changes[e.partition].push_back({e.start_us, -1});
    }
    if (e.kind == TimelineEvent::Kind::kBackwardWeight) {
      changes[e.partition].push_back({e.start_us, -1});
    }
  }
  std::map<int64_t, int64_t> peak;
  for (auto& [p, c] : changes) {
    std::sort(c.begin(), c.end());  // at a tie, a backward's start before a forward's end
    int64_t alive = 0;
    for (const auto& [t, d] : c) {
      alive += d;
      peak[p] = std::max(peak[p], alive);
    }
  }
  return peak;
}

/// Checks that two lists of tensors are alike within `tol`.
inline void check_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                       double tol) {
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    CATCH_INFO("tensor " << k);
    CATCH_CHECK(max_diff(a[k], b[k]) <= tol);
  }
}

}  // namespace testing
}  // namespace gpipe
