// GPipe; see gpipe.h.
#include "gpipe/gpipe.h"

#include <algorithm>
#include <numeric>
#include <ostream>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/irange.h>
#include <torch/cuda.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/batchnorm.h"
#include "gpipe/device.h"
#include "gpipe/internal/executor.h"
#include "gpipe/microbatch.h"
#include "gpipe/internal/partition.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/internal/link.h"
#include "gpipe/schedule.h"
#include "gpipe/internal/stage_backward.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/internal/stream.h"
#include "gpipe/thread_state.h"
#include "gpipe/trace.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace {

// `cuda` means the current CUDA device, as everywhere in LibTorch; the CPU has no index. The
// device is available (check_device_available).
c10::Device normalize(const c10::Device& device) {
  if (device.is_cuda() && !device.has_index()) {
    return c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
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
    for (size_t j = 0; j < given.size(); ++j) {
      // Devices past the partitions are not used (GPipe takes the first ones).
      if (j < partitions) {
        check_device_available(given[j], absl::StrCat("GPipe: partition ", j));
      }
      devices.push_back(j < partitions ? normalize(given[j]) : given[j]);
    }
  }
  return devices;
}

// forward()'s lanes (Note [forward() on the executor]): each partition's forwards in clock-cycle
// order, on its thread in `pool` (Note [Workers and the calling thread]); `workers` gets each
// lane's thread (null: the caller's).
std::vector<std::vector<Action>> forward_lanes(int64_t m, WorkerPool& pool, size_t partitions,
                                               std::vector<Worker*>& workers) {
  std::vector<size_t> lane_of(partitions);
  workers.clear();
  for (size_t j = 0; j < partitions; ++j) {
    Worker* worker = pool.runs_inline(j) ? nullptr : &pool.for_partition(j);
    lane_of[j] = std::find(workers.begin(), workers.end(), worker) - workers.begin();
    if (lane_of[j] == workers.size()) workers.push_back(worker);
  }
  std::vector<std::vector<Action>> lanes(workers.size());
  for (const std::vector<Task2D>& tick : clock_cycles(m, static_cast<int64_t>(partitions))) {
    for (const Task2D& task : tick) {
      lanes[lane_of[task.partition]].push_back(
          Action{ActionType::kForward, task.partition, task.microbatch});
    }
  }
  return lanes;
}

}  // namespace

GPipeImpl::GPipeImpl(torch::nn::Sequential module, GPipeOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(module, "GPipe needs a Sequential, but the given one is empty (null)");
  std::vector<c10::Device> devices = choose_devices(options_.devices(), options_.balance().size());
  internal::check_shared_options(options_, module, devices.size(), "GPipe");
  devices_.assign(devices.begin(), devices.begin() + options_.balance().size());
  // Note [Tied parameters]: a tensor shared across devices becomes a clone's copy.
  ties_ = find_ties(module, options_.tied_parameters(), "GPipe");
  partitions_ = internal::split_module(
      clone_across_devices(module, internal::layer_devices(options_.balance(), devices_), "GPipe"),
      options_.balance(), devices_);
  tied_ = std::make_shared<TiedCopies>(ties_, partitions_);
  skip_layout_ = SkipLayout(partitions_);
  partition_list_ = register_module("partitions", torch::nn::ModuleList());
  for (const auto& partition : partitions_) {
    partition_list_->push_back(partition);
  }
  for (const auto& partition : partitions_) {
    batch_norms_.push_back(
        std::make_shared<BatchNormLayers>(partition->modules(/*include_self=*/false)));
    grad_records_.push_back(std::make_shared<GradRecord>());
  }
  const std::optional<bool> chosen = internal::PartitionThreads::chosen(options_);
  const std::optional<bool> stage_local = internal::PartitionThreads::chosen_stage_local(options_);
  bool all_cpu = true;
  for (const c10::Device& device : devices_) all_cpu &= device.is_cpu();
  if (stage_local.value_or(false)) {
    for (size_t j = 0; j < devices_.size(); ++j) {
      TORCH_CHECK(devices_[j].is_cpu(), "GPipe stage_local_backward is for CPU partitions, but "
                  "partition ", j, " is on ", devices_[j], " (CUDA partitions already run their "
                  "backward on the autograd engine's device threads)");
    }
    TORCH_CHECK(chosen.value_or(true), "GPipe stage_local_backward runs each partition's "
                "backward on the partition's own thread, but worker_per_partition(false) gives "
                "the partitions one thread; remove worker_per_partition(false)");
  }
  // forward()'s threads, and stage-local backward's (Note [Threads of forward()] in worker.h).
  own_threads_ = internal::own_threads_for_forward(partitions_, devices_, chosen,
                                                   stage_local.value_or(false));
  // Where every partition is on the CPU with a thread of its own, each runs its backward there
  // (Note [Stage-local backward in one process]).
  stage_local_ = stage_local.value_or(own_threads_ && all_cpu && partitions_.size() > 1);
  workers_ = WorkerPool::make_shared(devices_, own_threads_);
  if (own_threads_) {
    // Each partition on a thread of its own (Note [Random numbers in concurrent partitions]).
    std::vector<int64_t> threads(partitions_.size());
    std::iota(threads.begin(), threads.end(), int64_t{0});
    internal::check_concurrent_generators(
        "GPipe", partitions_, devices_, threads,
        checkpoint_stop(options_.checkpoint(), options_.chunks()) > 0);
  }
  // step()'s schedule (Note [One schedule option]).
  check_schedule_option(options_.schedule(), static_cast<int64_t>(partitions_.size()),
                        options_.chunks(), "gpipe::GPipe");
  record_timeline_ = options_.initially_records_timeline();
  for (const auto j : c10::irange(partitions_.size())) {
    internal::ExecutorPartition p;
    p.layers = partitions_[j];
    p.device = devices_[j];
    p.batch_norms = batch_norms_[j];
    p.grad_record = grad_records_[j];
    step_partitions_.push_back(std::move(p));
  }
  // Every stream a forward needs exists before the first forward (Note [Copy streams]): forwards
  // share them read-only.
  copy_streams_.resize(devices_.size());
  for (const auto j : c10::irange(devices_.size())) {
    for (int64_t i = 0; i < options_.chunks(); ++i) {
      copy_streams_[j].push_back(internal::new_stream(devices_[j]));
    }
  }
}

std::vector<TimelineEvent> GPipeImpl::last_timeline() const {
  absl::MutexLock lock(&forward_mu_);
  return last_timeline_ ? last_timeline_->events() : std::vector<TimelineEvent>{};
}

namespace {

std::vector<TimelineEvent> recorded(const GPipeImpl& model, const char* what) {
  std::vector<TimelineEvent> events = model.last_timeline();
  TORCH_CHECK(!events.empty(), "GPipe::", what, ": no timeline was recorded; call "
              "model->record_timeline(true) and run a forward or a step first");
  return events;
}

}  // namespace

void GPipeImpl::write_chrome_trace(const std::string& path) const {
  write_file(path, chrome_trace_json(recorded(*this, "write_chrome_trace"), devices_));
}

void GPipeImpl::write_timeline_svg(const std::string& path) const {
  write_file(path, timeline_svg(recorded(*this, "write_timeline_svg"), devices_));
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
  absl::MutexLock lock(&forward_mu_);
  tied_->refresh();
  const bool grad_enabled = at::GradMode::is_enabled();
  const bool checkpointing = is_training() && grad_enabled;
  const int64_t stop =
      checkpointing ? checkpoint_stop(options_.checkpoint(), options_.chunks()) : 0;
  internal::ExecutorSpec spec;
  const std::vector<std::vector<Action>> lanes =
      forward_lanes(m, *workers_, partitions_.size(), spec.workers);
  internal::InputSource source(std::move(batches), grad_enabled, /*keep_graph=*/true);
  internal::OutputSink sink;
  spec.who = "gpipe::GPipe::forward";
  spec.partitions = &step_partitions_;
  spec.plan = [&lanes](int64_t) { return lanes; };
  spec.upstream = &source;
  spec.downstream = &sink;
  spec.microbatches = m;
  spec.grad_enabled = grad_enabled;
  spec.checkpoint_stop = [stop](int64_t) { return stop; };
  spec.run = internal::next_run_id();
  if (stop > 0) {
    // The caller's thread state, in which no deferred-statistics callback is ever added: the
    // recomputation observes no operator (Note [Deferred batch norm without replacing modules]).
    spec.recompute_state = std::make_shared<const ThreadState>();
  }
  if (record_timeline_) spec.timeline = std::make_shared<Timeline>(devices_);
  spec.skip_layout = &skip_layout_;
  spec.copy_streams = &copy_streams_;
  spec.keep_graph = true;
  // Not for an input with a history (a layer before the GPipe): each partition's backward of
  // each micro-batch would run into that graph once per micro-batch, and it can be run only once.
  // Such a forward keeps the one graph (Note [Stage-local backward in one process]).
  bool input_has_history = false;
  for (const at::Tensor& t : input.values()) {
    input_has_history |= t.defined() && t.grad_fn() != nullptr;
  }
  if (stage_local_ && checkpointing && devices_.size() > 1 && !input_has_history) {
    spec.stage_backward = std::make_shared<internal::StageBackward>(
        workers_, static_cast<int64_t>(partitions_.size()));
  }

  const bool deferred = options_.deferred_batch_norm() && is_training();
  {
    const DeferredBatchNormRun deferred_run(batch_norms_, deferred);
    internal::run_schedule(spec);
  }
  batches = sink.take();
  if (spec.stage_backward) {
    // The last partition's backward too runs on its worker, not on the thread that calls
    // backward(), which runs the first partition's (Note [Stage-local backward in one process]).
    for (int64_t i = 0; i < m; ++i) {
      spec.stage_backward->hand_off(batches[i], devices_.size() - 1, i, /*last=*/true);
    }
  }
  if (deferred) commit_deferred(batch_norms_, statistics_combiner_);
  last_timeline_ = spec.timeline;
  Batch result = gather(batches);
  out_atomic = result.atomic();
  out = std::move(result.values());
  if (tied_->has_copies()) {
    // The copies' gradients join their owners' once this output's backward is done.
    for (const at::Tensor& t : out) {
      if (t.defined() && t.requires_grad()) {
        t.register_hook(
            [tied = tied_](const at::Tensor&) { sum_tied_gradients_after_backward(tied); });
        break;
      }
    }
  }
}

std::vector<at::Tensor> GPipeImpl::parameters(bool recurse) const {
  return named_parameters(recurse).values();
}

torch::OrderedDict<std::string, at::Tensor> GPipeImpl::named_parameters(bool recurse) const {
  return unique_parameters(torch::nn::Module::named_parameters(recurse), tied_.get());
}

void GPipeImpl::set_statistics_combiner(StatisticsCombiner combine) {
  statistics_combiner_ = std::move(combine);
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
