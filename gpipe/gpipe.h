// GPipe: wraps a torch::nn::Sequential so that it trains as the same model would, pipelined over
// devices: the mini-batch is split into micro-batches, each partition of layers lives on its own
// device, and the partitions work on different micro-batches at the same time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/batchnorm.h"
#include "gpipe/checkpoint.h"
#include "gpipe/loss.h"
#include "gpipe/pipeline_options.h"
#include "gpipe/schedule.h"
#include "gpipe/schedule_option.h"
#include "gpipe/skip_layout.h"
#include "gpipe/skippable.h"
#include "gpipe/tied_parameters.h"
#include "gpipe/timeline.h"

namespace gpipe {

class Worker;
class WorkerPool;
namespace internal {
struct ExecutorPartition;
struct PartitionThreads;
}  // namespace internal

/// Options of a GPipe.
///
///   gpipe::GPipeOptions({2, 3})
///       .devices({torch::kCPU, torch::kCPU})
///       .chunks(8)
///       .checkpoint(gpipe::Checkpoint::kExceptLast)
///       .deferred_batch_norm(true);
struct GPipeOptions : PipelineOptions<GPipeOptions> {
  /// `balance[j]` is the number of consecutive layers in partition j.
  /* implicit */ GPipeOptions(std::vector<int64_t> balance) : PipelineOptions(std::move(balance)) {}

  // balance, chunks, checkpoint, deferred_batch_norm, tied_parameters and schedule: the options a
  // GPipe shares with a PipelineStage (pipeline_options.h). forward() always runs GPipe's
  // schedule; step() runs schedule().

  /// One device per partition (repeats allowed). Empty (the default) means every CUDA device
  /// when CUDA is available, else the CPU for every partition. Extra devices are ignored.
  TORCH_ARG(std::vector<c10::Device>, devices) = {};
 public:
  /// Deprecated: a schedule written as text; use schedule(PipelineSchedule::text(text)).
  [[deprecated("use schedule(gpipe::PipelineSchedule::text(text))")]]
  GPipeOptions& schedule_text(std::string text) {
    schedule_.set_text(std::move(text));
    return *this;
  }
  /// Deprecated: forward()'s threads are the engine's decision (Note [Threads of forward()] in
  /// worker.h: every CPU partition its own where that cannot change a result). This overrides
  /// the decision: true gives every partition a thread, false gives a device's partitions one.
  [[deprecated("forward()'s threads are the engine's decision (Note [Threads of forward()] in "
               "gpipe/worker.h); remove the call, or keep random layers off concurrent CPU "
               "partitions")]]
  GPipeOptions& worker_per_partition(bool own) {
    partition_threads_ = own;
    return *this;
  }
  /// Deprecated: whether each CPU partition runs its own backward on its thread is the engine's
  /// decision (Note [Stage-local backward in one process]: where every partition is on the CPU
  /// with a thread of its own, and exact for every backward). This overrides the decision.
  [[deprecated("stage-local backward is the engine's decision (Note [Stage-local backward in "
               "one process] in gpipe/internal/stage_backward.h); remove the call")]]
  GPipeOptions& stage_local_backward(bool on) {
    stage_local_ = on;
    return *this;
  }

 private:
  friend struct internal::PartitionThreads;
  std::optional<bool> partition_threads_;  // the override; none: the engine decides
  std::optional<bool> stage_local_;  // the override; none: the engine decides
};

/// Pipeline-parallel wrapper of a Sequential. Construct it through the GPipe holder:
///
///   torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
///   gpipe::GPipe model(seq, gpipe::GPipeOptions({2, 1}).chunks(4));
///   torch::Tensor y = model->forward(x);  // x on model->devices().front()
///   y.sum().backward();                   // y on model->devices().back()
///
/// The layers are the user's own module objects, placed on the partitions' devices. Parameters,
/// train()/eval(), named_parameters() (as "partitions.<j>.<layer name>.<param>") and
/// `torch::save` and `torch::load` work as for any module. Moving a GPipe to another device is
/// refused: it owns the placement. Changing the dtype is allowed.
///
/// Threads: forward may be called from several threads at once; the forwards of one GPipe are
/// serialised by a lock (one mini-batch at a time goes through the pipeline, which already keeps
/// every device busy), while backward passes and forwards of other GPipes run concurrently.
class GPipeImpl : public torch::nn::Module {
 public:
  /// Splits `module` by options.balance() onto options.devices() (each layer moved to its
  /// partition's device); throws c10::Error naming a wrong option.
  GPipeImpl(torch::nn::Sequential module, GPipeOptions options);
  ~GPipeImpl() override;

  /// Runs a mini-batch through the pipeline. `input` must be on devices().front(); the result is
  /// on devices().back(). Thread-safe: concurrent calls run one after another.
  at::Tensor forward(const at::Tensor& input);

  /// Runs a tuple mini-batch (several tensors split alike along dimension 0). The layers must
  /// take and return std::vector<at::Tensor> (the last one may return one tensor, in which case
  /// the result has one element).
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& input);

  /// One training step in the schedule of GPipeOptions::schedule: the forwards, the loss and the
  /// backwards of every micro-batch, interleaved as the schedule says, each partition's backward
  /// on its own thread. Returns the mini-batch's loss (without history); the parameters'
  /// gradients are the plain model's for the same loss (Note [Losses over micro-batches]: with
  /// the GPipe schedule `loss` sees the whole mini-batch, with the others each micro-batch,
  /// weighted by its share of what the loss averages over: its samples, or what the Loss's count
  /// counts, such as tokens that are not padding). `input` on devices().front(), `target` (one
  /// row per sample) on
  /// devices().back(). Under torch::NoGradGuard it runs the forwards only and returns the loss.
  ///
  ///   gpipe::GPipe model(seq, gpipe::GPipeOptions({2, 2}).chunks(8)
  ///                               .schedule(gpipe::ScheduleKind::k1F1B));
  ///   at::Tensor loss = model->step(x, y, [](const gpipe::Batch& out, const at::Tensor& y) {
  ///     return torch::nn::functional::cross_entropy(out.tensor(), y);
  ///   });
  ///   optimizer.step();
  at::Tensor step(const at::Tensor& input, const at::Tensor& target, const Loss& loss);
  /// The same for a tuple mini-batch.
  at::Tensor step(const Batch& input, const at::Tensor& target, const Loss& loss);
  /// The schedule step() runs for `microbatches` micro-batches.
  Schedule schedule(int64_t microbatches) const;

  /// The options it was made with.
  const GPipeOptions& options() const { return options_; }
  /// Layers per partition.
  const std::vector<int64_t>& balance() const { return options_.balance(); }
  /// The device of each partition.
  const std::vector<c10::Device>& devices() const { return devices_; }
  /// The number of micro-batches.
  int64_t chunks() const { return options_.chunks(); }
  /// The checkpoint mode.
  Checkpoint checkpoint() const { return options_.checkpoint(); }
  /// The partitions, each a Sequential of the user's layers on its device.
  const std::vector<torch::nn::Sequential>& partitions() const { return partitions_; }
  /// The total number of layers.
  size_t size() const;
  /// Switches recording on or off for the next forwards and steps: each then records its tasks
  /// and copies (see last_timeline()), with their device times on CUDA devices; each CUDA device
  /// is synchronised once at the start of a forward to align its clock with the host's (Note
  /// [Device times] in timeline.cc). Off by default.
  ///
  ///   model->record_timeline(true);
  void record_timeline(bool on = true) { record_timeline_ = on; }
  /// Whether forwards and steps record their timelines.
  bool is_recording_timeline() const { return record_timeline_; }
  /// What the last forward or step did, when recording (else empty), and the
  /// recomputations and checkpointed backward of its backward so far. Draw it with
  /// gpipe::render_timeline, or write it out with write_chrome_trace / write_timeline_svg. On
  /// CUDA it waits until the devices have run the recorded work, to read its device times.
  std::vector<TimelineEvent> last_timeline() const;

  /// Writes last_timeline() as a Chrome trace (JSON; open it in https://ui.perfetto.dev or
  /// chrome://tracing): one track per partition, named after its device, and on CUDA a second
  /// process with the same tracks in device time. Call it after the
  /// backward to see the recomputations too. Throws c10::Error when nothing was recorded or the
  /// file cannot be written.
  ///
  ///   gpipe::GPipe model(seq, gpipe::GPipeOptions({2, 2}).chunks(8));
  ///   model->record_timeline(true);
  ///   model->forward(x).sum().backward();
  ///   model->write_chrome_trace("/tmp/step.json");
  void write_chrome_trace(const std::string& path) const;

  /// Writes last_timeline() as an SVG picture (see gpipe::timeline_svg). Same errors.
  void write_timeline_svg(const std::string& path) const;
  /// Whether forward() runs each partition on a thread of its own, decided at construction (Note
  /// [Threads of forward()] in worker.h); else a device's partitions share one.
  bool partitions_on_own_threads() const { return own_threads_; }
  /// Whether the backward of a training forward() may run each partition's part on the
  /// partition's own thread, decided at construction: where every partition is on the CPU with a
  /// thread of its own (Note [Stage-local backward in one process]). A plain backward() does so
  /// where the graph allows it; grad, inputs and create_graph run as the one graph. Gradients are
  /// the same either way.
  bool stage_local_backward() const { return stage_local_; }
  /// Where the model's skip connections run between partitions.
  const SkipLayout& skip_layout() const { return skip_layout_; }

  /// Prints e.g. "gpipe::GPipe(balance={2, 3}, devices={cpu, cpu}, chunks=8,
  /// checkpoint=except_last)" followed by the partitions when printed with `std::cout << *model`.
  void pretty_print(std::ostream& stream) const override;

  /// The parameters, each once: a tied parameter under its first place's name, its copies on
  /// other devices not at all (Note [Tied parameters]). Give these to an optimizer. (They hide
  /// torch::nn::Module's, which, through a Module&, list every place and copy.)
  std::vector<at::Tensor> parameters(bool recurse = true) const;
  /// parameters() with their names ("partitions.<j>.<layer name>.<param>").
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const;
  /// The ties of the model (found and named), in the order of their first place.
  const std::vector<Tie>& ties() const { return ties_; }
  /// Whether a tie has a copy on another device (or a second tensor named as tied).
  bool has_tied_copies() const { return tied_ && tied_->has_copies(); }

  /// Refused: a GPipe decides where its partitions live (see GPipeOptions::devices).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  /// Refused: a GPipe decides where its partitions live (see GPipeOptions::devices).
  void to(torch::Device device, bool non_blocking = false) override;
  /// With deferred batch norm: `combine` sees each training forward's statistics (one entry per
  /// BatchNorm layer, partitions in order) before the running statistics are updated from them,
  /// and may change them, e.g. merge them with other replicas' (gpipe::distributed::DataParallel
  /// does). Null: none (the default). Not thread-safe with a running forward.
  void set_statistics_combiner(StatisticsCombiner combine);
  /// The combiner set by set_statistics_combiner (null if none).
  const StatisticsCombiner& statistics_combiner() const { return statistics_combiner_; }

  /// Converts every parameter and buffer to `dtype`, on its partition's device.
  void to(torch::Dtype dtype, bool non_blocking = false) override;

 private:
  struct Prepared;
  void forward_batches(std::vector<at::Tensor> values, bool atomic, std::vector<at::Tensor>& out,
                       bool& out_atomic);
  // schedule(microbatches) for a mini-batch of `samples`, with an error that says why a short
  // one splits into fewer micro-batches than chunks.
  Schedule schedule_of_batch(int64_t samples, int64_t microbatches, const char* who) const;

  GPipeOptions options_;
  std::vector<c10::Device> devices_;
  std::vector<torch::nn::Sequential> partitions_;
  torch::nn::ModuleList partition_list_;
  std::shared_ptr<WorkerPool> workers_;  // shared with stage-local backwards in flight
  bool own_threads_ = false;             // partitions_on_own_threads()
  bool stage_local_ = false;             // Note [Stage-local backward in one process]
  // Per partition: its BatchNorm layers (shared with the autograd graphs of checkpointed
  // micro-batches, which may outlive this GPipe) and its GradRecord.
  std::vector<std::shared_ptr<BatchNormLayers>> batch_norms_;
  std::vector<std::shared_ptr<GradRecord>> grad_records_;
  StatisticsCombiner statistics_combiner_;
  // copy_streams_[j][i]: partition j's copy stream for micro-batch i, made at construction.
  std::vector<std::vector<c10::Stream>> copy_streams_;
  // Whether step() checked its lanes' random generators (Note [Random numbers in concurrent
  // partitions] in internal/partition.h); once, at the first step that can checkpoint.
  bool generators_checked_ ABSL_GUARDED_BY(forward_mu_) = false;
  SkipLayout skip_layout_;
  // The model's ties and this GPipe's copies of them (Note [Tied parameters]).
  std::vector<Tie> ties_;
  std::shared_ptr<TiedCopies> tied_;
  // step()'s partitions and lanes' threads (rank 0 runs on the caller).
  std::vector<internal::ExecutorPartition> step_partitions_;
  std::vector<std::unique_ptr<Worker>> lane_workers_;
  // Whether forwards and steps record their timelines (record_timeline()).
  std::atomic<bool> record_timeline_{false};
  // Serialises forwards (see the class comment).
  mutable absl::Mutex forward_mu_;
  // The last forward's timeline (it goes on filling during backward), or null.
  std::shared_ptr<Timeline> last_timeline_ ABSL_GUARDED_BY(forward_mu_);
};

/// A GPipe: a module holder of GPipeImpl (see there).
TORCH_MODULE(GPipe);

}  // namespace gpipe
