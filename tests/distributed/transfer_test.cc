// Activations between stages over Gloo: one message per micro-batch (Note [One message per
// micro-batch] in gpipe/distributed/transfer.h): packing keeps every dtype and shape, and
// micro-batches larger than any before (which travel as two messages) still train to the plain
// model.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/transfer.h"
#include "tests/catch.h"
#include "tests/distributed/multiprocess.h"

namespace gpipe {
namespace distributed {
namespace {

namespace nn = torch::nn;

CATCH_TEST_CASE("packed activations keep every tensor's dtype shape and values",
                "[distributed][transfer]") {
  const std::vector<at::Tensor> tensors{
      at::randn({3, 5}, at::kDouble),
      at::randn({2, 3, 1}, at::kFloat).to(at::kHalf),
      at::arange(7, at::kLong),
      at::arange(5, at::kLong) > 2,             // bool, 5 bytes
      at::arange(3, at::kByte),                 // 3 bytes: the next one starts aligned again
      at::randn({0, 4}, at::kFloat),            // no elements
      at::randn({}, at::kDouble),               // a scalar
      at::randn({4, 6}, at::kFloat).t(),        // not contiguous: to_wire makes it so
  };
  const Batch batch(tensors);
  const BatchHeader header = BatchHeader::of(batch, 3, /*grad_enabled=*/true);
  const std::vector<at::Tensor> wire = to_wire(tensors, c10::Device(c10::kCPU));
  const int64_t header_bytes = BatchHeader::size() * 8;
  const int64_t data_bytes = packed_data_bytes(header);
  // With the header, and without (the second message of a micro-batch that did not fit).
  const at::Tensor message = pack_activations(wire, header.encode());
  const at::Tensor data_only = pack_activations(wire);
  CATCH_REQUIRE(message.numel() == header_bytes + data_bytes);
  CATCH_REQUIRE(data_only.numel() == data_bytes);
  const BatchHeader decoded = BatchHeader::decode(message.narrow(0, 0, header_bytes).view(at::kLong));
  CATCH_CHECK(decoded.microbatches == 3);
  for (const at::Tensor& data : {message.narrow(0, header_bytes, data_bytes), data_only}) {
    const std::vector<at::Tensor> out = unpack_activations(decoded, data);
    CATCH_REQUIRE(out.size() == tensors.size());
    for (size_t k = 0; k < tensors.size(); ++k) {
      CATCH_CAPTURE(k);
      CATCH_CHECK(out[k].scalar_type() == tensors[k].scalar_type());
      CATCH_CHECK(out[k].sizes() == tensors[k].sizes());
      CATCH_CHECK(at::equal(out[k], tensors[k]));
    }
  }
}

// Rows of each step's mini-batch: step 1's micro-batches are larger than step 0's (two messages
// each), step 2's smaller (one), step 3's as large as step 1's (one).
const std::vector<int64_t> kRows{4, 8, 6, 8};
constexpr int64_t kChunks = 3;

nn::Sequential mlp() {
  torch::manual_seed(11);
  nn::Sequential seq(nn::Linear(5, 7), nn::Tanh(), nn::Linear(7, 7), nn::Tanh(), nn::Linear(7, 2));
  seq->to(at::kDouble);
  return seq;
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  const int64_t rows = kRows[static_cast<size_t>(step)];
  return {at::randn({rows, 5}, gen, at::kDouble), at::randn({rows, 2}, gen, at::kDouble)};
}

at::Tensor mse(const Batch& output, const at::Tensor& target) {
  return nn::functional::mse_loss(output.tensor(), target);
}

constexpr const char* kGrowing =
    "micro-batches larger than any a link carried before still train two stages to the plain "
    "model";

CATCH_TEST_CASE(kGrowing, "[distributed][transfer]") {
  if (gpipe_test::test_rank() >= 0) {
    const char* name = std::getenv("GPIPE_TEST_SCHEDULE");
    ProcessGroup group =
        new_gloo_group(options_from_env().timeout(std::chrono::seconds(60)));
    PipelineStage stage(mlp(),
                        PipelineStageOptions({2, 3}).chunks(kChunks).loss(mse).schedule(
                            schedule_kind(name)),
                        group);
    torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < static_cast<int>(kRows.size()); ++step) {
      auto [x, y] = batch(step);
      sgd.zero_grad();
      if (stage->is_first()) {
        stage->step(Batch(x));
      } else {
        stage->step(no_input(), y);
      }
      sgd.step();
    }
    gpipe_test::write_doubles(gpipe_test::test_folder() + "/state" +
                                  std::to_string(gpipe_test::test_rank()) + ".bin",
                              stage->parameters());
    return;
  }
  const std::string schedule = GENERATE("gpipe", "1f1b");
  const std::string folder = gpipe_test::folder_for("transfer", "growing_" + schedule);
  const auto results =
      gpipe_test::run_ranks(kGrowing, 2, folder, {{"GPIPE_TEST_SCHEDULE", schedule}});
  CATCH_INFO(gpipe_test::outputs(results));
  for (const auto& r : results) CATCH_REQUIRE(r.exit_code == 0);
  nn::Sequential plain = mlp();
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < static_cast<int>(kRows.size()); ++step) {
    auto [x, y] = batch(step);
    sgd.zero_grad();
    nn::functional::mse_loss(plain->forward(x), y).backward();
    sgd.step();
  }
  std::vector<at::Tensor> stage0, stage1;
  const std::vector<at::Tensor> params = plain->parameters();
  for (size_t k = 0; k < params.size(); ++k) (k < 2 ? stage0 : stage1).push_back(params[k]);
  const at::Tensor got0 = gpipe_test::read_doubles(folder + "/state0.bin");
  const at::Tensor got1 = gpipe_test::read_doubles(folder + "/state1.bin");
  CATCH_CHECK(at::allclose(got0, gpipe_test::flat(stage0), 0, 1e-10));
  CATCH_CHECK(at::allclose(got1, gpipe_test::flat(stage1), 0, 1e-10));
  std::filesystem::remove_all(folder);
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
