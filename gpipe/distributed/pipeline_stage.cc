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
#include "gpipe/distributed/local_link.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/transfer.h"
#include "gpipe/device.h"
#include "gpipe/partition.h"
#include "gpipe/skip_tracker.h"
#include "gpipe/skippable.h"
#include "gpipe/stream.h"
#include "gpipe/thread_state.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace distributed {
namespace {

// The tensors of `batch` that require grad (the ones whose gradients cross to the previous stage),
// in order.
std::vector<at::Tensor> requiring_grad(const Batch& batch) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : batch.values()) {
    if (t.requires_grad()) out.push_back(t);
  }
  return out;
}

// The calling thread's current stream on `wire` when it is a GPU (Transfer's `stream`).
c10::optional<c10::Stream> wire_stream_of(c10::Device wire) {
  return wire.is_cuda() ? c10::make_optional(current_stream(wire)) : c10::nullopt;
}

// The gradient a leaf collected, or zeros when its micro-batch's outputs did not depend on it.
at::Tensor grad_or_zeros(const at::Tensor& leaf) {
  return leaf.grad().defined() ? leaf.grad() : at::zeros_like(leaf);
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
    Partition p;
    p.layers = local[j];
    p.device = partition_devices[j];
    p.batch_norms = std::make_shared<BatchNormLayers>(p.layers->modules(/*include_self=*/false));
    p.grad_record = std::make_shared<GradRecord>();
    if (j > 0) p.worker = std::make_unique<Worker>(absl::StrCat("stage ", stage_, " part ", j));
    partitions_.push_back(std::move(p));
  }
  // Transfers with the neighbouring stages: through the CPU (Gloo), or on this stage's first
  // GPU (NCCL).
  local_ = partitions_[0].device;
  for (const Partition& p : partitions_) {
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
}

void PipelineStageImpl::check_same_configuration(const torch::nn::Module& whole) {
  // The whole model, not only this stage's layers: every process builds the same Sequential.
  std::vector<std::pair<std::string, int64_t>> fields = module_fields(whole);
  fields.emplace_back("stages", stages());
  fields.emplace_back("balance (hash)",
                      static_cast<int64_t>(fingerprint(absl::StrJoin(options_.balance(), ","))));
  fields.emplace_back("chunks", options_.chunks());
  fields.emplace_back("checkpoint mode", static_cast<int64_t>(options_.checkpoint()));
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

// One step's state, shared by the partitions' threads.
struct PipelineStageImpl::StepContext {
  bool training = false;
  at::Tensor target;
  uint64_t run = 0;
  std::vector<Batch> inputs;  // stage 0: the mini-batch's micro-batches
  // The thread state checkpointed micro-batches are recomputed under (before the deferred
  // statistics' callback: Note [Deferred batch norm without replacing modules]).
  std::shared_ptr<const ThreadState> recompute_state;
  std::unique_ptr<ActivationReceiver> receiver;  // every stage but the first
  std::vector<std::unique_ptr<LocalLink>> links;  // links[j]: partitions j and j + 1
  std::vector<std::vector<std::shared_ptr<Transfer>>> sends;  // each partition's
  at::Tensor loss;
  absl::Mutex mu;
  std::exception_ptr error ABSL_GUARDED_BY(mu);  // the first partition's to fail
  // Skips between this stage's partitions: each micro-batch's tracker, and for each stashing
  // partition and micro-batch the popped tensors with the gradients the popping partitions caught
  // (Note [Partitions within a stage]).
  std::map<int64_t, std::shared_ptr<MicroBatchSkips>> skips ABSL_GUARDED_BY(mu);
  std::vector<std::map<int64_t, std::vector<std::pair<at::Tensor, at::Tensor>>>> skip_grads
      ABSL_GUARDED_BY(mu);

  std::shared_ptr<MicroBatchSkips> skips_of(int64_t microbatch, const SkipLayout* layout) {
    absl::MutexLock lock(&mu);
    std::shared_ptr<MicroBatchSkips>& tracker = skips[microbatch];
    if (!tracker) tracker = std::make_shared<MicroBatchSkips>(layout);
    return tracker;
  }
};

at::Tensor PipelineStageImpl::step(const Batch& input, const at::Tensor& target) {
  const char* who = "gpipe::distributed::PipelineStage::step";
  TORCH_CHECK(!is_first() || input.size() > 0, who, ": stage 0 needs the mini-batch as input");
  TORCH_CHECK(is_first() || input.size() == 0, who, ": stage ", stage_, " takes no input (only "
              "stage 0 does; its activations come from stage ", stage_ - 1, ")");
  TORCH_CHECK(!is_last() || options_.loss(), who, ": the last stage (", stage_, ") needs a loss "
              "function: PipelineStageOptions::loss");
  absl::MutexLock step_lock(&step_mu_);
  TORCH_CHECK(!failed_, who, ": an earlier step failed on this stage, which leaves transfers "
              "of the pipeline unmatched; make new process groups and stages to go on");
  // A step that leaves by an exception marks the stage failed (see above).
  struct FailOnThrow {
    bool& failed;
    int uncaught = std::uncaught_exceptions();
    ~FailOnThrow() {
      if (std::uncaught_exceptions() > uncaught) failed = true;
    }
  } fail_on_throw{failed_};
  timeline_ = options_.record_timeline() ? std::make_shared<Timeline>() : nullptr;
  StepContext context;
  context.training = at::GradMode::is_enabled();
  context.target = target;
  context.run = next_run_id();
  // Note [Pipeline stages and batch norm].
  bool any_batch_norm = false;
  for (const Partition& p : partitions_) any_batch_norm |= p.batch_norms->size() > 0;
  const bool deferred = options_.deferred_batch_norm() && is_training() && any_batch_norm;
  if (replica_group_ && context.training && is_training() && !deferred &&
      !layers_->buffers().empty()) {
    broadcast_from_rank0(replica_group_, layers_->buffers(), "replica 0's buffers", local_);
  }
  if (is_first()) {
    check_input(input);
    for (const at::Tensor& t : input.values()) {
      TORCH_CHECK(t.device() == partitions_[0].device, who, ": the input is on ", t.device(),
                  " but stage 0 runs on ", partitions_[0].device, "; move it there first");
    }
    context.inputs = scatter(input, options_.chunks());
  }
  // The micro-batches leave the input's graph (a layer before the stage, or the input's own
  // split): the first partition's backward of each micro-batch stops at a leaf, and the input's
  // graph runs once, at the end of the step, with all the leaves' gradients.
  std::vector<at::Tensor> input_roots, input_leaves;
  if (context.training) {
    for (Batch& b : context.inputs) {
      for (at::Tensor& t : b.values()) {
        if (!t.defined() || !t.requires_grad()) continue;
        input_roots.push_back(t);
        t = t.detach().requires_grad_(true);
        input_leaves.push_back(t);
      }
    }
  }
  // Captured before the deferred statistics' callback is added: the recomputation observes no
  // operator (Note [Deferred batch norm without replacing modules]).
  context.recompute_state = std::make_shared<const ThreadState>();
  // With deferred batch norm, the training-mode BatchNorms write their own updates to sinks
  // during the forwards, and the callback gathers the statistics; committed after the step.
  std::vector<BatchNormLayers::Redirect> deferred_redirects;
  std::optional<DeferredStatisticsScope> deferred_statistics;
  if (deferred) {
    for (Partition& p : partitions_) {
      p.batch_norms->reset_statistics();
      deferred_redirects.push_back(p.batch_norms->redirect());
    }
    deferred_statistics.emplace();
  }
  // Activations arrive on a thread of their own (Note [Receiving ahead] in transfer.h).
  if (!is_first()) {
    context.receiver =
        std::make_unique<ActivationReceiver>(group_, stage_ - 1, wire_, wire_stream_of(wire_));
  }
  const size_t k = partitions_.size();
  for (size_t j = 0; j + 1 < k; ++j) {
    context.links.push_back(std::make_unique<LocalLink>(static_cast<int64_t>(j),
                                                        partitions_[j].device,
                                                        partitions_[j + 1].device));
  }
  context.sends.resize(k);
  {
    absl::MutexLock lock(&context.mu);
    context.skip_grads.resize(k);
  }

  // Each partition on its own thread, the first on this one (Note [Partitions within a stage]);
  // the others under this thread's state (grad mode, autocast, the statistics' callback).
  const std::unique_ptr<ThreadState> worker_state =
      k > 1 ? std::make_unique<ThreadState>() : nullptr;
  // Keeps the first error of the step and fails the links of the partitions that caused it.
  const auto fail = [&](std::exception_ptr error, size_t from, size_t to, const std::string& why) {
    {
      absl::MutexLock lock(&context.mu);
      if (!context.error) context.error = std::move(error);
    }
    for (size_t l = from; l < to && l < context.links.size(); ++l) context.links[l]->fail(why);
  };
  const auto run = [&](size_t j) {
    try {
      std::optional<ThreadStateGuard> guard;
      if (j > 0) guard.emplace(*worker_state);
      run_stage_partition(j, context);
    } catch (...) {
      // Its links: j - 1 (to the partition before) and j (to the one after).
      fail(std::current_exception(), j > 0 ? j - 1 : 0, j + 1,
           absl::StrCat("partition ", j, " failed"));
    }
  };
  std::vector<absl::Notification> done(k);
  size_t started = 1;  // partitions running (the first on this thread)
  try {
    for (size_t j = 1; j < k; ++j) {
      partitions_[j].worker->submit([&, j] {
        run(j);
        done[j].Notify();
      });
      started = j + 1;
    }
  } catch (...) {
    // A partition that could not start (out of memory): the started ones must not wait for it.
    fail(std::current_exception(), 0, context.links.size(), "a partition could not start");
  }
  if (started == k) run(0);
  for (size_t j = 1; j < started; ++j) done[j].WaitForNotification();
  std::exception_ptr error;
  {
    absl::MutexLock lock(&context.mu);
    error = context.error;
    if (error) {
      // Unpopped skips of checkpointed stashes would keep their graphs alive (MicroBatchSkips::
      // clear).
      for (auto& entry : context.skips) entry.second->clear();
    }
  }
  if (error) std::rethrow_exception(error);
  for (const auto& sends : context.sends) {
    for (const auto& send : sends) send->wait();
  }
  // The input's own graph, once (see above).
  std::vector<at::Tensor> roots, grads;
  for (size_t k2 = 0; k2 < input_roots.size(); ++k2) {
    if (input_leaves[k2].grad().defined()) {
      roots.push_back(input_roots[k2]);
      grads.push_back(input_leaves[k2].grad());
    }
  }
  if (!roots.empty()) torch::autograd::backward(roots, grads);
  if (deferred) {
    deferred_statistics.reset();
    deferred_redirects.clear();
    std::vector<BatchNormStatistics> statistics;
    for (const Partition& p : partitions_) {
      for (BatchNormStatistics& s : p.batch_norms->statistics()) statistics.push_back(s);
    }
    if (replica_group_) combine_statistics(replica_group_, statistics, local_);
    size_t next = 0;
    for (Partition& p : partitions_) {
      std::vector<BatchNormStatistics> mine(statistics.begin() + next,
                                            statistics.begin() + next + p.batch_norms->size());
      next += p.batch_norms->size();
      p.batch_norms->commit(&mine);
    }
  }
  if (context.training && replica_group_) {
    average_gradients(replica_group_, layers_->parameters(), local_);
  }
  return context.loss;
}

void PipelineStageImpl::run_stage_partition(size_t j, StepContext& context) {
  const char* who = "gpipe::distributed::PipelineStage::step";
  Partition& part = partitions_[j];
  const bool first = j == 0;
  const bool last = j + 1 == partitions_.size();
  const bool training = context.training;
  // Posted by the courier thread (Note [Receiving ahead]), in the order of Note [Point-to-point
  // order], with tensors on the wire's device (the CPU for Gloo) and, on a GPU, each after the
  // work queued on this thread's stream before its Transfer was made.
  std::vector<std::shared_ptr<Transfer>>& sends = context.sends[j];
  std::vector<std::shared_ptr<Transfer>> grad_receives;  // per micro-batch, from the next stage
  const c10::Device wire = wire_;
  const c10::optional<c10::Stream> wire_stream = wire_stream_of(wire);
  const auto post = [this](std::shared_ptr<Transfer> transfer,
                           std::function<void(Transfer&)> operations) {
    courier_->submit([transfer, operations = std::move(operations)] {
      try {
        operations(*transfer);
        transfer->set_posted();
      } catch (...) {
        transfer->set_posted(std::current_exception());
      }
    });
    return transfer;
  };

  // Forward: every micro-batch, in order (Note [Stage-local backward]).
  std::vector<Batch> inputs;
  int64_t m = 0;
  if (first && is_first()) {
    inputs = std::move(context.inputs);
    m = static_cast<int64_t>(inputs.size());
  }
  std::vector<Batch> outputs;
  int64_t stop = -1;  // micro-batches before it are checkpointed; known with m
  // Times micro-batch i's forward or backward on the timeline, if one is recorded.
  const c10::Stream stream = current_stream(part.device);
  const auto start = [&] { return timeline_ ? timeline_->start(stream) : Timeline::Started{}; };
  const auto record = [&](TimelineEvent::Kind kind, int64_t i, const Timeline::Started& started) {
    if (timeline_) {
      TimelineEvent event{kind, i, static_cast<int64_t>(j)};
      event.checkpointed = i < stop;
      timeline_->finish(event, started, stream);
    }
  };
  const uint64_t params_key = requires_grad_key(part.layers);
  // Per micro-batch, the skips from earlier partitions cut at this one's input.
  std::vector<std::vector<MicroBatchSkips::Cut>> cuts;
  for (int64_t i = 0; m == 0 || i < m; ++i) {
    if (first && !is_first()) {
      ActivationReceiver::Received r = context.receiver->next();
      m = r.header.microbatches;
      TORCH_CHECK(r.header.grad_enabled == training, who, ": stage ", stage_ - 1, " runs ",
                  r.header.grad_enabled ? "with" : "without", " grad but stage ", stage_, " ",
                  training ? "with" : "without", " it; call step() under the same grad mode "
                  "(torch::NoGradGuard for inference) on every stage");
      std::vector<at::Tensor> values;
      for (size_t t = 0; t < r.tensors.size(); ++t) {
        at::Tensor v = r.tensors[t].to(part.device);
        if (r.header.entries[t].requires_grad) v.requires_grad_(true);
        values.push_back(std::move(v));
      }
      inputs.push_back(r.header.atomic ? Batch(values[0]) : Batch(std::move(values)));
    } else if (!first) {
      LocalLink::Activation a = context.links[j - 1]->next_activation();
      m = a.microbatches;
      inputs.push_back(std::move(a.batch));
    }
    if (stop < 0) {
      stop = training && is_training() ? checkpoint_stop(options_.checkpoint(), m) : 0;
    }
    const Timeline::Started started = start();
    TaskContext task;
    task.microbatch = MicroBatch{context.run, i};
    std::vector<MicroBatchSkips::Cut> cut;
    if (!skip_layout_.empty()) {
      std::shared_ptr<MicroBatchSkips> shared = context.skips_of(i, &skip_layout_);
      if (!skip_layout_.routes_into(static_cast<int64_t>(j)).empty()) {
        // The skips from earlier partitions move to this one's device (every stream is the
        // device's current one: each partition computes and copies on its thread's streams).
        std::vector<c10::Stream> streams;
        for (const Partition& p : partitions_) streams.push_back(current_stream(p.device));
        std::vector<std::vector<c10::Stream>> copy_streams;
        for (const c10::Stream& s : streams) copy_streams.emplace_back(i + 1, s);
        shared->fence(i, static_cast<int64_t>(j), streams, copy_streams);
      }
      if (training) cut = shared->cut(static_cast<int64_t>(j));
      task.skips = std::move(shared);
    }
    cuts.push_back(std::move(cut));
    auto run_layers = [layers = part.layers, batch_norms = part.batch_norms,
                       task](const Batch& b) {
      TaskScope scope(task);
      if (batch_norms->size() > 0 && is_recomputing()) {
        // Note [Recomputation leaves running statistics alone] in batchnorm.h.
        BatchNormLayers::Redirect redirect = batch_norms->redirect();
        return run_partition(layers, b);
      }
      return run_partition(layers, b);
    };
    Batch out{std::vector<at::Tensor>{}};
    if (i < stop) {
      Checkpointing checkpointing(run_layers, inputs[i], part.device, context.recompute_state,
                                  part.grad_record, params_key);
      out = checkpointing.checkpoint();
      checkpointing.recompute(out);
    } else {
      out = run_layers(inputs[i]);
    }
    record(TimelineEvent::Kind::kCompute, i, started);
    if (!last) {
      context.links[j]->send_activation(m, out);
    } else if (!is_last()) {
      // (The tensors first: on a GPU the Transfer's sends follow the work queued before it.)
      at::Tensor header = BatchHeader::of(out, m, training).encode().to(wire);
      std::vector<at::Tensor> tensors = to_wire(out.values(), wire);
      sends.push_back(post(
          std::make_shared<Transfer>(group_, "sending activations to the next stage",
                                     wire_stream),
          [header = std::move(header), tensors = std::move(tensors), peer = stage_ + 1,
           i](Transfer& t) {
            t.send({header}, peer, Message::kHeader, i);
            t.send(tensors, peer, Message::kActivation, i);
          }));
    }
    outputs.push_back(std::move(out));
  }
  // The gradients of the outputs come back from the next stage: their receives are posted after
  // the last activations' send, in the order the next stage sends them (Note [Point-to-point
  // order]).
  if (last && !is_last() && training) {
    grad_receives.resize(static_cast<size_t>(m));
    for (int64_t i = m - 1; i >= 0; --i) {
      std::vector<at::Tensor> buffers;
      for (const at::Tensor& t : requiring_grad(outputs[i])) {
        buffers.push_back(at::empty(t.sizes(), t.options().device(wire)));
      }
      grad_receives[i] = post(
          std::make_shared<Transfer>(group_, "receiving gradients from the next stage",
                                     wire_stream),
          [buffers = std::move(buffers), peer = stage_ + 1, i](Transfer& t) {
            t.receive(buffers, peer, Message::kGradient, i);
          });
    }
  }

  // The last stage: the loss of the whole mini-batch, and from it each micro-batch's output
  // gradients, through leaves standing for the outputs.
  std::vector<std::vector<at::Tensor>> output_grads(m);
  if (last && is_last()) {
    std::vector<Batch> leaves;
    for (const Batch& out : outputs) {
      std::vector<at::Tensor> values;
      for (const at::Tensor& t : out.values()) {
        values.push_back(t.requires_grad() ? t.detach().requires_grad_(true) : t);
      }
      leaves.push_back(out.atomic() ? Batch(values[0]) : Batch(std::move(values)));
    }
    const Batch output = gather(leaves);
    at::Tensor loss = options_.loss()(output, context.target);
    output_ = output;
    for (at::Tensor& t : output_.values()) t = t.detach();
    if (training && loss.requires_grad()) {
      loss.backward();
    }
    for (int64_t i = 0; i < m && training; ++i) {
      for (const at::Tensor& leaf : requiring_grad(leaves[i])) {
        output_grads[i].push_back(grad_or_zeros(leaf));
      }
    }
    context.loss = loss;
  }

  // Backward: the micro-batches in reverse, each as soon as its output gradients are here.
  for (int64_t i = m - 1; i >= 0 && training; --i) {
    if (!last) {
      output_grads[i] = context.links[j]->gradients(i);
    } else if (!is_last()) {
      grad_receives[i]->wait();
      for (const at::Tensor& g : grad_receives[i]->tensors()) {
        output_grads[i].push_back(g.to(part.device));
      }
    }
    const Timeline::Started started = start();
    std::vector<at::Tensor> roots = requiring_grad(outputs[i]);
    TORCH_CHECK(roots.size() == output_grads[i].size(), who, ": stage ", stage_, " got ",
                output_grads[i].size(), " gradients for micro-batch ", i, " but has ",
                roots.size(), " outputs that require grad");
    // The skips this partition stashed and later ones popped: more roots, with the gradients
    // caught there (they are complete: those partitions ran this micro-batch's backward first).
    {
      absl::MutexLock lock(&context.mu);
      auto it = context.skip_grads[j].find(i);
      if (it != context.skip_grads[j].end()) {
        for (auto& [tensor, grad] : it->second) {
          roots.push_back(std::move(tensor));
          output_grads[i].push_back(std::move(grad));
        }
        context.skip_grads[j].erase(it);
      }
    }
    if (!roots.empty()) {
      torch::autograd::backward(roots, output_grads[i]);
    }
    // The skips this partition popped from earlier ones: their gradients, for the stashing
    // partitions (before this micro-batch's gradients go back, which they follow).
    if (!cuts[i].empty()) {
      absl::MutexLock lock(&context.mu);
      for (MicroBatchSkips::Cut& cut : cuts[i]) {
        if (cut.leaf.grad().defined()) {
          context.skip_grads[cut.from][i].emplace_back(std::move(cut.tensor), cut.leaf.grad());
        }
      }
      cuts[i].clear();
    }
    outputs[i] = Batch(std::vector<at::Tensor>{});  // the graph is spent
    record(TimelineEvent::Kind::kBackward, i, started);
    if (first && is_first()) continue;
    std::vector<at::Tensor> grads;
    for (const at::Tensor& leaf : requiring_grad(inputs[i])) {
      grads.push_back(grad_or_zeros(leaf));
    }
    if (!first) {
      context.links[j - 1]->send_gradients(i, grads);
    } else {
      std::vector<at::Tensor> tensors = to_wire(grads, wire);
      sends.push_back(post(
          std::make_shared<Transfer>(group_, "sending gradients to the previous stage",
                                     wire_stream),
          [tensors = std::move(tensors), peer = stage_ - 1, i](Transfer& t) {
            t.send(tensors, peer, Message::kGradient, i);
          }));
    }
  }
}

std::vector<TimelineEvent> PipelineStageImpl::gather_timeline() {
  TORCH_CHECK(timeline_, "gpipe::distributed::PipelineStage::gather_timeline: no timeline was "
              "recorded; set PipelineStageOptions::record_timeline and run a step first");
  // Each stage's number of events and of partitions; then each event as 6 doubles: kind,
  // micro-batch, checkpointed, start and end on the host's clock, partition within its stage.
  const std::vector<TimelineEvent> mine = timeline_->events();
  const double origin = timeline_->origin_us();
  const int size = group_->getSize();
  const char* what = "the gather of the stages' timelines";
  const std::vector<at::Tensor> counts = all_gather(
      group_, at::tensor({static_cast<int64_t>(mine.size()), partitions()}, at::kLong), local_,
      what);
  int64_t most = 0;
  for (const at::Tensor& c : counts) most = std::max(most, c[0].item<int64_t>());
  at::Tensor packed = at::zeros({std::max<int64_t>(most, 1), 6}, at::kDouble);
  for (size_t k = 0; k < mine.size(); ++k) {
    const TimelineEvent& e = mine[k];
    at::Tensor row = packed[static_cast<int64_t>(k)];
    row[0] = static_cast<double>(e.kind);
    row[1] = static_cast<double>(e.microbatch);
    row[2] = e.checkpointed ? 1.0 : 0.0;
    row[3] = origin + e.start_us;
    row[4] = origin + e.end_us;
    row[5] = static_cast<double>(e.partition);
  }
  const std::vector<at::Tensor> all = all_gather(group_, packed, local_, what);
  std::vector<TimelineEvent> events;
  double earliest = std::numeric_limits<double>::infinity();
  int64_t first_partition = 0;  // of stage r, in the whole pipeline
  for (int r = 0; r < size; ++r) {
    const int64_t n = counts[r][0].item<int64_t>();
    const at::Tensor rows = all[r];
    for (int64_t k = 0; k < n; ++k) {
      TimelineEvent e{static_cast<TimelineEvent::Kind>(rows[k][0].item<double>()),
                      static_cast<int64_t>(rows[k][1].item<double>()),
                      first_partition + static_cast<int64_t>(rows[k][5].item<double>())};
      e.checkpointed = rows[k][2].item<double>() != 0;
      e.start_us = rows[k][3].item<double>();
      e.end_us = rows[k][4].item<double>();
      earliest = std::min(earliest, e.start_us);
      events.push_back(e);
    }
    first_partition += counts[r][1].item<int64_t>();
  }
  for (TimelineEvent& e : events) {
    e.start_us -= earliest;
    e.end_us -= earliest;
  }
  return events;
}

}  // namespace distributed
}  // namespace gpipe
