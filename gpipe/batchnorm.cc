// Deferred batch norm; see Note [Deferred batch norm without replacing modules] in batchnorm.h.
#include "gpipe/batchnorm.h"

#include <cstring>
#include <unordered_map>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/var_mean.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/irange.h>
#include <torch/nn/modules/batchnorm.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/checkpoint.h"

namespace gpipe {

struct DeferredBatchNorm::Layer {
  torch::nn::Module* module;
  at::Tensor* running_mean;  // the layer's members, redirected to sinks while training
  at::Tensor* running_var;
  at::Tensor* num_batches_tracked;
  c10::optional<double> momentum;

  at::Tensor sink_mean;
  at::Tensor sink_var;
  at::Tensor sink_count;

  absl::Mutex mu;
  double count ABSL_GUARDED_BY(mu) = 0;
  at::Tensor mean ABSL_GUARDED_BY(mu);  // float64, per channel
  at::Tensor m2 ABSL_GUARDED_BY(mu);    // float64, per channel: sum of squared deviations

  at::Tensor buffer(const char* name) const { return module->named_buffers(false)[name]; }

  void accumulate(const at::Tensor& input) {
    TORCH_CHECK(input.dim() >= 2, "deferred batch norm: expected an input with at least 2 "
                "dimensions (N, C, ...), got ", input.dim());
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < input.dim(); ++d) {
      dims.push_back(d);
    }
    const double n = static_cast<double>(input.numel() / input.size(1));
    auto var_mean = at::var_mean(input.detach().to(at::kDouble), dims, /*unbiased=*/false);
    at::Tensor batch_mean = std::get<1>(var_mean);
    at::Tensor batch_m2 = std::get<0>(var_mean) * n;
    absl::MutexLock lock(&mu);
    if (count == 0) {
      mean = batch_mean;
      m2 = batch_m2;
      count = n;
      return;
    }
    // Chan et al.: combine (count, mean, m2) with (n, batch_mean, batch_m2).
    const double total = count + n;
    at::Tensor delta = batch_mean - mean;
    mean = mean + delta * (n / total);
    m2 = m2 + batch_m2 + delta * delta * (count * n / total);
    count = total;
  }
};

namespace {

// Sink tensor -> layer, for the callback. Guarded by registry_mu.
absl::Mutex registry_mu(absl::kConstInit);
std::unordered_map<const c10::TensorImpl*, DeferredBatchNorm::Layer*>& registry() {
  static auto* map = new std::unordered_map<const c10::TensorImpl*, DeferredBatchNorm::Layer*>();
  return *map;
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (is_recomputing() || std::strcmp(fn.name(), "aten::batch_norm") != 0) {
    return nullptr;
  }
  auto inputs = fn.inputs();
  if (inputs.size() < 4 || !inputs[0].isTensor() || !inputs[3].isTensor()) {
    return nullptr;
  }
  DeferredBatchNorm::Layer* layer = nullptr;
  {
    absl::MutexLock lock(&registry_mu);
    auto it = registry().find(inputs[3].toTensor().unsafeGetTensorImpl());
    if (it == registry().end()) {
      return nullptr;
    }
    layer = it->second;
  }
  // The statistics are bookkeeping: no autograd, no autocast, no recursion into this callback.
  at::DisableRecordFunctionGuard no_recursion;
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  layer->accumulate(inputs[0].toTensor());
  return nullptr;
}

template <typename BatchNormImpl>
std::unique_ptr<DeferredBatchNorm::Layer> as_layer(torch::nn::Module& module) {
  auto* bn = dynamic_cast<BatchNormImpl*>(&module);
  if (bn == nullptr || !bn->options.track_running_stats()) {
    return nullptr;
  }
  auto layer = std::make_unique<DeferredBatchNorm::Layer>();
  layer->module = bn;
  layer->running_mean = &bn->running_mean;
  layer->running_var = &bn->running_var;
  layer->num_batches_tracked = &bn->num_batches_tracked;
  layer->momentum = bn->options.momentum();
  return layer;
}

bool same_kind(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.scalar_type() == b.scalar_type() &&
         a.device() == b.device() && a.sizes() == b.sizes();
}

}  // namespace

DeferredBatchNorm::DeferredBatchNorm(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  for (const auto& module : modules) {
    std::unique_ptr<Layer> layer = as_layer<torch::nn::BatchNorm1dImpl>(*module);
    if (!layer) layer = as_layer<torch::nn::BatchNorm2dImpl>(*module);
    if (!layer) layer = as_layer<torch::nn::BatchNorm3dImpl>(*module);
    if (layer) {
      layers_.push_back(std::move(layer));
    }
  }
}

DeferredBatchNorm::~DeferredBatchNorm() {
  set_training(false);
}

void DeferredBatchNorm::set_training(bool training) {
  absl::MutexLock lock(&registry_mu);
  for (auto& layer : layers_) {
    at::Tensor real_mean = layer->buffer("running_mean");
    at::Tensor real_var = layer->buffer("running_var");
    at::Tensor real_count = layer->buffer("num_batches_tracked");
    if (!training) {
      if (layer->sink_mean.defined()) {
        registry().erase(layer->sink_mean.unsafeGetTensorImpl());
        layer->sink_mean.reset();
        layer->sink_var.reset();
        layer->sink_count.reset();
      }
      *layer->running_mean = real_mean;
      *layer->running_var = real_var;
      *layer->num_batches_tracked = real_count;
      continue;
    }
    // (Re)make the sinks when the buffers changed dtype or device (e.g. after to(kDouble)).
    if (!same_kind(layer->sink_mean, real_mean) || !same_kind(layer->sink_var, real_var)) {
      if (layer->sink_mean.defined()) {
        registry().erase(layer->sink_mean.unsafeGetTensorImpl());
      }
      layer->sink_mean = at::empty_like(real_mean).zero_();
      layer->sink_var = at::empty_like(real_var).fill_(1);
      layer->sink_count = at::empty_like(real_count).zero_();
      registry()[layer->sink_mean.unsafeGetTensorImpl()] = layer.get();
    }
    *layer->running_mean = layer->sink_mean;
    *layer->running_var = layer->sink_var;
    *layer->num_batches_tracked = layer->sink_count;
  }
  training_ = training;
}

std::unique_ptr<DeferredBatchNorm::TrackingScope> DeferredBatchNorm::track() {
  for (auto& layer : layers_) {
    absl::MutexLock lock(&layer->mu);
    layer->count = 0;
    layer->mean.reset();
    layer->m2.reset();
  }
  at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_op).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  return std::make_unique<TrackingScope>(handle);
}

DeferredBatchNorm::TrackingScope::~TrackingScope() { at::removeCallback(handle_); }

void DeferredBatchNorm::commit() {
  at::NoGradGuard no_grad;
  for (auto& layer : layers_) {
    absl::MutexLock lock(&layer->mu);
    if (layer->count == 0) {
      continue;
    }
    at::Tensor real_mean = layer->buffer("running_mean");
    at::Tensor real_var = layer->buffer("running_var");
    at::Tensor real_count = layer->buffer("num_batches_tracked");
    real_count.add_(1);
    const double factor = layer->momentum.has_value()
                              ? *layer->momentum
                              : 1.0 / real_count.item<double>();
    // Unbiased variance, as BatchNorm uses for running_var (a count of 1 has none: BatchNorm
    // refuses such input in training).
    at::Tensor var = layer->m2 / std::max(layer->count - 1.0, 1.0);
    real_mean.mul_(1.0 - factor).add_(layer->mean.to(real_mean.options()), factor);
    real_var.mul_(1.0 - factor).add_(var.to(real_var.options()), factor);
    layer->count = 0;
    layer->mean.reset();
    layer->m2.reset();
  }
}

}  // namespace gpipe
