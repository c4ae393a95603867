// The gradient reducer; see Note [Buckets that start during backward] in gradient_reducer.h.
#include "gpipe/distributed/internal/gradient_reducer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_join.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/internal/end_of_backward.h"

namespace gpipe {
namespace distributed {
namespace internal {

struct GradientReducer::State {
  struct Bucket {
    std::vector<size_t> params;
    int64_t pending = 0;  // parameters whose gradient is not final yet
    bool started = false;
    bool late = false;  // a parameter of it accumulated after it started (this backward)
    // The parameters' gradients, then one flag each (1: this rank has a gradient), then, in the
    // last bucket, one flag per bucket (1: late on this rank) and one per rank (its Failure:
    // 1 its backward failed, 2 its forward); divided by the world size and summed over the ranks
    // (Notes [Graphs that change between backwards], [A backward that fails on some replicas]).
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };

  ProcessGroup group;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // kept alive for the hooks
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;

  std::mutex mu;
  bool armed = false;    // a backward is running (begin_backward .. finish)
  bool learned = false;  // accumulation counts are known (from the last backward)
  // Whether this rank's step failed, and where (abandon), as its flag in the last bucket.
  enum Failure { kNone = 0, kBackward = 1, kForward = 2 };
  Failure failed_here = kNone;
  std::vector<int64_t> expected, seen;
  size_t next_bucket = 0;
  ReductionStats stats;

  void on_accumulated(size_t p) {
    std::lock_guard<std::mutex> lock(mu);
    if (!armed) {
      return;  // outside a reducing backward (no_sync, or not through the wrapper's output)
    }
    ++seen[p];
    if (!learned) {
      return;
    }
    Bucket& bucket = buckets[bucket_of[p]];
    if (bucket.started) {
      bucket.late = true;  // reduced again at the end, on every rank
      return;
    }
    if (seen[p] == expected[p]) {
      --bucket.pending;
      start_ready(/*during_backward=*/true);
    }
  }

  // Starts the buckets that are ready, in index order.
  void start_ready(bool during_backward) {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending <= 0) {
      start(next_bucket++, during_backward);
    }
  }

  // Bucket `b`'s parameters.
  std::vector<at::Tensor> params_of(const Bucket& bucket) const {
    std::vector<at::Tensor> out;
    for (size_t p : bucket.params) out.push_back(params[p]);
    return out;
  }

  void start(size_t b, bool during_backward) {
    Bucket& bucket = buckets[b];
    for (size_t p : bucket.params) {
      const at::Tensor& grad = params[p].grad();
      TORCH_CHECK(!grad.defined() || !grad.is_sparse(), "gpipe::DataParallel: parameter ",
                  names[p], " has a sparse gradient on rank ", group->getRank(), ", which is not "
                  "supported");
    }
    std::vector<double> flags;  // the last bucket's: late buckets, failed ranks
    if (b + 1 == buckets.size()) {
      for (const Bucket& other : buckets) flags.push_back(other.late ? 1 : 0);
      for (int r = 0; r < group->getSize(); ++r) {
        flags.push_back(r == group->getRank() ? static_cast<double>(failed_here) : 0);
      }
    }
    const at::Tensor& first = params[bucket.params[0]];
    bucket.flat = pack_gradients(params_of(bucket), first.device(), flags)
                      .div_(group->getSize());
    std::vector<at::Tensor> tensors{bucket.flat};
    check_collective(group, "the all-reduce of a gradient bucket",
                     [&] { bucket.work = group->allreduce(tensors); });
    bucket.started = true;
    stats.started_during_backward += during_backward ? 1 : 0;
    stats.bytes += bucket.flat.numel() * bucket.flat.element_size();
  }

  // Readies the buckets for a backward: none started, each waiting for its parameters' counted
  // accumulations (all of them, in the first backward). Called with mu held.
  void arm() {
    armed = true;
    failed_here = kNone;
    next_bucket = 0;
    stats = ReductionStats{};
    stats.buckets = static_cast<int64_t>(buckets.size());
    std::fill(seen.begin(), seen.end(), 0);
    for (Bucket& bucket : buckets) {
      bucket.started = false;
      bucket.late = false;
      bucket.pending = 0;
      for (size_t p : bucket.params) {
        bucket.pending += learned && expected[p] > 0 ? 1 : 0;
      }
      if (!learned) {
        bucket.pending = 1;  // started at the end of the first backward
      }
    }
    // The last bucket carries every bucket's late flag, so it starts at the end.
    if (!buckets.empty()) buckets.back().pending += 1;
    if (learned) {
      start_ready(/*during_backward=*/true);  // buckets whose parameters get no gradient
    }
  }

  // A step that failed before finish() (Note [A backward that fails on some replicas]; in
  // forward, Note [A forward that fails on some replicas] in data_parallel.h): this rank runs the
  // collectives the others run in finish(), its failure marked in the last bucket, and drops the
  // results; the next backward starts afresh. Called with mu held.
  void abandon(Failure how) {
    if (!armed) return;
    failed_here = how;
    try {
      if (!buckets.empty()) settle();
    } catch (const std::exception&) {
      // A collective failed (a peer died or timed out): the group is broken, and the next
      // backward's collectives fail with the cause.
    }
    disarm();
  }

  // Drops whatever the buckets hold; the next backward starts afresh. Called with mu held.
  void disarm() {
    for (Bucket& bucket : buckets) {
      bucket.work.reset();
      bucket.flat.reset();
      bucket.late = false;
    }
    armed = false;
  }

  // Starts every bucket not started yet, waits for them all, and all-reduces again the buckets
  // late on any rank: the same collectives on every rank, whether its backward finished or failed.
  // Returns the ranks whose step failed, and where. Called with mu held.
  std::vector<std::pair<int, Failure>> settle() {
    for (Bucket& bucket : buckets) {
      bucket.pending = 0;
    }
    start_ready(/*during_backward=*/false);  // the last bucket, with the flags, among them
    at::NoGradGuard no_grad;
    for (Bucket& bucket : buckets) {
      wait(group, bucket.work, "the all-reduce of a gradient bucket");
      bucket.work.reset();
    }
    // Buckets late on any rank are reduced again from the final gradients, in index order on
    // every rank (Note [Graphs that change between backwards]).
    const Bucket& last = buckets.back();
    const int64_t nb = static_cast<int64_t>(buckets.size());
    const int64_t flags_at = gradient_elements(last) + static_cast<int64_t>(last.params.size());
    const at::Tensor flags =
        last.flat.narrow(0, flags_at, nb + group->getSize()).to(at::kCPU, at::kDouble);
    for (int64_t b = 0; b + 1 < nb; ++b) {
      if (flags[b].item<double>() > 0) {
        start(static_cast<size_t>(b), /*during_backward=*/false);
        wait(group, buckets[static_cast<size_t>(b)].work, "the all-reduce of a gradient bucket");
        buckets[static_cast<size_t>(b)].work.reset();
        ++stats.reduced_again;
      }
    }
    std::vector<std::pair<int, Failure>> failed;
    for (int r = 0; r < group->getSize(); ++r) {
      // (Each rank's flag is its Failure divided by the number of ranks.)
      const long how = std::lround(flags[nb + r].item<double>() * group->getSize());
      if (how > 0) failed.emplace_back(r, how == kForward ? kForward : kBackward);
    }
    return failed;
  }

  // The number of elements of bucket `b`'s gradients.
  int64_t gradient_elements(const Bucket& bucket) const {
    int64_t n = 0;
    for (size_t p : bucket.params) n += params[p].numel();
    return n;
  }

  void finish() {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu);
    struct Disarm {
      State& s;
      ~Disarm() { s.armed = false; }
    } disarm{*this};
    if (buckets.empty()) return;  // nothing requires grad
    const std::vector<std::pair<int, Failure>> failed = settle();
    at::NoGradGuard no_grad;
    if (!failed.empty()) {
      for (Bucket& bucket : buckets) {
        bucket.flat.reset();
        bucket.late = false;
      }
      bool forward = false, backward = false;
      std::vector<int> ranks;
      for (const auto& [rank, how] : failed) {
        (how == kForward ? forward : backward) = true;
        ranks.push_back(rank);
      }
      TORCH_CHECK(false, "gpipe::DataParallel: the ",
                  forward && backward ? "forward or backward" : forward ? "forward" : "backward",
                  " failed on rank", failed.size() > 1 ? "s " : " ", absl::StrJoin(ranks, ", "),
                  " of ",
                  group->getSize(), " (", failed.size() > 1 ? "their" : "its", " own error is "
                  "raised there), so this step's gradients were not averaged on rank ",
                  group->getRank(), " (they are its own); every replica's all-reduces still pair: "
                  "zero the gradients and go on with the next step");
    }
    for (Bucket& bucket : buckets) {
      // Parameters no replica has a gradient for keep it undefined, as in one process (Note
      // [Parameters that no replica used]).
      unpack_averages(params_of(bucket), bucket.flat);
      bucket.flat.reset();
      bucket.late = false;
    }
    expected = seen;
    learned = true;
    stats.exposed_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

namespace {

struct AccumulatedHook : torch::autograd::FunctionPostHook {
  AccumulatedHook(std::weak_ptr<GradientReducer::State> state, size_t index)
      : state(std::move(state)), index(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (auto s = state.lock()) {
      s->on_accumulated(index);
    }
    return outputs;
  }
  std::weak_ptr<GradientReducer::State> state;
  size_t index;
};

}  // namespace

GradientReducer::GradientReducer(std::vector<at::Tensor> parameters,
                                 std::vector<std::string> names, ProcessGroup group,
                                 int64_t bucket_bytes)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(bucket_bytes > 0, "gpipe::DataParallel: bucket_bytes must be positive, got ",
              bucket_bytes);
  State& s = *state_;
  s.group = std::move(group);
  for (size_t k = 0; k < parameters.size(); ++k) {
    if (parameters[k].requires_grad()) {
      TORCH_CHECK(!carries_device_tensors(s.group) || parameters[k].is_cuda(),
                  "gpipe::DataParallel: rank ", s.group->getRank(), "'s parameter '", names[k],
                  "' is on ",
                  parameters[k].device(), ", but the group's backend (",
                  s.group->getBackendName(), ") all-reduces only GPU tensors; move the module to "
                  "its GPU first, or use a Gloo group");
      s.params.push_back(parameters[k]);
      s.names.push_back(names[k]);
    }
  }
  // Buckets: reverse registration order, by (device, dtype), closed at bucket_bytes.
  std::map<std::tuple<std::string, int>, size_t> open;  // (device, dtype) -> bucket
  s.bucket_of.assign(s.params.size(), 0);
  std::vector<int64_t> bytes;
  for (size_t k = s.params.size(); k-- > 0;) {
    const at::Tensor& p = s.params[k];
    const auto key = std::make_tuple(p.device().str(), static_cast<int>(p.scalar_type()));
    auto it = open.find(key);
    if (it == open.end() || bytes[it->second] >= bucket_bytes) {
      s.buckets.emplace_back();
      bytes.push_back(0);
      it = open.insert_or_assign(key, s.buckets.size() - 1).first;
    }
    s.buckets[it->second].params.push_back(k);
    bytes[it->second] += p.numel() * p.element_size();
    s.bucket_of[k] = it->second;
  }
  s.expected.assign(s.params.size(), 0);
  s.seen.assign(s.params.size(), 0);
  for (size_t k = 0; k < s.params.size(); ++k) {
    std::shared_ptr<torch::autograd::Node> accumulator =
        torch::autograd::impl::grad_accumulator(s.params[k]);
    accumulator->add_post_hook(std::make_unique<AccumulatedHook>(state_, k));
    s.accumulators.push_back(std::move(accumulator));
  }
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::begin_backward() {
  std::shared_ptr<State> s = state_;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->armed) {
      return;  // already reducing this backward
    }
    s->arm();
  }
  // Note [The reduction's end]: finish() runs after every other end-of-backward callback queued
  // during the backward (the first callback queues it again), so that a stage-local GPipe's,
  // which waits for its partitions' backwards on their workers, has run: their gradients are
  // final (and have started their buckets). When the backward fails before finish() ran, the
  // engine drops the callback and abandon() disarms the reducer (Note [A callback the failed
  // backward drops] in gpipe/internal/end_of_backward.h).
  const auto abandon = [s] {
    std::lock_guard<std::mutex> lock(s->mu);
    s->abandon(State::kBackward);
  };
  gpipe::internal::queue_end_of_backward(
      [s, abandon] { gpipe::internal::queue_end_of_backward([s] { s->finish(); }, abandon); },
      abandon);
}

void GradientReducer::fail_forward() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->armed) return;  // inside a reducing backward, whose own end runs the collectives
  try {
    state_->arm();  // may start buckets: a collective that fails leaves the group broken
  } catch (const std::exception&) {
    state_->disarm();
    return;
  }
  state_->abandon(State::kForward);
}

size_t GradientReducer::bucket_count() const { return state_->buckets.size(); }

ReductionStats GradientReducer::last_stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->stats;
}

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
