// A pipeline stage in a process of its own; see pipeline_stage.h and Note [Stage-local backward].
#include "gpipe/distributed/pipeline_stage.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/distributed/configuration.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/transfer.h"
#include "gpipe/partition.h"
#include "gpipe/skip_tracker.h"
#include "gpipe/skippable.h"
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
  if (rank < static_cast<int>(balance.size())) devices[rank] = options_.device();
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
  skip_layout_ = SkipLayout({layers_});
  batch_norms_ = std::make_shared<BatchNormLayers>(layers_->modules(/*include_self=*/false));
  grad_record_ = std::make_shared<GradRecord>();
  courier_ = std::make_unique<Worker>(absl::StrCat("send ", stage_));
  check_same_configuration(*module);
  if (replica_group_) {
    std::vector<at::Tensor> state = layers_->parameters();
    for (const at::Tensor& b : layers_->buffers()) state.push_back(b);
    broadcast_from_rank0(replica_group_, state, "replica 0's parameters and buffers");
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
                    "Every process of a pipeline must build the same model with the same options");
  if (replica_group_) {
    fields.emplace_back("which parameters require grad (hash)",
                        static_cast<int64_t>(requires_grad_key(layers_)));
    check_same_fields(replica_group_, fields, "gpipe::distributed::PipelineStage", "replica",
                      "Every replica of a pipeline must build the same model with the same "
                      "options");
  }
}

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
  const bool training = at::GradMode::is_enabled();
  timeline_ = options_.record_timeline() ? std::make_shared<Timeline>() : nullptr;
  // Note [Pipeline stages and batch norm].
  const bool deferred = options_.deferred_batch_norm() && is_training() &&
                        batch_norms_->size() > 0;
  if (replica_group_ && training && is_training() && !deferred && !layers_->buffers().empty()) {
    broadcast_from_rank0(replica_group_, layers_->buffers(), "replica 0's buffers");
  }

  // Forward: every micro-batch, in order (Note [Stage-local backward]).
  std::vector<Batch> inputs;
  int64_t m = 0;
  if (is_first()) {
    check_input(input);
    for (const at::Tensor& t : input.values()) {
      TORCH_CHECK(t.device() == options_.device(), who, ": the input is on ", t.device(),
                  " but stage 0 runs on ", options_.device(), "; move it there first");
    }
    inputs = scatter(input, options_.chunks());
    m = static_cast<int64_t>(inputs.size());
  }
  // Activations arrive on a thread of their own (Note [Receiving ahead] in transfer.h).
  std::unique_ptr<ActivationReceiver> receiver =
      is_first() ? nullptr : std::make_unique<ActivationReceiver>(group_, stage_ - 1);
  std::vector<Batch> outputs;
  // Posted by the courier thread (Note [Receiving ahead]).
  std::vector<std::shared_ptr<Transfer>> sends;          // activations forward, gradients back
  std::vector<std::shared_ptr<Transfer>> grad_receives;  // per micro-batch
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
  const uint64_t run = next_run_id();
  int64_t stop = -1;  // micro-batches before it are checkpointed; known with m
  // Times micro-batch i's forward or backward on the timeline, if one is recorded.
  const c10::Stream stream = current_stream(options_.device());
  const auto start = [&] { return timeline_ ? timeline_->start(stream) : Timeline::Started{}; };
  const auto record = [&](TimelineEvent::Kind kind, int64_t i, const Timeline::Started& started) {
    if (timeline_) {
      TimelineEvent event{kind, i, stage_};
      event.checkpointed = i < stop;
      timeline_->finish(event, started, stream);
    }
  };
  // Captured before the deferred statistics' callback is added: the recomputation observes no
  // operator (Note [Deferred batch norm without replacing modules]).
  const auto recompute_state = std::make_shared<const ThreadState>();
  const uint64_t params_key = requires_grad_key(layers_);
  // With deferred batch norm, the training-mode BatchNorms write their own updates to sinks
  // during the forwards, and the callback gathers the statistics; committed after the forwards.
  std::optional<BatchNormLayers::Redirect> deferred_redirect;
  std::optional<DeferredStatisticsScope> deferred_statistics;
  if (deferred) {
    batch_norms_->reset_statistics();
    deferred_redirect.emplace(batch_norms_->redirect());
    deferred_statistics.emplace();
  }
  for (int64_t i = 0; m == 0 || i < m; ++i) {
    if (!is_first()) {
      ActivationReceiver::Received r = receiver->next();
      m = r.header.microbatches;
      TORCH_CHECK(r.header.grad_enabled == training, who, ": stage ", stage_ - 1, " runs ",
                  r.header.grad_enabled ? "with" : "without", " grad but stage ", stage_, " ",
                  training ? "with" : "without", " it; call step() under the same grad mode "
                  "(torch::NoGradGuard for inference) on every stage");
      std::vector<at::Tensor> values;
      for (size_t t = 0; t < r.tensors.size(); ++t) {
        at::Tensor v = r.tensors[t].to(options_.device());
        if (r.header.entries[t].requires_grad) v.requires_grad_(true);
        values.push_back(std::move(v));
      }
      inputs.push_back(r.header.atomic ? Batch(values[0]) : Batch(std::move(values)));
    }
    if (stop < 0) {
      stop = training && is_training() ? checkpoint_stop(options_.checkpoint(), m) : 0;
    }
    const Timeline::Started started = start();
    TaskContext context;
    context.microbatch = MicroBatch{run, i};
    if (!skip_layout_.empty()) context.skips = std::make_shared<MicroBatchSkips>(&skip_layout_);
    auto run_layers = [layers = layers_, batch_norms = batch_norms_, context](const Batch& b) {
      TaskScope scope(context);
      if (batch_norms->size() > 0 && is_recomputing()) {
        // Note [Recomputation leaves running statistics alone] in batchnorm.h.
        BatchNormLayers::Redirect redirect = batch_norms->redirect();
        return run_partition(layers, b);
      }
      return run_partition(layers, b);
    };
    Batch out{std::vector<at::Tensor>{}};
    if (i < stop) {
      Checkpointing checkpointing(run_layers, inputs[i], options_.device(), recompute_state,
                                  grad_record_, params_key);
      out = checkpointing.checkpoint();
      checkpointing.recompute(out);
    } else {
      out = run_layers(inputs[i]);
    }
    record(TimelineEvent::Kind::kCompute, i, started);
    if (!is_last()) {
      sends.push_back(post(
          std::make_shared<Transfer>(group_, "sending activations to the next stage"),
          [header = BatchHeader::of(out, m, training).encode(), wire = to_wire(out.values()),
           peer = stage_ + 1, i](Transfer& t) {
            t.send({header}, peer, Message::kHeader, i);
            t.send(wire, peer, Message::kActivation, i);
          }));
      // The gradients of this micro-batch's outputs come back from the next stage.
      std::vector<at::Tensor> buffers;
      if (training) {
        for (const at::Tensor& t : requiring_grad(out)) {
          buffers.push_back(at::empty(t.sizes(), t.options().device(at::kCPU)));
        }
      }
      grad_receives.push_back(post(
          std::make_shared<Transfer>(group_, "receiving gradients from the next stage"),
          [buffers = std::move(buffers), peer = stage_ + 1, i](Transfer& t) {
            t.receive(buffers, peer, Message::kGradient, i);
          }));
    }
    outputs.push_back(std::move(out));
  }
  if (deferred) {
    deferred_statistics.reset();
    deferred_redirect.reset();
    if (replica_group_) {
      std::vector<BatchNormStatistics> statistics = batch_norms_->statistics();
      combine_statistics(replica_group_, statistics);
      batch_norms_->commit(&statistics);
    } else {
      batch_norms_->commit();
    }
  }

  // The last stage: the loss of the whole mini-batch, and from it each micro-batch's output
  // gradients, through leaves standing for the outputs.
  at::Tensor loss;
  std::vector<std::vector<at::Tensor>> output_grads(m);
  if (is_last()) {
    std::vector<Batch> leaves;
    for (const Batch& out : outputs) {
      std::vector<at::Tensor> values;
      for (const at::Tensor& t : out.values()) {
        values.push_back(t.requires_grad() ? t.detach().requires_grad_(true) : t);
      }
      leaves.push_back(out.atomic() ? Batch(values[0]) : Batch(std::move(values)));
    }
    const Batch output = gather(leaves);
    loss = options_.loss()(output, target);
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
  }

  // Backward: the micro-batches in reverse, each as soon as its output gradients are here.
  for (int64_t i = m - 1; i >= 0 && training; --i) {
    if (!is_last()) {
      grad_receives[i]->wait();
      for (const at::Tensor& g : grad_receives[i]->tensors()) {
        output_grads[i].push_back(g.to(options_.device()));
      }
    }
    const Timeline::Started started = start();
    const std::vector<at::Tensor> roots = requiring_grad(outputs[i]);
    TORCH_CHECK(roots.size() == output_grads[i].size(), who, ": stage ", stage_, " got ",
                output_grads[i].size(), " gradients for micro-batch ", i, " but has ",
                roots.size(), " outputs that require grad");
    if (!roots.empty()) {
      torch::autograd::backward(roots, output_grads[i]);
    }
    outputs[i] = Batch(std::vector<at::Tensor>{});  // the graph is spent
    record(TimelineEvent::Kind::kBackward, i, started);
    if (!is_first()) {
      std::vector<at::Tensor> grads;
      for (const at::Tensor& leaf : requiring_grad(inputs[i])) {
        grads.push_back(grad_or_zeros(leaf));
      }
      sends.push_back(post(
          std::make_shared<Transfer>(group_, "sending gradients to the previous stage"),
          [wire = to_wire(grads), peer = stage_ - 1, i](Transfer& t) {
            t.send(wire, peer, Message::kGradient, i);
          }));
    }
  }
  for (const auto& send : sends) {
    send->wait();
  }
  if (training && replica_group_) {
    average_gradients(replica_group_, layers_->parameters());
  }
  return loss;
}

std::vector<TimelineEvent> PipelineStageImpl::gather_timeline() {
  TORCH_CHECK(timeline_, "gpipe::distributed::PipelineStage::gather_timeline: no timeline was "
              "recorded; set PipelineStageOptions::record_timeline and run a step first");
  // Each event as 5 doubles: kind, micro-batch, checkpointed, start and end on the host's clock.
  const std::vector<TimelineEvent> mine = timeline_->events();
  const double origin = timeline_->origin_us();
  const int size = group_->getSize();
  std::vector<at::Tensor> count{at::tensor({static_cast<int64_t>(mine.size())}, at::kLong)};
  std::vector<std::vector<at::Tensor>> counts(1);
  for (int r = 0; r < size; ++r) counts[0].push_back(at::empty_like(count[0]));
  check_collective(group_, "the gather of the stages' timelines",
                   [&] { group_->allgather(counts, count)->wait(); });
  int64_t most = 0;
  for (const at::Tensor& c : counts[0]) most = std::max(most, c.item<int64_t>());
  std::vector<at::Tensor> packed{at::zeros({std::max<int64_t>(most, 1), 5}, at::kDouble)};
  for (size_t k = 0; k < mine.size(); ++k) {
    const TimelineEvent& e = mine[k];
    at::Tensor row = packed[0][static_cast<int64_t>(k)];
    row[0] = static_cast<double>(e.kind);
    row[1] = static_cast<double>(e.microbatch);
    row[2] = e.checkpointed ? 1.0 : 0.0;
    row[3] = origin + e.start_us;
    row[4] = origin + e.end_us;
  }
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < size; ++r) all[0].push_back(at::empty_like(packed[0]));
  check_collective(group_, "the gather of the stages' timelines",
                   [&] { group_->allgather(all, packed)->wait(); });
  std::vector<TimelineEvent> events;
  double earliest = std::numeric_limits<double>::infinity();
  for (int r = 0; r < size; ++r) {
    const int64_t n = counts[0][r].item<int64_t>();
    const at::Tensor rows = all[0][r];
    for (int64_t k = 0; k < n; ++k) {
      TimelineEvent e{static_cast<TimelineEvent::Kind>(rows[k][0].item<double>()),
                      static_cast<int64_t>(rows[k][1].item<double>()), r};
      e.checkpointed = rows[k][2].item<double>() != 0;
      e.start_us = rows[k][3].item<double>();
      e.end_us = rows[k][4].item<double>();
      earliest = std::min(earliest, e.start_us);
      events.push_back(e);
    }
  }
  for (TimelineEvent& e : events) {
    e.start_us -= earliest;
    e.end_us -= earliest;
  }
  return events;
}

}  // namespace distributed
}  // namespace gpipe
