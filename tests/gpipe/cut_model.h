// A module as C++ users write one, with three cut points, for the tests of cut points in one
// process and across processes (Note [Cut points] in gpipe/cut_point.h).
#pragma once

#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "gpipe/cut_point.h"

namespace gpipe {
namespace cut_test {

namespace nn = torch::nn;

// Three cut points, four stretches: a layer; a residual block (its input through a BatchNorm
// first when `batch_norm`); a loop over one layer scaled by a lone parameter of the root; the
// head, after a view.
struct NetImpl : nn::Cloneable<NetImpl> {
  explicit NetImpl(bool batch_norm = false) : batch_norm(batch_norm) { reset(); }
  void reset() override {
    a = register_module("a", nn::Linear(4, 8));
    block = register_module("block", nn::Sequential(nn::Linear(8, 8), nn::Tanh()));
    c = register_module("c", nn::Linear(8, 8));
    head = register_module("head", nn::Linear(8, 3));
    norm = register_module("norm", nn::BatchNorm1d(8));
    scale = register_parameter("scale", at::full({8}, 0.5));
    cuts = {register_module("cut0", CutPoint()), register_module("cut1", CutPoint()),
            register_module("cut2", CutPoint())};
  }
  at::Tensor forward(at::Tensor x) {
    x = at::relu(a(x));
    x = cuts[0](x);
    x = x + block->forward(batch_norm ? norm(x) : x);
    x = cuts[1](x);
    for (int i = 0; i < 2; ++i) x = x + c(x) * scale;
    x = cuts[2](x);
    return head(x.view({x.size(0), -1}));
  }
  bool batch_norm;
  nn::Linear a{nullptr}, c{nullptr}, head{nullptr};
  nn::Sequential block{nullptr};
  nn::BatchNorm1d norm{nullptr};
  at::Tensor scale;
  std::vector<CutPoint> cuts;
};
TORCH_MODULE(Net);

// The model in float64, the same every call.
inline Net make_net(bool batch_norm = false) {
  at::manual_seed(3);
  Net net(batch_norm);
  net->to(at::kDouble);
  return net;
}

// A deep copy.
inline Net copy_of(const Net& net) { return Net(std::dynamic_pointer_cast<NetImpl>(net->clone())); }

// A sample to cut with: 4 rows.
inline at::Tensor sample() { return at::randn({4, 4}, at::kDouble); }

}  // namespace cut_test
}  // namespace gpipe
