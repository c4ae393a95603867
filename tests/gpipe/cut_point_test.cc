// Cut points (Note [Cut points]): a Module whose forward() mixes submodules, residuals, a loop and
// a lone parameter, cut at its CutPoints, trains in a GPipe under every schedule and checkpoint
// mode as the model itself does; each section holds only its own tensors; misuse is refused.
#include "gpipe/cut_point.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <utility>
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "gpipe/gpipe.h"
#include "gpipe/saved_training.h"
#include "tests/gpipe/cut_model.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

using cut_test::copy_of;
using cut_test::make_net;
using cut_test::Net;
using cut_test::sample;

at::Tensor mse(const Batch& out, const at::Tensor& y) {
  return nn::functional::mse_loss(out.tensor(), y);
}

// Trains `plain` and `pipe` side by side with Adam for `steps` steps on the batches `batch`(step)
// gives, checking each step's loss against the plain module's.
template <typename Plain>
void train_beside(Plain& plain, GPipe& pipe, int steps,
                  const std::function<std::pair<at::Tensor, at::Tensor>(int)>& batch) {
  torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam pipe_adam(pipe->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = batch(step);
    plain_adam.zero_grad();
    pipe_adam.zero_grad();
    const at::Tensor want = mse(Batch(plain->forward(x)), y);
    want.backward();
    CATCH_CHECK(std::abs(pipe->step(x, y, mse).item<double>() - want.item<double>()) <= 1e-12);
    plain_adam.step();
    pipe_adam.step();
  }
}

CATCH_TEST_CASE("A module cut at its cut points trains as the module itself under every schedule",
                "[cut_point][transparency]") {
  const std::string kind =
      GENERATE("gpipe", "1f1b", "zb", "interleaved", "zb1p", "zbv", "dualpipev");
  const Checkpoint mode =
      GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const bool merged = GENERATE(false, true);
  CATCH_CAPTURE(kind, static_cast<int>(mode), merged);
  const bool two_per_rank = kind == "interleaved" || kind == "zb1p";
  if ((two_per_rank || kind == "zbv" || kind == "dualpipev") && merged) return;  // 4 sections
  Net plain = make_net();
  Net net = copy_of(plain);
  // Merged: 3 sections, the first spanning two intervals (cut point 0 inactive).
  nn::Sequential sections = merged ? cut(net, sample(), {2, 1, 1}) : cut(net, sample());
  CATCH_REQUIRE(sections->size() == (merged ? 3u : 4u));
  const int64_t n = static_cast<int64_t>(sections->size());
  const int64_t v = two_per_rank ? 2 : 1;
  GPipe pipe(sections, GPipeOptions(std::vector<int64_t>(n, 1))
                           .devices(std::vector<c10::Device>(n, at::kCPU))
                           .chunks(two_per_rank ? 4 : 3)
                           .checkpoint(mode)
                           .schedule(PipelineSchedule::of(schedule_kind(kind), v)));
  CATCH_REQUIRE(pipe->parameters().size() == plain->parameters().size());
  train_beside(plain, pipe, 3, [](int step) {
    at::manual_seed(50 + step);
    const at::Tensor x = at::randn({7, 4}, at::kDouble);  // micro-batches of 3, 2, 2 (or 2s, 1)
    return std::make_pair(x, at::randn({7, 3}, at::kDouble));
  });
  // The trained tensors, copied back into a model, are the plain model's.
  Net back = make_net();
  uncut(sections, *back);
  const auto want = plain->named_parameters();
  for (const auto& item : back->named_parameters()) {
    CATCH_CAPTURE(item.key());
    CATCH_CHECK(max_diff(item.value(), want[item.key()]) <= 1e-10);
  }
}

CATCH_TEST_CASE("On a GPU and the CPU a module cut at its cut points trains as the module itself",
                "[cut_point][cuda]") {
  const Checkpoint mode = GENERATE(Checkpoint::kExceptLast, Checkpoint::kNever);
  CATCH_CAPTURE(static_cast<int>(mode));
  const c10::Device gpu(at::kCUDA, 0);
  Net plain = make_net();
  Net net = copy_of(plain);
  // Sections 0 and 1 (and the placeholders of their copies) on the GPU, 2 and 3 on the CPU.
  GPipe pipe(cut(net, sample()), GPipeOptions({2, 2})
                                     .devices({gpu, c10::Device(at::kCPU)})
                                     .chunks(3)
                                     .checkpoint(mode)
                                     .schedule(ScheduleKind::k1F1B));
  torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam pipe_adam(pipe->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = at::randn({7, 4}, at::kDouble);
    const at::Tensor y = at::randn({7, 3}, at::kDouble);
    plain_adam.zero_grad();
    pipe_adam.zero_grad();
    const at::Tensor want = mse(Batch(plain->forward(x)), y);
    want.backward();
    const at::Tensor got = pipe->step(x.to(gpu), y, mse);
    CATCH_CHECK(std::abs(got.item<double>() - want.item<double>()) <= 1e-10);
    plain_adam.step();
    pipe_adam.step();
  }
}

CATCH_TEST_CASE("Each section holds its own tensors and placeholders of one element for the rest",
                "[cut_point]") {
  Net net = make_net();
  nn::Sequential sections = cut(net, sample());
  // Interval 0: a, and norm (unused here: a parameter no interval's result reaches goes to the
  // first); 1: block; 2: c and scale; 3: head.
  const std::vector<std::set<std::string>> want{{"a.weight", "a.bias", "norm.weight", "norm.bias"},
                                                {"block.0.weight", "block.0.bias"},
                                                {"c.weight", "c.bias", "scale"},
                                                {"head.weight", "head.bias"}};
  for (size_t k = 0; k < want.size(); ++k) {
    CATCH_CAPTURE(k);
    std::set<std::string> names;
    const auto section = std::dynamic_pointer_cast<SectionImpl>(sections->ptr(k));
    for (const auto& item : section->named_parameters()) names.insert(item.key());
    CATCH_CHECK(names == want[k]);
    int64_t held = 0, own = 0;
    for (const at::Tensor& t : section->model()->parameters()) held += t.storage().nbytes();
    for (const at::Tensor& t : section->parameters()) own += t.numel() * 8;
    // Every other parameter of its copy is one double.
    CATCH_CHECK(held == own + 8 * (static_cast<int64_t>(net->parameters().size()) -
                                   static_cast<int64_t>(want[k].size())));
  }
  // Outside a section a cut point returns its input: the model works as before.
  const at::Tensor x = sample();
  at::Tensor through = x;
  {
    at::NoGradGuard no_grad;
    for (const auto& section : sections->children()) {
      through = std::dynamic_pointer_cast<SectionImpl>(section)->forward(through);
    }
    CATCH_CHECK(max_diff(through, net->forward(x)) <= 1e-12);
  }
}

CATCH_TEST_CASE("Deferred batch norm reaches a BatchNorm inside a section",
                "[cut_point][batchnorm]") {
  Net plain = make_net(true);
  Net net = copy_of(plain);
  GPipe pipe(
      cut(net, sample()),
      GPipeOptions({2, 2}).chunks(4).deferred_batch_norm(true).checkpoint(Checkpoint::kNever));
  const at::Tensor x = at::randn({8, 4}, at::kDouble);
  plain->forward(x);
  pipe->forward(x);
  // The running statistics over the whole mini-batch, as the plain model's.
  const auto section = std::dynamic_pointer_cast<SectionImpl>(pipe->partitions()[0]->ptr(1));
  CATCH_REQUIRE(section != nullptr);
  const at::Tensor mean = section->named_buffers()["norm.running_mean"];
  CATCH_CHECK(max_diff(mean, plain->norm->running_mean) <= 1e-12);
  CATCH_CHECK(max_diff(mean, at::zeros_like(mean)) > 1e-3);
}

CATCH_TEST_CASE(
    "Cutting keeps every module's mode and a BatchNorm in eval mode inside a "
    "training section stays frozen",
    "[cut_point][batchnorm]") {
  Net plain = make_net(true);
  plain->norm->eval();  // frozen: its running statistics, not the batch's
  Net net = copy_of(plain);
  nn::Sequential sections = cut(net, sample());
  CATCH_CHECK(net->is_training());
  CATCH_CHECK(!net->norm->is_training());
  const at::Tensor mean = plain->norm->running_mean.clone();
  GPipe pipe(sections, GPipeOptions({2, 2}).chunks(3).schedule(ScheduleKind::k1F1B));
  train_beside(plain, pipe, 2, [](int) {
    const at::Tensor x = at::randn({6, 4}, at::kDouble);
    return std::make_pair(x, at::randn({6, 3}, at::kDouble));
  });
  const auto section = std::dynamic_pointer_cast<SectionImpl>(pipe->partitions()[0]->ptr(1));
  CATCH_REQUIRE(section != nullptr);
  CATCH_CHECK(at::equal(section->named_buffers()["norm.running_mean"], mean));
}

CATCH_TEST_CASE("Sections cast to another dtype and cloned compute what the model computes",
                "[cut_point]") {
  Net net = make_net();
  net->c->weight.requires_grad_(false);  // frozen
  nn::Sequential sections = cut(net, sample());
  const at::Tensor x = at::randn({5, 4}, at::kDouble);
  at::NoGradGuard no_grad;
  const at::Tensor want = net->forward(x);
  // A clone of each section, then the clones cast to float32.
  nn::Sequential clones;
  for (size_t k = 0; k < sections->size(); ++k) {
    clones->push_back(std::dynamic_pointer_cast<SectionImpl>(sections->ptr(k)->clone()));
  }
  CATCH_CHECK(max_diff(clones->forward(x), want) <= 1e-12);
  CATCH_CHECK(!clones[2]->named_parameters()["c.weight"].requires_grad());
  CATCH_CHECK(clones[2]->named_parameters()["c.bias"].requires_grad());
  clones->to(at::kFloat);
  net->to(at::kFloat);
  CATCH_CHECK(max_diff(clones->forward(x.to(at::kFloat)).to(at::kDouble),
                       net->forward(x.to(at::kFloat)).to(at::kDouble)) <= 1e-6);
}

// A token embedding before the first cut point and the output projection after the last, which
// use one weight: one tensor (`shared`, the plain model), or two named as one (cut: Varuna's
// shared weights, GPipeOptions::tied_parameters).
struct TiedNetImpl : nn::Cloneable<TiedNetImpl> {
  explicit TiedNetImpl(bool shared) : shared(shared) { reset(); }
  void reset() override {
    embed = register_parameter("embed", at::randn({6, 5}, at::kDouble));
    project = shared ? at::Tensor() : register_parameter("project", embed.detach().clone());
    mid = register_module("mid", nn::Linear(nn::LinearOptions(5, 5)));
    mid->to(at::kDouble);
    cuts = {register_module("cut0", CutPoint()), register_module("cut1", CutPoint())};
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = cuts[0](x.matmul(embed));
    h = cuts[1](at::tanh(mid(h)));
    return h.matmul((shared ? embed : project).t());
  }
  bool shared;
  at::Tensor embed, project;
  nn::Linear mid{nullptr};
  std::vector<CutPoint> cuts;
};
TORCH_MODULE(TiedNet);

CATCH_TEST_CASE(
    "A weight used before the first cut point and after the last trains as one when "
    "its two copies are tied",
    "[cut_point][tied]") {
  at::manual_seed(9);
  TiedNet plain(true);
  at::manual_seed(9);
  TiedNet net(false);
  const at::Tensor x0 = at::randn({4, 6}, at::kDouble);
  nn::Sequential sections = cut(net, x0);
  CATCH_REQUIRE(sections->size() == 3);
  GPipe pipe(sections, GPipeOptions({1, 1, 1})
                           .chunks(2)
                           .schedule(ScheduleKind::k1F1B)
                           .tied_parameters({{"0.embed", "2.project"}}));
  train_beside(plain, pipe, 3, [](int) {
    const at::Tensor x = at::randn({6, 6}, at::kDouble);
    return std::make_pair(x, at::randn({6, 6}, at::kDouble));
  });
  TiedNet back(false);
  uncut(sections, *back);
  CATCH_CHECK(max_diff(back->embed, plain->embed) <= 1e-10);
  CATCH_CHECK(max_diff(back->mid->weight, plain->mid->weight) <= 1e-10);
}

CATCH_TEST_CASE(
    "A cut module accumulates gradients over two steps and resumes from a save as "
    "the module itself",
    "[cut_point][save]") {
  Net plain = make_net();
  Net net = copy_of(plain);
  const auto options = GPipeOptions({2, 2}).chunks(3).schedule(ScheduleKind::k1F1B);
  GPipe pipe(cut(net, sample()), options);
  torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam pipe_adam(pipe->parameters(), torch::optim::AdamOptions(0.01));
  const auto data = [](int k) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + k);
    return std::make_pair(at::randn({7, 4}, gen, at::kDouble), at::randn({7, 3}, gen, at::kDouble));
  };
  // Two optimizer steps, each over two batches' gradients.
  for (int step = 0; step < 2; ++step) {
    plain_adam.zero_grad();
    pipe_adam.zero_grad();
    for (int k = 2 * step; k < 2 * step + 2; ++k) {
      const auto [x, y] = data(k);
      const at::Tensor want = mse(Batch(plain->forward(x)), y);
      want.backward();
      CATCH_CHECK(std::abs(pipe->step(x, y, mse).item<double>() - want.item<double>()) <= 1e-12);
    }
    plain_adam.step();
    pipe_adam.step();
  }
  // Saved, loaded into a new cut of another model, and one more step there.
  const std::string file = (std::filesystem::temp_directory_path() /
                            ("gpipe_cut_point_" + std::to_string(::getpid()) + ".pt"))
                               .string();
  save_training(file, *pipe, &pipe_adam, 2);
  at::manual_seed(77);
  Net other(false);
  other->to(at::kDouble);
  GPipe resumed(cut(other, sample()), options);
  torch::optim::Adam resumed_adam(resumed->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(load_training(file, *resumed, &resumed_adam) == 2);
  std::filesystem::remove(file);
  const auto [x, y] = data(4);
  plain_adam.zero_grad();
  resumed_adam.zero_grad();
  const at::Tensor want = mse(Batch(plain->forward(x)), y);
  want.backward();
  CATCH_CHECK(std::abs(resumed->step(x, y, mse).item<double>() - want.item<double>()) <= 1e-12);
  plain_adam.step();
  resumed_adam.step();
  const auto sections = resumed->partitions();
  Net back = make_net();
  for (const nn::Sequential& part : sections) uncut(part, *back);
  const auto expected = plain->named_parameters();
  for (const auto& item : back->named_parameters()) {
    CATCH_CAPTURE(item.key());
    CATCH_CHECK(max_diff(item.value(), expected[item.key()]) <= 1e-10);
  }
}

// Its forward() begins with a view that an empty batch cannot run (-1 is ambiguous for zero
// elements): the second section's placeholder falls back to one sample.
struct ViewNetImpl : nn::Cloneable<ViewNetImpl> {
  ViewNetImpl() { reset(); }
  void reset() override {
    first = register_module("first", nn::Linear(8, 8));
    second = register_module("second", nn::Linear(8, 3));
    cut_point = register_module("cut", CutPoint());
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor flat = x.view({x.size(0), -1});
    return second(cut_point(at::tanh(first(flat))));
  }
  nn::Linear first{nullptr}, second{nullptr};
  CutPoint cut_point{nullptr};
};
TORCH_MODULE(ViewNet);

CATCH_TEST_CASE(
    "A section whose code before it cannot run on an empty batch trains on one sample "
    "instead",
    "[cut_point]") {
  at::manual_seed(4);
  ViewNet plain;
  ViewNet net(std::dynamic_pointer_cast<ViewNetImpl>(plain->clone()));
  GPipe pipe(cut(net, at::randn({4, 2, 4}, at::kDouble)),
             GPipeOptions({1, 1}).chunks(2).schedule(ScheduleKind::k1F1B));
  train_beside(plain, pipe, 2, [](int) {
    const at::Tensor x = at::randn({5, 2, 4}, at::kDouble);
    return std::make_pair(x, at::randn({5, 3}, at::kDouble));
  });
}

// Misused models.
struct TwiceImpl : nn::Cloneable<TwiceImpl> {
  TwiceImpl() { reset(); }
  void reset() override {
    l = register_module("l", nn::Linear(4, 4));
    m = register_module("m", nn::Linear(4, 4));
    cut_point = register_module("cut", CutPoint());
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor y = l(x);
    if (mode == 0) return cut_point(cut_point(y));  // called twice
    if (mode == 1) return cut_point(y.t());         // not the batch first
    if (mode == 2) return m(cut_point(y)) + y;      // a value across the cut point
    return l(cut_point(y));                         // the same weight on both sides
  }
  int mode = 0;
  nn::Linear l{nullptr}, m{nullptr};
  CutPoint cut_point{nullptr};
};
TORCH_MODULE(Twice);

struct NoCutImpl : nn::Cloneable<NoCutImpl> {
  NoCutImpl() { reset(); }
  void reset() override { l = register_module("l", nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) { return l(x); }
  nn::Linear l{nullptr};
};
TORCH_MODULE(NoCut);

// A value computed before the cut point, without autograd, used after it.
struct MaskImpl : nn::Cloneable<MaskImpl> {
  MaskImpl() { reset(); }
  void reset() override {
    l = register_module("l", nn::Linear(4, 4));
    m = register_module("m", nn::Linear(4, 4));
    cut_point = register_module("cut", CutPoint());
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor mask = (x > 0).to(x.dtype());
    return m(cut_point(l(x))) * mask;
  }
  nn::Linear l{nullptr}, m{nullptr};
  CutPoint cut_point{nullptr};
};
TORCH_MODULE(Mask);

CATCH_TEST_CASE("A model that misuses cut points is refused naming what is wrong",
                "[cut_point][errors]") {
  using gpipe_test::contains;
  Twice twice;
  CATCH_CHECK_THROWS_WITH(cut(twice, at::randn({4, 4})), contains("already called"));
  twice->mode = 1;
  CATCH_CHECK_THROWS_WITH(cut(twice, at::randn({3, 4})),
                          contains("whose first dimension is not the batch (3)"));
  twice->mode = 2;
  CATCH_CHECK_THROWS_WITH(cut(twice, at::randn({4, 4})),
                          contains("parameter 'l.weight' is used both"));
  twice->mode = 3;
  CATCH_CHECK_THROWS_WITH(cut(twice, at::randn({4, 4})),
                          contains("parameter 'l.weight' is used both"));
  NoCut none;
  CATCH_CHECK_THROWS_WITH(cut(none, at::randn({4, 4})), contains("calls no CutPoint"));
  Net net = make_net();
  CATCH_CHECK_THROWS_WITH(cut(net, at::randn({1, 4}, at::kDouble)), contains("at least 2 samples"));
  CATCH_CHECK_THROWS_WITH(cut(net, sample(), {2, 1}),
                          contains("spans 3 intervals, but the model's 3 cut point(s) make 4"));
  CATCH_CHECK_THROWS_WITH(cut(net, sample(), {4, 0}), contains("an entry below 1"));
  Mask mask;
  CATCH_CHECK_THROWS_WITH(cut(mask, at::randn({4, 4})), contains("do not give the model's output"));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
