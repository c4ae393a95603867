// The planner: from one profile of a model, predicts the step time and memory of every
// configuration (partitions, balance, micro-batches, checkpointing, schedule) by simulating it,
// and picks the fastest that fits in memory. Profiles and plans are JSON files.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include "balancing/memory.h"
#include "balancing/optimizer_cost.h"
#include "balancing/process_link.h"
#include "balancing/profile.h"
#include "balancing/simulate.h"
#include "gpipe/gpipe.h"
#include "gpipe/schedule_search.h"

namespace gpipe {

// Note [Planning]
// ~~~~~~~~~~~~~~~
// Varuna's auto-configuration, for one process: profile the model once, simulate every candidate,
// keep those that fit, and take the fastest.
// - The profile (profile_pipeline) is profile_layers at three micro-batch sizes, the smallest and
//   the largest a candidate can have and their geometric mean, and profile_copies between the
//   devices. A layer's time and bytes at any other size are interpolated linearly between the two
//   profiled sizes around it (a fixed cost per call plus a cost per sample), so no candidate is
//   profiled again. It is saved as JSON, so a script can
//   plan without the devices present.
// - The candidates: for 1 up to the number of devices partitions n, on each placement of n
//   workers (Note [Placement]), each schedule (interleaved and zb1p with
//   PlanOptions::virtual_stages stages per worker, from two workers on and where the micro-batches
//   are a multiple of n; zbv and dualpipev with 2n stages in a V, worker r holding r and 2n - 1 - r
//   on its device, from two workers on, dualpipev where m >= 2n - 1), micro-batch
//   counts m from PlanOptions::chunks, each checkpoint mode, and two balances: the one of least
//   bottleneck time (forward, backward, and the recomputation where checkpointed, at the
//   micro-batch size) and the one of least bottleneck memory. Where a worker runs several stages
//   (interleaved, zb1p, a V), its load is their sum, which a balance of least bottleneck stage
//   may leave uneven (few layers in many stages): a third balance is the one of least busiest
//   worker's sum (then the next's), found among every balance where there are at most 20000,
//   else by moving layers across the first one's cuts, one at a time, while that lowers it (a
//   local optimum: on many layers the stages' sums are close anyway).
// - Calibration: layers timed one at a time miss what the engine adds around them (a micro-batch's
//   graph and its backward call, the loss per micro-batch, caches that activations of other
//   micro-batches have since filled). So the profile also runs the whole model as one partition,
//   GPipe's schedule, no checkpointing, at the smallest and the middle micro-batch size, and keeps
//   measured / simulated per size; a candidate's times are scaled by the ratio at its micro-batch
//   size (interpolated in log size, clamped at the ends). It runs the same step under the
//   zero-bubble schedule too: the backward split in two costs more in the engine than its layers'
//   halves timed alone (on the project's VM, 5-30% more at small micro-batches: one gradient call
//   for the stage's input and each layer's output, then one per layer for the weights), and
//   I and W are scaled by what that step measured beyond the ratio (Calibration::split).
// - A CPU shared by more workers than it has cores: they take turns (Note [Simulating a step]),
//   with the turns of Linux's scheduler (plan.cc).
// - Each is simulated (Note [Simulating a step] in simulate.h): a stage's times are the sums of
//   its layers'; what it keeps of a micro-batch is what each layer saved beyond its output, plus
//   the outputs that the layer itself or the next one keeps (saves_output, saves_input: a Linear
//   keeps its input, a Tanh its output, a ReLU's input is its mask), plus the stage's output (the
//   backward's root); parameters, their gradients, master weights and the optimizer's moments
//   by dtype as Note [Training memory] in memory.h counts them; a CPU gives the capacity
//   cpu_capacity measured: cores / threads workers of the model's own training passes at once,
//   against one alone (hyperthreads and memory bandwidth make it less than cores / threads; on
//   the project's 2-vCPU VM it measured 1.4 to 2.0 for two).
// - The optimizer's step after it is predicted apart (Note [The optimizer's step]).
// - Plans are ranked by predicted step time, the optimizer's included; those over
//   PlanOptions::memory_limit on any device are left out. When none fits, plan() says by how much
//   the least hungry misses, and whether the static bytes alone (more devices would help) or the
//   activations (smaller micro-batches) are the excess.
// How close this comes is measured by benchmarks/plan_accuracy (docs/balancing.md says where it is
// wrong).

// Note [Device overhead]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A GPU holds more than the tensors the simulation counts: its CUDA context, the libraries'
// handles and kernels (outside LibTorch's caching allocator), and the allocator's reserve, the
// blocks it keeps beyond those in use (rounding, splitting, freed blocks kept for reuse).
// profile_pipeline measures both on the first GPU among its devices, after profiling: the
// driver's bytes in use less the allocator's reserved ones (other processes' memory on that GPU
// counts too), and the allocator's peak reserved over its peak allocated since the profile's
// layers began (the layers are profiled on the first GPU too, Note [Placement]; the optimizer's
// profile, whose large tensors are not the model's, runs before, its cached blocks released). A
// plan's peak on each GPU is then that context plus the simulated peak times that ratio: what
// memory_limit is compared with.
// Every GPU of a plan is taken to be like the first (the same model of GPU); the CPU has neither
// (0 and 1).

// Note [Placement]
// ~~~~~~~~~~~~~~~~
// Which device each worker gets is chosen, not taken in the order given. profile_pipeline profiles
// the layers (and calibrates) on the first device and on the first device of every other kind
// among the devices (a CPU beside GPUs: PipelineProfile::other_kinds), so a stage's times are
// those of its own kind of device. For n workers, plan() tries every sequence of kinds the devices
// allow, each kind's devices taken in their order: on {cuda:0, cpu}, two workers as {cuda:0, cpu}
// and as {cpu, cuda:0}, one on either; on devices of one kind, the first n as before. Where the
// workers' kinds differ, the balance of least bottleneck time weighs each layer by its time on
// the device of the stage that would hold it (an exact dynamic programme over the cut points).
// Devices of one kind are taken to be alike (the same model of GPU, as Note [Device overhead]
// assumes); copies are measured per pair of devices, but the order of a kind's devices is not
// searched (NVLink topology is not).

// Note [Stages and replicas in the plan]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A plan may run each worker in a process of its own (PlanOptions::processes: PipelineStage, one
// stage per process) and be replicated for data parallelism (PlanOptions::replicas). Both cost
// what the profile's process link says (Note [Costs between processes] in process_link.h):
//   - with processes, a stage's output reaches the next stage as a message, message_us of its
//     bytes, instead of a copy within one process; a stage on a GPU first copies to the CPU and the
//     next one back from it when the link is Gloo's (as the stage's transport does), and the
//     gradient returns the same way. The hand-over between threads stays (the stage's courier
//     thread hands the message to the worker).
//   - with r replicas and processes, each worker, after its last action, averages its stages'
//     gradients over the replicas as PipelineStage does after its step: an all-reduce of their
//     trainable parameters' bytes (and a small one of which gradients exist), allreduce_us over r
//     ranks. The step ends when the last worker's all-reduce does; the all-reduces of different
//     workers run at once, on groups of their own. The memory of the flat buffer it reduces (the
//     gradients once more, at the step's end when the activations are gone) is not counted.
//   - with r replicas of one process's pipeline (distributed::DataParallel around a GPipe), all of
//     its gradients are reduced on one group: one all-reduce of the whole model's after the last
//     worker's end. DataParallel starts its buckets while backward runs, so this is an upper
//     bound of what it adds.
// Replicas change what each of them computes only through the mini-batch: the profile's is one
// replica's. The profile's link is the loopback's unless given (balance --process_link): a plan for
// several machines wants the network's numbers.

// Note [Searched plans]
// ~~~~~~~~~~~~~~~~~~~~~
// Beside each zero-bubble, zbv and zb1p candidate without checkpointing (each micro-batch's
// actions are then F, I and W, what search_schedule orders; a zbv candidate's in a V, whose
// searched plan has virtual_stages 2 and schedule kZeroBubbleV; a zb1p candidate's interleaved,
// whose searched plan keeps its virtual_stages and schedule kInterleavedZeroBubble; a plan's file
// tells the two apart by its text's placement), plan() searches a schedule (Note [Searching a
// schedule]) on the candidate's own stage costs: each stage's forward, input-gradient and
// weight-gradient times at the candidate's micro-batch size and its copy to the next stage. It
// searches twice: within the candidate's own peak in-flight (stage, micro-batch) pairs per worker
// (ZB-H1's n; zbv's 2n half-size ones over n workers; zb1p's) and within all m (vm with v stages
// per worker). Each schedule found is
// predicted as every candidate is (simulate_pipeline over parse_schedule of its text, which adds
// what the search's model leaves out: workers taking turns on shared cores, hand-overs, memory).
// The faster one that fits the memory limit becomes a plan (PipelinePlan::schedule_text) only
// when the search found an order of its own (not one of its generated seeds) and it is faster
// than every generated candidate of the same balance, micro-batches and checkpointing that fits:
// a searched plan is never one that a generated schedule matches. PlanOptions::search(false)
// leaves the search out.
//
// Every candidate's micro-batch count m is one the mini-batch really splits into: the engine
// splits B samples into pieces of ceil(B / m), so an m with ceil(B / ceil(B / m)) != m (24 of
// 128: 22 pieces) is left out (its generated schedules would run the smaller count, and a
// searched text written for m would not run at all).

/// How to plan.
///
///   gpipe::PlanOptions().memory_limit(int64_t{2} << 30).optimizer(gpipe::OptimizerKind::kAdam)
struct PlanOptions {
  /// The partition counts (workers) to consider; empty: 1 up to the number of devices.
  TORCH_ARG(std::vector<int64_t>, partitions) = {};
  /// The micro-batch counts to consider (those above the mini-batch's size are left out).
  TORCH_ARG(std::vector<int64_t>, chunks) = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
  /// The schedules to consider.
  TORCH_ARG(std::vector<ScheduleKind>, schedules) = {
      ScheduleKind::kGPipe,        ScheduleKind::k1F1B,
      ScheduleKind::kInterleaved,  ScheduleKind::kZeroBubble,
      ScheduleKind::kZeroBubbleV,  ScheduleKind::kInterleavedZeroBubble,
      ScheduleKind::kDualPipeV};
  /// The checkpoint modes to consider.
  TORCH_ARG(std::vector<Checkpoint>, checkpoints) = {Checkpoint::kAlways, Checkpoint::kExceptLast,
                                                     Checkpoint::kNever};
  /// Stages per worker of the interleaved schedule.
  TORCH_ARG(int64_t, virtual_stages) = 2;
  /// Bytes per device that a plan may hold at its peak; 0: no limit.
  TORCH_ARG(int64_t, memory_limit) = 0;
  /// The optimizer's state per parameter.
  TORCH_ARG(OptimizerKind, optimizer) = OptimizerKind::kMomentum;
  /// Whether training keeps float32 master weights of the float16 and bfloat16 parameters, and
  /// steps those (Note [Training memory] in memory.h).
  TORCH_ARG(bool, master_weights) = false;
  /// The dtype the forward runs under autocast with, if it does: its weight cache holds each
  /// float32 parameter at that dtype (Note [Training memory]).
  TORCH_ARG(c10::optional<c10::ScalarType>, autocast) = c10::nullopt;

 public:
  /// What the options say of the parameters' memory.
  ParameterMemory parameter_memory() const { return {optimizer_, master_weights_, autocast_}; }
  /// How many plans plan() returns.
  TORCH_ARG(int64_t, top) = 5;
  /// Whether to search schedules beside the zero-bubble candidates (Note [Searched plans]).
  TORCH_ARG(bool, search) = true;
  /// Whether each worker runs in a process of its own (distributed::PipelineStage), its
  /// activations and gradients sent on the profile's process link instead of copied within one
  /// process (Note [Stages and replicas in the plan]).
  TORCH_ARG(bool, processes) = false;
  /// Data-parallel replicas of the pipeline, each stage's gradients averaged over them after the
  /// step on the profile's process link; the profile's mini-batch is one replica's.
  TORCH_ARG(int64_t, replicas) = 1;
};

/// How to profile for planning.
struct PipelineProfileOptions {
  /// Timing passes per micro-batch size last this long (at least one).
  TORCH_ARG(std::chrono::duration<double>, timeout) = std::chrono::seconds(1);
  /// The smallest and largest micro-batch to profile (and their geometric mean); 0: 1 and the
  /// sample's batch.
  TORCH_ARG(int64_t, min_batch) = 0;
  /// The largest micro-batch to profile (see min_batch); 0: the sample's batch.
  TORCH_ARG(int64_t, max_batch) = 0;
  /// Intra-op threads of each CPU worker, set while profiling and kept in the plans; 0: the cores
  /// divided among the devices (at least 1), as the trainers' --threads=0.
  TORCH_ARG(int64_t, threads) = 0;
  /// The machine's cores; 0: std::thread::hardware_concurrency().
  TORCH_ARG(int64_t, cores) = 0;
  /// Whether to calibrate against whole-model steps (Note [Planning]); they hold the activations
  /// of the whole mini-batch at once (a step that does not fit is left out).
  TORCH_ARG(bool, calibrate) = true;
};

/// What the planner knows of a model on some devices (Note [Planning]).
struct PipelineProfile {
  /// The layers profiled at (usually) three micro-batch sizes, ascending.
  std::vector<LayerProfile> sizes;
  /// Copies between the distinct devices.
  std::vector<CopyStats> copies;
  /// One step of each optimizer kind on the first device of each kind (Note [The optimizer's
  /// step] in optimizer_cost.h); empty in profiles written before it (no optimizer time).
  std::vector<OptimizerStats> optimizers;
  /// The devices a pipeline may use, one per partition at most.
  std::vector<c10::Device> devices;
  /// The mini-batch's size.
  int64_t batch = 0;
  /// The mini-batch's bytes (the input the first partition holds).
  int64_t input_bytes = 0;
  /// The machine's cores.
  int64_t cores = 1;
  /// Each CPU worker's intra-op threads.
  int64_t threads = 1;
  /// How many workers' worth of compute the CPU gives cores / threads workers running at once
  /// (cpu_capacity); 0: cores / threads, as if each had its own cores.
  double cpu_capacity = 0;
  /// A hand-over between two workers' threads (handoff_us), microseconds.
  double handoff_us = 0;
  /// What a CUDA device holds beyond the tensors the simulation counts (Note [Device overhead]),
  /// measured on the first GPU among the devices: the bytes in use outside the caching
  /// allocator (the CUDA context, libraries' handles and kernels), and the allocator's most
  /// reserved over its most allocated while profiling (at least 1). 0 and 1 on the CPU.
  int64_t device_context_bytes = 0;
  /// See device_context_bytes.
  double allocator_reserve = 1;
  /// Messages and all-reduces between processes (Note [Costs between processes] in
  /// process_link.h), for plans whose stages run in processes of their own or with replicas;
  /// not measured by profile_pipeline (measure_gloo_link, balance --processes or --replicas).
  ProcessLinkStats process_link;
  /// The engine against the layers alone: for micro-batches of `batch` samples, a whole-model
  /// step in one partition measured over its simulation (Note [Planning]); empty: none (1).
  /// `split`: what the backward split in two (zero bubble's I and W) costs beyond `ratio`, from a
  /// step of the zero-bubble schedule: I and W are scaled by ratio x split.
  struct Calibration {
    /// The micro-batch size of the calibrating steps.
    int64_t batch = 0;
    /// The whole-model step measured over its simulation.
    double ratio = 1;
    /// What the split backward costs beyond `ratio` (see above).
    double split = 1;
  };
  /// One entry per micro-batch size calibrated; empty: not calibrated (a ratio of 1).
  std::vector<Calibration> calibration;
  /// The layers and the calibration on a kind of device unlike the first's (Note [Placement]).
  struct DeviceKind {
    /// The device profiled: the first of its kind among `devices`.
    c10::Device device = c10::Device(c10::kCPU);
    /// Its layers at the sizes of PipelineProfile::sizes.
    std::vector<LayerProfile> sizes;
    /// Its calibration, as PipelineProfile::calibration.
    std::vector<Calibration> calibration;
  };
  /// One entry per kind of device (CPU, CUDA) among `devices` other than the first's: empty for
  /// devices of one kind, and in profiles written before Note [Placement] (every device is then
  /// planned as the first).
  std::vector<DeviceKind> other_kinds;
  /// The calibration's ratio at micro-batches of `batch` (interpolated; 1 without one) on the
  /// first device.
  double time_scale(int64_t batch) const;
  /// The same on `device`: its kind's calibration.
  double time_scale(int64_t batch, c10::Device device) const;
  /// The scale of I and W at micro-batches of `batch`: time_scale x the interpolated split.
  double split_scale(int64_t batch) const;
  /// The same on `device`: its kind's calibration.
  double split_scale(int64_t batch, c10::Device device) const;

  /// The number of layers profiled (0 without a profile).
  int64_t layers() const { return sizes.empty() ? 0 : static_cast<int64_t>(sizes[0].layers.size()); }
  /// Layer k's measurements at a micro-batch of `batch` samples (interpolated; Note [Planning]) on
  /// the first device.
  LayerStats layer(int64_t k, int64_t batch) const;
  /// The same on `device`: as profiled on its kind of device (Note [Placement]).
  LayerStats layer(int64_t k, int64_t batch, c10::Device device) const;
  /// What copying `bytes` from `from` to `to` costs (0 on one device).
  double copy_us(c10::Device from, c10::Device to, int64_t bytes) const;

  /// The profile as JSON text (a profile file), which from_json reads back.
  std::string to_json() const;
  /// Reads to_json's text; throws c10::Error naming what is missing or malformed.
  static PipelineProfile from_json(const std::string& text);
};

/// Profiles `model` on `sample` (a mini-batch) for planning on `devices` (one per partition at
/// most; repeats allowed, e.g. three CPUs for three CPU partitions).
///
///   auto profile = gpipe::profile_pipeline(model, x, {torch::kCPU, torch::kCPU});
///   gpipe::write_file("profile.json", profile.to_json());
PipelineProfile profile_pipeline(const torch::nn::Sequential& model, const at::Tensor& sample,
                                 const std::vector<c10::Device>& devices,
                                 const PipelineProfileOptions& options = {});

/// One configuration and what it is predicted to cost.
struct PipelinePlan {
  /// Layers per partition (GPipeOptions::balance).
  std::vector<int64_t> balance;
  /// One device per partition.
  std::vector<c10::Device> devices;
  /// Micro-batches per mini-batch.
  int64_t chunks = 1;
  /// Which micro-batches are checkpointed.
  Checkpoint checkpoint = Checkpoint::kExceptLast;
  /// The schedule of a training step (GPipeImpl::step).
  ScheduleKind schedule = ScheduleKind::kGPipe;
  /// Stages per worker: more than 1 only with the interleaved schedules (interleaved, zb1p), and
  /// 2 with the V-shaped ones (zbv, dualpipev: worker r holds partitions r and 2n - 1 - r).
  int64_t virtual_stages = 1;
  /// A searched schedule (Note [Searched plans]) as text (Note [Schedule text]), which step()
  /// runs instead of `schedule`'s generated one; empty for a generated schedule. `schedule` is
  /// then kZeroBubble, or kZeroBubbleV in a V, or kInterleavedZeroBubble interleaved: the
  /// search's actions are F, I and W.
  std::string schedule_text;
  /// Intra-op threads of each CPU worker.
  int64_t threads = 1;
  /// Whether each worker runs in a process of its own (PlanOptions::processes).
  bool processes = false;
  /// Data-parallel replicas (PlanOptions::replicas).
  int64_t replicas = 1;
  /// Predicted: the step's time (forward and backward of every micro-batch), microseconds.
  double step_us = 0;
  /// Predicted: the optimizer's step after it (Note [The optimizer's step] in optimizer_cost.h:
  /// PlanOptions::optimizer over every stage's trainable parameters, on the stage's device),
  /// microseconds; 0 where the profile has no optimizer measurements. Plans are ranked by
  /// step_us + optimizer_us.
  double optimizer_us = 0;
  /// Predicted: each distinct device's peak bytes (in the order of first appearance in
  /// `devices`).
  std::vector<int64_t> peak_bytes;
  /// The optimizer the predictions are for (predict's ParameterMemory::optimizer, from
  /// PlanOptions::optimizer): its moments are in peak_bytes and its step is optimizer_us. Unset
  /// before a prediction, and in plan files written before it.
  c10::optional<OptimizerKind> optimizer;
  /// Predicted on: the c10d backend whose costs the messages and all-reduces between processes
  /// were predicted with (Note [Costs between processes] in process_link.h), "nccl" or "gloo", to
  /// launch the stages with (the trainers' --backend); empty where nothing crosses processes (one
  /// process, no replicas), before a prediction, and in plan files written before it.
  std::string backend;

  /// The options to build this pipeline with.
  ///
  ///   gpipe::GPipe pipe(model, best.options());
  GPipeOptions options() const;
  /// "balance {3, 2}, 8 micro-batches, checkpoint except_last, schedule 1f1b: 12.3 ms, 45.6 MiB"
  /// ("schedule searched" for a searched one).
  std::string describe() const;
  /// The plan as JSON text (a plan file, the trainers' --plan), which from_json reads back.
  std::string to_json() const;
  /// Reads to_json's text (the predictions may be absent); throws c10::Error naming what is
  /// missing or malformed.
  static PipelinePlan from_json(const std::string& text);
};

/// `bytes` of tensors per device (`devices`, in the same order), each GPU's with its context and
/// its allocator's reserve added as `profile` measured them (Note [Device overhead]); the CPU's
/// as they are.
std::vector<int64_t> with_device_overhead(const PipelineProfile& profile,
                                          const std::vector<c10::Device>& devices,
                                          std::vector<int64_t> bytes);

/// The simulation inputs of `plan` (its balance, devices, chunks, checkpoint, schedule and
/// threads) over `profile`, the parameters trained as `memory` says.
PipelineCosts pipeline_costs(const PipelineProfile& profile, const PipelinePlan& plan,
                             const ParameterMemory& memory);
/// The same with float32 parameters, no master weights and no autocast.
PipelineCosts pipeline_costs(const PipelineProfile& profile, const PipelinePlan& plan,
                             OptimizerKind optimizer);

/// Simulates `plan` over `profile` and fills its step_us and peak_bytes; returns the simulation
/// (for its timeline).
PipelineSimulation predict(const PipelineProfile& profile, PipelinePlan& plan,
                           const ParameterMemory& memory);
/// The same with float32 parameters, no master weights and no autocast.
PipelineSimulation predict(const PipelineProfile& profile, PipelinePlan& plan,
                           OptimizerKind optimizer = OptimizerKind::kMomentum);

/// `plan` (one partition per worker, two in a V, or several interleaved) with a schedule searched
/// on its own stage costs over `profile` (Note [Searched plans]: each stage's F, I and W at the
/// plan's micro-batch size and its copy), each worker holding at most `max_in_flight` (stage,
/// micro-batch) pairs, then predicted on the planner's model (predict: its step_us, optimizer_us,
/// peak_bytes and optimizer). `found`, if given, gets what the search found
/// (its own simulation, and the best generated schedule's). The plan's chunks must be a count the
/// mini-batch splits into (Note [Searched plans]). A checkpointed micro-batch is not split into I
/// and W (as in the executor); the search's own model leaves its recomputation out, the
/// prediction counts it.
///
///   gpipe::PipelinePlan zb = gpipe::plan(profile, gpipe::PlanOptions()
///       .partitions({2}).chunks({16}).schedules({gpipe::ScheduleKind::kZeroBubble})
///       .checkpoints({gpipe::Checkpoint::kNever}).search(false).top(1)).front();
///   gpipe::PipelinePlan searched = gpipe::search_plan(profile, zb, 2);
PipelinePlan search_plan(const PipelineProfile& profile, const PipelinePlan& plan,
                         int64_t max_in_flight, const ParameterMemory& memory = {},
                         SearchedSchedule* found = nullptr);

/// The best plans (fastest first) for `profile` that fit options.memory_limit(), at most
/// options.top(). Throws c10::Error when none fits, saying by how much the least hungry misses
/// and what would help.
///
///   auto plans = gpipe::plan(profile, gpipe::PlanOptions().memory_limit(int64_t{1} << 30));
///   gpipe::GPipe pipe(model, plans.front().options());
std::vector<PipelinePlan> plan(const PipelineProfile& profile, const PlanOptions& options = {});

/// Profiles `model` (profile_pipeline) and plans.
std::vector<PipelinePlan> plan(const torch::nn::Sequential& model, const at::Tensor& sample,
                               const std::vector<c10::Device>& devices,
                               const PlanOptions& options = {},
                               const PipelineProfileOptions& profile_options = {});

}  // namespace gpipe
