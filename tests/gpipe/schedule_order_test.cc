// The order in which a GPipe runs its tasks: lock-step clock cycles in forward, the reverse in
// backward, and checkpointing and recomputation exactly where they belong. Observed by Probe
// layers inside the model.
#include "tests/gpipe/test_util.h"

#include "gpipe/internal/dependency.h"
#include "gpipe/internal/partition_threads.h"

#include <algorithm>
#include <map>
#include <set>

#include <ATen/core/grad_mode.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/schedule.h"

namespace gpipe {
namespace testing {
namespace {

// A model of `partitions` partitions, each a Probe then a Scale, all on the CPU.
// With `one_thread`, the partitions share the calling thread, so that the log's order across
// partitions is the schedule's (by default CPU partitions get threads of their own: Note [Threads
// of forward()]).
GPipe probed_model(int64_t partitions, int64_t chunks, Checkpoint mode,
                   const std::shared_ptr<Log>& log, bool one_thread = false) {
  torch::nn::Sequential seq;
  for (int64_t j = 0; j < partitions; ++j) {
    seq->push_back(Probe(j, log));
    seq->push_back(Scale(3));
  }
  GPipeOptions options = GPipeOptions(std::vector<int64_t>(partitions, 2))
                             .devices(std::vector<c10::Device>(partitions, at::kCPU))
                             .chunks(chunks)
                             .checkpoint(mode);
  if (one_thread) options = internal::with_partition_threads(options, false);
  // The one graph, whose backward order the pipeline's fork/join edges set (Note [Backward
  // order]); stage-local backward has none (Note [Stage-local backward in one process]).
  return GPipe(seq, internal::with_stage_local_backward(options, false));
}

// How many micro-batches `mode` checkpoints in training (the reference's checkpoint_stop).
int64_t checkpointed(Checkpoint mode, int64_t chunks) {
  switch (mode) {
    case Checkpoint::kAlways:
      return chunks;
    case Checkpoint::kExceptLast:
      return chunks - 1;
    case Checkpoint::kNever:
      return 0;
  }
  return -1;
}

std::vector<Event> events(const std::string& phase, std::vector<std::pair<int64_t, int64_t>> ij) {
  std::vector<Event> out;
  for (auto [i, j] : ij) out.push_back({phase, i, j});
  return out;
}

CATCH_TEST_CASE("forward runs the tasks in lock-step clock cycles", "[pipeline][schedule]") {
  auto log = std::make_shared<Log>(/*rows_per_microbatch=*/2);
  GPipe model = probed_model(2, 3, Checkpoint::kNever, log, /*one_thread=*/true);
  model->forward(rows_input(6, 3));
  // Ticks {(0,0)}, {(1,0),(0,1)}, {(2,0),(1,1)}, {(2,1)}.
  CATCH_CHECK(log->take("forward") ==
              events("forward", {{0, 0}, {1, 0}, {0, 1}, {2, 0}, {1, 1}, {2, 1}}));
}

CATCH_TEST_CASE("forward follows clock_cycles for several sizes", "[pipeline][schedule]") {
  const int64_t partitions = GENERATE(1, 2, 3, 4);
  const int64_t chunks = GENERATE(1, 2, 3, 5);
  auto log = std::make_shared<Log>(2);
  GPipe model = probed_model(partitions, chunks, Checkpoint::kNever, log, /*one_thread=*/true);
  model->forward(rows_input(2 * chunks, 3));
  std::vector<Event> expected;
  for (const auto& tick : clock_cycles(chunks, partitions)) {
    for (const Task2D& t : tick) expected.push_back({"forward", t.microbatch, t.partition});
  }
  CATCH_CHECK(log->take("forward") == expected);
}

CATCH_TEST_CASE("backward visits micro-batches in reverse on every partition",
                "[pipeline][schedule]") {
  const int64_t partitions = GENERATE(1, 2, 3);
  const int64_t chunks = GENERATE(2, 3, 4);
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways);
  CATCH_CAPTURE(partitions, chunks, static_cast<int>(mode));
  auto log = std::make_shared<Log>(2);
  GPipe model = probed_model(partitions, chunks, mode, log);
  model->train();
  at::Tensor x = rows_input(2 * chunks, 3).requires_grad_(true);
  model->forward(x).sum().backward();
  const std::vector<Event> backward = log->take("backward");
  CATCH_REQUIRE(static_cast<int64_t>(backward.size()) == partitions * chunks);
  for (int64_t j = 0; j < partitions; ++j) {
    std::vector<int64_t> order;
    for (const Event& e : backward) {
      if (e.partition == j) order.push_back(e.microbatch);
    }
    std::vector<int64_t> expected;
    for (int64_t i = chunks - 1; i >= 0; --i) expected.push_back(i);
    CATCH_CHECK(order == expected);
  }
  // A micro-batch's backward goes from the last partition to the first.
  for (int64_t i = 0; i < chunks; ++i) {
    std::vector<int64_t> partitions_seen;
    for (const Event& e : backward) {
      if (e.microbatch == i) partitions_seen.push_back(e.partition);
    }
    std::vector<int64_t> expected;
    for (int64_t j = partitions - 1; j >= 0; --j) expected.push_back(j);
    CATCH_CHECK(partitions_seen == expected);
  }
}

// Counts the autograd nodes of each name reachable from `root`, and (under "A -> B:k") the edges
// from nodes named A to input k of nodes named B.
std::map<std::string, int64_t> count_nodes(const std::shared_ptr<torch::autograd::Node>& root) {
  std::map<std::string, int64_t> counts;
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{root.get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    counts[node->name()] += 1;
    for (const auto& edge : node->next_edges()) {
      if (edge.function) {
        counts[node->name() + " -> " + edge.function->name() + ":" +
               std::to_string(edge.input_nr)] += 1;
      }
      stack.push_back(edge.function.get());
    }
  }
  return counts;
}

// On the CPU the autograd engine happens to visit micro-batches in reverse even without help, so
// the order test above cannot tell whether the dependencies exist; this one looks at the graph.
CATCH_TEST_CASE("the autograd graph holds one fork-join dependency per task after the first "
                "micro-batch, and one recomputation per checkpointed task",
                "[pipeline][schedule][checkpoint]") {
  const int64_t partitions = GENERATE(1, 2, 3);
  const int64_t chunks = GENERATE(1, 2, 4);
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways);
  CATCH_CAPTURE(partitions, chunks, static_cast<int>(mode));
  auto log = std::make_shared<Log>(2);
  GPipe model = probed_model(partitions, chunks, mode, log);
  model->train();
  at::Tensor y = model->forward(rows_input(2 * chunks, 3).requires_grad_(true));
  const int64_t stop = checkpointed(mode, chunks);
  auto counts = count_nodes(y.grad_fn());
  // A dependency per task (i > 0, j): a fork, unless micro-batch i - 1 was checkpointed, whose
  // CheckpointBackward (on the CPU no RecomputeBackward: Note [Checkpoint and recompute]) takes
  // the phony as one more input, its second (one output, no stashes); and a join, unless micro-batch
  // i is checkpointed, whose CheckpointBackward takes the phony's edge.
  const int64_t merged_forks = std::min(stop, chunks - 1) * partitions;
  const int64_t merged_joins = std::max<int64_t>(stop - 1, 0) * partitions;
  CATCH_CHECK(counts["gpipe::ForkBackward"] == (chunks - 1) * partitions - merged_forks);
  CATCH_CHECK(counts["gpipe::JoinBackward"] == (chunks - 1) * partitions - merged_joins);
  // The phonies: where the join is left out, the checkpoint's node holds the edge to the previous
  // micro-batch's checkpoint (both are checkpointed).
  CATCH_CHECK(counts["gpipe::CheckpointBackward -> gpipe::CheckpointBackward:1"] == merged_joins);
  CATCH_CHECK(counts["gpipe::JoinBackward -> gpipe::CheckpointBackward:1"] ==
              merged_forks - merged_joins);
  CATCH_CHECK(counts["gpipe::JoinBackward -> gpipe::ForkBackward:1"] ==
              (chunks - 1) * partitions - merged_forks);
  CATCH_CHECK(counts["gpipe::RecomputeBackward"] == 0);
  CATCH_CHECK(counts["gpipe::CheckpointBackward"] == stop * partitions);
}

// A node that takes phonies when it says so (internal::TakesPhonies).
struct PhonyTaker : torch::autograd::Node, internal::TakesPhonies {
  explicit PhonyTaker(bool takes) : takes(takes) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override { return {}; }
  bool takes_phonies() const override { return takes; }
  bool takes;
};

CATCH_TEST_CASE("fork adds the phony to a node that takes phonies, and forks where it does not",
                "[pipeline][schedule][checkpoint]") {
  const bool takes = GENERATE(true, false);
  CATCH_CAPTURE(takes);
  auto node = std::shared_ptr<PhonyTaker>(new PhonyTaker(takes), torch::autograd::deleteNode);
  at::Tensor x = at::randn({2});
  torch::autograd::set_history(x, node);
  CATCH_REQUIRE(node->num_inputs() == 1);
  const std::pair<at::Tensor, at::Tensor> forked = internal::fork(x);
  if (takes) {
    // One more input of the node itself (a CPU checkpoint without stashes).
    CATCH_CHECK(forked.first.is_same(x));
    CATCH_CHECK(forked.second.grad_fn().get() == node.get());
    CATCH_CHECK(forked.second.output_nr() == 1);
    CATCH_CHECK(node->num_inputs() == 2);
  } else {
    // A checkpoint whose skips other partitions pop: a ForkBackward of its own.
    CATCH_CHECK(forked.second.grad_fn()->name() == "gpipe::ForkBackward");
    CATCH_CHECK(forked.first.grad_fn() == forked.second.grad_fn());
    CATCH_CHECK(node->num_inputs() == 1);
  }
}

CATCH_TEST_CASE("checkpointing runs and recomputes exactly the chosen micro-batches",
                "[pipeline][checkpoint]") {
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const int64_t chunks = GENERATE(1, 3, 4);
  CATCH_CAPTURE(static_cast<int>(mode), chunks);
  const int64_t partitions = 2;
  auto log = std::make_shared<Log>(2);
  GPipe model = probed_model(partitions, chunks, mode, log);
  model->train();
  at::Tensor y = model->forward(rows_input(2 * chunks, 3).requires_grad_(true));
  const int64_t stop = checkpointed(mode, chunks);
  auto micro_of = [](const std::vector<Event>& es, int64_t j) {
    std::vector<int64_t> out;
    for (const Event& e : es) {
      if (e.partition == j) out.push_back(e.microbatch);
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  std::vector<int64_t> checkpointed;
  std::vector<int64_t> plain;
  for (int64_t i = 0; i < chunks; ++i) (i < stop ? checkpointed : plain).push_back(i);
  for (int64_t j = 0; j < partitions; ++j) {
    CATCH_CHECK(micro_of(log->take("checkpoint"), j) == checkpointed);
    CATCH_CHECK(micro_of(log->take("forward"), j) == plain);
  }
  CATCH_CHECK(log->take("recompute").empty());  // not before backward
  y.sum().backward();
  for (int64_t j = 0; j < partitions; ++j) {
    CATCH_CHECK(micro_of(log->take("recompute"), j) == checkpointed);
  }
}

CATCH_TEST_CASE("nothing is checkpointed in eval mode or without grad mode",
                "[pipeline][checkpoint]") {
  auto log = std::make_shared<Log>(2);
  GPipe model = probed_model(2, 4, Checkpoint::kAlways, log);
  model->eval();
  model->forward(rows_input(8, 3));
  CATCH_CHECK(log->take("checkpoint").empty());
  CATCH_CHECK(log->take("forward").size() == 8);
  log->clear();
  model->train();
  {
    at::NoGradGuard no_grad;
    model->forward(rows_input(8, 3));
  }
  CATCH_CHECK(log->take("checkpoint").empty());
  CATCH_CHECK(log->take("forward").size() == 8);
}

CATCH_TEST_CASE("is_checkpointing and is_recomputing are false outside a pipeline",
                "[pipeline][checkpoint]") {
  CATCH_CHECK_FALSE(is_checkpointing());
  CATCH_CHECK_FALSE(is_recomputing());
  auto log = std::make_shared<Log>(2);
  GPipe model = probed_model(2, 2, Checkpoint::kAlways, log);
  model->train();
  model->forward(rows_input(4, 3).requires_grad_(true)).sum().backward();
  CATCH_CHECK(log->take("recompute").size() == 4);
  CATCH_CHECK_FALSE(is_checkpointing());
  CATCH_CHECK_FALSE(is_recomputing());
}

}  // namespace
}  // namespace testing
}  // namespace gpipe

namespace gpipe {
namespace testing {
namespace {

CATCH_TEST_CASE("the recorded timeline draws the schedule that ran", "[pipeline][timeline]") {
  auto log = std::make_shared<Log>(2);
  torch::nn::Sequential seq(Probe(0, log), Scale(3), Probe(1, log), Scale(3));
  GPipe model(seq, GPipeOptions({2, 2})
                       .devices({at::kCPU, at::kCPU})
                       .chunks(3)
                       .checkpoint(Checkpoint::kExceptLast));
  model->record_timeline(true);
  model->train();
  model->forward(rows_input(6, 3).requires_grad_(true));
  const std::vector<TimelineEvent> events = model->last_timeline();
  int64_t computes = 0;
  for (const TimelineEvent& e : events) {
    if (e.kind == TimelineEvent::Kind::kCompute) {
      ++computes;
      CATCH_CHECK(e.checkpointed == (e.microbatch < 2));
      CATCH_CHECK(e.end_us >= e.start_us);
    }
  }
  CATCH_CHECK(computes == 6);
  // Everything up to the busy times, which vary.
  std::string picture = render_timeline(events);
  std::string grid;
  for (size_t start = 0; start < picture.size();) {
    const size_t end = picture.find('\n', start);
    const std::string line = picture.substr(start, end - start);
    grid += line.substr(0, line.rfind('|')) + "\n";
    start = end + 1;
  }
  CATCH_CHECK(grid == "partition 0 | 0* 1* 2  .  \npartition 1 | .  0* 1* 2  \n");
  GPipe quiet(torch::nn::Sequential(Scale(3)), GPipeOptions({1}).devices({at::kCPU}));
  quiet->forward(rows_input(2, 3));
  CATCH_CHECK(quiet->last_timeline().empty());
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
