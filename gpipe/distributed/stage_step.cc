// A pipeline stage's training step (PipelineStage::step): its links to the neighbouring stages,
// the executor's run of its partitions, and what follows (deferred batch norm, replicas); see
// pipeline_stage.h and Note [Failing fast across processes] in fault.h.
#include <algorithm>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "gpipe/distributed/internal/fault.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/internal/remote_link.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/internal/shared_memory.h"
#include "gpipe/distributed/internal/tied_stages.h"
#include "gpipe/distributed/internal/transfer.h"
#include "gpipe/internal/error_text.h"
#include "gpipe/internal/executor.h"
#include "gpipe/microbatch.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/internal/stream.h"
#include "gpipe/thread_state.h"

namespace gpipe {
namespace distributed {
namespace {

// The calling thread's current stream on `wire` when it is a GPU (Transfer's `stream`).
c10::optional<c10::Stream> wire_stream_of(c10::Device wire) {
  return wire.is_cuda() ? c10::make_optional(gpipe::internal::current_stream(wire)) : c10::nullopt;
}

// This stage's actions for m micro-batches: each of its partitions runs them in order (Note
// [Partitions within a stage] in pipeline_stage.h), or, with virtual stages (`held`: the
// entries of balance it holds), its one lane runs theirs.
std::function<std::vector<std::vector<Action>>(int64_t)> lanes_of(ScheduleKind kind, int64_t stages,
                                                                  int64_t me, int64_t k, int64_t v,
                                                                  int64_t group,
                                                                  std::vector<int64_t> held) {
  return [kind, stages, me, k, v, group, held = std::move(held)](int64_t m) {
    std::vector<Action> mine = make_schedule(kind, stages, m, v, group).ranks[me];
    const bool virtual_stages = held.size() > 1;
    std::vector<std::vector<Action>> lanes(virtual_stages ? 1 : k);
    for (size_t j = 0; j < lanes.size(); ++j) {
      for (Action a : mine) {
        if (is_communication(a.type)) continue;
        a.stage = virtual_stages ? std::find(held.begin(), held.end(), a.stage) - held.begin()
                                 : static_cast<int64_t>(j);
        lanes[j].push_back(a);
      }
    }
    return lanes;
  };
}

// The executor's ends of this stage's partitions: the input or remote upstreams, the loss or
// remote downstreams. With virtual stages (`held`, more than one): each one's own links, in
// links()'s order, and none (a LocalLink) between two that are neighbours.
void attach_links(
    gpipe::internal::ExecutorSpec& spec, gpipe::internal::InputSource* source,
    gpipe::internal::LossSink* sink,
    const std::vector<std::unique_ptr<internal::RemoteUpstream>>& remote_upstreams,
    const std::vector<std::unique_ptr<internal::RemoteDownstream>>& remote_downstreams,
    const std::vector<int64_t>& held, int64_t last) {
  if (held.size() < 2) {
    spec.upstream =
        source ? static_cast<gpipe::internal::Upstream*>(source) : remote_upstreams[0].get();
    spec.downstream =
        sink ? static_cast<gpipe::internal::Downstream*>(sink) : remote_downstreams[0].get();
    return;
  }
  size_t up = 0, down = 0;
  for (size_t c = 0; c < held.size(); ++c) {
    const int64_t k = held[c];
    gpipe::internal::Upstream* from = nullptr;
    if (k == 0) {
      from = source;
    } else if (c == 0 || held[c - 1] != k - 1) {
      from = remote_upstreams[up++].get();
    }
    gpipe::internal::Downstream* to = nullptr;
    if (k == last) {
      to = sink;
    } else if (c + 1 == held.size() || held[c + 1] != k + 1) {
      to = remote_downstreams[down++].get();
    }
    spec.upstreams.push_back(from);
    spec.downstreams.push_back(to);
  }
  TORCH_INTERNAL_ASSERT(up == remote_upstreams.size() && down == remote_downstreams.size());
}

// The last stage's loss. GPipe's order on the last stage (forwards first): the loss sees the
// whole mini-batch. The same rule as GPipe::step's, on the schedule of as many micro-batches as
// chunks (fewer, for a small mini-batch, change no schedule's answer but 1F1B's and ZB's at one
// micro-batch, where the two losses are the same).
std::unique_ptr<gpipe::internal::LossSink> loss_sink(const PipelineStageOptions& options,
                                                     int64_t stages, const at::Tensor& target,
                                                     const Loss& loss, const char* who) {
  const PipelineSchedule& schedule = options.schedule();
  const int64_t v = schedule.virtual_stages();
  const int64_t group = schedule.interleaves() ? schedule.microbatch_group() : 0;
  const bool whole = gpipe::internal::forwards_before_backwards(
      make_schedule(schedule.kind(), stages, options.chunks(), v, group).ranks, stages * v - 1);
  return std::make_unique<gpipe::internal::LossSink>(loss, target, whole, who);
}

}  // namespace

bool PipelineStageImpl::begin_step(bool grad_enabled) {
  timeline_ = record_timeline_ ? std::make_shared<Timeline>() : nullptr;
  tied_->refresh();
  if (grad_enabled) tied_stages_->begin_step();  // Note [Ties across stages]
  // Note [Pipeline stages and batch norm].
  bool any_batch_norm = false;
  for (const gpipe::internal::ExecutorPartition& p : partitions_) {
    any_batch_norm |= p.batch_norms->size() > 0;
  }
  const bool deferred = options_.deferred_batch_norm() && is_training() && any_batch_norm;
  if (replica_group_ && grad_enabled && is_training() && !deferred &&
      !layers_->buffers().empty()) {
    broadcast_from_rank0(replica_group_, layers_->buffers(), "replica 0's buffers", local_);
  }
  return deferred;
}

std::unique_ptr<gpipe::internal::InputSource> PipelineStageImpl::input_source(
    const Batch& input, bool grad_enabled, const char* who) const {
  check_input(input);
  for (const at::Tensor& t : input.values()) {
    TORCH_CHECK(t.device() == partitions_[0].device, who, ": the input is on ", t.device(),
                " but stage 0 runs on ", partitions_[0].device, "; move it there first");
  }
  std::vector<Batch> microbatches = scatter(input, options_.chunks());
  const int64_t m = static_cast<int64_t>(microbatches.size());
  // Note [Micro-batch groups] in schedule.h (0: the default, n).
  const int64_t group = options_.schedule().microbatch_group();
  const int64_t stages = this->stages();
  TORCH_CHECK(!options_.schedule().interleaves() || m % (group > 0 ? group : stages) == 0, who,
              ": the mini-batch of ", input[0].size(0), " samples splits into ", m,
              " micro-batches (chunks ", options_.chunks(),
              "), but the interleaved schedule needs a multiple of ",
              group > 0 ? "the micro-batch group, " : "the stages, ", group > 0 ? group : stages,
              "; give a mini-batch that splits into chunks "
              "micro-batches (a multiple of chunks samples always does), or drop the last "
              "partial one (torch::data's DataLoaderOptions::drop_last)");
  return std::make_unique<gpipe::internal::InputSource>(std::move(microbatches), grad_enabled);
}

void PipelineStageImpl::end_step(int64_t index, bool grad_enabled, bool deferred,
                                 const std::vector<std::shared_ptr<BatchNormLayers>>& batch_norms) {
  if (deferred) {
    StatisticsCombiner combine;
    if (replica_group_) {
      // A replica that failed tells this one over the replica group's channel (Note [Failing
      // fast across processes]): the all-gather waits no longer.
      combine = [this, index](std::vector<BatchNormStatistics>& statistics) {
        combine_statistics(replica_group_, statistics, local_, [this, index] {
          internal::FaultChannel::throw_if_heard(replica_faults_.get(), index);
        });
      };
    }
    commit_deferred(batch_norms, combine);
  }
  if (grad_enabled) {
    // Note [Tied parameters], then Note [Ties across stages].
    tied_->sum_gradients();
    if (!tied_stages_->empty()) {
      tied_stages_->sum_gradients(group_, local_, [this, index] {
        internal::FaultChannel::throw_if_heard(faults_.get(), index);
      });
    }
  }
  if (grad_enabled && replica_group_) {
    average_gradients(replica_group_, layers_->parameters(), local_, [this, index] {
      internal::FaultChannel::throw_if_heard(replica_faults_.get(), index);
    });
  }
}

at::Tensor PipelineStageImpl::step(const Batch& input, const at::Tensor& target,
                                   Loss loss) {
  const char* who = "gpipe::distributed::PipelineStage::step";
  if (!loss) loss = options_.loss_;  // the deprecated option
  absl::MutexLock step_lock(&step_mu_);
  TORCH_CHECK(!failed_, who, ": an earlier step failed on this stage, which leaves transfers "
              "of the pipeline unmatched; make new process groups and stages to go on");
  const int64_t index = steps_++;
  for (internal::FaultChannel* channel : {faults_.get(), replica_faults_.get()}) {
    if (channel == nullptr) continue;
    if (std::optional<std::string> heard = channel->heard()) {
      failed_ = true;
      TORCH_CHECK(false, *heard);
    }
  }
  // Note [Failing fast across processes] in fault.h: a failure heard from this pipeline's stages,
  // or from this stage's replicas, cancels the step's transfers.
  auto cancellation = std::make_shared<internal::Cancellation>();
  for (internal::FaultChannel* channel : {faults_.get(), replica_faults_.get()}) {
    if (channel) channel->attach(cancellation, index);
  }
  struct Detach {
    internal::FaultChannel* faults;
    internal::FaultChannel* replica_faults;
    ~Detach() {
      if (faults) faults->detach();
      if (replica_faults) replica_faults->detach();
    }
  } detach{faults_.get(), replica_faults_.get()};
  bool checked = false;
  try {
    TORCH_CHECK(!is_first() || input.size() > 0, who, ": stage 0 needs the mini-batch as input");
    TORCH_CHECK(is_first() || input.size() == 0, who, ": stage ", stage_, " takes no input (only "
                "stage 0 does; its activations come from stage ", stage_ - 1, ")");
    TORCH_CHECK(!is_last() || loss, who, ": the last stage (", stage_, ") needs a loss "
                "function: pass it to step(input, target, loss)");
    checked = true;
    return run_step(input, target, loss, index, cancellation);
  } catch (const std::exception& e) {
    // The other stages wait for this one's transfers: the pipeline is broken for good.
    if (checked || stages() > 1) failed_ = true;
    // Its transfers in flight stay posted in the group: kept until the stage goes (Note
    // [Failing fast across processes]).
    abandoned_ = cancellation;
    const std::string what = gpipe::internal::without_backtrace(e);
    if (faults_ && !cancellation->cancelled()) {
      faults_->raise(absl::StrCat("stage ", stage_, " of ", stages(), " failed: ", what), index);
    }
    // The other replicas' same stage waits for this one's gradients: told too, unless the failure
    // came from them.
    if (replica_faults_ && !replica_faults_->heard()) {
      replica_faults_->raise(absl::StrCat("stage ", stage_, " of replica ",
                                          replica_group_->getRank(), " of ",
                                          replica_group_->getSize(), " failed: ", what),
                             index);
    }
    throw;
  }
}

at::Tensor PipelineStageImpl::run_step(const Batch& input, const at::Tensor& target,
                                       const Loss& loss, int64_t index,
                                       std::shared_ptr<internal::Cancellation> cancellation) {
  const char* who = "gpipe::distributed::PipelineStage::step";
  const bool grad_enabled = at::GradMode::is_enabled();
  const bool deferred = begin_step(grad_enabled);
  const internal::Wire wire{
      group_, wire_, wire_stream_of(wire_), courier_.get(), std::move(cancellation), is_training()};
  // On a group that matches in posting order, schedules that interleave forwards and backwards
  // post each pair's transfers in turn (Note [When gradients' receives are posted]).
  const bool in_turn =
      options_.schedule().kind() != ScheduleKind::kGPipe && !matches_by_tag(group_);
  const auto turns_with = [&](int64_t peer) -> internal::TurnsOf {
    if (!in_turn) return nullptr;
    return [kind = options_.schedule().kind(), stages = stages(), me = stage_, peer](int64_t m) {
      return internal::pair_turns(kind, stages, m, me, peer);
    };
  };
  const ScheduleKind kind = options_.schedule().kind();
  const int64_t stages = this->stages();
  const int64_t v = options_.schedule().virtual_stages();
  const int64_t me = stage_;
  const int64_t k = static_cast<int64_t>(partitions_.size());
  // Note [Interleaving across processes]: partition c is virtual stage held_[c], with a remote
  // link on each side but at the pipeline's two ends and the V's turn.
  const bool interleaved = holds_virtual_stages();
  std::unique_ptr<gpipe::internal::InputSource> source;
  std::vector<std::unique_ptr<internal::RemoteUpstream>> remote_upstreams;
  std::vector<std::unique_ptr<internal::RemoteDownstream>> remote_downstreams;
  // Note [Micro-batch groups] in schedule.h (0: the default, n).
  const int64_t group =
      options_.schedule().interleaves() ? options_.schedule().microbatch_group() : 0;
  if (is_first()) source = input_source(input, grad_enabled, who);
  // Activations arrive on a thread of their own (Note [Receiving ahead] in transfer.h), over Gloo
  // one message per micro-batch (Note [One message per micro-batch]).
  const bool packs = internal::packs_activations(group_);
  const std::vector<Link> links = this->links();
  for (const Link& l : links) {
    if (l.downstream) continue;
    remote_upstreams.push_back(std::make_unique<internal::RemoteUpstream>(
        wire, l.peer, partitions_[interleaved ? l.chunk : 0].device, grad_enabled,
        turns_with(l.peer), l.channel, packs ? &received_bytes_[l.channel] : nullptr,
        shared_ ? shared_->find(false, l.channel) : nullptr));
  }
  std::unique_ptr<gpipe::internal::LossSink> sink =
      is_last() ? loss_sink(options_, stages, target, loss, who) : nullptr;
  // Note [When gradients' receives are posted] in remote_link.h.
  const internal::GradientReceives when = kind == ScheduleKind::kGPipe
                                              ? internal::GradientReceives::kAfterLastSend
                                          : in_turn ? internal::GradientReceives::kInTurn
                                                    : internal::GradientReceives::kWithSend;
  for (const Link& l : links) {
    if (!l.downstream) continue;
    remote_downstreams.push_back(std::make_unique<internal::RemoteDownstream>(
        wire, l.peer, partitions_[interleaved ? l.chunk : k - 1].device, when, turns_with(l.peer),
        l.channel, packs ? &sent_bytes_[l.channel] : nullptr,
        shared_ ? shared_->find(true, l.channel) : nullptr));
  }

  gpipe::internal::ExecutorSpec spec;
  spec.who = who;
  spec.partitions = &partitions_;
  spec.plan = lanes_of(kind, stages, me, k, v, group, held_);
  for (const std::unique_ptr<Worker>& w : workers_) spec.workers.push_back(w.get());
  attach_links(spec, source.get(), sink.get(), remote_upstreams, remote_downstreams, held_,
               static_cast<int64_t>(stage_ranks_.size()) - 1);
  spec.microbatches = 0;  // as the upstream's first activation says, at most chunks
  spec.max_microbatches = options_.chunks();
  spec.grad_enabled = grad_enabled;
  spec.checkpoint_stop = [mode = options_.checkpoint(), training = is_training()](int64_t m) {
    return training ? checkpoint_stop(mode, m) : int64_t{0};
  };
  spec.run = gpipe::internal::next_run_id();
  // The caller's thread state, in which no deferred-statistics callback is ever added: the
  // recomputation observes no operator (Note [Deferred batch norm without replacing modules]).
  spec.recompute_state = std::make_shared<const ThreadState>();
  spec.timeline = timeline_;
  spec.skip_layout = &skip_layout_;
  // With deferred batch norm, the statistics gathered during the step are committed after it,
  // merged over the replicas first.
  std::vector<std::shared_ptr<BatchNormLayers>> batch_norms;
  for (const gpipe::internal::ExecutorPartition& p : partitions_)
    batch_norms.push_back(p.batch_norms);
  {
    const DeferredBatchNormRun deferred_run(batch_norms, deferred);
    gpipe::internal::run_schedule(spec);
    if (sink) sink->finish();
  }
  internal::run_step_end_hook(index);
  for (const auto& remote : remote_downstreams) remote->finish();
  for (const auto& remote : remote_upstreams) remote->finish();
  // The input's own graph, once.
  if (source) source->finish();
  end_step(index, grad_enabled, deferred, batch_norms);
  if (sink) {
    output_ = sink->output();
    return sink->loss();
  }
  return at::Tensor();
}

}  // namespace distributed
}  // namespace gpipe
