// Exceptions thrown by layers, in forward or in backward, at any micro-batch and partition, reach
// the caller with their message; nothing hangs, and the model works for the next step.
#include "tests/gpipe/test_util.h"

#include "gpipe/internal/partition_threads.h"

#include <stdexcept>

#include "absl/strings/str_format.h"

namespace gpipe {
namespace testing {
namespace {

// Where to fail: micro-batch `microbatch` in partition `partition`, in "forward" or "backward";
// microbatch -1 disarms it.
struct Trap {
  int64_t microbatch = -1;
  int64_t partition = -1;
  std::string phase;
};

// Identity layer of partition `partition` that throws where the trap says. In backward it throws
// from a gradient hook on its output.
struct TrapLayerImpl : torch::nn::Module {
  TrapLayerImpl(int64_t partition, std::shared_ptr<Trap> trap)
      : partition(partition), trap(std::move(trap)) {}
  at::Tensor forward(const at::Tensor& x) {
    const int64_t mb = static_cast<int64_t>(x[0][0].item<double>()) / 2;
    const bool here = trap->microbatch == mb && trap->partition == partition;
    if (here && trap->phase == "forward") {
      throw std::runtime_error(absl::StrFormat("trap in forward at (%d, %d)", mb, partition));
    }
    at::Tensor y = x * 1.0;
    if (here && trap->phase == "backward" && y.requires_grad()) {
      const int64_t j = partition;
      y.register_hook([mb, j](const at::Tensor& /*grad*/) -> at::Tensor {
        TORCH_CHECK(false, absl::StrFormat("trap in backward at (%d, %d)", mb, j));
      });
    }
    return y;
  }
  int64_t partition;
  std::shared_ptr<Trap> trap;
};
TORCH_MODULE(TrapLayer);

torch::nn::Sequential trapped_model(int64_t partitions, const std::shared_ptr<Trap>& trap,
                                    uint64_t seed) {
  at::manual_seed(seed);
  torch::nn::Sequential seq;
  for (int64_t j = 0; j < partitions; ++j) {
    seq->push_back(TrapLayer(j, trap));
    seq->push_back(Scale(3));
  }
  return seq;
}

// Three partitions of a TrapLayer and a Scale each, four micro-batches of two rows.
GPipe trapped_gpipe(const std::shared_ptr<Trap>& trap, Checkpoint mode, bool threads) {
  GPipe model(trapped_model(3, trap, 0),
              gpipe::internal::with_partition_threads(GPipeOptions({2, 2, 2})
                                                          .devices({at::kCPU, at::kCPU, at::kCPU})
                                                          .chunks(4)
                                                          .checkpoint(mode),
                                                      threads));
  model->train();
  return model;
}

// After a failed step, the same GPipe still computes what a plain model computes.
void check_next_step_works(GPipe& model, const std::shared_ptr<Trap>& trap, int64_t partitions) {
  trap->microbatch = -1;
  torch::nn::Sequential plain = trapped_model(partitions, trap, 0);
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  at::Tensor x = rows_input(8, 3);
  at::Tensor y = model->forward(x);
  CATCH_CHECK(max_diff(y, plain->forward(x)) <= 1e-12);
  y.sum().backward();
  for (const auto& p : model->parameters()) CATCH_CHECK(p.grad().defined());
}

CATCH_TEST_CASE("an exception in forward at any task reaches the caller", "[pipeline][errors]") {
  const int64_t partitions = 3;
  const int64_t i = GENERATE(0, 1, 2, 3);
  const int64_t j = GENERATE(0, 1, 2);
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast);
  const bool threads = GENERATE(false, true);
  CATCH_CAPTURE(i, j, static_cast<int>(mode), threads);
  auto trap = std::make_shared<Trap>(Trap{i, j, "forward"});
  GPipe model = trapped_gpipe(trap, mode, threads);
  CATCH_CHECK_THROWS_WITH(model->forward(rows_input(8, 3)),
                          gpipe_test::contains(absl::StrFormat("trap in forward at (%d, %d)", i, j)));
  check_next_step_works(model, trap, partitions);
}

CATCH_TEST_CASE("an exception in backward at any task reaches the caller", "[pipeline][errors]") {
  const int64_t partitions = 3;
  const int64_t i = GENERATE(0, 1, 2, 3);
  const int64_t j = GENERATE(0, 1, 2);
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways);
  const bool threads = GENERATE(false, true);
  CATCH_CAPTURE(i, j, static_cast<int>(mode), threads);
  auto trap = std::make_shared<Trap>(Trap{i, j, "backward"});
  GPipe model = trapped_gpipe(trap, mode, threads);
  // The input needs a gradient, so that the first partition's layer has a backward to fail in.
  at::Tensor y = model->forward(rows_input(8, 3).requires_grad_(true));
  CATCH_CHECK_THROWS_WITH(y.sum().backward(),
                          gpipe_test::contains(absl::StrFormat("trap in backward at (%d, %d)", i, j)));
  check_next_step_works(model, trap, partitions);
}

CATCH_TEST_CASE("an exception stops the pipeline at the end of its clock tick",
                "[pipeline][errors]") {
  // 4 partitions, 3 micro-batches, failing at the last partition's first task. That task is in
  // tick 3 with (2,1) and (1,2), which still finish; no later tick runs. So partitions 0 and 1 saw
  // all three micro-batches, partition 2 two, and partition 3 only the failing one.
  auto trap = std::make_shared<Trap>(Trap{0, 3, "forward"});
  auto log = std::make_shared<Log>(2);
  torch::nn::Sequential seq;
  for (int64_t j = 0; j < 4; ++j) {
    seq->push_back(Probe(j, log));
    seq->push_back(TrapLayer(j, trap));
  }
  // On one thread, so that the ticks run in order (Note [Threads of forward()]).
  GPipe model(seq,
              internal::with_partition_threads(GPipeOptions({2, 2, 2, 2})
                                                   .devices(std::vector<c10::Device>(4, at::kCPU))
                                                   .chunks(3)
                                                   .checkpoint(Checkpoint::kNever),
                                               false));
  CATCH_CHECK_THROWS_WITH(model->forward(rows_input(6, 3)), gpipe_test::contains("trap in forward"));
  std::vector<int64_t> per_partition(4, 0);
  for (const Event& e : log->take("forward")) per_partition[e.partition] += 1;
  CATCH_CHECK(per_partition == std::vector<int64_t>{3, 3, 2, 1});
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
