// A stage of a pipeline that spans processes: this process's contiguous range of a Sequential's
// layers (interleaved: several ranges, its virtual stages), trained in GPipe's schedule (or 1F1B,
// zero bubble, interleaved) with the stages before and after it in other processes, activations
// and gradients passing between them on c10d.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/batchnorm.h"
#include "gpipe/checkpoint.h"
#include "gpipe/distributed/process_group.h"
#include "gpipe/loss.h"
#include "gpipe/schedule.h"
#include "gpipe/schedule_option.h"
#include "gpipe/gpipe.h"
#include "gpipe/microbatch.h"
#include "gpipe/skip_layout.h"
#include "gpipe/tied_parameters.h"
#include "gpipe/timeline.h"
#include "gpipe/worker.h"

namespace gpipe {
class Worker;
namespace internal {
struct ExecutorPartition;
class InputSource;
}  // namespace internal
namespace distributed {
namespace internal {
class Cancellation;  // internal/fault.h
class FaultChannel;
class TiedStages;   // internal/tied_stages.h
class SharedLinks;  // internal/shared_memory.h
}  // namespace internal

// Note [Stage-local backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In one process, a GPipe's backward is one call of the autograd engine over every micro-batch
// and partition, ordered by the edges the pipeline added (Note [Backward order]). Across processes
// there is no shared graph: each stage keeps the graph of each micro-batch it ran, from the leaves
// it received (or the input, on the first stage) to its outputs, and runs that graph's backward
// itself, one engine call per micro-batch, as soon as the gradient of the micro-batch's outputs
// arrives from the next stage (the last stage makes them from the loss). The gradients of the
// received leaves then go to the previous stage. So stage s computes micro-batch i's backward
// while stage s+1 computes micro-batch i-1's: stages overlap in backward as they do in forward,
// and the order on each stage is GPipe's (the micro-batches in reverse), set by the order of the
// calls rather than by edges. No micro-batch's graph reaches another's, so each engine call runs
// exactly its micro-batch's nodes. Checkpointed micro-batches are recomputed inside their call.
//
// The last stage gathers the micro-batches' outputs into one batch, through leaves that stand
// for them, and applies the loss function to the whole mini-batch, as a user of a GPipe does: the
// loss, its reduction and its gradients are the plain model's. One backward through the loss
// gives every micro-batch's output gradient; the micro-batches' own backwards follow.
// With another schedule (PipelineStageOptions::schedule: 1F1B, zero bubble), each stage runs its
// forwards and backwards in that schedule's order on the same executor (Note [One executor] in
// gpipe/internal/executor.h), and the last stage applies the loss to each micro-batch as its output
// arrives (Note [Losses over micro-batches] in gpipe/loss.h).

/// A loss function of the last stage (gpipe::LossFunction): with the GPipe schedule it sees the
/// whole mini-batch's output, with the others each micro-batch's (Note [Losses over
/// micro-batches] in gpipe/loss.h).
using LossFunction = gpipe::LossFunction;
/// A loss function with what it averages over (gpipe::Loss, gpipe/loss.h).
using Loss = gpipe::Loss;

/// The input of every stage but the first: none (their activations come from the stage before).
inline Batch no_input() { return Batch(std::vector<at::Tensor>{}); }

// Note [Partitions within a stage]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage may split its layers into several partitions on this process's devices
// (PipelineStageOptions::local_balance and devices). Each partition then works as a stage
// of its own would, on a thread of its own: it runs every micro-batch's forward in order, then
// each micro-batch's backward in reverse as soon as the gradients of its outputs arrive
// (Note [Stage-local backward]); only the hop to its neighbour is a LocalLink
// (gpipe/internal/link.h) instead of c10d. With a schedule other than GPipe's, every partition of
// the stage runs the stage's actions in the schedule's order.
// What crosses a link is cut from the sender's graph: the receiver gets each tensor detached
// (moved to its device), as a leaf that requires grad where the sender's tensor did, and sends
// the leaves' gradients back. So every micro-batch's graph on a partition is its own, and each
// partition's backward is an engine call on its own thread: partitions overlap in backward as in
// forward, on CPU cores as on GPUs. The first partition runs on the thread that called step();
// the others on workers of the stage.
//
// A skip stashed in partition a and popped in a later partition b of the same stage goes through
// the skip tracker that the partitions share for each micro-batch (as a GPipe's do: Note [Skips
// and checkpointing] in gpipe/internal/skip_tracker.h), which moves it to b's device; then it is
// cut the same way (MicroBatchSkips::cut): b pops a detached leaf, and after b's backward of the
// micro-batch the leaf's gradient waits for a, whose backward starts from its outputs and from the
// stashed tensors together — one engine call, so that a checkpointed stash's recomputation gets
// both gradients at once. a's backward of a micro-batch always follows b's (the gradients pass
// through the partitions in between), so the skips' gradients are there when a needs them.
//
// A link fails when either side fails: the other side's next wait then throws, naming the
// partition, instead of waiting for a micro-batch that never comes.

// Note [Interleaving across processes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under the interleaved schedule (Megatron-LM's), the model is cut into n * v virtual stages and
// the process of stage s holds virtual stages s, s + n, s + 2n, ...: each is a partition of the
// stage, and all of them run on the thread that calls step(), in the order of the schedule's rank
// s (one lane of the executor, Note [One executor]). No two of a stage's partitions are
// neighbours, so each has links of its own: virtual stage k receives from k - 1 on stage
// (s - 1) mod n and sends to k + 1 on stage (s + 1) mod n — the last stage sends back to the
// first for the next chunk. A pair of stages then carries several links (two directions, one per
// chunk), told apart by a channel in their tags (transfer_tag: the sending virtual stage's chunk,
// k / n); so the schedule needs a group that matches transfers by tag (Gloo), where each link
// posts as 1F1B does (gradients' receives with their activations), and is refused on NCCL,
// whose in-order matching would need one order over all the links of a pair. Each virtual stage
// keeps the activations its schedule says (Note [Schedules as data] in gpipe/schedule.h); the
// bubble is GPipe's divided by v, at the price of v times as many transfers.
// The V-shaped schedules (Note [V-shaped placement] in gpipe/schedule.h) place by the same data
// (the schedule's stage_ranks): stage s holds virtual stages s and 2n - 1 - s, so a pair of
// neighbouring stages carries one link each way (channel 0 down the V, 1 back up), stage 0 holds
// both ends of the pipeline, and on stage n - 1 the V's two halves are neighbours, joined by a
// LocalLink in the process instead of a link across processes.

/// Options of a pipeline stage. Every process of a pipeline must pass the same ones.
struct PipelineStageOptions : PipelineOptions<PipelineStageOptions> {
  /// Layers per stage, one entry per process of the pipeline (rank order): stage s owns layers
  /// sum(balance[0 .. s)) .. sum(balance[0 .. s]) of the Sequential. With virtual stages, one
  /// entry per virtual stage (PipelineSchedule::interleaved).
  /* implicit */ PipelineStageOptions(std::vector<int64_t> balance)
      : PipelineOptions(std::move(balance)) {}

  // balance, chunks, checkpoint, deferred_batch_norm, tied_parameters and schedule: the options a
  // stage shares with a GPipe (pipeline_options.h), the same on every stage. Here, schedule() is
  // a kind (ScheduleKind::kGPipe, the default; k1F1B; kZeroBubble) or interleaved 1F1B with its
  // virtual stages per process (PipelineSchedule::interleaved(v, group)): the balance then has
  // one entry per virtual stage, n * v in all, and stage s runs virtual stages s, s + n, ... (Note
  // [Interleaving across processes]); chunks must be a multiple of n, and so must the
  // micro-batches each mini-batch splits into (a mini-batch of at least chunks samples); the
  // same for interleaved zero bubble (PipelineSchedule::interleaved_zero_bubble(v)). The V-shaped
  // kinds (kZeroBubbleV, kDualPipeV) take 2n entries too, stage s running s and 2n - 1 - s, any
  // chunks: stage 0 then takes the mini-batch and the target (is_last()). A schedule written as
  // text is GPipe's only.
  //
  //   // 2 processes, 8 layers: stage 0 runs layers 0-1 and 4-5, stage 1 layers 2-3 and 6-7.
  //   PipelineStageOptions({2, 2, 2, 2}).schedule(PipelineSchedule::interleaved(2)).chunks(4)
  //   // The V: stage 0 runs layers 0-1 and 6-7, stage 1 layers 2-5.
  //   PipelineStageOptions({2, 2, 2, 2}).schedule(ScheduleKind::kZeroBubbleV).chunks(4)
  // Batch norm: Note [Pipeline stages and batch norm]; ties across stages: Note [Ties across
  // stages] in internal/tied_stages.h.

  /// Where this stage's layers run: one device for the whole stage, or one per partition (entry
  /// of local_balance); empty (the default): the CPU. Tensors cross processes through the CPU
  /// with Gloo, from GPU to GPU with NCCL (Note [Point-to-point order] in process_group.h). May
  /// differ between stages.
  ///
  ///   PipelineStageOptions({3, 4}).devices({"cuda:0"})  // this stage on cuda:0
  TORCH_ARG(std::vector<c10::Device>, devices) = {};
  /// This stage's own split of its layers into partitions, one entry per partition, adding up to
  /// its entry of balance; empty: one partition. Each partition runs on a thread of its own and
  /// on its entry of devices (Note [Partitions within a stage]). Unlike the
  /// other options, it may differ between stages.
  ///
  ///   // Stage 1 of {3, 4}: layers 3-4 on cuda:0, layers 5-6 on cuda:1.
  ///   PipelineStageOptions({3, 4}).local_balance({2, 2}).devices({"cuda:0", "cuda:1"})
  TORCH_ARG(std::vector<int64_t>, local_balance);
  /// The bytes of each ring of shared memory between this stage and a neighbour in another
  /// process on the same host (one ring per direction of each link, a memfd), through which
  /// the computing threads pass activations and gradients themselves instead of over the process
  /// group (Note [Shared memory between stages on one host] in internal/shared_memory.h); 0: every
  /// link over the process group. Used with Gloo only. A micro-batch larger than half a ring, or
  /// one that finds the ring full, goes over the process group. The same on every stage.
  TORCH_ARG(int64_t, shared_memory) = int64_t{8} << 20;

 public:
  /// Deprecated: the older spelling of devices({device}).
  [[deprecated("use devices({device})")]]
  PipelineStageOptions& device(c10::Device device) {
    devices_ = {device};
    return *this;
  }
  /// Deprecated: the older spelling of devices(one per partition).
  [[deprecated("use devices(...), one device per partition")]]
  PipelineStageOptions& local_devices(std::vector<c10::Device> devices) {
    devices_ = std::move(devices);
    return *this;
  }
  /// Deprecated: the older spelling of step()'s and evaluate()'s argument `loss`, used by the last
  /// stage when that argument is empty. As in a GPipe, the loss is an argument of step().
  [[deprecated("pass the loss to step() and evaluate(): stage->step(input, target, loss)")]]
  PipelineStageOptions& loss(Loss loss) {
    loss_ = std::move(loss);
    return *this;
  }

 private:
  friend class PipelineStageImpl;
  Loss loss_;  // the deprecated default of step()'s loss
};

// Note [Pipeline stages and batch norm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage's BatchNorms behave as in a GPipe partition (Notes in batchnorm.h): each micro-batch is
// normalised with its own statistics; the running statistics are updated once per micro-batch,
// or with deferred_batch_norm once per mini-batch from the statistics of all its micro-batches;
// the recomputation of a checkpointed micro-batch never updates them a second time. With
// replicas, the running statistics stay equal across the replica group: deferred statistics are
// merged over the replicas before the update (combine_statistics in replication.h), so every
// replica updates as one process would on the whole mini-batch of all replicas; without deferred
// batch norm, every replica takes replica 0's buffers at the start of each training step, as
// DataParallel and PyTorch's DistributedDataParallel do.

/// This process's stage of a pipeline whose stages are the ranks of `group`, in rank order. Each
/// process builds the same Sequential (same layers, same initial parameters) and keeps its own
/// layers; step() runs one training step's forward and backward of the whole pipeline, in the
/// schedule of PipelineStageOptions::schedule (GPipe's by default), with the other processes
/// calling step() at the same time. Parameters (this stage's
/// only) get their gradients as they would in the plain model; an optimizer over parameters()
/// steps them.
///
///   auto group = gpipe::distributed::new_gloo_group(gpipe::distributed::options_from_env());
///   gpipe::distributed::PipelineStage stage(
///       model, gpipe::distributed::PipelineStageOptions({3, 2}).chunks(8), group);
///   torch::optim::SGD sgd(stage->parameters(), 0.1);
///   at::Tensor loss = stage->is_first()
///                         ? stage->step(gpipe::Batch(input), {}, loss_fn)
///                         : stage->step(gpipe::distributed::no_input(), target, loss_fn);
///   sgd.step();
///
/// Skips (gpipe::stash / pop) must be stashed and popped within one stage (in any of its
/// partitions; interleaved, within one virtual stage). BatchNorms: see Note
/// [Pipeline stages and batch norm]. Configurations are
/// compared across ranks at construction; a process that dies makes the others' step() throw
/// within the group's timeout.
class PipelineStageImpl : public torch::nn::Module {
 public:
  /// This process's stage (its rank in `group`) of `module`, split by options.balance(); a
  /// collective: every rank of `group` constructs its stage with the same options. Throws
  /// c10::Error naming a wrong option or a configuration that differs between ranks.
  PipelineStageImpl(const torch::nn::Sequential& module, PipelineStageOptions options,
                    ProcessGroup group);
  /// A stage replicated over `replica_group` (the same stage of the other replicas of the
  /// pipeline, each fed its own shard of the mini-batch): replica 0's parameters and buffers are
  /// copied to the others at construction, and each step ends with the parameters' gradients
  /// averaged over the replicas (one all-reduce per dtype, after this stage's backward). Running
  /// statistics stay equal across replicas (Note [Pipeline stages and batch norm]).
  ///
  ///   auto groups = gpipe::distributed::new_pipeline_groups(options_from_env(), /*stages=*/2);
  ///   gpipe::distributed::PipelineStage stage(model, options, groups.pipeline,
  ///                                           groups.replica_group);
  PipelineStageImpl(const torch::nn::Sequential& module, PipelineStageOptions options,
                    ProcessGroup group, ProcessGroup replica_group);
  ~PipelineStageImpl() override;

  /// One training step: on the first stage `input` is the mini-batch (a tensor or a tuple Batch);
  /// on the last, `loss` computes the loss of the output and `target` (as GPipe::step's does; a
  /// gpipe::Loss with a count for a mean over tokens that are not padding).
  /// Other stages take no input (no_input()) and ignore the target and loss, so every stage may
  /// pass the same target and loss; the last stage needs one (an empty one there is refused,
  /// unless the deprecated PipelineStageOptions::loss gave one).
  /// Returns the loss on the last stage, an undefined tensor elsewhere. Blocks until this stage's
  /// forward and backward of every micro-batch are done and its gradients sent. Under
  /// torch::NoGradGuard (on every stage) only the forward runs, and the last stage calls the loss
  /// only when given a target. After a step that threw (a peer died, a layer failed), the stage
  /// refuses further steps. Steps called from several threads run one at a time.
  ///
  ///   at::Tensor loss = stage->step(stage->is_first() ? gpipe::Batch(x) : no_input(), y, mse);
  at::Tensor step(const Batch& input = no_input(), const at::Tensor& target = {},
                  Loss loss = {});

  /// What evaluate() returns on every stage.
  struct Evaluation {
    Batch output;     ///< the last stage's output of the whole mini-batch, on this stage's device
    at::Tensor loss;  ///< the last stage's loss (a double scalar on the CPU), given a target there
  };
  /// Inference across the stages, for every rank: step() under torch::NoGradGuard (the forward
  /// only; the last stage calls `loss` when given a target), then the last stage's output and
  /// loss broadcast to every stage of the pipeline. A collective: every stage calls it, e.g. to
  /// log the loss or count accuracy on any rank.
  ///
  ///   stage->eval();
  ///   auto result = stage->evaluate(stage->is_first() ? gpipe::Batch(x) : no_input(), y, loss);
  ///   double accuracy =
  ///       result.output.tensor().argmax(1).eq(y).to(at::kDouble).mean().item<double>();
  Evaluation evaluate(const Batch& input = no_input(), const at::Tensor& target = {},
                      Loss loss = {});

  /// On the last stage, the last step's output of the whole mini-batch (gathered from the
  /// micro-batches, without history): for accuracy, or for inference under torch::NoGradGuard,
  /// where step() runs only the forward.
  const Batch& output() const { return output_; }

  /// The pipeline's group (one rank per stage) and the stage's replica group (null when the
  /// stage is not replicated).
  const ProcessGroup& group() const { return group_; }
  /// The stage's replica group; null when the stage is not replicated.
  const ProcessGroup& replica_group() const { return replica_group_; }
  /// This stage's device for collectives: its first GPU, else its first partition's device
  /// (also for a stage without parameters, which has no tensor to tell it).
  c10::Device device() const { return local_; }
  /// This process's stage and the number of stages.
  int64_t stage() const { return stage_; }
  /// The number of stages (processes) of the pipeline.
  int64_t stages() const {
    return static_cast<int64_t>(options_.balance().size()) / options_.schedule().virtual_stages();
  }
  /// Whether this is stage 0, which takes the mini-batch.
  bool is_first() const { return stage_ == 0; }
  /// Whether this stage holds the pipeline's last partition, which computes the loss: the last
  /// stage, or stage 0 under a V-shaped schedule (kZeroBubbleV, kDualPipeV: Note [V-shaped
  /// placement] in gpipe/schedule.h), which then takes both the mini-batch and the target.
  bool is_last() const { return stage_ranks_.back() == stage_; }
  /// The entries of balance this stage holds, in pipeline order: its own, or with virtual stages
  /// s, s + n, ... (interleaved) or s and 2n - 1 - s (V-shaped) of n stages.
  const std::vector<int64_t>& held_partitions() const { return held_; }

  /// The layers this stage owns.
  const torch::nn::Sequential& layers() const { return layers_; }
  /// The number of partitions of this stage (Note [Partitions within a stage]).
  int64_t partitions() const;
  /// The options the stage was made with.
  const PipelineStageOptions& options() const { return options_; }
  /// How many of this stage's links to its neighbours pass through shared memory (Note [Shared
  /// memory between stages on one host]): those to stages on this host, with shared_memory set
  /// and rings that every rank could make and open; the others go over the process group.
  int64_t shared_memory_links() const;

  /// Switches recording on or off for the next steps (off by default): each step then records
  /// what it did on this stage (timeline(), gather_timeline()). The same on every stage.
  void record_timeline(bool on = true) { record_timeline_ = on; }
  /// Whether the next steps record their timeline.
  bool is_recording_timeline() const { return record_timeline_; }
  /// What the last step did on this stage (when recording): kCompute for each
  /// micro-batch's forward, kBackward for its backward, partition = the partition of this stage
  /// (0 when it has one).
  std::shared_ptr<const Timeline> timeline() const { return timeline_; }
  /// Scales the gradients of every stage's parameters() so that the whole model's gradient norm
  /// of order `norm_type` (positive, or infinity) is at most `max_norm`, as
  /// torch::nn::utils::clip_grad_norm_ does on the plain model: each parameter counted once, a
  /// tie across stages once (Note [Clipping by the global norm] in gpipe/clip_grad.h). A
  /// collective over the pipeline's group: every stage calls it, after step() and before its
  /// optimizer's step. Returns the norm before clipping (a double scalar on the CPU), the same on
  /// every stage and replica.
  ///
  ///   stage->step(stage->is_first() ? gpipe::Batch(x) : no_input(), y, loss);
  ///   stage->clip_grad_norm(1.0);
  ///   adamw.step();
  at::Tensor clip_grad_norm(double max_norm, double norm_type = 2.0);

  /// This stage's parameters, each once, without copies of tied parameters (Note [Tied
  /// parameters]); give these to an optimizer. (They hide torch::nn::Module's.)
  std::vector<at::Tensor> parameters(bool recurse = true) const;
  /// parameters() with their names, as torch::nn::Module names this stage's.
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const;
  /// The model's ties (found and named), in the order of their first place, as GPipe's.
  const std::vector<Tie>& ties() const { return ties_; }
  /// The stages holding each tie that spans stages, in the ties' order (Note [Ties across
  /// stages]).
  std::vector<std::vector<int64_t>> tied_stages() const;
  /// Checks that each tie spanning stages has one value on every stage holding it, as Note [Ties
  /// across stages] keeps it: a collective over the pipeline's group (every stage calls it).
  /// Throws c10::Error on every stage, naming the tie and its stages, where a stage's optimizer
  /// stepped it otherwise. save_training checks before it writes.
  void check_ties() const;

  /// Every stage's timeline of the last step, on one clock (the processes must share a host):
  /// partitions numbered across the whole pipeline (stage s's first partition follows the
  /// partitions of stages 0 .. s-1; with one partition per stage, partition = stage; interleaved,
  /// partition = virtual stage), times in
  /// microseconds since the earliest stage's step began. A collective: every stage of the
  /// pipeline calls it (with record_timeline).
  ///
  ///   auto events = stage->gather_timeline();
  ///   if (stage->is_first()) std::ofstream("steps.svg") << gpipe::timeline_svg(events);
  std::vector<TimelineEvent> gather_timeline();

 private:
  // The constructor's parts: this stage's layers cloned onto their devices and split into its
  // partitions (their devices in `devices`); the partitions' executor state, ties, skips and
  // threads; the transport to the other stages and replicas.
  std::vector<torch::nn::Sequential> place(const torch::nn::Sequential& module,
                                           std::vector<c10::Device>& devices, const char* who);
  void start_partitions(const torch::nn::Sequential& module,
                        std::vector<torch::nn::Sequential> local,
                        const std::vector<c10::Device>& devices, const char* who);
  void connect(const torch::nn::Sequential& module, const char* who);
  void check_same_configuration(const torch::nn::Module& whole);
  // Whether this stage holds several virtual stages (Note [Interleaving across processes]); with
  // one, the interleaved schedule is 1F1B and placed as any other.
  bool holds_virtual_stages() const { return held_.size() > 1; }
  // A link with a neighbouring stage: to the next stage (`downstream`: activations out, gradients
  // in) or from the previous one, with `peer`'s rank, on `channel` (the sending virtual stage's
  // chunk: transfer_tag), for this stage's partition (virtual stage chunk) `chunk`.
  struct Link {
    bool downstream = true;
    int peer = 0;
    int64_t channel = 0;
    int64_t chunk = 0;
  };
  // This stage's links (Note [Interleaving across processes]): one on each side of each virtual
  // stage but at the pipeline's two ends and where two of them are neighbours (the V's turn);
  // those from the previous stage first, by chunk.
  std::vector<Link> links() const;
  // Step `index` (step()'s count) after step()'s checks, with the step's cancellation.
  // run_step's parts: the step's timeline, tied copies and replicas' buffers (returns whether
  // batch norm is deferred); stage 0's micro-batches; deferred statistics, tied and replicas'
  // gradients after the executor.
  bool begin_step(bool grad_enabled);
  std::unique_ptr<gpipe::internal::InputSource> input_source(const Batch& input, bool grad_enabled,
                                                             const char* who) const;
  void end_step(int64_t index, bool grad_enabled, bool deferred,
                const std::vector<std::shared_ptr<BatchNormLayers>>& batch_norms);
  at::Tensor run_step(const Batch& input, const at::Tensor& target, const Loss& loss, int64_t index,
                      std::shared_ptr<internal::Cancellation> cancellation);

  PipelineStageOptions options_;
  ProcessGroup group_;
  ProcessGroup replica_group_;  // null: not replicated
  int64_t stage_ = 0;
  // The rank that holds each entry of balance (the schedule's stage_ranks), and this stage's.
  std::vector<int64_t> stage_ranks_, held_;
  torch::nn::Sequential layers_;  // all of this stage's layers
  std::vector<gpipe::internal::ExecutorPartition> partitions_;  // Note [Partitions within a stage]
  std::vector<std::unique_ptr<Worker>> workers_;  // per partition; null: the calling thread
  SkipLayout skip_layout_;  // over this stage's partitions
  // The model's ties, this process's copies of them, and those spanning stages.
  std::vector<Tie> ties_;
  std::shared_ptr<TiedCopies> tied_;
  std::unique_ptr<internal::TiedStages> tied_stages_;
  // This stage's first GPU (else its first partition's device), where groups that carry GPU
  // tensors (NCCL) take them; wire_: where group_'s do (wire_device).
  c10::Device local_{c10::kCPU};
  c10::Device wire_{c10::kCPU};
  std::shared_ptr<Timeline> timeline_;
  std::atomic<bool> record_timeline_{false};  // record_timeline()
  Batch output_{std::vector<at::Tensor>{}};
  // Steps from two threads run one after the other: their transfers share tags.
  absl::Mutex step_mu_;
  bool failed_ = false;  // a step left by an exception: the pipeline's transfers are unmatched
  // step() calls so far, this one included: the index a failure is told and heard with (Note
  // [Failing fast across processes]).
  int64_t steps_ = 0;
  std::unique_ptr<Worker> courier_;  // posts sends and gradients' receives (internal/transfer.h)
  // Per link (its channel), the largest activation data sent and received in the steps so far
  // (Note [One message per micro-batch] in internal/transfer.h).
  std::map<int64_t, int64_t> sent_bytes_, received_bytes_;
  // The links' rings to the stages on this host, if any (internal/shared_memory.h).
  std::unique_ptr<internal::SharedLinks> shared_;
  // Other stages' failures, heard; this one's, told (Note [Failing fast across processes] in
  // internal/fault.h). Null on groups that cannot have one (NCCL).
  std::unique_ptr<internal::FaultChannel> faults_;
  // The same over the replica group: a replica's failed step reaches the other replicas' stages,
  // which wait for its gradients' all-reduce (Note [Failing fast across processes]).
  std::unique_ptr<internal::FaultChannel> replica_faults_;
  std::shared_ptr<internal::Cancellation>
      abandoned_;  // a failed step's transfers, kept (see step())
};

/// A PipelineStage: a module holder of PipelineStageImpl (see there).
TORCH_MODULE(PipelineStage);

}  // namespace distributed
}  // namespace gpipe
