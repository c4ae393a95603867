// Batch norm in a pipeline; see the Notes in batchnorm.h.
#include "gpipe/batchnorm.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/var_mean.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/nn/modules/batchnorm.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/checkpoint.h"
#include "gpipe/internal/batchnorm_readings.h"

namespace gpipe {

struct BatchNormLayers::Layer {
  ~Layer();

  torch::nn::Module* module = nullptr;
  at::Tensor* running_mean = nullptr;  // the layer's members, redirected to sinks at times
  at::Tensor* running_var = nullptr;
  at::Tensor* num_batches_tracked = nullptr;
  const torch::nn::BatchNormOptions* options = nullptr;  // read at every commit

  // Redirection (Note [Recomputation leaves running statistics alone]).
  std::mutex redirect_mu;
  int redirects = 0;
  // Recomputations running now, and started so far (Note [Statistics from the sinks]).
  int recomputations = 0;
  uint64_t recomputations_started = 0;
  at::Tensor saved_mean, saved_var, saved_count;  // the members while redirected
  at::Tensor sink_mean, sink_var, sink_count;

  // Deferred statistics.
  absl::Mutex mu;
  BatchNormStatistics statistics ABSL_GUARDED_BY(mu);  // count 0 and undefined tensors: none yet
  void accumulate(const at::Tensor& input);
  // Note [Statistics from the sinks]: the recomputations started so far if none runs now.
  c10::optional<uint64_t> quiet_since();
  void accumulate_scaled(at::Tensor mean, at::Tensor var, double n, double momentum);
};

namespace {

// Sink tensor -> layer, for the callback. Guarded by registry_mu.
absl::Mutex registry_mu(absl::kConstInit);
std::unordered_map<const c10::TensorImpl*, BatchNormLayers::Layer*>& registry() {
  static auto* map = new std::unordered_map<const c10::TensorImpl*, BatchNormLayers::Layer*>();
  return *map;
}

bool same_kind(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.scalar_type() == b.scalar_type() &&
         a.device() == b.device() && a.sizes() == b.sizes();
}

// What on_op leaves for on_op_end (Note [Statistics from the sinks]): the layer whose sinks hold
// the call's statistics times its momentum, the values per channel, and the input, to gather
// from instead where a recomputation may have written the sinks meanwhile.
struct SinkReading : at::ObserverContext {
  BatchNormLayers::Layer* layer = nullptr;
  at::Tensor input;
  double n = 0;
  double momentum = 0;
  uint64_t recomputations = 0;
};

std::atomic<int64_t> readings{0};  // internal::sink_readings()

// The statistics are bookkeeping: no autograd, no autocast, no recursion into the callback.
struct Bookkeeping {
  at::DisableRecordFunctionGuard no_recursion;
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

bool float_at_least(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (is_recomputing() || std::strcmp(fn.name(), "aten::batch_norm") != 0) {
    return nullptr;
  }
  auto inputs = fn.inputs();
  if (inputs.size() < 4 || !inputs[0].isTensor() || !inputs[3].isTensor()) {
    return nullptr;
  }
  BatchNormLayers::Layer* layer = nullptr;
  {
    absl::MutexLock lock(&registry_mu);
    auto it = registry().find(inputs[3].toTensor().unsafeGetTensorImpl());
    if (it == registry().end()) {
      return nullptr;
    }
    layer = it->second;
  }
  const at::Tensor& input = inputs[0].toTensor();
  const Bookkeeping bookkeeping;
  // (batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, ...))
  const bool updates_sinks =
      inputs.size() > 6 && inputs[4].isTensor() &&
      inputs[4].toTensor().unsafeGetTensorImpl() == layer->sink_var.unsafeGetTensorImpl() &&
      inputs[5].isBool() && inputs[5].toBool() && inputs[6].isDouble() &&
      inputs[6].toDouble() > 0 && inputs[6].toDouble() <= 1;
  const c10::optional<uint64_t> quiet = updates_sinks ? layer->quiet_since() : c10::nullopt;
  if (updates_sinks && quiet && input.dim() >= 2 && input.size(1) > 0 &&
      float_at_least(layer->sink_mean) && float_at_least(layer->sink_var)) {
    auto reading = std::make_unique<SinkReading>();
    reading->layer = layer;
    reading->input = input;
    reading->n = static_cast<double>(input.numel() / input.size(1));
    reading->momentum = inputs[6].toDouble();
    reading->recomputations = *quiet;
    // From zero, the update leaves momentum x the call's statistics. (Through variable_data(),
    // as the kernel's own update does, not bumping the version that earlier micro-batches'
    // graphs saved the sinks at.)
    layer->sink_mean.variable_data().zero_();
    layer->sink_var.variable_data().zero_();
    return reading;
  }
  // Any other call (another running variance, narrow sinks, a recomputation running): from its
  // input.
  layer->accumulate(input);
  return nullptr;
}

void on_op_end(const at::RecordFunction&, at::ObserverContext* context) {
  auto* reading = dynamic_cast<SinkReading*>(context);
  if (reading == nullptr) return;
  const Bookkeeping bookkeeping;
  BatchNormLayers::Layer& layer = *reading->layer;
  // Copies (a float64 sink's to(kDouble) would be the sink itself), read before the check.
  at::Tensor mean = layer.sink_mean.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
  at::Tensor var = layer.sink_var.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
  if (layer.quiet_since() != c10::optional<uint64_t>(reading->recomputations)) {
    // A recomputation began since on_op: the sinks may hold its update.
    layer.accumulate(reading->input);
    return;
  }
  layer.accumulate_scaled(std::move(mean), std::move(var), reading->n, reading->momentum);
  readings.fetch_add(1, std::memory_order_relaxed);
}

template <typename BatchNormImpl>
std::unique_ptr<BatchNormLayers::Layer> as_layer(torch::nn::Module& module) {
  auto* bn = dynamic_cast<BatchNormImpl*>(&module);
  if (bn == nullptr || !bn->options.track_running_stats()) {
    return nullptr;
  }
  auto layer = std::make_unique<BatchNormLayers::Layer>();
  layer->module = bn;
  layer->running_mean = &bn->running_mean;
  layer->running_var = &bn->running_var;
  layer->num_batches_tracked = &bn->num_batches_tracked;
  layer->options = &bn->options;
  return layer;
}

}  // namespace

BatchNormLayers::Layer::~Layer() {
  if (sink_mean.defined()) {
    absl::MutexLock lock(&registry_mu);
    registry().erase(sink_mean.unsafeGetTensorImpl());
  }
}

void BatchNormLayers::Layer::accumulate(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2, "deferred batch norm: expected an input with at least 2 "
              "dimensions (N, C, ...), got ", input.dim());
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) {
    dims.push_back(d);
  }
  const double n = static_cast<double>(input.numel() / input.size(1));
  // In the input's own precision (float at least, as BatchNorm computes); only the per-channel
  // results become float64.
  at::Tensor x = input.detach();
  if (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) {
    x = x.to(at::kFloat);
  }
  auto var_mean = at::var_mean(x, dims, /*unbiased=*/false);
  at::Tensor batch_mean = std::get<1>(var_mean).to(at::kDouble);
  at::Tensor batch_m2 = std::get<0>(var_mean).to(at::kDouble) * n;
  absl::MutexLock lock(&mu);
  statistics.merge(n, batch_mean, batch_m2);
}

c10::optional<uint64_t> BatchNormLayers::Layer::quiet_since() {
  std::lock_guard<std::mutex> lock(redirect_mu);
  if (recomputations > 0) return c10::nullopt;
  return recomputations_started;
}

void BatchNormLayers::Layer::accumulate_scaled(at::Tensor mean, at::Tensor var, double n,
                                               double momentum) {
  // The sinks went from zero to momentum x (the mean, the unbiased variance).
  mean.div_(momentum);
  at::Tensor m2 = var.mul_(std::max(n - 1.0, 0.0) / momentum);
  absl::MutexLock lock(&mu);
  statistics.merge(n, mean, m2);
}

BatchNormLayers::BatchNormLayers(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  for (const auto& module : modules) {
    std::unique_ptr<Layer> layer = as_layer<torch::nn::BatchNorm1dImpl>(*module);
    if (!layer) layer = as_layer<torch::nn::BatchNorm2dImpl>(*module);
    if (!layer) layer = as_layer<torch::nn::BatchNorm3dImpl>(*module);
    if (layer) {
      layers_.push_back(std::move(layer));
    }
  }
}

BatchNormLayers::~BatchNormLayers() = default;

BatchNormLayers::Redirect BatchNormLayers::redirect(bool recomputation) {
  Redirect redirect;
  redirect.recomputation_ = recomputation;
  redirect.layers_.reserve(layers_.size());  // (no allocation below once a layer is counted)
  for (auto& owned : layers_) {
    Layer& layer = *owned;
    if (!layer.module->is_training()) {
      continue;  // an eval-mode BatchNorm updates nothing
    }
    std::lock_guard<std::mutex> lock(layer.redirect_mu);
    if (layer.redirects == 0) {
      layer.saved_mean = *layer.running_mean;
      layer.saved_var = *layer.running_var;
      layer.saved_count = *layer.num_batches_tracked;
      // (Re)make the sinks when the buffers changed dtype or device (e.g. after to(kDouble)), as
      // normal tensors even under InferenceMode, so that a later normal step can write them.
      if (!same_kind(layer.sink_mean, layer.saved_mean) ||
          !same_kind(layer.sink_var, layer.saved_var) ||
          !same_kind(layer.sink_count, layer.saved_count)) {
        c10::InferenceMode normal_tensors(false);
        at::NoGradGuard no_grad;
        absl::MutexLock registry_lock(&registry_mu);
        if (layer.sink_mean.defined()) {
          registry().erase(layer.sink_mean.unsafeGetTensorImpl());
        }
        layer.sink_mean = at::empty_like(layer.saved_mean).zero_();
        layer.sink_var = at::empty_like(layer.saved_var).fill_(1);
        layer.sink_count = at::empty_like(layer.saved_count).zero_();
        registry()[layer.sink_mean.unsafeGetTensorImpl()] = &layer;
      }
      *layer.running_mean = layer.sink_mean;
      *layer.running_var = layer.sink_var;
      *layer.num_batches_tracked = layer.sink_count;
    }
    // Counted only once nothing can throw: a failure above (out of memory making the sinks)
    // leaves this layer as it was, and `redirect` undoes the layers before it.
    ++layer.redirects;
    if (recomputation) {
      ++layer.recomputations;
      ++layer.recomputations_started;
    }
    redirect.layers_.push_back(&layer);
  }
  return redirect;
}

BatchNormLayers::Redirect::~Redirect() {
  for (Layer* layer : layers_) {
    std::lock_guard<std::mutex> lock(layer->redirect_mu);
    if (recomputation_) --layer->recomputations;
    if (--layer->redirects == 0) {
      *layer->running_mean = std::move(layer->saved_mean);
      *layer->running_var = std::move(layer->saved_var);
      *layer->num_batches_tracked = std::move(layer->saved_count);
    }
  }
}

void BatchNormLayers::reset_statistics() {
  for (auto& layer : layers_) {
    absl::MutexLock lock(&layer->mu);
    layer->statistics = BatchNormStatistics{};
  }
}

void BatchNormStatistics::merge(double n, const at::Tensor& other_mean,
                                const at::Tensor& other_m2) {
  if (n == 0) {
    return;
  }
  if (count == 0) {
    count = n;
    mean = other_mean;
    m2 = other_m2;
    return;
  }
  const double total = count + n;
  at::Tensor delta = other_mean - mean;
  mean = mean + delta * (n / total);
  m2 = m2 + other_m2 + delta * delta * (count * n / total);
  count = total;
}

std::vector<BatchNormStatistics> BatchNormLayers::statistics() const {
  std::vector<BatchNormStatistics> out;
  out.reserve(layers_.size());
  for (const auto& owned : layers_) {
    Layer& layer = *owned;
    absl::MutexLock lock(&layer.mu);
    if (layer.statistics.count == 0) {
      const at::Tensor zeros = at::zeros(layer.options->num_features(),
                                         at::TensorOptions(at::kDouble).device(
                                             layer.running_mean->device()));
      out.push_back(BatchNormStatistics{0, zeros, zeros.clone()});
    } else {
      out.push_back(layer.statistics);
    }
  }
  return out;
}

void BatchNormLayers::commit(const std::vector<BatchNormStatistics>* statistics) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(statistics == nullptr || statistics->size() == layers_.size(),
              "gpipe: batch norm statistics for ", statistics ? statistics->size() : 0,
              " layers were given to a partition with ", layers_.size());
  for (size_t k = 0; k < layers_.size(); ++k) {
    Layer& layer = *layers_[k];
    absl::MutexLock lock(&layer.mu);
    const BatchNormStatistics own = std::move(layer.statistics);
    layer.statistics = BatchNormStatistics{};
    const BatchNormStatistics& s = statistics ? (*statistics)[k] : own;
    if (s.count == 0) {
      continue;
    }
    at::Tensor real_mean, real_var, real_count;
    {
      // Another thread's recomputation may hold the members redirected.
      std::lock_guard<std::mutex> redirect_lock(layer.redirect_mu);
      const bool redirected = layer.redirects > 0;
      real_mean = redirected ? layer.saved_mean : *layer.running_mean;
      real_var = redirected ? layer.saved_var : *layer.running_var;
      real_count = redirected ? layer.saved_count : *layer.num_batches_tracked;
    }
    real_count.add_(1);
    const c10::optional<double> momentum = layer.options->momentum();
    const double factor =
        momentum.has_value() ? *momentum : 1.0 / real_count.item<double>();
    // Unbiased variance, as BatchNorm uses for running_var (a count of 1 has none: BatchNorm
    // refuses such input in training).
    at::Tensor var = s.m2 / std::max(s.count - 1.0, 1.0);
    real_mean.mul_(1.0 - factor).add_(s.mean.to(real_mean.options()), factor);
    real_var.mul_(1.0 - factor).add_(var.to(real_var.options()), factor);
  }
}

DeferredStatisticsScope::DeferredStatisticsScope()
    : handle_(at::addThreadLocalCallback(
          at::RecordFunctionCallback(&on_op, &on_op_end)
              .needsInputs(true)
              .scopes({at::RecordScope::FUNCTION}))) {}

DeferredStatisticsScope::~DeferredStatisticsScope() { at::removeCallback(handle_); }

DeferredBatchNormRun::DeferredBatchNormRun(
    const std::vector<std::shared_ptr<BatchNormLayers>>& partitions, bool on) {
  if (!on) return;
  for (const auto& batch_norms : partitions) {
    batch_norms->reset_statistics();
    redirects_.push_back(batch_norms->redirect());
  }
  // (Once every redirection is in place: a constructor that throws leaves nothing gathering.)
  for (size_t k = 0; k < partitions.size(); ++k) {
    if (redirects_[k].empty()) continue;  // no BatchNorm in training mode: nothing to watch
    gathering_.push_back(partitions[k]);  // (before the flag: the destructor clears what is here)
    partitions[k]->gathering_.store(true, std::memory_order_release);
  }
}

DeferredBatchNormRun::~DeferredBatchNormRun() {
  for (const auto& batch_norms : gathering_) {
    batch_norms->gathering_.store(false, std::memory_order_release);
  }
}

void commit_deferred(const std::vector<std::shared_ptr<BatchNormLayers>>& partitions,
                     const StatisticsCombiner& combine) {
  if (!combine) {
    for (const auto& batch_norms : partitions) batch_norms->commit();
    return;
  }
  std::vector<BatchNormStatistics> statistics;
  for (const auto& batch_norms : partitions) {
    for (BatchNormStatistics& s : batch_norms->statistics()) statistics.push_back(std::move(s));
  }
  const size_t layers = statistics.size();
  combine(statistics);
  TORCH_CHECK(statistics.size() == layers, "gpipe: the statistics combiner left ",
              statistics.size(), " entries of batch norm statistics; it must keep one per "
              "layer (", layers, ")");
  auto next = statistics.begin();
  for (const auto& batch_norms : partitions) {
    const std::vector<BatchNormStatistics> own(next, next + batch_norms->size());
    next += batch_norms->size();
    batch_norms->commit(&own);
  }
}

namespace internal {

int64_t sink_readings() { return readings.load(std::memory_order_relaxed); }

}  // namespace internal
}  // namespace gpipe
