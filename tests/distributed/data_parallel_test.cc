// Data-parallel replicas on c10d: processes on loopback (Gloo, float64) each training on a shard
// of every mini-batch reach the same parameters and batch norm statistics as one process on the
// whole mini-batch, through GPipe or a plain module, with gradient accumulation; a replica that
// dies or is configured differently makes the others fail with a clear error.
#include <torch/optim/sgd.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>

#include "gpipe/distributed/data_parallel.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/partition_threads.h"
#include "tests/catch.h"
#include "tests/distributed/data_parallel_test_util.h"
#include "tests/distributed/multiprocess.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace dp_test;  // NOLINT: the shared helpers of the data-parallel tests

// Rank `rank`'s replica of `pipe`: kSteps SGD steps on its shards, with buckets of 256 bytes (so
// that several start during backward), and the state saved. With `failed_backward`, step 1 first
// runs a backward that fails on every rank (the user's own hook, after the pipeline's backward);
// the step then goes on from zeroed gradients.
void train_replica(GPipe pipe, int rank, bool failed_backward = false) {
  DataParallel model(pipe, join(), DataParallelOptions().bucket_bytes(256));
  CATCH_CHECK(model->bucket_count() >= 3);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    if (failed_backward && step == 1) {
      const at::Tensor w = at::randn({3}, at::kDouble).requires_grad_(true);
      at::Tensor z = w * 2;  // made before the forward: its backward runs after the pipeline's
      z.register_hook([](const at::Tensor& grad) {
        TORCH_CHECK(false, "the user's backward failed on purpose");
        return grad;
      });
      at::Tensor loss =
          torch::nn::functional::mse_loss(model->forward(shard(x, rank)), shard(y, rank));
      CATCH_CHECK_THROWS_WITH((loss + z.sum()).backward(),
                              gpipe_test::contains("the user's backward failed on purpose"));
    }
    sgd.zero_grad();
    torch::nn::functional::mse_loss(model->forward(shard(x, rank)), shard(y, rank)).backward();
    const ReductionStats stats = model->last_reduction();
    CATCH_CHECK(stats.buckets == static_cast<int64_t>(model->bucket_count()));
    // The first backward learns when gradients are final; later ones start buckets early.
    if (step > 0) CATCH_CHECK(stats.started_during_backward >= 1);
    sgd.step();
  }
  save_state(*model);
}

GPipeOptions pipe_options() {
  return GPipeOptions({2, 2, 1}).chunks(2).checkpoint(Checkpoint::kExceptLast);
}

constexpr const char* kTransparency =
    "replicas through GPipe on shards of each batch train to the parameters of the plain "
    "model on the whole batch";

CATCH_TEST_CASE(kTransparency, "[distributed]") {
  if (test_rank() >= 0) {
    train_replica(GPipe(make_model(false, test_rank()), pipe_options()), test_rank());
    return;
  }
  check_plain_training(replicas(kTransparency, "transparency"));
}

constexpr const char* kStageLocal =
    "replicas of a GPipe whose CPU partitions run their own backward train to the parameters of "
    "the plain model on the whole batch";

CATCH_TEST_CASE(kStageLocal, "[distributed][stage_backward]") {
  if (test_rank() >= 0) {
    // Each partition's backward on its worker (Note [Stage-local backward in one process]): the
    // gradients become final there, and the reduction ends after them (Note [The reduction's
    // end]).
    train_replica(
        GPipe(make_model(false, test_rank()),
              gpipe::internal::with_stage_local_backward(
                  pipe_options().devices({at::kCPU, at::kCPU, at::kCPU}), true)),
        test_rank());
    return;
  }
  check_plain_training(replicas(kStageLocal, "stage_local"));
}

constexpr const char* kFailedBackward =
    "a backward that fails on every replica leaves the reduction ready and the replicas then "
    "train to the parameters of the plain model";

CATCH_TEST_CASE(kFailedBackward, "[distributed][errors]") {
  if (test_rank() >= 0) {
    train_replica(GPipe(make_model(false, test_rank()), pipe_options()), test_rank(),
                  /*failed_backward=*/true);
    return;
  }
  check_plain_training(replicas(kFailedBackward, "failed_backward"));
}

constexpr const char* kNccl =
    "replicas on a GPU each train over NCCL to the parameters of the plain model on the whole "
    "batch";

CATCH_TEST_CASE(kNccl, "[distributed][cuda][gpus2]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    const c10::Device gpu(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
    GPipe pipe(make_model(false, rank), GPipeOptions({2, 2, 1}).chunks(2).devices({gpu, gpu, gpu})
                                            .checkpoint(Checkpoint::kExceptLast));
    // NCCL: the configuration check, the broadcast and the buckets' all-reduce on the GPU.
    DataParallel model(pipe,
                       new_process_group(
                           options_from_env().timeout(std::chrono::seconds(60)).backend("nccl")),
                       DataParallelOptions().bucket_bytes(256));
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      sgd.zero_grad();
      torch::nn::functional::mse_loss(model->forward(shard(x, rank).to(gpu)),
                                      shard(y, rank).to(gpu))
          .backward();
      sgd.step();
    }
    save_state(*model);
    return;
  }
  CATCH_REQUIRE(built_with_nccl());
  check_plain_training(replicas(kNccl, "nccl"));
}

constexpr const char* kBatchNorm =
    "replicas with deferred batch norm keep the running statistics of one GPipe on the whole "
    "batch";

CATCH_TEST_CASE(kBatchNorm, "[distributed][batchnorm]") {
  // Each replica runs 2 micro-batches of its 4 samples; the one GPipe runs the same 4 micro-batches
  // of 2 samples, so every layer sees the same micro-batches.
  const GPipeOptions options =
      GPipeOptions({2, 4}).chunks(2).checkpoint(Checkpoint::kNever).deferred_batch_norm(true);
  if (test_rank() >= 0) {
    DataParallel model(GPipe(make_model(true, test_rank()), options), join());
    train_and_save(model, test_rank());
    return;
  }
  const std::vector<at::Tensor> states = replicas(kBatchNorm, "batchnorm");
  check_one_gpipe(states, options);
  CATCH_CHECK(at::equal(states[0], states[1]));  // identical replicas, bit for bit
}

constexpr const char* kNoSync =
    "no_sync accumulates a replica's own gradients and the next backward averages their sum";

CATCH_TEST_CASE(kNoSync, "[distributed]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    DataParallel model(make_model(false, rank), join());
    torch::optim::SGD sgd(model->parameters(), 0.1);
    for (int step = 0; step + 1 < kSteps; step += 2) {
      auto [a, ya] = batch(step);
      auto [b, yb] = batch(step + 1);
      sgd.zero_grad();
      {
        auto local = model->no_sync();
        torch::nn::functional::mse_loss(model->forward(shard(a, rank)), shard(ya, rank))
            .backward();
      }
      torch::nn::functional::mse_loss(model->forward(shard(b, rank)), shard(yb, rank)).backward();
      sgd.step();
    }
    save_state(*model);
    return;
  }
  const std::vector<at::Tensor> states = replicas(kNoSync, "nosync");
  nn::Sequential plain = make_model(false, 0);
  torch::optim::SGD sgd(plain->parameters(), 0.1);
  for (int step = 0; step + 1 < kSteps; step += 2) {
    auto [a, ya] = batch(step);
    auto [b, yb] = batch(step + 1);
    sgd.zero_grad();
    (torch::nn::functional::mse_loss(plain->forward(a), ya) +
     torch::nn::functional::mse_loss(plain->forward(b), yb))
        .backward();
    sgd.step();
  }
  const at::Tensor expected = flat(state_of(*plain));
  for (const at::Tensor& state : states) {
    CATCH_CHECK(at::allclose(state, expected, 0, 1e-10));
  }
}

constexpr const char* kDeadReplica =
    "a replica that dies mid-step makes the others fail with an error that says so";

CATCH_TEST_CASE(kDeadReplica, "[distributed][errors]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    DataParallel model(GPipe(make_model(false, rank), GPipeOptions({3, 2}).chunks(2)), join());
    auto [x, y] = batch(0);
    at::Tensor loss = torch::nn::functional::mse_loss(model->forward(shard(x, rank)),
                                                      shard(y, rank));
    if (rank == 1) {
      std::_Exit(3);  // dies before its backward
    }
    CATCH_CHECK_THROWS_WITH(loss.backward(),
                            gpipe_test::contains("failed on rank 0 of 2") &&
                                gpipe_test::contains("another process may have died"));
    return;
  }
  const std::string folder = folder_for("dead");
  const auto results = run_ranks(kDeadReplica, kWorld, folder, {{"GPIPE_TIMEOUT_S", "20"}});
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[1].exit_code == 3);
  CATCH_CHECK(results[0].exit_code == 0);  // it saw the error it expected, within the timeout
  std::filesystem::remove_all(folder);
}

constexpr const char* kMismatch = "replicas configured differently are refused at construction";

CATCH_TEST_CASE(kMismatch, "[distributed][errors]") {
  if (test_rank() >= 0) {
    const int rank = test_rank();
    GPipe pipe(make_model(false, rank), GPipeOptions({3, 2}).chunks(rank == 0 ? 2 : 4));
    CATCH_CHECK_THROWS_WITH(DataParallel(pipe, join()),
                            gpipe_test::contains("rank 1's replica differs from rank 0's") &&
                                gpipe_test::contains("GPipe chunks: 4 (rank 0: 2)"));
    return;
  }
  const std::string folder = folder_for("mismatch");
  const auto results = run_ranks(kMismatch, kWorld, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[0].exit_code == 0);
  CATCH_CHECK(results[1].exit_code == 0);
  std::filesystem::remove_all(folder);
}

CATCH_TEST_CASE("the process group's options come from torchrun's environment, and wrong ones "
                "are named",
                "[distributed][errors]") {
  if (test_rank() >= 0) return;
  const auto set = [](const char* name, const char* value) {
    if (value) ::setenv(name, value, 1); else ::unsetenv(name);
  };
  set("RANK", "1");
  set("WORLD_SIZE", "4");
  set("MASTER_ADDR", "10.0.0.7");
  set("MASTER_PORT", "29501");
  set("GPIPE_TIMEOUT_S", "2.5");
  const GroupOptions options = options_from_env();
  CATCH_CHECK(options.rank() == 1);
  CATCH_CHECK(options.world_size() == 4);
  CATCH_CHECK(options.master_addr() == "10.0.0.7");
  CATCH_CHECK(options.master_port() == 29501);
  CATCH_CHECK(options.timeout() == std::chrono::milliseconds(2500));
  CATCH_CHECK_FALSE(options.launcher_store());
  set("TORCHELASTIC_USE_AGENT_STORE", "True");  // torchrun serves the store itself
  CATCH_CHECK(options_from_env().launcher_store());
  set("TORCHELASTIC_USE_AGENT_STORE", nullptr);
  set("RANK", "4");
  CATCH_CHECK_THROWS_WITH(options_from_env(), gpipe_test::contains("RANK='4' is not an integer "
                                                                   "from 0 to 3"));
  set("RANK", nullptr);
  CATCH_CHECK_THROWS_WITH(options_from_env(), gpipe_test::contains("RANK is not set") &&
                                                  gpipe_test::contains("torchrun"));
  for (const char* name : {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPIPE_TIMEOUT_S"}) {
    set(name, nullptr);
  }
  CATCH_CHECK_THROWS_WITH(new_gloo_group(GroupOptions().rank(2).world_size(2)),
                          gpipe_test::contains("rank 2 is not in 0 .. world_size - 1 = 1"));
  // A rank whose store never comes up (nothing listens at the port) gives up at the timeout
  // (Note [Waiting for the store's port]), naming the address.
  const int port = gpipe_test::free_port();
  CATCH_CHECK_THROWS_WITH(
      new_gloo_group(GroupOptions().rank(1).world_size(2).master_addr("127.0.0.1")
                         .master_port(port).timeout(std::chrono::milliseconds(300))),
      gpipe_test::contains("rank 1 of 2 could not meet the others at 127.0.0.1:" +
                           std::to_string(port)) &&
          gpipe_test::contains("nothing accepted a connection there within the timeout"));
}

CATCH_TEST_CASE("a group's backend is gloo or nccl and gloo takes every tensor on the CPU",
                "[distributed][errors]") {
  if (test_rank() >= 0) return;
  const auto options = [] {
    return GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30));
  };
  CATCH_CHECK_THROWS_WITH(new_process_group(options().backend("mpi")),
                          gpipe_test::contains("unknown backend 'mpi'"));
  CATCH_CHECK_THROWS_WITH(new_pipeline_groups(options().backend("MPI"), 1),
                          gpipe_test::contains("unknown backend 'MPI'"));
  if (!built_with_nccl()) {
    CATCH_CHECK_THROWS_WITH(new_process_group(options().backend("nccl")),
                            gpipe_test::contains("this gpipe was built without NCCL"));
  }
  const ProcessGroup group = new_process_group(options());  // "gloo"
  CATCH_CHECK(group->getBackendName() == "gloo");
  CATCH_CHECK_FALSE(carries_device_tensors(group));
  CATCH_CHECK(wire_device(group, c10::Device("cuda:1")) == c10::Device(c10::kCPU));
  CATCH_CHECK(wire_device(group, c10::Device(c10::kCPU)) == c10::Device(c10::kCPU));
}

constexpr const char* kNamedGroups =
    "groups made by name meet under it beside the unnamed ones and a name used twice is refused";

CATCH_TEST_CASE(kNamedGroups, "[distributed][errors]") {
  if (test_rank() >= 0) {
    const GroupOptions options = options_from_env().timeout(std::chrono::seconds(60));
    // Named, unnamed, named: each a group of its own in the one store (rank 0 serves it once).
    std::vector<ProcessGroup> groups{new_gloo_group(GroupOptions(options).name("first")),
                                     new_gloo_group(options),
                                     new_gloo_group(GroupOptions(options).name("second"))};
    for (size_t g = 0; g < groups.size(); ++g) {
      std::vector<at::Tensor> t{at::full({1}, static_cast<double>(g + test_rank()), at::kDouble)};
      groups[g]->allreduce(t)->wait();
      CATCH_CHECK(t[0].item<double>() == static_cast<double>(2 * g + 1));
    }
    CATCH_CHECK_THROWS_WITH(new_gloo_group(GroupOptions(options).name("first")),
                            gpipe_test::contains("made a group named 'first' at 127.0.0.1:") &&
                                gpipe_test::contains("each group needs a name of its own"));
    return;
  }
  const std::string folder = folder_for("named_groups");
  const auto results = run_ranks(kNamedGroups, kWorld, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_CHECK(results[0].exit_code == 0);
  CATCH_CHECK(results[1].exit_code == 0);
  std::filesystem::remove_all(folder);
}

CATCH_TEST_CASE("one replica is the module itself", "[distributed]") {
  if (test_rank() >= 0) return;
  ProcessGroup group = new_gloo_group(
      GroupOptions().master_port(gpipe_test::free_port()).timeout(std::chrono::seconds(30)));
  nn::Sequential plain = make_model(false, 0);
  DataParallel model(GPipe(make_model(false, 0), GPipeOptions({3, 2}).chunks(2)), group);
  auto [x, y] = batch(0);
  torch::nn::functional::mse_loss(plain->forward(x), y).backward();
  torch::nn::functional::mse_loss(model->forward(x), y).backward();
  const auto expected = plain->parameters();
  const auto got = model->parameters();
  CATCH_REQUIRE(got.size() == expected.size());
  for (size_t k = 0; k < got.size(); ++k) {
    CATCH_CHECK(at::allclose(got[k].grad(), expected[k].grad(), 0, 1e-12));
  }
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
