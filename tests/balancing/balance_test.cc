// balance_by_time and balance_by_size choose the balances their measurements call for, and leave
// the user's model as it was.
#include "tests/gpipe/test_util.h"

#include <chrono>
#include <thread>

#include <torch/cuda.h>
#include <torch/nn/cloneable.h>

#include "balancing/balance.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

// A layer that does `reps` times the work of a Linear(width, width).
struct WorkImpl : nn::Cloneable<WorkImpl> {
  explicit WorkImpl(int64_t reps, int64_t width = 256) : reps(reps), width(width) { reset(); }
  void reset() override { linear = register_module("linear", nn::Linear(width, width)); }
  at::Tensor forward(at::Tensor x) {
    for (int64_t r = 0; r < reps; ++r) x = at::tanh(linear(x));
    return x;
  }
  int64_t reps;
  int64_t width;
  nn::Linear linear{nullptr};
};
TORCH_MODULE(Work);

// Costs 6, 1, 1, 1: the slow layer alone (6 against 3), where counting layers instead of time
// would give {2, 2} (7 against 2). {1, 3} stays the better split as long as the slow layer
// measures more than twice a light one: a margin of 3x, which the layers' fixed costs (their call,
// the profiler's timing: the same for every layer) and a busy machine under a sanitizer do not
// close. (With costs 3, 1, 1, 1 the margin was 1.5x, and Debian 13's ASan build measured {2, 2}
// once, on 2026-11-30.)
nn::Sequential slow_first(int64_t width) {
  return nn::Sequential(Work(6, width), Work(1, width), Work(1, width), Work(1, width));
}

nn::Sequential one_huge_layer() {
  return nn::Sequential(nn::Linear(16, 16), nn::Linear(16, 16), nn::Linear(16, 4096),
                        nn::Linear(4096, 16), nn::Linear(16, 16));
}

// The partition that holds layer `layer`, as (first layer, number of layers).
std::pair<int64_t, int64_t> block_of(const std::vector<int64_t>& balance, int64_t layer) {
  int64_t start = 0;
  for (int64_t b : balance) {
    if (layer < start + b) return {start, b};
    start += b;
  }
  return {-1, 0};
}

CATCH_TEST_CASE("balance_by_time equalises time around a slow layer", "[balancing][time]") {
  // 512 wide, so that a Linear's work (a 256 x 512 x 512 product) outweighs a layer's fixed
  // cost even under a sanitizer, where a 256-wide layer's fixed cost once made {2, 3} the better
  // split of a 4, 1, 1, 1, 1 model on a busy machine.
  const auto balance = balance_by_time(2, slow_first(512), at::randn({256, 512}),
                                       BalanceByTimeOptions().timeout(std::chrono::seconds(1)));
  CATCH_CHECK(balance == std::vector<int64_t>{1, 3});
}

CATCH_TEST_CASE("balance_by_size isolates a layer with huge activations and parameters",
                "[balancing][size]") {
  const auto balance = balance_by_size(3, one_huge_layer(), at::randn({64, 16}),
                                       BalanceBySizeOptions().chunks(1).param_scale(2.0));
  CATCH_CAPTURE(balance);
  CATCH_CHECK(block_of(balance, 2) == std::make_pair<int64_t, int64_t>(2, 1));
}

// Sleeps 1 s in its first forward only (a stand-in for a kernel library's one-time
// initialisation), or 300 ms in every forward. A Cloneable: the profiler times copies.
struct SlowImpl : nn::Cloneable<SlowImpl> {
  explicit SlowImpl(bool every_call) : every_call(every_call) {}
  void reset() override {}
  at::Tensor forward(const at::Tensor& x) {
    if (calls++ == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(every_call ? 300 : 1000));
    } else if (every_call) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    return x * 2;
  }
  bool every_call;
  int calls = 0;
};
TORCH_MODULE(Slow);

CATCH_TEST_CASE("the profiler does not charge one-time costs of a first pass to the first layers",
                "[balancing][profile]") {
  nn::Sequential seq(Slow(false), Slow(true));
  const LayerProfile profile = profile_layers(seq, at::randn({4, 4}).requires_grad_(true),
                                              ProfileOptions().timeout(std::chrono::seconds(0)));
  CATCH_CHECK(profile.passes == 1);
  CATCH_CHECK(profile.layers[1].forward_us >= 300000);
  CATCH_CHECK(profile.layers[0].forward_us < profile.layers[1].forward_us);
}

CATCH_TEST_CASE("the profiler measures memory on the CPU", "[balancing][profile]") {
  const LayerProfile profile =
      profile_layers(one_huge_layer(), at::randn({64, 16}), ProfileOptions().timeout(std::chrono::seconds(0)));
  CATCH_REQUIRE(profile.layers.size() == 5);
  CATCH_CHECK(profile.passes == 1);
  const LayerStats& huge = profile.layers[2];
  // Its output, 64 x 4096 floats, is allocated by its forward and held for the next layer's
  // backward; parameters 4096 x 16 + 4096 floats.
  CATCH_CHECK(huge.output_bytes == 64 * 4096 * 4);
  CATCH_CHECK(huge.held_bytes >= huge.output_bytes);
  CATCH_CHECK(huge.held_bytes < 2 * huge.output_bytes);
  CATCH_CHECK(huge.param_bytes == (4096 * 16 + 4096) * 4);
  CATCH_CHECK(huge.input_bytes == 64 * 16 * 4);
  CATCH_CHECK(profile.layers[0].held_bytes < huge.held_bytes / 16);
  CATCH_CHECK(profile.layers[0].forward_us > 0);
  CATCH_CHECK(profile.layers[0].backward_us > 0);
  CATCH_CHECK(profile.table().find("torch::nn::LinearImpl") != std::string::npos);
  CATCH_CHECK(profile.json().find("\"held_bytes\":") != std::string::npos);
  // The whole profile survives JSON.
  const LayerProfile back = LayerProfile::from_json(profile.to_json());
  CATCH_REQUIRE(back.layers.size() == 5);
  CATCH_CHECK(back.layers[2].held_bytes == huge.held_bytes);
  CATCH_CHECK(back.layers[2].backward_us == huge.backward_us);
  CATCH_CHECK(back.layers[2].saves_input == huge.saves_input);
  CATCH_CHECK(back.layers[2].name == huge.name);
  CATCH_CHECK(back.batch == profile.batch);
  CATCH_CHECK(back.device == profile.device);
}

CATCH_TEST_CASE("profiling leaves the model untouched", "[balancing][profile]") {
  nn::Sequential model(nn::Linear(8, 8), nn::BatchNorm1d(8), nn::ReLU(), nn::Linear(8, 2));
  model->eval();
  std::vector<at::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  std::vector<at::Tensor> buffers;
  for (const auto& b : model->buffers()) buffers.push_back(b.clone());
  balance_by_time(2, model, at::randn({16, 8}),
                  BalanceByTimeOptions().timeout(std::chrono::milliseconds(50)));
  balance_by_size(2, model, at::randn({16, 8}));
  const auto after_params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    CATCH_CHECK(after_params[k].equal(params[k]));
    CATCH_CHECK_FALSE(after_params[k].grad().defined());
  }
  const auto after_buffers = model->buffers();
  for (size_t k = 0; k < buffers.size(); ++k) CATCH_CHECK(after_buffers[k].equal(buffers[k]));
  for (const auto& m : model->modules()) CATCH_CHECK_FALSE(m->is_training());
}

CATCH_TEST_CASE("balancers refuse bad input with a clear error", "[balancing][errors]") {
  nn::Sequential model(nn::Linear(8, 8), nn::ReLU(), nn::Linear(8, 2));
  const at::Tensor x = at::randn({4, 8});
  CATCH_CHECK_THROWS_WITH(balance_by_time(0, model, x), gpipe_test::contains("at least 1, got 0"));
  CATCH_CHECK_THROWS_WITH(balance_by_size(4, model, x),
                          gpipe_test::contains("cannot split a Sequential of 3 layers into 4"));
  CATCH_CHECK_THROWS_WITH(balance_by_time(2, model, at::randn({4, 5})),
                          gpipe_test::contains("the sample does not go through layer 0 ('0', "
                                          "torch::nn::LinearImpl)"));
  model->forward(x).sum().backward();
  CATCH_CHECK_THROWS_WITH(balance_by_time(2, model, x), gpipe_test::contains("already has a gradient"));
  CATCH_CHECK_THROWS_WITH(balance_by_size(2, nn::Sequential(nn::Linear(8, 8), nn::Linear(8, 8)), x,
                                          BalanceBySizeOptions().chunks(0)),
                          gpipe_test::contains("chunks must be at least 1"));
}

CATCH_TEST_CASE("a layer that cannot be copied is named", "[balancing][errors]") {
  struct PlainImpl : nn::Module {
    at::Tensor forward(const at::Tensor& x) { return x; }
  };
  nn::Sequential model(nn::Linear(8, 8), nn::ModuleHolder<PlainImpl>(std::make_shared<PlainImpl>()));
  CATCH_CHECK_THROWS_WITH(balance_by_size(2, model, at::randn({4, 8})),
                          gpipe_test::contains("cannot copy layer 1") &&
                              gpipe_test::contains("torch::nn::Cloneable"));
}

CATCH_TEST_CASE("balancers refuse a device this machine does not have, without the clone() hint",
                "[balancing][errors]") {
  const auto [gpu, reason] = unavailable_cuda();
  const nn::Sequential model(nn::Linear(8, 8), nn::Linear(8, 8));
  for (int by_time = 0; by_time < 2; ++by_time) {
    try {
      if (by_time) {
        balance_by_time(2, model, at::randn({4, 8}), BalanceByTimeOptions().device(gpu));
      } else {
        balance_by_size(2, model, at::randn({4, 8}), BalanceBySizeOptions().device(gpu));
      }
      CATCH_FAIL("no error for " << gpu);
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      CATCH_CHECK_THAT(message, gpipe_test::contains("profile_layers: the profiling device is on " +
                                                     gpu.str() + ", " + reason));
      CATCH_CHECK(message.find("clone()") == std::string::npos);
    }
  }
}

CATCH_TEST_CASE("balancers work on CUDA", "[balancing][cuda]") {
  const c10::Device gpu(at::kCUDA, 0);
  // Layers wide enough that their kernels, not the launches and the synchronisation after each
  // layer (tens of microseconds, the same for every layer), take a layer's time: on an H200 the
  // 256-wide ones took so little that equal fixed costs made a count of layers the better balance.
  const auto by_time = balance_by_time(
      2, slow_first(2048), at::randn({8192, 2048}),
      BalanceByTimeOptions().timeout(std::chrono::milliseconds(1000)).device(gpu));
  CATCH_CHECK(by_time == std::vector<int64_t>{1, 3});
  const auto by_size = balance_by_size(3, one_huge_layer(), at::randn({64, 16}),
                                       BalanceBySizeOptions().device(gpu));
  CATCH_CHECK(block_of(by_size, 2) == std::make_pair<int64_t, int64_t>(2, 1));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
