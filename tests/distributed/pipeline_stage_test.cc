// Pipeline stages in processes of their own on c10d: two processes on loopback (Gloo, float64),
// each owning a range of a Sequential's layers, train with tuple batches, skips, every checkpoint
// mode, frozen layers, replicas, batch norms, autocast and two threads to the parameters and
// losses of the plain model.
#include "tests/distributed/stage_test_util.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers

constexpr const char* kTransparency =
    "two processes with one stage each train a model with tuples and skips to the plain model's "
    "parameters and losses";

CATCH_TEST_CASE(kTransparency, "[distributed][stage]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()),
                /*record_timeline=*/true);
    return;
  }
  const std::string mode = GENERATE(as<std::string>(), "always", "except_last", "never");
  CATCH_INFO("checkpoint " << mode);
  const std::string folder = folder_for("transparency_" + mode);
  // (Then evaluate(), on every rank.)
  check_two_stages(kTransparency, folder,
                   {{"GPIPE_TEST_CHECKPOINT", mode}, {"GPIPE_TEST_EVALUATE", "1"}},
                   /*loss_tolerance=*/1e-12);
}

constexpr const char* kLocalPartitions =
    "two processes with two partitions each on threads of their own train a model with tuples "
    "and skips within or across partitions to the plain model's parameters and losses";

CATCH_TEST_CASE(kLocalPartitions, "[distributed][stage][partitions]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()),
                /*record_timeline=*/true);
    return;
  }
  // "1,2": stage 0 Linear | Stash, PopPair (the skip within a partition), stage 1 PairLinear |
  // First, Linear (the pair with its integer tensor crosses between the partitions). "2,1":
  // stage 0 Linear, Stash | PopPair (the skip crosses between the partitions), stage 1
  // PairLinear, First | Linear.
  const std::string local = GENERATE(as<std::string>(), "1,2", "2,1");
  const std::string mode = GENERATE(as<std::string>(), "always", "except_last", "never");
  CATCH_INFO("local balance " << local << " in each stage, checkpoint " << mode);
  const std::string folder = folder_for("local_" + local.substr(0, 1) + "_" + mode);
  check_two_stages(kLocalPartitions, folder,
                   {{"GPIPE_TEST_CHECKPOINT", mode}, {"GPIPE_TEST_LOCAL", local + ";" + local}},
                   /*loss_tolerance=*/1e-12);
}

constexpr const char* kInOrder =
    "two stages whose transfers are matched in posting order as NCCL matches them train to the "
    "plain model's parameters and losses";

CATCH_TEST_CASE(kInOrder, "[distributed][stage][order]") {
  if (test_rank() >= 0) {
    // (The schedule is checked where both stages run backward.)
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()),
                /*record_timeline=*/freeze_from_env() != "stage0");
    return;
  }
  // Note [Point-to-point order]: the stages post in an order both agree on, so a group that
  // ignores tags (NCCL) pairs each send with its receive and never waits on a gradient that
  // needs activations queued behind it. With one partition per stage, and with two (the skip
  // across stage 0's partitions, the tuple across stage 1's); frozen stage 1 (gradients still
  // cross) and frozen stage 0 (none cross).
  const auto [local, mode, frozen] = GENERATE(table<std::string, std::string, std::string>(
      {{"", "never", ""}, {"", "always", ""}, {"2,1;2,1", "except_last", ""},
       {"", "always", "stage1"}, {"", "always", "stage0"}}));
  CATCH_INFO("local balance '" << local << "', checkpoint " << mode << ", frozen '" << frozen
                               << "'");
  std::map<std::string, std::string> env{{"GPIPE_TEST_IN_ORDER", "1"},
                                         {"GPIPE_TEST_CHECKPOINT", mode},
                                         {"GPIPE_TEST_FREEZE", frozen}};
  if (!local.empty()) env["GPIPE_TEST_LOCAL"] = local;
  const std::string folder =
      folder_for("in_order_" + mode + "_" + std::to_string(local.size()) + "_" + frozen);
  check_two_stages(kInOrder, folder, env, /*loss_tolerance=*/1e-12, frozen);
}

constexpr const char* kFineTuning =
    "fine-tuning with frozen layers in either stage trains to the plain model's parameters and "
    "losses";

CATCH_TEST_CASE(kFineTuning, "[distributed][stage]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()));
    return;
  }
  // Frozen stage 0: nothing of stage 0 requires grad, so no gradient crosses back; frozen stage 1:
  // its inputs' gradients still go to stage 0.
  // (Checkpointing everywhere for a frozen stage 0: micro-batches whose graph needs no backward.)
  const auto [frozen, mode] = GENERATE(table<std::string, std::string>(
      {{"stage0", "always"}, {"layer0", "never"}, {"stage1", "always"}}));
  CATCH_INFO("frozen " << frozen << ", checkpoint " << mode);
  const std::string folder = folder_for("frozen_" + frozen + "_" + mode);
  // The frozen parameters are compared too: they must not have moved.
  check_two_stages(kFineTuning, folder,
                   {{"GPIPE_TEST_CHECKPOINT", mode}, {"GPIPE_TEST_FREEZE", frozen}},
                   /*loss_tolerance=*/1e-12, frozen);
}

constexpr const char* kCudaStages =
    "two processes with one stage each on the GPU train to the plain model's parameters and "
    "losses";

CATCH_TEST_CASE(kCudaStages, "[distributed][stage][cuda]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()),
                /*record_timeline=*/true);
    return;
  }
  // Both processes on cuda:0 (one GPU is enough: Gloo carries the tensors through the CPU).
  const std::string mode = GENERATE(as<std::string>(), "always", "never");
  CATCH_INFO("checkpoint " << mode);
  const std::string folder = folder_for("cuda_" + mode);
  check_two_stages(kCudaStages, folder,
                   {{"GPIPE_TEST_CHECKPOINT", mode},
                    {"GPIPE_TEST_DEVICE", "cuda:0"},
                    {"GPIPE_TEST_EVALUATE", "1"}},
                   /*loss_tolerance=*/1e-10);
}

constexpr const char* kNccl =
    "two processes with one stage each on a GPU of their own train over NCCL under each schedule "
    "to the plain model's parameters and losses, and evaluate to its output";

CATCH_TEST_CASE(kNccl, "[distributed][stage][cuda][gpus2]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks).checkpoint(mode_from_env()),
                /*record_timeline=*/true);
    return;
  }
  // The activations and gradients go from GPU to GPU, on NCCL's streams (Note [Point-to-point
  // order]); with one partition per stage, and with two (both on the stage's GPU would share its
  // generator: the second partition of each stage on the CPU).
  // 1F1B and ZB-H1 post each pair's transfers in turn (Note [When gradients' receives are
  // posted]).
  CATCH_REQUIRE(built_with_nccl());
  const auto [mode, local, schedule] = GENERATE(table<std::string, std::string, std::string>(
      {{"always", "", "gpipe"}, {"never", "", "gpipe"}, {"except_last", "2,1;2,1", "gpipe"},
       {"never", "", "1f1b"}, {"always", "2,1;2,1", "zb"}}));
  CATCH_INFO("checkpoint " << mode << ", local balance '" << local << "', schedule "
                           << schedule);
  std::map<std::string, std::string> env{{"GPIPE_TEST_CHECKPOINT", mode},
                                         {"GPIPE_TEST_DEVICE", "cuda:rank"},
                                         {"GPIPE_TEST_BACKEND", "nccl"},
                                         {"GPIPE_TEST_SCHEDULE", schedule},
                                         {"GPIPE_TEST_EVALUATE", "1"}};  // (its broadcasts)
  if (!local.empty()) env["GPIPE_TEST_LOCAL"] = local;
  const std::string folder = folder_for("nccl_" + mode + "_" + schedule);
  check_two_stages(kNccl, folder, env, /*loss_tolerance=*/1e-10);
}

constexpr const char* kReplicas =
    "replicated pipelines on shards of each batch train to the plain model's parameters and "
    "losses on the whole batch";

CATCH_TEST_CASE(kReplicas, "[distributed][stage]") {
  if (test_rank() >= 0) {
    const int stages = std::atoi(std::getenv("GPIPE_TEST_STAGES"));
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), stages);
    const std::vector<int64_t> balance = stages == 1 ? std::vector<int64_t>{6} : kBalance;
    // Replicas start apart: replica 0's parameters must reach the others.
    PipelineStage stage(make_model(7 + 100 * groups.replica),
                        PipelineStageOptions(balance).chunks(2), groups.pipeline,
                        groups.replica_group);
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    std::vector<at::Tensor> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      const at::Tensor xs = x.chunk(groups.replicas)[groups.replica];
      const at::Tensor ys = y.chunk(groups.replicas)[groups.replica];
      sgd.zero_grad();
      at::Tensor loss =
          stage->is_first() ? stage->step(Batch(xs), ys, mse) : stage->step(no_input(), ys, mse);
      if (loss.defined()) losses.push_back(loss.detach());
      sgd.step();
    }
    const std::string folder = gpipe_test::test_folder();
    gpipe_test::write_doubles(folder + "/state" + std::to_string(test_rank()) + ".bin",
                              stage->parameters());
    if (stage->is_last()) {
      gpipe_test::write_doubles(folder + "/loss" + std::to_string(groups.replica) + ".bin",
                                losses);
    }
    return;
  }
  const auto [stages, replicas] = GENERATE(std::make_pair(1, 2), std::make_pair(2, 2));
  CATCH_INFO(stages << " stages x " << replicas << " replicas");
  const int world = stages * replicas;
  const std::string folder = folder_for("replicas_" + std::to_string(stages));
  const auto results = run_ranks(kReplicas, world, folder,
                                 {{"GPIPE_TEST_STAGES", std::to_string(stages)}});
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < world; ++r) CATCH_REQUIRE(results[r].exit_code == 0);
  const Oracle oracle = plain_training(stages == 1 ? std::vector<int64_t>{6} : kBalance);
  for (int r = 0; r < world; ++r) {
    const at::Tensor state = gpipe_test::read_doubles(folder + "/state" + std::to_string(r) +
                                                      ".bin");
    CATCH_REQUIRE(state.sizes() == oracle.stage_states[r % stages].sizes());
    CATCH_CHECK(at::allclose(state, oracle.stage_states[r % stages], 0, 1e-10));
  }
  // Equal shards: the mini-batch's mean loss is the mean of the replicas' losses.
  at::Tensor mean = gpipe_test::read_doubles(folder + "/loss0.bin");
  for (int q = 1; q < replicas; ++q) {
    mean = mean + gpipe_test::read_doubles(folder + "/loss" + std::to_string(q) + ".bin");
  }
  mean = mean / replicas;
  CATCH_REQUIRE(mean.sizes() == oracle.losses.sizes());
  CATCH_CHECK(at::allclose(mean, oracle.losses, 0, 1e-12));
  std::filesystem::remove_all(folder);
}

// BatchNorms in stages (Note [Pipeline stages and batch norm]): a model with a BatchNorm in each
// of two stages, trained over kSteps checkpointed steps in S x R processes, 4 micro-batches of 2
// rows per mini-batch in all (each replica takes a shard of 4 rows in 4 / R micro-batches).
nn::Sequential make_bn_model(bool frozen) {
  torch::manual_seed(11);
  nn::Sequential seq(nn::Linear(6, 8), nn::BatchNorm1d(8), nn::Tanh(), nn::Linear(8, 8),
                     nn::BatchNorm1d(8), nn::Linear(8, 3));
  seq->to(at::kDouble);
  if (frozen) {  // fine-tuning: the BatchNorms in eval mode inside a training model
    seq[1]->eval();
    seq[4]->eval();
  }
  return seq;
}
constexpr int64_t kBnMicrobatches = 4;

// What each stage's layers hold after training: parameters and buffers, flattened.
struct StageState {
  at::Tensor params, buffers;
};

// The plain model on the same micro-batches, each forward on its own (as BatchNorm normalises
// them in a pipeline), the loss over the whole mini-batch. Running statistics: per micro-batch,
// in order ("micro"); with `replicas` > 1 each replica's from replica 0's at the start of the step
// and its own micro-batches; once per mini-batch from all its micro-batches ("deferred"); never
// ("frozen"). Returns per replica, per stage, the state.
std::vector<std::vector<StageState>> plain_bn_training(const std::string& bn, int replicas) {
  nn::Sequential plain = make_bn_model(bn == "frozen");
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto buffers_of = [](const nn::Sequential& model) {
    std::vector<at::Tensor> copy;
    for (const at::Tensor& b : model->buffers()) copy.push_back(b.clone());
    return copy;
  };
  const auto set_buffers = [](const nn::Sequential& model, const std::vector<at::Tensor>& values) {
    at::NoGradGuard no_grad;
    const auto buffers = model->buffers();
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(values[k]);
  };
  // The running statistics come from a copy of the model with this step's parameters, run
  // without grad on the micro-batches that move them: the model that computes the gradients
  // must not have its buffers overwritten before its backward (BatchNorm's backward keeps them).
  const auto statistics_after = [&](const std::vector<at::Tensor>& start,
                                    const std::vector<at::Tensor>& inputs) {
    auto copy = std::dynamic_pointer_cast<nn::SequentialImpl>(plain->clone());
    set_buffers(nn::Sequential(copy), start);
    at::NoGradGuard no_grad;
    for (const at::Tensor& x : inputs) copy->forward(x);
    return buffers_of(nn::Sequential(copy));
  };
  // Deferred: each BatchNorm moves once, by the statistics of all the inputs it saw in the
  // micro-batches' forwards (normalised per micro-batch by the layers before it).
  const auto deferred_statistics_after = [&](const std::vector<at::Tensor>& start,
                                             const std::vector<at::Tensor>& inputs) {
    auto stats = std::dynamic_pointer_cast<nn::SequentialImpl>(plain->clone());
    auto run = std::dynamic_pointer_cast<nn::SequentialImpl>(plain->clone());
    set_buffers(nn::Sequential(stats), start);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> h = inputs;
    auto layer = run->begin();
    for (size_t k = 0; k < stats->size(); ++k, ++layer) {
      if (auto* bn = stats->ptr(k)->as<nn::BatchNorm1dImpl>()) bn->forward(at::cat(h));
      for (at::Tensor& t : h) t = layer->forward(t);
    }
    return buffers_of(nn::Sequential(stats));
  };
  std::vector<std::vector<at::Tensor>> replica_buffers(replicas, buffers_of(plain));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    // Every replica starts the step from replica 0's statistics (the same, when deferred).
    const std::vector<at::Tensor> start = replica_buffers[0];
    const std::vector<at::Tensor> micro = x.chunk(kBnMicrobatches);
    const int64_t per_replica = kBnMicrobatches / replicas;
    for (int q = 0; q < replicas; ++q) {
      replica_buffers[q] =
          bn == "deferred"
              ? deferred_statistics_after(start, micro)
              : statistics_after(start, std::vector<at::Tensor>(
                                            micro.begin() + q * per_replica,
                                            micro.begin() + (q + 1) * per_replica));
    }
    std::vector<at::Tensor> outputs;
    for (const at::Tensor& m : micro) outputs.push_back(plain->forward(m));
    sgd.zero_grad();
    nn::functional::mse_loss(at::cat(outputs), y).backward();
    sgd.step();
  }
  std::vector<std::vector<StageState>> states(replicas);
  for (int q = 0; q < replicas; ++q) {
    set_buffers(plain, replica_buffers[q]);
    int64_t first = 0;
    for (int64_t b : kBalance) {
      std::vector<at::Tensor> params, buffers;
      for (int64_t k = first; k < first + b; ++k) {
        for (const at::Tensor& p : plain[k]->parameters()) params.push_back(p);
        for (const at::Tensor& t : plain[k]->buffers()) buffers.push_back(t);
      }
      states[q].push_back({flat(params), flat(buffers)});
      first += b;
    }
  }
  return states;
}

constexpr const char* kBatchNorm =
    "batch norms in stages and their replicas train to the plain model's parameters and running "
    "statistics on the same micro-batches";

CATCH_TEST_CASE(kBatchNorm, "[distributed][stage][batchnorm]") {
  if (test_rank() >= 0) {
    const std::string bn = std::getenv("GPIPE_TEST_BN");
    const int replicas = std::atoi(std::getenv("GPIPE_TEST_REPLICAS"));
    const PipelineGroups groups =
        new_pipeline_groups(options_from_env().timeout(std::chrono::seconds(60)), 2);
    const PipelineStageOptions options = PipelineStageOptions(kBalance)
                                             .chunks(kBnMicrobatches / replicas)
                                             .checkpoint(Checkpoint::kExceptLast)
                                             .deferred_batch_norm(bn == "deferred")
                                             .local_balance(local_balance_from_env(groups.stage));
    PipelineStage stage = replicas == 1
        ? PipelineStage(make_bn_model(bn == "frozen"), options, groups.pipeline)
        : PipelineStage(make_bn_model(bn == "frozen"), options, groups.pipeline,
                        groups.replica_group);
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      const at::Tensor xs = x.chunk(replicas)[groups.replica];
      const at::Tensor ys = y.chunk(replicas)[groups.replica];
      sgd.zero_grad();
      if (stage->is_first()) {
        stage->step(Batch(xs), {}, mse);
      } else {
        stage->step(no_input(), ys, mse);
      }
      sgd.step();
    }
    const std::string folder = gpipe_test::test_folder();
    const std::string r = std::to_string(test_rank());
    gpipe_test::write_doubles(folder + "/params" + r + ".bin", stage->parameters());
    gpipe_test::write_doubles(folder + "/buffers" + r + ".bin", stage->buffers());
    return;
  }
  // With "local", each stage has two partitions: Linear, BatchNorm | Tanh and Linear |
  // BatchNorm, Linear.
  const auto [bn, replicas, local] = GENERATE(table<std::string, int, bool>(
      {{"micro", 1, false}, {"deferred", 1, false}, {"frozen", 1, false}, {"micro", 2, false},
       {"deferred", 2, false}, {"micro", 1, true}, {"deferred", 2, true}}));
  CATCH_INFO("batch norm " << bn << ", 2 stages x " << replicas << " replicas"
                           << (local ? ", 2 partitions per stage" : ""));
  const int world = 2 * replicas;
  const std::string folder = folder_for("batchnorm_" + bn + std::to_string(replicas) +
                                        (local ? "_local" : ""));
  std::map<std::string, std::string> env{
      {"GPIPE_TEST_BN", bn}, {"GPIPE_TEST_REPLICAS", std::to_string(replicas)}};
  if (local) env.emplace("GPIPE_TEST_LOCAL", "2,1;1,2");
  const auto results = run_ranks(kBatchNorm, world, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  for (int r = 0; r < world; ++r) CATCH_REQUIRE(results[r].exit_code == 0);
  const auto oracle = plain_bn_training(bn, replicas);
  for (int r = 0; r < world; ++r) {
    CATCH_INFO("rank " << r);
    const StageState& want = oracle[r / 2][r % 2];  // ranks: replica-major (new_pipeline_groups)
    const std::string name = std::to_string(r) + ".bin";
    const at::Tensor params = gpipe_test::read_doubles(folder + "/params" + name);
    const at::Tensor buffers = gpipe_test::read_doubles(folder + "/buffers" + name);
    CATCH_REQUIRE(params.sizes() == want.params.sizes());
    CATCH_REQUIRE(buffers.sizes() == want.buffers.sizes());
    CATCH_CHECK(at::allclose(params, want.params, 0, 1e-10));
    CATCH_CHECK(at::allclose(buffers, want.buffers, 0, 1e-10));
  }
  std::filesystem::remove_all(folder);
}

// The model for autocast: float32 (autocast computes Linear in bfloat16 on the CPU).
nn::Sequential make_float_model() {
  torch::manual_seed(5);
  return nn::Sequential(nn::Linear(6, 16), nn::Tanh(), nn::Linear(16, 16), nn::Tanh(),
                        nn::Linear(16, 3));
}
constexpr double kAutocastBound = 5e-4;

// The plain model's parameters after kSteps SGD steps under CPU autocast, each micro-batch's
// forward on its own (as in the pipeline), with the loss over the mini-batch.
std::vector<at::Tensor> plain_autocast_training(int64_t chunks) {
  nn::Sequential plain = make_float_model();
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.05));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    at::Tensor loss;
    {
      Autocast autocast;
      std::vector<at::Tensor> outputs;
      for (const at::Tensor& m : x.to(at::kFloat).chunk(chunks)) {
        outputs.push_back(plain->forward(m));
      }
      loss = nn::functional::mse_loss(at::cat(outputs), y.to(at::kFloat));
    }
    loss.backward();
    sgd.step();
  }
  return plain->parameters();
}

constexpr const char* kAutocast =
    "stages under CPU autocast train over several steps to the plain model's parameters under "
    "autocast";

CATCH_TEST_CASE(kAutocast, "[distributed][stage][autocast]") {
  if (test_rank() >= 0) {
    ProcessGroup group = join();
    PipelineStage stage(make_float_model(),
                        PipelineStageOptions({3, 2}).chunks(kChunks).checkpoint(mode_from_env())
                            .local_balance(local_balance_from_env(group->getRank())),
                        group);
    const auto loss = [](const Batch& out, const at::Tensor& target) {
      return nn::functional::mse_loss(out.tensor(), target);
    };
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      sgd.zero_grad();
      {
        Autocast autocast;  // around the step on every stage, as around a forward
        if (stage->is_first()) {
          stage->step(Batch(x.to(at::kFloat)), {}, loss);
        } else {
          stage->step(no_input(), y.to(at::kFloat), loss);
        }
      }
      sgd.step();
    }
    gpipe_test::write_doubles(gpipe_test::test_folder() + "/state" +
                                  std::to_string(test_rank()) + ".bin",
                              stage->parameters());
    return;
  }
  // With "local", two partitions per stage: autocast reaches the partitions' own threads.
  const auto [mode, local] = GENERATE(table<std::string, bool>(
      {{"except_last", false}, {"never", false}, {"except_last", true}}));
  CATCH_INFO("checkpoint " << mode << (local ? ", 2 partitions per stage" : ""));
  const std::string folder = folder_for("autocast_" + mode + (local ? "_local" : ""));
  std::map<std::string, std::string> env{{"GPIPE_TEST_CHECKPOINT", mode}};
  if (local) env.emplace("GPIPE_TEST_LOCAL", "2,1;1,1");
  const auto results = run_ranks(kAutocast, 2, folder, env);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_REQUIRE(results[0].exit_code == 0);
  CATCH_REQUIRE(results[1].exit_code == 0);
  const std::vector<at::Tensor> params = plain_autocast_training(kChunks);
  const std::vector<at::Tensor> first(params.begin(), params.begin() + 4);  // two Linears
  const std::vector<at::Tensor> last(params.begin() + 4, params.end());
  const at::Tensor got = at::cat({gpipe_test::read_doubles(folder + "/state0.bin"),
                                  gpipe_test::read_doubles(folder + "/state1.bin")});
  const at::Tensor want = at::cat({flat(first), flat(last)});
  CATCH_REQUIRE(got.sizes() == want.sizes());
  // bfloat16 keeps 8 bits: the stages may differ from the plain model by rounding (the plain
  // model sums weight gradients behind one cached cast per region), far less than a step moves.
  const double gap = (got - want).abs().max().item<double>();
  CATCH_INFO("largest difference " << gap);
  CATCH_CHECK(gap <= kAutocastBound);
  const at::Tensor initial = flat(make_float_model()->parameters());
  CATCH_CHECK((want - initial).abs().max().item<double>() >= 10 * kAutocastBound);
  std::filesystem::remove_all(folder);
}

constexpr const char* kThreads =
    "steps called from two threads of each stage run one after the other and accumulate both "
    "steps' gradients";

CATCH_TEST_CASE(kThreads, "[distributed][stage][threads]") {
  if (test_rank() >= 0) {
    PipelineStage stage(make_model(), PipelineStageOptions(kBalance).chunks(kChunks), join());
    // A server's two request threads, each running a step on the same batch: whichever step of a
    // stage runs first meets the other stage's first.
    auto [x, y] = batch(0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, x = x, y = y] {
        if (stage->is_first()) {
          stage->step(Batch(x), {}, mse);
        } else {
          stage->step(no_input(), y, mse);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : stage->parameters()) grads.push_back(p.grad());
    gpipe_test::write_doubles(gpipe_test::test_folder() + "/grad" + std::to_string(test_rank()) +
                                  ".bin",
                              grads);
    return;
  }
  const std::string folder = folder_for("threads");
  const auto results = run_ranks(kThreads, 2, folder);
  CATCH_INFO(gpipe_test::outputs(results));
  CATCH_REQUIRE(results[0].exit_code == 0);
  CATCH_REQUIRE(results[1].exit_code == 0);
  nn::Sequential plain = make_model();
  auto [x, y] = batch(0);
  for (int t = 0; t < 2; ++t) nn::functional::mse_loss(plain->forward(x), y).backward();
  int64_t first = 0;
  for (int r = 0; r < 2; ++r) {
    std::vector<at::Tensor> want;
    for (int64_t k = first; k < first + kBalance[r]; ++k) {
      for (const at::Tensor& p : plain[k]->parameters()) want.push_back(p.grad());
    }
    first += kBalance[r];
    const at::Tensor got = gpipe_test::read_doubles(folder + "/grad" + std::to_string(r) + ".bin");
    CATCH_REQUIRE(got.sizes() == flat(want).sizes());
    CATCH_CHECK(at::allclose(got, flat(want), 0, 1e-12));
  }
  std::filesystem::remove_all(folder);
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
