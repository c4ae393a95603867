// AmoebaNet-D: the reference's architecture (parameter counts, L + 6 layers, pairs between cells)
// and training steps in a GPipe equal to the plain model's.
#include "tests/models/model_test_util.h"

#include "examples/models/amoebanet.h"

#include <ATen/Parallel.h>

namespace gpipe {
namespace testing {
namespace {

CATCH_TEST_CASE("AmoebaNet-D has the reference's parameter counts", "[models][amoebanet]") {
  // torchgpipe's benchmarks/amoebanetd-memory: 81.5M and 319.0M parameters (exact counts of the
  // reference's code with 1,000 classes).
  CATCH_CHECK(parameter_count(*models::amoebanet_d(18, 208)) == 81505540);
#ifndef __SANITIZE_ADDRESS__  // a 1.3 GB model: counted in the plain builds, not again under ASan
  CATCH_CHECK(parameter_count(*models::amoebanet_d(18, 416)) == 319024120);
#endif
}

CATCH_TEST_CASE("AmoebaNet-D is L + 6 layers that pass pairs of tensors", "[models][amoebanet]") {
  const int64_t layers = GENERATE(3, 6, 18);
  CATCH_CAPTURE(layers);
  torch::nn::Sequential model = models::amoebanet_d(layers, 32, 10);
  CATCH_CHECK(static_cast<int64_t>(model->size()) == layers + 6);
  model->eval();
  // Small inputs work (global pooling); shapes through the network: 32 -> 16 (stem) -> 8 -> 4
  // (stem reductions) -> 2 -> 1 (reductions); channels as the reference's arithmetic.
  torch::nn::AnyValue value(at::randn({2, 3, 32, 32}));
  std::vector<int64_t> sizes;
  std::vector<int64_t> channels;
  for (size_t k = 0; k + 1 < model->size(); ++k) {
    value = std::next(model->begin(), k)->any_forward(std::move(value));
    const auto* pair = value.try_get<std::vector<at::Tensor>>();
    CATCH_REQUIRE(pair != nullptr);
    CATCH_REQUIRE(pair->size() == 2);
    sizes.push_back((*pair)[0].size(2));
    channels.push_back((*pair)[0].size(1));
  }
  const int64_t c = 32 / 4;
  const int64_t n = layers / 3;
  std::vector<int64_t> expected_sizes{16, 8, 4};
  std::vector<int64_t> expected_channels{c, 6 * c, 12 * c};
  for (int64_t k = 0; k < n; ++k) expected_sizes.push_back(4), expected_channels.push_back(16 * c);
  expected_sizes.push_back(2), expected_channels.push_back(24 * c);
  for (int64_t k = 0; k < n; ++k) expected_sizes.push_back(2), expected_channels.push_back(32 * c);
  expected_sizes.push_back(1), expected_channels.push_back(48 * c);
  for (int64_t k = 0; k < n; ++k) expected_sizes.push_back(1), expected_channels.push_back(64 * c);
  CATCH_CHECK(sizes == expected_sizes);
  CATCH_CHECK(channels == expected_channels);
  at::Tensor out =
      std::prev(model->end())->any_forward(std::move(value)).get<at::Tensor>();
  CATCH_CHECK(out.sizes() == at::IntArrayRef({2, 10}));
  CATCH_CHECK_THROWS_WITH(models::amoebanet_d(4, 32), gpipe_test::contains("multiple of 3, got 4"));
}

// One intra-op thread for the plain model and the partitions alike while it lives: LibTorch's
// reductions sum in an order that depends on the thread count, and with two threads for the
// plain model and one per partition the float64 gradients came out 1.2-1.8e-10 apart (LibTorch
// 2.6, 2 cores; passing with OMP_NUM_THREADS=1), after Adam 1e-9.
struct OneIntraOpThread {
  int before = at::get_num_threads();
  OneIntraOpThread() { at::set_num_threads(1); }
  ~OneIntraOpThread() { at::set_num_threads(before); }
};

CATCH_TEST_CASE("a training step of AmoebaNet-D in a GPipe equals the plain model's",
                "[models][amoebanet][transparency]") {
  const OneIntraOpThread one_thread;
  // 9 layers: stem, 2 stem reductions, 1 normal, reduction, 1 normal, reduction, 1 normal,
  // classifier.
  const std::vector<int64_t> balance = GENERATE(std::vector<int64_t>{9}, std::vector<int64_t>{2, 7},
                                                std::vector<int64_t>{1, 3, 3, 2});
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways);
  CATCH_CAPTURE(balance, static_cast<int>(mode));
  auto make = [] { return models::amoebanet_d(3, 16, 10, /*in_channels=*/1); };
  at::manual_seed(5);
  const at::Tensor x = at::randn({6, 1, 28, 28}, at::kDouble);
  const at::Tensor labels = at::randint(10, {6}, at::kLong);
  check_training_step(make, x, labels, cpu_options(balance, 3, mode));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
