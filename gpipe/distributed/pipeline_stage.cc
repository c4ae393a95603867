// A pipeline stage in a process of its own; see pipeline_stage.h and Note [Stage-local backward].
#include "gpipe/distributed/pipeline_stage.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "gpipe/distributed/configuration.h"
#include "gpipe/distributed/fault.h"
#include "gpipe/distributed/remote_link.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/transfer.h"
#include "gpipe/device.h"
#include "gpipe/executor.h"
#include "gpipe/partition.h"
#include "gpipe/skip_tracker.h"
#include "gpipe/skippable.h"
#include "gpipe/stream.h"
#include "gpipe/thread_state.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace distributed {
namespace {

// The calling thread's current stream on `wire` when it is a GPU (Transfer's `stream`).
c10::optional<c10::Stream> wire_stream_of(c10::Device wire) {
  return wire.is_cuda() ? c10::make_optional(current_stream(wire)) : c10::nullopt;
}

}  // namespace

PipelineStageImpl::PipelineStageImpl(const torch::nn::Sequential& module,
                                     PipelineStageOptions options, ProcessGroup group)
    : PipelineStageImpl(module, std::move(options), std::move(group), ProcessGroup()) {}

PipelineStageImpl::PipelineStageImpl(const torch::nn::Sequential& module,
                                     PipelineStageOptions options, ProcessGroup group,
                                     ProcessGroup replica_group)
    : options_(std::move(options)),
      group_(std::move(group)),
      replica_group_(std::move(replica_group)) {
  const char* who = "gpipe::distributed::PipelineStage";
  TORCH_CHECK(group_, who, ": the process group is null; make one with "
              "gpipe::distributed::new_gloo_group");
  const std::vector<int64_t>& balance = options_.balance();
  TORCH_CHECK(options_.chunks() >= 1, who, ": chunks must be at least 1, got ",
              options_.chunks());
  TORCH_CHECK(options_.schedule() != ScheduleKind::kInterleaved, who, ": the interleaved "
              "schedule needs several stages per process, which PipelineStage does not place yet; "
              "use ScheduleKind::k1F1B or kZeroBubble, or interleave in one process (GPipe)");
  verify_module(module);
  verify_balance(balance, static_cast<int64_t>(module->size()), balance.size());
  verify_skippables(module);
  // Only this stage's layers move to its device; the others stay on the CPU.
  std::vector<c10::Device> devices(balance.size(), c10::Device(c10::kCPU));
  const int rank = group_->getRank();
  const std::vector<c10::Device>& local_devices = options_.local_devices();
  if (local_devices.empty()) {
    check_device_available(options_.device(), absl::StrCat(who, ": the stage's device"));
  }
  for (size_t j = 0; j < local_devices.size(); ++j) {
    check_device_available(local_devices[j], absl::StrCat(who, ": local partition ", j));
  }
  const c10::Device first_device = local_devices.empty() ? options_.device() : local_devices[0];
  if (rank < static_cast<int>(balance.size())) devices[rank] = first_device;
  const std::vector<torch::nn::Sequential> parts = split_module(module, balance, devices);
  const SkipLayout across(parts);
  const std::vector<SkipKey> crossing = across.crossing();
  TORCH_CHECK(crossing.empty(), who, ": the skip '", crossing.empty() ? "" : crossing[0].name,
              "' is stashed in one stage and popped in another; skips cannot cross processes. "
              "Choose a balance that keeps each stash and its pop in one stage");
  TORCH_CHECK(static_cast<int>(balance.size()) == group_->getSize(), who, ": the balance has ",
              balance.size(), " stages ({", absl::StrJoin(balance, ", "), "}) but the process "
              "group has ", group_->getSize(), " ranks; give one entry per process of the "
              "pipeline");
  stage_ = group_->getRank();
  layers_ = parts[stage_];
  register_module("layers", layers_);

  // This stage's partitions (Note [Partitions within a stage]).
  std::vector<int64_t> local_balance = options_.local_balance();
  TORCH_CHECK(!local_balance.empty() || local_devices.empty(), who, ": local_devices has ",
              local_devices.size(), " devices but local_balance is empty; give this stage's "
              "layers per partition, one entry per device");
  if (local_balance.empty()) local_balance = {balance[stage_]};
  const std::string shown = absl::StrCat("{", absl::StrJoin(local_balance, ", "), "}");
  for (int64_t b : local_balance) {
    TORCH_CHECK(b > 0, who, ": local_balance ", shown, " has a non-positive entry ", b,
                "; every partition needs at least one layer");
  }
  const int64_t local_sum =
      std::accumulate(local_balance.begin(), local_balance.end(), int64_t{0});
  TORCH_CHECK(local_sum == balance[stage_], who, ": local_balance ", shown, " adds up to ",
              local_sum, " layers, but stage ", stage_, " has ", balance[stage_],
              " (its entry of balance {", absl::StrJoin(balance, ", "), "})");
  TORCH_CHECK(local_devices.empty() || local_devices.size() == local_balance.size(), who,
              ": local_devices has ", local_devices.size(), " devices but local_balance ", shown,
              " has ", local_balance.size(), " partitions; give one device per partition");
  std::vector<c10::Device> partition_devices =
      local_devices.empty() ? std::vector<c10::Device>(local_balance.size(), options_.device())
                            : local_devices;
  const std::vector<torch::nn::Sequential> local =
      split_module(layers_, local_balance, partition_devices);
  skip_layout_ = SkipLayout(local);
  // Partitions run at the same time on threads of their own (as a GPipe's with
  // worker_per_partition, and with the same caveats about random numbers).
  for (size_t j = 0; j < partition_devices.size(); ++j) {
    for (size_t k = 0; k < j; ++k) {
      TORCH_CHECK(!partition_devices[j].is_cuda() || partition_devices[j] != partition_devices[k],
                  who, ": partitions ", k, " and ", j, " of stage ", stage_, " would run on two "
                  "threads that share ", partition_devices[j], " and its random generator, so a "
                  "checkpointed micro-batch could recompute different random numbers; give each "
                  "partition its own GPU (local_devices)");
    }
  }
  // Warned only where it applies (Note [Random numbers in concurrent CPU partitions]).
  if (checkpoint_stop(options_.checkpoint(), options_.chunks()) > 0) {
    const auto [j, layer] = concurrent_random_layer(local, partition_devices);
    if (j >= 0) {
      TORCH_WARN(who, ": local partition ", j, " of stage ", stage_, " holds ", layer, ", which "
                 "draws random numbers, and the CPU partitions of a stage run at the same time: "
                 "they draw from the one CPU generator in an order that depends on thread timing, "
                 "so a checkpointed micro-batch may recompute different numbers than its forward "
                 "drew. Use Checkpoint::kNever, or one partition per stage.");
    }
  }
  for (size_t j = 0; j < local.size(); ++j) {
    detail::ExecutorPartition p;
    p.layers = local[j];
    p.device = partition_devices[j];
    p.batch_norms = std::make_shared<BatchNormLayers>(p.layers->modules(/*include_self=*/false));
    p.grad_record = std::make_shared<GradRecord>();
    // The first partition runs on the thread that calls step().
    workers_.push_back(
        j > 0 ? std::make_unique<Worker>(absl::StrCat("stage ", stage_, " part ", j)) : nullptr);
    partitions_.push_back(std::move(p));
  }
  // Transfers with the neighbouring stages: through the CPU (Gloo), or on this stage's first
  // GPU (NCCL).
  local_ = partitions_[0].device;
  for (const detail::ExecutorPartition& p : partitions_) {
    if (p.device.is_cuda()) {
      local_ = p.device;
      break;
    }
  }
  wire_ = wire_device(group_, local_);
  courier_ = std::make_unique<Worker>(absl::StrCat("send ", stage_));
  check_same_configuration(*module);
  if (replica_group_) {
    std::vector<at::Tensor> state = layers_->parameters();
    for (const at::Tensor& b : layers_->buffers()) state.push_back(b);
    broadcast_from_rank0(replica_group_, state, "replica 0's parameters and buffers", local_);
  }
  if (FaultChannel::can_hear_any(group_)) {
    faults_ = std::make_unique<FaultChannel>(group_, "gpipe::distributed::PipelineStage::step");
  }
}

PipelineStageImpl::~PipelineStageImpl() = default;

int64_t PipelineStageImpl::partitions() const { return static_cast<int64_t>(partitions_.size()); }

void PipelineStageImpl::check_same_configuration(const torch::nn::Module& whole) {
  // The whole model, not only this stage's layers: every process builds the same Sequential.
  std::vector<std::pair<std::string, int64_t>> fields = module_fields(whole);
  fields.emplace_back("stages", stages());
  fields.emplace_back("balance (hash)",
                      static_cast<int64_t>(fingerprint(absl::StrJoin(options_.balance(), ","))));
  fields.emplace_back("chunks", options_.chunks());
  fields.emplace_back("checkpoint mode", static_cast<int64_t>(options_.checkpoint()));
  fields.emplace_back("schedule", static_cast<int64_t>(options_.schedule()));
  fields.emplace_back("record_timeline", options_.record_timeline() ? 1 : 0);
  fields.emplace_back("deferred_batch_norm", options_.deferred_batch_norm() ? 1 : 0);
  fields.emplace_back("replicas", replica_group_ ? replica_group_->getSize() : 1);
  check_same_fields(group_, fields, "gpipe::distributed::PipelineStage", "stage",
                    "Every process of a pipeline must build the same model with the same options",
                    wire_);
  if (replica_group_) {
    fields.emplace_back("which parameters require grad (hash)",
                        static_cast<int64_t>(requires_grad_key(layers_)));
    check_same_fields(replica_group_, fields, "gpipe::distributed::PipelineStage", "replica",
                      "Every replica of a pipeline must build the same model with the same "
                      "options",
                      local_);
  }
}

at::Tensor PipelineStageImpl::step(const Batch& input, const at::Tensor& target) {
  const char* who = "gpipe::distributed::PipelineStage::step";
  absl::MutexLock step_lock(&step_mu_);
  TORCH_CHECK(!failed_, who, ": an earlier step failed on this stage, which leaves transfers "
              "of the pipeline unmatched; make new process groups and stages to go on");
  if (faults_) {
    if (std::optional<std::string> heard = faults_->heard()) {
      failed_ = true;
      TORCH_CHECK(false, *heard);
    }
  }
  // Note [Failing fast across processes] in fault.h.
  auto cancellation = std::make_shared<Cancellation>();
  if (faults_) faults_->attach(cancellation);
  struct Detach {
    FaultChannel* faults;
    ~Detach() {
      if (faults) faults->detach();
    }
  } detach{faults_.get()};
  bool checked = false;
  try {
    TORCH_CHECK(!is_first() || input.size() > 0, who, ": stage 0 needs the mini-batch as input");
    TORCH_CHECK(is_first() || input.size() == 0, who, ": stage ", stage_, " takes no input (only "
                "stage 0 does; its activations come from stage ", stage_ - 1, ")");
    TORCH_CHECK(!is_last() || options_.loss(), who, ": the last stage (", stage_, ") needs a "
                "loss function: PipelineStageOptions::loss");
    checked = true;
    return run_step(input, target, cancellation);
  } catch (const std::exception& e) {
    // The other stages wait for this one's transfers: the pipeline is broken for good.
    if (checked || stages() > 1) failed_ = true;
    // Its transfers in flight stay posted in the group: kept until the stage goes (Note
    // [Failing fast across processes]).
    abandoned_ = cancellation;
    if (faults_ && !cancellation->cancelled()) {
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      faults_->raise(absl::StrCat("stage ", stage_, " of ", stages(), " failed: ",
                                  error ? error->what_without_backtrace() : e.what()));
    }
    throw;
  }
}

at::Tensor PipelineStageImpl::run_step(const Batch& input, const at::Tensor& target,
                                       std::shared_ptr<Cancellation> cancellation) {
  const char* who = "gpipe::distributed::PipelineStage::step";
  timeline_ = options_.record_timeline() ? std::make_shared<Timeline>() : nullptr;
  const bool grad_enabled = at::GradMode::is_enabled();
  // Note [Pipeline stages and batch norm].
  bool any_batch_norm = false;
  for (const detail::ExecutorPartition& p : partitions_) any_batch_norm |= p.batch_norms->size() > 0;
  const bool deferred = options_.deferred_batch_norm() && is_training() && any_batch_norm;
  if (replica_group_ && grad_enabled && is_training() && !deferred &&
      !layers_->buffers().empty()) {
    broadcast_from_rank0(replica_group_, layers_->buffers(), "replica 0's buffers", local_);
  }
  const Wire wire{group_, wire_, wire_stream_of(wire_), courier_.get(), std::move(cancellation)};
  // On a group that matches in posting order, schedules that interleave forwards and backwards
  // post each pair's transfers in turn (Note [When gradients' receives are posted]).
  const bool in_turn = options_.schedule() != ScheduleKind::kGPipe && !matches_by_tag(group_);
  const auto turns_with = [&](int64_t peer) -> TurnsOf {
    if (!in_turn) return nullptr;
    return [kind = options_.schedule(), stages = stages(), me = stage_, peer](int64_t m) {
      return pair_turns(kind, stages, m, me, peer);
    };
  };
  std::unique_ptr<detail::InputSource> source;
  std::unique_ptr<RemoteUpstream> remote_upstream;
  if (is_first()) {
    check_input(input);
    for (const at::Tensor& t : input.values()) {
      TORCH_CHECK(t.device() == partitions_[0].device, who, ": the input is on ", t.device(),
                  " but stage 0 runs on ", partitions_[0].device, "; move it there first");
    }
    source = std::make_unique<detail::InputSource>(scatter(input, options_.chunks()),
                                                   grad_enabled);
  } else {
    // Activations arrive on a thread of their own (Note [Receiving ahead] in transfer.h).
    remote_upstream = std::make_unique<RemoteUpstream>(
        wire, stage_ - 1, partitions_[0].device, grad_enabled, turns_with(stage_ - 1));
  }
  const ScheduleKind kind = options_.schedule();
  const int64_t stages = this->stages();
  const int64_t me = stage_;
  // This stage's actions; each of its partitions runs them in order (Note [Partitions within a
  // stage] in pipeline_stage.h).
  const auto plan = [kind, stages, me, k = partitions_.size()](int64_t m) {
    std::vector<Action> mine = make_schedule(kind, stages, m).ranks[me];
    std::vector<std::vector<Action>> lanes(k);
    for (size_t j = 0; j < k; ++j) {
      for (Action a : mine) {
        if (is_communication(a.type)) continue;
        a.stage = static_cast<int64_t>(j);
        lanes[j].push_back(a);
      }
    }
    return lanes;
  };
  std::unique_ptr<detail::LossSink> sink;
  std::unique_ptr<RemoteDownstream> remote_downstream;
  if (is_last()) {
    // GPipe's order on the last stage (forwards first): the loss sees the whole mini-batch. The
    // same rule as GPipe::step's, on the schedule of as many micro-batches as chunks (fewer, for
    // a small mini-batch, change no schedule's answer but 1F1B's and ZB's at one micro-batch,
    // where the two losses are the same).
    const bool whole = detail::forwards_before_backwards(
        make_schedule(kind, stages, options_.chunks()).ranks, stages - 1);
    sink = std::make_unique<detail::LossSink>(options_.loss(), target, whole, who);
  } else {
    // Note [When gradients' receives are posted] in remote_link.h.
    const GradientReceives when = kind == ScheduleKind::kGPipe ? GradientReceives::kAfterLastSend
                                  : in_turn                    ? GradientReceives::kInTurn
                                                               : GradientReceives::kWithSend;
    remote_downstream = std::make_unique<RemoteDownstream>(
        wire, stage_ + 1, partitions_.back().device, when, turns_with(stage_ + 1));
  }

  detail::ExecutorSpec spec;
  spec.who = who;
  spec.partitions = &partitions_;
  spec.plan = plan;
  for (const std::unique_ptr<Worker>& w : workers_) spec.workers.push_back(w.get());
  spec.upstream = source ? static_cast<detail::Upstream*>(source.get()) : remote_upstream.get();
  spec.downstream =
      sink ? static_cast<detail::Downstream*>(sink.get()) : remote_downstream.get();
  spec.microbatches = 0;  // as the upstream's first activation says
  spec.grad_enabled = grad_enabled;
  spec.checkpoint_stop = [mode = options_.checkpoint(), training = is_training()](int64_t m) {
    return training ? checkpoint_stop(mode, m) : int64_t{0};
  };
  spec.run = next_run_id();
  // Captured before the deferred statistics' callback is added: the recomputation observes no
  // operator (Note [Deferred batch norm without replacing modules]).
  spec.recompute_state = std::make_shared<const ThreadState>();
  spec.timeline = timeline_;
  spec.skip_layout = &skip_layout_;
  // With deferred batch norm, the statistics gathered during the step are committed after it,
  // merged over the replicas first.
  std::vector<std::shared_ptr<BatchNormLayers>> batch_norms;
  for (const detail::ExecutorPartition& p : partitions_) batch_norms.push_back(p.batch_norms);
  {
    const DeferredBatchNormRun deferred_run(batch_norms, deferred);
    detail::run_schedule(spec);
    if (sink) sink->finish();
  }
  if (remote_downstream) remote_downstream->finish();
  if (remote_upstream) remote_upstream->finish();
  // The input's own graph, once.
  if (source) source->finish();
  if (deferred) {
    StatisticsCombiner combine;
    if (replica_group_) {
      combine = [this](std::vector<BatchNormStatistics>& statistics) {
        combine_statistics(replica_group_, statistics, local_);
      };
    }
    commit_deferred(batch_norms, combine);
  }
  if (grad_enabled && replica_group_) {
    average_gradients(replica_group_, layers_->parameters(), local_);
  }
  if (sink) {
    output_ = sink->output();
    return sink->loss();
  }
  return at::Tensor();
}

}  // namespace distributed
}  // namespace gpipe
