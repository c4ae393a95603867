// A user's program built against an installed gpipe (find_package(gpipe)): balances a small
// model by size, trains one step of it as a two-partition GPipe, and checks the output and the
// gradients against the plain Sequential. Prints "gpipe consumer: ok" and exits 0 when they agree.
#include <algorithm>
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "balancing/balance.h"
#include "gpipe/gpipe.h"

namespace nn = torch::nn;

nn::Sequential make_model() {
  at::manual_seed(0);
  nn::Sequential seq(nn::Linear(4, 16), nn::ReLU(), nn::Linear(16, 16), nn::Tanh(),
                     nn::Linear(16, 2));
  seq->to(at::kDouble);
  return seq;
}

int main() {
  nn::Sequential plain = make_model();
  const at::Tensor x = at::randn({8, 4}, at::kDouble);
  const std::vector<int64_t> balance = gpipe::balance_by_size(2, make_model(), x);
  gpipe::GPipe model(make_model(), gpipe::GPipeOptions(balance)
                                       .devices({at::kCPU, at::kCPU})
                                       .chunks(4));
  at::Tensor y1 = plain->forward(x);
  at::Tensor y2 = model->forward(x);
  y1.sum().backward();
  y2.sum().backward();
  double worst = (y1 - y2).abs().max().item<double>();
  const auto a = plain->parameters();
  const auto b = model->parameters();
  if (a.size() != b.size()) {
    std::printf("gpipe consumer: FAILED (%zu parameters, expected %zu)\n", b.size(), a.size());
    return 1;
  }
  for (size_t k = 0; k < a.size(); ++k) {
    worst = std::max(worst, (a[k].grad() - b[k].grad()).abs().max().item<double>());
  }
  std::printf("gpipe consumer: balance {%lld, %lld}, largest difference from the plain model %g\n",
              static_cast<long long>(balance[0]), static_cast<long long>(balance[1]), worst);
  if (worst > 1e-10) {
    std::printf("gpipe consumer: FAILED\n");
    return 1;
  }
  std::printf("gpipe consumer: ok\n");
  return 0;
}
