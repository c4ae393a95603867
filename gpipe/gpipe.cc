// GPipe; see gpipe.h.
#include "gpipe/gpipe.h"

#include <ostream>

#include <c10/util/irange.h>
#include <torch/cuda.h>

#include "absl/strings/str_join.h"
#include "gpipe/batchnorm.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"
#include "gpipe/pipeline.h"
#include "gpipe/skip_tracker.h"
#include "gpipe/stream.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace {

const char* checkpoint_name(Checkpoint mode) {
  switch (mode) {
    case Checkpoint::kAlways:
      return "always";
    case Checkpoint::kExceptLast:
      return "except_last";
    case Checkpoint::kNever:
      return "never";
  }
  return "?";
}

// `cuda` means the current CUDA device; the CPU has no index.
c10::Device normalize(const c10::Device& device) {
  if (device.is_cuda() && !device.has_index()) {
    TORCH_CHECK(torch::cuda::is_available(), "GPipe was given device ", device,
                ", but CUDA is not available");
    return c10::Device(c10::kCUDA, 0);
  }
  if (device.is_cpu()) {
    return c10::Device(c10::kCPU);
  }
  return device;
}

std::vector<c10::Device> choose_devices(const std::vector<c10::Device>& given, size_t partitions) {
  std::vector<c10::Device> devices;
  if (given.empty()) {
    if (torch::cuda::is_available()) {
      for (const auto i : c10::irange(torch::cuda::device_count())) {
        devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
      }
    } else {
      devices.assign(partitions, c10::Device(c10::kCPU));
    }
  } else {
    for (const c10::Device& d : given) {
      devices.push_back(normalize(d));
    }
  }
  return devices;
}

int64_t checkpoint_stop(Checkpoint mode, int64_t chunks) {
  switch (mode) {
    case Checkpoint::kAlways:
      return chunks;
    case Checkpoint::kExceptLast:
      return chunks - 1;
    case Checkpoint::kNever:
      return 0;
  }
  return 0;
}

}  // namespace

GPipeImpl::GPipeImpl(torch::nn::Sequential module, GPipeOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(module, "GPipe needs a Sequential, but the given one is empty (null)");
  TORCH_CHECK(options_.chunks() > 0, "GPipe chunks must be a positive number of micro-batches, "
              "got ", options_.chunks());
  verify_module(module);
  verify_skippables(module);
  std::vector<c10::Device> devices = choose_devices(options_.devices(), options_.balance().size());
  verify_balance(options_.balance(), static_cast<int64_t>(module->size()), devices.size());
  devices_.assign(devices.begin(), devices.begin() + options_.balance().size());
  partitions_ = split_module(module, options_.balance(), devices_);
  skip_layout_ = SkipLayout(partitions_);
  partition_list_ = register_module("partitions", torch::nn::ModuleList());
  for (const auto& partition : partitions_) {
    partition_list_->push_back(partition);
  }
  if (options_.deferred_batch_norm()) {
    deferred_batch_norm_ = std::make_unique<DeferredBatchNorm>(modules(/*include_self=*/false));
  }
  workers_ = std::make_unique<WorkerPool>(devices_, options_.worker_per_partition());
  if (options_.worker_per_partition() && options_.checkpoint() != Checkpoint::kNever) {
    for (size_t j = 1; j < devices_.size(); ++j) {
      if (devices_[j].is_cpu() && devices_[j - 1].is_cpu()) {
        TORCH_WARN_ONCE(
            "GPipe: worker_per_partition runs CPU partitions at the same time, so layers that draw "
            "random numbers from the CPU generator (dropout) draw them in an order that depends on "
            "thread timing, and a checkpointed micro-batch may recompute different numbers than "
            "its first forward drew. Use it for deterministic layers, or with Checkpoint::kNever.");
        break;
      }
    }
  }
  copy_streams_.resize(devices_.size());
}

GPipeImpl::~GPipeImpl() = default;

size_t GPipeImpl::size() const {
  size_t total = 0;
  for (const auto& p : partitions_) {
    total += p->size();
  }
  return total;
}

at::Tensor GPipeImpl::forward(const at::Tensor& input) {
  std::vector<at::Tensor> out;
  bool atomic = true;
  forward_batches({input}, /*atomic=*/true, out, atomic);
  TORCH_CHECK(atomic, "GPipe: the last layer returned ", out.size(), " tensors; call "
              "forward(std::vector<at::Tensor>) to get them all");
  return out[0];
}

std::vector<at::Tensor> GPipeImpl::forward(const std::vector<at::Tensor>& input) {
  std::vector<at::Tensor> out;
  bool atomic = false;
  forward_batches(input, /*atomic=*/false, out, atomic);
  return out;
}

void GPipeImpl::forward_batches(std::vector<at::Tensor> values, bool atomic,
                                std::vector<at::Tensor>& out, bool& out_atomic) {
  Batch input = atomic ? Batch(std::move(values[0])) : Batch(std::move(values));
  check_input(input);
  if (partitions_.empty()) {
    out = input.values();
    out_atomic = input.atomic();
    return;
  }
  for (const auto k : c10::irange(input.size())) {
    TORCH_CHECK(input[k].device() == devices_.front(), "GPipe input tensor ", k, " is on ",
                input[k].device(), ", but the first partition is on ", devices_.front(),
                "; move the input there first, e.g. x.to(model->devices().front())");
  }
  std::vector<Batch> batches = scatter(input, options_.chunks());
  const int64_t m = static_cast<int64_t>(batches.size());

  PipelineSpec spec;
  spec.devices = devices_;
  for (const auto j : c10::irange(devices_.size())) {
    spec.stages.emplace_back(
        [partition = partitions_[j]](const Batch& b) { return run_partition(partition, b); });
    spec.compute_streams.push_back(current_stream(devices_[j]));
    while (static_cast<int64_t>(copy_streams_[j].size()) < m) {
      copy_streams_[j].push_back(new_stream(devices_[j]));
    }
  }
  spec.copy_streams = &copy_streams_;
  const bool checkpointing = is_training() && at::GradMode::is_enabled();
  spec.checkpoint_stop =
      checkpointing ? checkpoint_stop(options_.checkpoint(), options_.chunks()) : 0;
  spec.workers = workers_.get();
  spec.skip_layout = &skip_layout_;
  spec.run = next_run_id();
  std::unique_ptr<Timeline> timeline;
  if (options_.record_timeline()) {
    timeline = std::make_unique<Timeline>();
    spec.timeline = timeline.get();
  }

  std::unique_ptr<DeferredBatchNorm::TrackingScope> tracking;
  if (deferred_batch_norm_) {
    deferred_batch_norm_->set_training(is_training());
    if (is_training()) {
      tracking = deferred_batch_norm_->track();
    }
  }
  run_pipeline(spec, batches);
  if (timeline) {
    last_timeline_ = timeline->events();
  }
  if (tracking) {
    tracking.reset();
    deferred_batch_norm_->commit();
  }
  Batch result = gather(batches);
  out_atomic = result.atomic();
  out = std::move(result.values());
}

void GPipeImpl::pretty_print(std::ostream& stream) const {
  stream << "gpipe::GPipe(balance={" << absl::StrJoin(options_.balance(), ", ") << "}, devices={"
         << absl::StrJoin(devices_, ", ",
                          [](std::string* s, const c10::Device& d) { s->append(d.str()); })
         << "}, chunks=" << options_.chunks()
         << ", checkpoint=" << checkpoint_name(options_.checkpoint())
         << (options_.deferred_batch_norm() ? ", deferred_batch_norm=true" : "") << ")";
}

void GPipeImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool /*non_blocking*/) {
  TORCH_CHECK(false, "GPipe refuses to move its parameters and buffers to ", device,
              ": it places each partition on its own device (",
              absl::StrJoin(devices_, ", ", [](std::string* s, const c10::Device& d) {
                s->append(d.str());
              }),
              "); choose devices with GPipeOptions::devices. Changing only the dtype, "
              "to(torch::kFloat64), is allowed");
}

void GPipeImpl::to(torch::Device device, bool non_blocking) {
  to(device, torch::kFloat32, non_blocking);
}

void GPipeImpl::to(torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(dtype, non_blocking);
}

}  // namespace gpipe
