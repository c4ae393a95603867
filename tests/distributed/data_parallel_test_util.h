// What the data-parallel tests share: the model, the batches and their shards, the replicas' runs
// and the plain model they are checked against.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "gpipe/distributed/data_parallel.h"
#include "gpipe/gpipe.h"
#include "tests/catch.h"
#include "tests/distributed/multiprocess.h"

namespace gpipe {
namespace distributed {
namespace dp_test {

namespace nn = torch::nn;
using gpipe_test::flat;
using gpipe_test::run_ranks;
using gpipe_test::test_rank;

constexpr int kWorld = 2;
constexpr int kSteps = 4;
constexpr int64_t kBatch = 8;

inline std::string folder_for(const std::string& name) {
  return gpipe_test::folder_for("dp", name);
}

// The model every test trains, made with seed 100 + `seed_offset` (rank r uses r, so that
// replicas start different and the broadcast from rank 0 matters).
inline nn::Sequential make_model(bool batch_norm, int seed_offset) {
  torch::manual_seed(100 + seed_offset);
  nn::Sequential seq(nn::Linear(6, 8), nn::Tanh(), nn::Linear(8, 8));
  if (batch_norm) seq->push_back(nn::BatchNorm1d(8));
  seq->push_back(nn::Tanh());
  seq->push_back(nn::Linear(8, 3));
  seq->to(at::kDouble);
  return seq;
}

// Step k's whole mini-batch of `rows` and its targets (the same in every process).
inline std::pair<at::Tensor, at::Tensor> batch(int step, int64_t rows = kBatch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor x = at::randn({rows, 6}, gen, at::kDouble);
  at::Tensor y = at::randn({rows, 3}, gen, at::kDouble);
  return {x, y};
}

inline at::Tensor shard(const at::Tensor& t, int rank) { return t.chunk(kWorld)[rank]; }

inline std::vector<at::Tensor> state_of(nn::Module& module) {
  std::vector<at::Tensor> out = module.parameters();
  for (const at::Tensor& b : module.buffers()) out.push_back(b);
  return out;
}

inline ProcessGroup join() {
  return new_gloo_group(options_from_env().timeout(std::chrono::seconds(60)));
}

// Runs `test` in `world` ranks (with `env`) and returns what each rank wrote to "state<r>.bin".
inline std::vector<at::Tensor> replicas(const std::string& test, const std::string& key,
                                        const std::map<std::string, std::string>& env = {},
                                        int world = kWorld) {
  const std::string folder = folder_for(key);
  const auto results = run_ranks(test, world, folder, env);
  std::vector<at::Tensor> states;
  for (int r = 0; r < world; ++r) {
    CATCH_INFO(gpipe_test::outputs(results));
    CATCH_REQUIRE(results[r].exit_code == 0);
    states.push_back(gpipe_test::read_doubles(folder + "/state" + std::to_string(r) + ".bin"));
  }
  std::filesystem::remove_all(folder);
  return states;
}

// Checks each replica's `states` against `expected` (1e-10).
inline void check_states(const std::vector<at::Tensor>& states, const at::Tensor& expected) {
  for (const at::Tensor& state : states) {
    CATCH_REQUIRE(state.sizes() == expected.sizes());
    CATCH_CHECK(at::allclose(state, expected, 0, 1e-10));
  }
}

// Checks each replica's `states` against the plain model after kSteps SGD steps on the whole
// batches of `rows` (1e-10).
inline void check_plain_training(const std::vector<at::Tensor>& states, int64_t rows = kBatch) {
  nn::Sequential plain = make_model(false, 0);
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, rows);
    sgd.zero_grad();
    torch::nn::functional::mse_loss(plain->forward(x), y).backward();
    sgd.step();
  }
  check_states(states, flat(state_of(*plain)));
}

inline void save_state(nn::Module& module) {
  gpipe_test::write_doubles(gpipe_test::test_folder() + "/state" + std::to_string(test_rank()) +
                                ".bin",
                            state_of(module));
}

// Replica `rank`: kSteps steps of plain SGD (0.1) on its shards, then its state saved.
inline void train_and_save(DataParallel& model, int rank) {
  torch::optim::SGD sgd(model->parameters(), 0.1);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    torch::nn::functional::mse_loss(model->forward(shard(x, rank)), shard(y, rank)).backward();
    sgd.step();
  }
  save_state(*model);
}

// Checks the replicas' `states` against one GPipe (`options`, kWorld times the chunks) of the
// batch-norm model trained as train_and_save on the whole batches: the same micro-batches, the
// running statistics of all of them.
inline void check_one_gpipe(const std::vector<at::Tensor>& states, const GPipeOptions& options) {
  GPipe one(make_model(true, 0), GPipeOptions(options).chunks(options.chunks() * kWorld));
  torch::optim::SGD sgd(one->parameters(), 0.1);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    torch::nn::functional::mse_loss(one->forward(x), y).backward();
    sgd.step();
  }
  check_states(states, flat(state_of(*one)));
}

}  // namespace dp_test
}  // namespace distributed
}  // namespace gpipe
