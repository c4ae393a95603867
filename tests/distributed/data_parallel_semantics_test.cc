// Data-parallel replicas keep the promises of PyTorch's DistributedDataParallel: parameters that
// no replica used keep undefined gradients (an optimizer skips them), graphs may change between
// steps (a branch used later, more micro-batches), replicas must freeze the same parameters, and a
// GPipe wrapped again keeps merging its replicas' batch norm statistics; each against the plain
// model on the whole batch.
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>

#include <ATen/ops/arange.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/ones.h>
#include <torch/nn/cloneable.h>
#include <torch/optim/adam.h>

#include "gpipe/distributed/data_parallel.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/gpipe.h"
#include "tests/catch.h"
#include "tests/distributed/data_parallel_test_util.h"
#include "tests/distributed/multiprocess.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace dp_test;  // NOLINT: the shared helpers of the data-parallel tests

// y = lin(x), plus branch(x) on the rows whose first feature is positive: in a step (or on a
// shard, or in a micro-batch) where no row is, the branch's parameters get no gradient.
struct GatedImpl : nn::Cloneable<GatedImpl> {
  GatedImpl() { reset(); }
  void reset() override {
    lin = register_module("lin", nn::Linear(6, 3));
    branch = register_module("branch", nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = lin(x);
    const at::Tensor rows = at::nonzero(x.select(1, 0) > 0).reshape(-1);
    if (rows.numel() == 0) return y;
    return y.index_add(0, rows, branch(x.index_select(0, rows)));
  }
  nn::Linear lin{nullptr}, branch{nullptr};
};
TORCH_MODULE(Gated);

nn::Sequential gated_model(int seed_offset) {
  torch::manual_seed(200 + seed_offset);
  nn::Sequential seq(Gated(), nn::Tanh(), nn::Linear(3, 3));
  seq->to(at::kDouble);
  return seq;
}

// Step k's batch, with the rows that pass the gate: none in steps 0 and 3, one in rank 0's shard
// only in step 1, one in each shard in step 2.
std::pair<at::Tensor, at::Tensor> gated_batch(int step) {
  auto [x, y] = batch(step);
  x.select(1, 0).fill_(-1);
  const std::vector<std::vector<int64_t>> passing{{}, {1}, {2, 6}, {}};
  for (int64_t row : passing[static_cast<size_t>(step)]) x[row][0] = 2;
  return {x, y};
}

bool branch_used(int step) { return step == 1 || step == 2; }

// Every gradient undefined (the optimizers' zero_grad zeroes them in LibTorch 1.13 and sets them
// to none in 2.x; this test needs none in both).
void clear_grads(const std::vector<at::Tensor>& params) {
  for (at::Tensor p : params) p.mutable_grad() = at::Tensor();
}

std::vector<at::Tensor> branch_params(nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& item : module.named_parameters()) {
    if (item.key().find("branch") != std::string::npos) out.push_back(item.value());
  }
  return out;
}

constexpr const char* kUnused =
    "parameters that no replica used keep undefined gradients and ones that some used get the "
    "average so Adam with weight decay trains to the plain model";

CATCH_TEST_CASE(kUnused, "[distributed][unused]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    const std::string wrap = std::getenv("GPIPE_TEST_WRAP");
    nn::Sequential seq = gated_model(rank);
    // Buckets of 64 bytes: the branch's parameters in buckets of their own, which start as soon as
    // backward does when the last step did not use them.
    std::optional<DataParallel> model;
    if (wrap == "gpipe") {
      model.emplace(GPipe(seq, GPipeOptions({1, 2}).chunks(2).checkpoint(Checkpoint::kAlways)),
                    join(), DataParallelOptions().bucket_bytes(64));
    } else {
      model.emplace(seq, join(), DataParallelOptions().bucket_bytes(64));
    }
    DataParallel& dp = *model;
    torch::optim::Adam adam(dp->parameters(), torch::optim::AdamOptions(0.01).weight_decay(0.1));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = gated_batch(step);
      clear_grads(dp->parameters());
      torch::nn::functional::mse_loss(dp->forward(shard(x, rank)), shard(y, rank)).backward();
      CATCH_CAPTURE(step);
      // Rank 1 never passes a row to the branch, and still gets rank 0's half in step 1.
      for (const at::Tensor& p : branch_params(*dp)) CATCH_CHECK(p.grad().defined() == branch_used(step));
      adam.step();
    }
    save_state(*dp);
    return;
  }
  const std::string wrap = GENERATE(as<std::string>(), "module", "gpipe");
  CATCH_INFO("a DataParallel of a " << wrap);
  const std::vector<at::Tensor> states =
      replicas(kUnused, "unused_" + wrap, {{"GPIPE_TEST_WRAP", wrap}});
  nn::Sequential plain = gated_model(0);
  torch::optim::Adam adam(plain->parameters(), torch::optim::AdamOptions(0.01).weight_decay(0.1));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = gated_batch(step);
    clear_grads(plain->parameters());
    torch::nn::functional::mse_loss(plain->forward(x), y).backward();
    for (const at::Tensor& p : branch_params(*plain)) {
      CATCH_REQUIRE(p.grad().defined() == branch_used(step));
    }
    adam.step();
  }
  check_states(states, flat(state_of(*plain)));
}

constexpr const char* kUnusedInStages =
    "replicated pipeline stages keep undefined gradients for parameters that no replica used and "
    "average the others so Adam with weight decay trains to the plain model";

CATCH_TEST_CASE(kUnusedInStages, "[distributed][unused][stage]") {
  if (test_rank() >= 0) {
    // 2 stages x 2 replicas: stage 0 holds the gated branch (Note [Parameters that no replica
    // used]: the replicas' average after each step).
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    const auto loss = [](const Batch& out, const at::Tensor& y) {
      return torch::nn::functional::mse_loss(out.tensor(), y);
    };
    PipelineStage stage(gated_model(groups.replica), PipelineStageOptions({1, 2}).chunks(2),
                        groups.pipeline, groups.replica_group);
    torch::optim::Adam adam(stage->parameters(),
                            torch::optim::AdamOptions(0.01).weight_decay(0.1));
    // The plain model, trained alongside on the whole batches: the oracle of this stage's layers.
    nn::Sequential plain = gated_model(0);
    torch::optim::Adam plain_adam(plain->parameters(),
                                  torch::optim::AdamOptions(0.01).weight_decay(0.1));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = gated_batch(step);
      const at::Tensor xs = x.chunk(2)[groups.replica];
      const at::Tensor ys = y.chunk(2)[groups.replica];
      clear_grads(stage->parameters());
      if (stage->is_first()) {
        stage->step(Batch(xs), {}, loss);
      } else {
        stage->step(no_input(), ys, loss);
      }
      CATCH_CAPTURE(step);
      for (const at::Tensor& p : branch_params(*stage)) {
        CATCH_CHECK(p.grad().defined() == branch_used(step));
      }
      adam.step();
      clear_grads(plain->parameters());
      torch::nn::functional::mse_loss(plain->forward(x), y).backward();
      plain_adam.step();
    }
    std::vector<at::Tensor> expected;
    const int64_t first = stage->is_first() ? 0 : 1, end = stage->is_first() ? 1 : 3;
    for (int64_t k = first; k < end; ++k) {
      for (const at::Tensor& p : plain[k]->parameters()) expected.push_back(p);
    }
    CATCH_CHECK(at::allclose(flat(stage->parameters()), flat(expected), 0, 1e-10));
    return;
  }
  const std::string folder = folder_for("unused_in_stages");
  const auto results = run_ranks(kUnusedInStages, 4, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < 4; ++r) CATCH_CHECK(results[r].exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kMoreMicrobatches =
    "replicas of a GPipe train to the plain model when a step has more micro-batches than the "
    "step before";

CATCH_TEST_CASE(kMoreMicrobatches, "[distributed][dynamic]") {
  // Rows of each step's whole mini-batch: 1, 4, 4 and 2 per replica, so 1, 4, 4 and 2
  // checkpointed micro-batches, each accumulating every gradient once.
  const std::vector<int64_t> rows{2, 8, 8, 4};
  if (test_rank() >= 0) {
    const int rank = test_rank();
    DataParallel model(GPipe(make_model(false, rank),
                             GPipeOptions({2, 2, 1}).chunks(4).checkpoint(Checkpoint::kAlways)),
                       join(), DataParallelOptions().bucket_bytes(256));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, rows[static_cast<size_t>(step)]);
      sgd.zero_grad();
      torch::nn::functional::mse_loss(model->forward(shard(x, rank)), shard(y, rank)).backward();
      const ReductionStats stats = model->last_reduction();
      CATCH_CAPTURE(step);
      // Step 1 accumulates 4 times what step 0 counted once: buckets started after the first are
      // reduced again. Step 2 is step 1 again: counted right, nothing again.
      if (step == 1) CATCH_CHECK(stats.reduced_again >= 1);
      if (step == 2) CATCH_CHECK(stats.reduced_again == 0);
      if (step == 2) CATCH_CHECK(stats.started_during_backward >= 1);
      sgd.step();
    }
    save_state(*model);
    return;
  }
  const std::vector<at::Tensor> states = replicas(kMoreMicrobatches, "more_microbatches");
  nn::Sequential plain = make_model(false, 0);
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, rows[static_cast<size_t>(step)]);
    sgd.zero_grad();
    torch::nn::functional::mse_loss(plain->forward(x), y).backward();
    sgd.step();
  }
  check_states(states, flat(state_of(*plain)));
}

constexpr const char* kFailsOnOne =
    "a backward that fails on one replica makes the others throw at once naming it and every "
    "replica then trains on to the plain model";

CATCH_TEST_CASE(kFailsOnOne, "[distributed][errors]") {
  // Six rows split evenly over two or three replicas.
  constexpr int64_t kRows = 6;
  if (test_rank() >= 0) {
    const int rank = test_rank();
    const int world = std::stoi(std::getenv("WORLD_SIZE"));
    DataParallel model(GPipe(make_model(false, rank),
                             GPipeOptions({2, 2, 1}).chunks(2).checkpoint(Checkpoint::kExceptLast)),
                       join(), DataParallelOptions().bucket_bytes(256));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const auto mine = [&](const at::Tensor& t) { return t.chunk(world)[rank]; };
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, kRows);
      if (step == 2) {
        // Rank 1's own hook fails after the pipeline's backward, when some buckets have started.
        const at::Tensor w = at::ones({3}, at::kDouble).requires_grad_(true);
        at::Tensor z = w * 2;
        if (rank == 1) {
          z.register_hook([](const at::Tensor& grad) {
            TORCH_CHECK(false, "rank 1's backward failed on purpose");
            return grad;
          });
        }
        at::Tensor loss = torch::nn::functional::mse_loss(model->forward(mine(x)), mine(y));
        const auto start = std::chrono::steady_clock::now();
        if (rank == 1) {
          CATCH_CHECK_THROWS_WITH((loss + z.sum()).backward(),
                                  gpipe_test::contains("rank 1's backward failed on purpose"));
        } else {
          CATCH_CHECK_THROWS_WITH(
              (loss + z.sum()).backward(),
              gpipe_test::contains("the backward failed on rank 1 of " + std::to_string(world)) &&
                  gpipe_test::contains("zero the gradients and go on"));
        }
        std::printf("rank %d threw after %.3f s\n", rank,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                        .count());
      }
      sgd.zero_grad();
      torch::nn::functional::mse_loss(model->forward(mine(x)), mine(y)).backward();
      sgd.step();
    }
    save_state(*model);
    return;
  }
  const int world = GENERATE(2, 3);
  CATCH_INFO(world << " replicas");
  dp_test::check_plain_training(
      replicas(kFailsOnOne, "fails_on_one_" + std::to_string(world), {}, world), kRows);
}

constexpr const char* kForwardFails =
    "a forward that fails on one replica makes the others throw at once naming it (with and "
    "without deferred batch norm and in the statistics' merge before its all-gather) and every "
    "replica then trains on as before";

CATCH_TEST_CASE(kForwardFails, "[distributed][errors]") {
  // Without batch norm: six rows split evenly over two or three replicas, checked against the
  // plain model. With deferred batch norm: two replicas, checked against one GPipe.
  constexpr int64_t kRows = 6;
  const auto options = [](bool batch_norm) {
    return batch_norm
               ? GPipeOptions({3, 3}).chunks(2).deferred_batch_norm(true)
               : GPipeOptions({2, 2, 1}).chunks(2).checkpoint(Checkpoint::kExceptLast);
  };
  if (test_rank() >= 0) {
    const int rank = test_rank();
    const int world = std::stoi(std::getenv("WORLD_SIZE"));
    const bool batch_norm = std::getenv("GPIPE_TEST_BATCH_NORM") != nullptr;
    DataParallel model(GPipe(make_model(batch_norm, rank), options(batch_norm)), join(),
                       DataParallelOptions().bucket_bytes(256));
    torch::optim::SGD sgd(model->parameters(),
                          torch::optim::SGDOptions(0.1).momentum(batch_norm ? 0 : 0.9));
    const auto mine = [&](const at::Tensor& t) { return t.chunk(world)[rank]; };
    const auto mse = [](const at::Tensor& a, const at::Tensor& b) {
      return torch::nn::functional::mse_loss(a, b);
    };
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, batch_norm ? kBatch : kRows);
      if (step == 1) {
        // A validation forward in eval mode, grad on, that fails on rank 1: the others run no
        // collective after theirs, so rank 1 joins none, and training goes on.
        model->eval();
        const at::Tensor bad = rank == 1 ? mine(x).narrow(1, 0, 5) : mine(x);
        if (rank == 1) {
          CATCH_CHECK_THROWS(model->forward(bad));
        } else {
          CATCH_CHECK_NOTHROW(model->forward(bad));
        }
        model->train();
      }
      if (step == 2) {
        // Rank 1's shard has 5 features where its first layer takes 6: its forward throws.
        const at::Tensor bad = rank == 1 ? mine(x).narrow(1, 0, 5) : mine(x);
        const std::string failed = "the forward failed on rank 1 of " + std::to_string(world);
        const auto start = std::chrono::steady_clock::now();
        if (rank == 1) {
          CATCH_CHECK_THROWS_WITH(model->forward(bad), !gpipe_test::contains("failed on rank"));
        } else if (batch_norm) {
          // The others' forward, merging the statistics, hears it.
          CATCH_CHECK_THROWS_WITH(model->forward(bad),
                                  gpipe_test::contains(failed) &&
                                      gpipe_test::contains("go on with the next step"));
        } else {
          // The others' forward worked; their backward's all-reduces hear it.
          at::Tensor loss = mse(model->forward(bad), mine(y));
          CATCH_CHECK_THROWS_WITH(loss.backward(),
                                  gpipe_test::contains(failed) &&
                                      gpipe_test::contains("zero the gradients and go on"));
        }
        std::printf("rank %d threw after %.3f s\n", rank,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                        .count());
      }
      if (step == 3 && batch_norm) {
        // Rank 1's forward works but its statistics merge fails before posting the all-gather
        // (a fault injected where packing them would run out of memory): it is rank 1's own
        // failure, which its forward still tells the others in their all-gather.
        if (rank == 1) {
          auto once = std::make_shared<bool>(true);
          internal::set_all_gather_hook([once] {
            if (*once) {
              *once = false;
              TORCH_CHECK(false, "injected: no memory to pack the statistics");
            }
          });
          CATCH_CHECK_THROWS_WITH(model->forward(mine(x)),
                                  gpipe_test::contains("injected: no memory"));
          internal::set_all_gather_hook(nullptr);
        } else {
          CATCH_CHECK_THROWS_WITH(model->forward(mine(x)),
                                  gpipe_test::contains("the forward failed on rank 1 of 2"));
        }
      }
      sgd.zero_grad();
      mse(model->forward(mine(x)), mine(y)).backward();
      sgd.step();
    }
    save_state(*model);
    return;
  }
  const auto [world, batch_norm] =
      GENERATE(table<int, bool>({{2, false}, {3, false}, {2, true}}));
  CATCH_INFO(world << " replicas" << (batch_norm ? ", deferred batch norm" : ""));
  const std::map<std::string, std::string> env =
      batch_norm ? std::map<std::string, std::string>{{"GPIPE_TEST_BATCH_NORM", "1"}}
                 : std::map<std::string, std::string>{};
  const std::vector<at::Tensor> states =
      replicas(kForwardFails,
               "forward_fails_" + std::to_string(world) + (batch_norm ? "_bn" : ""), env, world);
  if (batch_norm) {
    check_one_gpipe(states, options(true));
  } else {
    dp_test::check_plain_training(states, kRows);
  }
}

// A tuple model: (x, k) -> (tanh(lin(x)) * (1 + k / 8), k) -> its first -> Linear(8, 3); k is an
// integer tensor that needs no gradient.
struct PairInImpl : nn::Module {
  PairInImpl() : lin(register_module("lin", nn::Linear(6, 8))) {}
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& xs) {
    return {at::tanh(lin(xs[0])) * (1 + xs[1].unsqueeze(1).to(at::kDouble) / 8), xs[1]};
  }
  nn::Linear lin;
};
TORCH_MODULE(PairIn);

struct FirstOfImpl : nn::Module {
  at::Tensor forward(const std::vector<at::Tensor>& xs) { return xs[0]; }
};
TORCH_MODULE(FirstOf);

nn::Sequential tuple_model(int seed_offset) {
  torch::manual_seed(300 + seed_offset);
  nn::Sequential seq(PairIn(), FirstOf(), nn::Tanh(), nn::Linear(8, 3));
  seq->to(at::kDouble);
  return seq;
}

at::Tensor labels_of(int step) { return at::arange(dp_test::kBatch, at::kLong).remainder(3 + step); }

constexpr const char* kTuple =
    "replicas of a GPipe fed a tuple of shards train to the plain model on the whole batch";

CATCH_TEST_CASE(kTuple, "[distributed]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    DataParallel model(GPipe(tuple_model(rank), GPipeOptions({2, 2}).chunks(2)), join(),
                       DataParallelOptions().bucket_bytes(256));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      sgd.zero_grad();
      const std::vector<at::Tensor> out =
          model->forward(std::vector<at::Tensor>{shard(x, rank), shard(labels_of(step), rank)});
      CATCH_REQUIRE(out.size() == 1);
      torch::nn::functional::mse_loss(out[0], shard(y, rank)).backward();
      sgd.step();
    }
    // A module that takes one tensor is refused a tuple, naming what it takes.
    DataParallel plain(nn::Sequential(nn::Linear(6, 3)), join());
    CATCH_CHECK_THROWS_WITH(plain->forward(std::vector<at::Tensor>{at::ones({2, 6})}),
                            gpipe_test::contains("forward of 1 tensors needs a module that takes "
                                                 "a tuple (a GPipe)"));
    save_state(*model);
    return;
  }
  const std::vector<at::Tensor> states = replicas(kTuple, "tuple");
  nn::Sequential plain = tuple_model(0);
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    const at::Tensor out =
        plain->forward<at::Tensor>(std::vector<at::Tensor>{x, labels_of(step)});
    torch::nn::functional::mse_loss(out, y).backward();
    sgd.step();
  }
  check_states(states, flat(state_of(*plain)));
}

constexpr const char* kFrozenMismatch =
    "replicas that freeze different parameters are refused at construction";

CATCH_TEST_CASE(kFrozenMismatch, "[distributed][errors]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    nn::Sequential model = make_model(false, rank);
    // As many frozen on each, not the same ones.
    model[rank == 0 ? 0 : 2]->named_parameters()["weight"].requires_grad_(false);
    CATCH_CHECK_THROWS_WITH(DataParallel(model, join()),
                            gpipe_test::contains("rank 1's replica differs from rank 0's") &&
                                gpipe_test::contains("names of the frozen parameters (hash)") &&
                                gpipe_test::contains("freeze the same parameters"));
    return;
  }
  const std::string folder = folder_for("frozen_mismatch");
  const auto results = run_ranks(kFrozenMismatch, kWorld, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[0].exit_code == 0);
  CATCH_CHECK(results[1].exit_code == 0);
  std::filesystem::remove_all(folder);
}

constexpr const char* kWrappedAgain =
    "a DataParallel destroyed after a newer one wraps the same GPipe leaves the newer one "
    "merging the replicas' batch norm statistics";

CATCH_TEST_CASE(kWrappedAgain, "[distributed][batchnorm]") {
  const auto options = [] {
    return GPipeOptions({2, 4}).chunks(2).checkpoint(Checkpoint::kNever).deferred_batch_norm(true);
  };
  if (test_rank() >= 0) {
    const int rank = test_rank();
    GPipe pipe(make_model(true, rank), options());
    const ProcessGroup group = join();
    std::optional<DataParallel> first(std::in_place, pipe, group);
    DataParallel model(pipe, group);
    first.reset();  // must not take the newer wrapper's combiner with it
    CATCH_CHECK(static_cast<bool>(pipe->statistics_combiner()));
    train_and_save(model, rank);
    return;
  }
  check_one_gpipe(replicas(kWrappedAgain, "wrapped_again"), options());
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
