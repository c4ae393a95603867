// What training keeps per parameter (Note [Training memory] in balancing/memory.h), against the
// tensors a real training step leaves: parameters, gradients, float32 masters and their
// gradients, the optimizer's state, and (on a GPU) autocast's weight cache as the CUDA allocator
// counts it.
#include "tests/catch.h"
#include "tests/gpipe/test_util.h"

#include <cmath>
#include <utility>
#include <vector>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <nlohmann/json.hpp>

#include "balancing/memory.h"
#include "balancing/plan.h"
#include "gpipe/internal/stream.h"
#include "gpipe/thread_state.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

// Linear, LayerNorm (buffers none, two parameters), Tanh (none), Linear.
nn::Sequential small_model() {
  nn::Sequential seq(nn::Linear(16, 32), nn::LayerNorm(nn::LayerNormOptions({32})), nn::Tanh(),
                     nn::Linear(32, 8));
  return seq;
}

// A quick profile of small_model() on two CPU workers, mini-batches of 32 (times only roughly:
// the memory is what these tests read).
PipelineProfile small_profile() {
  at::manual_seed(0);
  return profile_pipeline(
      small_model(), at::randn({32, 16}), {at::kCPU, at::kCPU},
      PipelineProfileOptions().timeout(std::chrono::milliseconds(10)).calibrate(false));
}

// The model's parameter state as the planner counts it: each layer's, added up.
int64_t counted(const nn::Sequential& model, const ParameterMemory& memory) {
  int64_t total = 0;
  for (const auto& child : model->children()) {
    LayerStats stats;
    count_parameters(*child, stats);
    total += parameter_state_bytes(stats, memory);
  }
  return total;
}

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) total += static_cast<int64_t>(t.nbytes());
  }
  return total;
}

// Every tensor an optimizer keeps in its state.
int64_t state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t total = 0;
  for (const auto& entry : optimizer.state()) {
    if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(entry.second.get())) {
      total += bytes_of({adam->exp_avg(), adam->exp_avg_sq(), adam->max_exp_avg_sq()});
    } else if (const auto* adamw =
                   dynamic_cast<const torch::optim::AdamWParamState*>(entry.second.get())) {
      total += bytes_of({adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()});
    } else if (const auto* sgd =
                   dynamic_cast<const torch::optim::SGDParamState*>(entry.second.get())) {
      total += bytes_of({sgd->momentum_buffer()});
    }
  }
  return total;
}

// What the parameters, their gradients and the buffers hold.
int64_t model_bytes(const nn::Sequential& model) {
  std::vector<at::Tensor> all = model->parameters();
  for (const at::Tensor& p : model->parameters()) all.push_back(p.grad());
  for (const at::Tensor& b : model->buffers()) all.push_back(b);
  return bytes_of(all);
}

CATCH_TEST_CASE(
    "the parameter state the planner counts is what a training step leaves, for "
    "every optimizer kind, frozen layers and float64",
    "[balancing][memory]") {
  const OptimizerKind kind = GENERATE(OptimizerKind::kSGD, OptimizerKind::kMomentum,
                                      OptimizerKind::kAdam, OptimizerKind::kAdamW);
  const bool frozen = GENERATE(false, true);
  const bool float64 = GENERATE(false, true);
  CATCH_CAPTURE(optimizer_kind_name(kind), frozen, float64);
  nn::Sequential model = small_model();
  if (float64) model->to(at::kDouble);
  if (frozen) {
    for (at::Tensor& p : model[0]->parameters()) p.requires_grad_(false);
  }
  std::vector<at::Tensor> trainable;
  for (const at::Tensor& p : model->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  switch (kind) {
    case OptimizerKind::kSGD:
      optimizer = std::make_unique<torch::optim::SGD>(trainable, torch::optim::SGDOptions(0.01));
      break;
    case OptimizerKind::kMomentum:
      optimizer = std::make_unique<torch::optim::SGD>(
          trainable, torch::optim::SGDOptions(0.01).momentum(0.9));
      break;
    case OptimizerKind::kAdam:
      optimizer = std::make_unique<torch::optim::Adam>(trainable, torch::optim::AdamOptions(0.01));
      break;
    case OptimizerKind::kAdamW:
      optimizer =
          std::make_unique<torch::optim::AdamW>(trainable, torch::optim::AdamWOptions(0.01));
      break;
  }
  const at::Tensor x = at::randn({4, 16}, float64 ? at::kDouble : at::kFloat);
  model->forward(x).pow(2).sum().backward();
  optimizer->step();
  ParameterMemory memory;
  memory.optimizer = kind;
  CATCH_CHECK(counted(model, memory) == model_bytes(model) + state_bytes(*optimizer));
}

CATCH_TEST_CASE(
    "bfloat16 parameters with float32 master weights and Adam hold 20 bytes an "
    "element as a master-weight step does",
    "[balancing][memory]") {
  nn::Sequential model = small_model();
  model->to(at::kBFloat16);
  // The masters: float32 copies that the optimizer steps, each with a float32 gradient copied
  // from the parameter's bfloat16 one (set here: the bytes, not the values, are the point).
  std::vector<at::Tensor> masters;
  for (const at::Tensor& p : model->parameters()) {
    p.mutable_grad() = at::ones_like(p);
    at::Tensor master = p.detach().to(at::kFloat).requires_grad_(true);
    master.mutable_grad() = p.grad().to(at::kFloat);
    masters.push_back(master);
  }
  torch::optim::Adam adam(masters, torch::optim::AdamOptions(0.01));
  adam.step();
  std::vector<at::Tensor> master_tensors = masters;
  for (const at::Tensor& m : masters) master_tensors.push_back(m.grad());
  ParameterMemory memory;
  memory.optimizer = OptimizerKind::kAdam;
  memory.master_weights = true;
  const int64_t real = model_bytes(model) + bytes_of(master_tensors) + state_bytes(adam);
  CATCH_CHECK(counted(model, memory) == real);
  int64_t elements = 0;
  for (const at::Tensor& p : model->parameters()) elements += p.numel();
  CATCH_CHECK(real == 20 * elements);
  // Without master weights the same model counts its moments in bfloat16: 8 bytes an element.
  memory.master_weights = false;
  CATCH_CHECK(counted(model, memory) == 8 * elements);
}

CATCH_TEST_CASE(
    "autocast's weight cache holds each trainable float32 parameter at the autocast "
    "dtype while its region lasts",
    "[balancing][memory][cuda]") {
  // On a GPU, where autocast keeps the casts of the weights for the region (LibTorch 1.13's CPU
  // autocast was seen to keep a Linear's bias but not its weight: the CPU is not counted here).
  const c10::Device gpu("cuda:0");
  nn::Sequential model(nn::Linear(256, 512), nn::Tanh(), nn::Linear(512, 64));
  for (at::Tensor& p : model[2]->parameters()) p.requires_grad_(false);  // not cached
  model->to(gpu);
  const at::Tensor x = at::randn({8, 256}, at::TensorOptions().device(gpu));
  model->forward(x);  // cuBLAS's workspace, made once, before the measurement
  int64_t cache = 0;
  {
    Autocast autocast(c10::kCUDA, c10::kHalf);
    const int64_t before = internal::memory_allocated(gpu);
    model->forward(x);  // the output and its graph are freed at once
    cache = internal::memory_allocated(gpu) - before;
  }
  // The first Linear's weight and bias in float16 (the caching allocator rounds each up to 512).
  const auto rounded = [](int64_t bytes) { return (bytes + 511) / 512 * 512; };
  CATCH_CHECK(cache == rounded(2 * 256 * 512) + rounded(2 * 512));
  ParameterMemory memory;
  memory.optimizer = OptimizerKind::kSGD;
  memory.autocast = at::kHalf;
  ParameterMemory plain = memory;
  plain.autocast = c10::nullopt;
  CATCH_CHECK(counted(model, memory) - counted(model, plain) == 2 * (256 * 512 + 512));
}

CATCH_TEST_CASE(
    "a plan's predicted peak grows by the parameter state that master weights add, "
    "device by device",
    "[balancing][memory][plan]") {
  const PipelineProfile profile = small_profile();
  // The same profile as if its Linear layers were bfloat16: half the bytes, all narrow.
  PipelineProfile narrow = profile;
  for (LayerProfile& size : narrow.sizes) {
    for (LayerStats& l : size.layers) {
      l.param_bytes /= 2;
      l.trainable_param_bytes /= 2;
      l.narrow_param_elements = l.float32_param_elements;
      l.narrow_param_bytes = l.trainable_param_bytes;
      l.float32_param_elements = 0;
    }
  }
  PipelinePlan p;
  p.balance = {1, 3};
  p.devices = {at::kCPU, c10::Device(c10::kCPU)};
  p.chunks = 2;
  ParameterMemory without;
  without.optimizer = OptimizerKind::kAdam;
  ParameterMemory with = without;
  with.master_weights = true;
  const PipelineCosts a = pipeline_costs(narrow, p, without);
  const PipelineCosts b = pipeline_costs(narrow, p, with);
  int64_t added = 0;
  for (int64_t k = 0; k < 4; ++k) {
    const LayerStats l = narrow.layer(k, 16);
    added += parameter_state_bytes(l, with) - parameter_state_bytes(l, without);
  }
  CATCH_REQUIRE(a.static_bytes.size() == 1);  // both partitions on the one CPU
  CATCH_CHECK(b.static_bytes[0] - a.static_bytes[0] == added);
  // Per narrow element: a float32 master and its gradient (8 bytes), and Adam's two moments in
  // float32 rather than bfloat16 (2 x 2 more).
  CATCH_CHECK(added == 12 * (narrow.layer(0, 16).narrow_param_elements +
                             narrow.layer(1, 16).narrow_param_elements +
                             narrow.layer(3, 16).narrow_param_elements));
  PipelinePlan q = p;
  predict(narrow, p, without);
  predict(narrow, q, with);
  CATCH_CHECK(q.peak_bytes[0] - p.peak_bytes[0] == added);
  // And PlanOptions carries it to plan().
  const PlanOptions options = PlanOptions()
                                  .partitions({2})
                                  .chunks({2})
                                  .schedules({ScheduleKind::kGPipe})
                                  .checkpoints({Checkpoint::kNever})
                                  .optimizer(OptimizerKind::kAdam)
                                  .master_weights(true)
                                  .search(false);
  const std::vector<PipelinePlan> plans = plan(narrow, options);
  CATCH_REQUIRE(!plans.empty());
  for (const PipelinePlan& planned : plans) {
    PipelinePlan again = planned;
    predict(narrow, again, with);
    CATCH_CHECK(again.peak_bytes == planned.peak_bytes);
  }
}

CATCH_TEST_CASE(
    "a plan's peak on each GPU is the device's context plus the simulated peak times "
    "the allocator's reserve and a CPU's is the simulated peak",
    "[balancing][memory][plan]") {
  PipelineProfile profile = small_profile();
  CATCH_CHECK(profile.device_context_bytes == 0);  // measured on a CPU: none
  CATCH_CHECK(profile.allocator_reserve == 1);
  // The same layers as if profiled on two GPUs (the simulation takes any device), with copies
  // between every two devices, as profile_copies measures them.
  profile.devices = {c10::Device("cuda:0"), c10::Device("cuda:1"), c10::Device(c10::kCPU)};
  for (const c10::Device& from : profile.devices) {
    for (const c10::Device& to : profile.devices) {
      if (from == to) continue;
      CopyStats c;
      c.from = from;
      c.to = to;
      c.latency_us = 10;
      c.bytes_per_us = 1000;
      profile.copies.push_back(c);
    }
  }
  PipelinePlan p;
  p.balance = {1, 2, 1};
  p.devices = {c10::Device("cuda:0"), c10::Device("cuda:1"), c10::Device(c10::kCPU)};
  p.chunks = 2;
  PipelinePlan bare = p;
  predict(profile, bare);
  profile.device_context_bytes = 500 << 20;
  profile.allocator_reserve = 1.25;
  predict(profile, p);
  CATCH_REQUIRE(p.peak_bytes.size() == 3);
  for (size_t d = 0; d < 2; ++d) {
    CATCH_CHECK(p.peak_bytes[d] ==
                (500 << 20) + static_cast<int64_t>(std::ceil(1.25 * bare.peak_bytes[d])));
  }
  CATCH_CHECK(p.peak_bytes[2] == bare.peak_bytes[2]);
  // With a limit below the GPUs' contexts no plan fits, and the parameters' side (with the
  // context) is named as the excess, not the activations.
  CATCH_CHECK_THROWS_WITH(plan(profile, PlanOptions()
                                            .partitions({2})
                                            .chunks({2})
                                            .schedules({ScheduleKind::kGPipe})
                                            .memory_limit(int64_t{100} << 20)
                                            .search(false)),
                          gpipe_test::contains("(with a GPU's context and its allocator's "
                                               "reserve). Those alone exceed the limit"));
  // It travels in the profile's JSON.
  const PipelineProfile back = PipelineProfile::from_json(profile.to_json());
  CATCH_CHECK(back.device_context_bytes == 500 << 20);
  CATCH_CHECK(back.allocator_reserve == 1.25);
  profile.allocator_reserve = 0.5;
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(profile.to_json()),
                          gpipe_test::contains("allocator_reserve must be at least 1, got"));
}

CATCH_TEST_CASE("profiling on a GPU measures its context and its allocator's reserve",
                "[balancing][memory][cuda]") {
  // (With the CPU too, the copies between them are profiled: 64 MiB probes.)
  const std::vector<c10::Device> devices =
      GENERATE(std::vector<c10::Device>{c10::Device("cuda:0")},
               std::vector<c10::Device>{c10::Device("cuda:0"), c10::Device(c10::kCPU)});
  CATCH_CAPTURE(devices.size());
  at::manual_seed(0);
  const PipelineProfile profile =
      profile_pipeline(small_model(), at::randn({64, 16}), devices,
                       PipelineProfileOptions().timeout(std::chrono::milliseconds(20)));
  // A CUDA context alone takes hundreds of MiB; the allocator reserves at least what it gives.
  CATCH_CHECK(profile.device_context_bytes > (int64_t{64} << 20));
  CATCH_CHECK(profile.allocator_reserve >= 1);
  CATCH_CHECK(profile.allocator_reserve < 1000);
  // The reserve is the model's: the optimizer's profile (a GPU's 256 MiB tensor with its gradient
  // and moments, Note [The optimizer's step]) and the copies' 64 MiB probes are out of the peaks it
  // is measured over.
  CATCH_CHECK(profile.optimizers.size() == optimizer_kinds().size());
  CATCH_CHECK(profile.copies.size() == 2 * (devices.size() - 1));
  CATCH_CHECK(internal::device_memory_use(c10::Device("cuda:0")).peak_allocated <
              (int64_t{64} << 20));
}

CATCH_TEST_CASE(
    "a profile's parameter counts survive JSON and older profiles read as float32 "
    "and trainable",
    "[balancing][memory][json]") {
  nn::Sequential model = small_model();
  model[0]->to(at::kBFloat16);
  for (at::Tensor& p : model[3]->parameters()) p.requires_grad_(false);
  PipelineProfile profile;
  profile.batch = 4;
  profile.devices = {at::kCPU};
  LayerProfile size;
  size.batch = 4;
  for (const auto& item : model->named_children()) {
    LayerStats stats;
    stats.name = item.key();
    stats.type = item.value()->name();
    count_parameters(*item.value(), stats);
    size.layers.push_back(stats);
  }
  profile.sizes = {size};
  CATCH_CHECK(size.layers[0].narrow_param_elements == 16 * 32 + 32);
  CATCH_CHECK(size.layers[0].narrow_param_bytes == 2 * (16 * 32 + 32));
  CATCH_CHECK(size.layers[1].float32_param_elements == 2 * 32);
  CATCH_CHECK(size.layers[3].trainable_param_bytes == 0);
  CATCH_CHECK(size.layers[3].param_bytes == 4 * (32 * 8 + 8));
  const PipelineProfile back = PipelineProfile::from_json(profile.to_json());
  for (size_t k = 0; k < size.layers.size(); ++k) {
    const LayerStats& a = size.layers[k];
    const LayerStats& b = back.sizes[0].layers[k];
    CATCH_CHECK(b.trainable_param_bytes == a.trainable_param_bytes);
    CATCH_CHECK(b.narrow_param_elements == a.narrow_param_elements);
    CATCH_CHECK(b.narrow_param_bytes == a.narrow_param_bytes);
    CATCH_CHECK(b.float32_param_elements == a.float32_param_elements);
  }
  // A profile written before the counts: each layer's parameters trainable float32.
  nlohmann::json older = nlohmann::json::parse(profile.to_json());
  for (nlohmann::json& size_json : older["sizes"]) {
    for (nlohmann::json& row : size_json["layers"]) {
      for (const char* key : {"trainable_param_bytes", "narrow_param_elements",
                              "narrow_param_bytes", "float32_param_elements"}) {
        row.erase(key);
      }
    }
  }
  const PipelineProfile old = PipelineProfile::from_json(older.dump());
  for (size_t k = 0; k < size.layers.size(); ++k) {
    const LayerStats& l = old.sizes[0].layers[k];
    CATCH_CHECK(l.trainable_param_bytes == l.param_bytes);
    CATCH_CHECK(l.float32_param_elements == l.param_bytes / 4);
    CATCH_CHECK(l.narrow_param_elements == 0);
  }
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
