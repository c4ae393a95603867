// GPipe::step: a training step of the whole pipeline under a schedule — forwards, the loss and
// backwards in the schedule's order, run by the executor (Note [One executor]); see gpipe.h.
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include "gpipe/batchnorm.h"
#include "gpipe/internal/executor.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/link.h"
#include "gpipe/microbatch.h"
#include "gpipe/internal/partition.h"
#include "gpipe/schedule.h"
#include "gpipe/schedule_option.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/thread_state.h"
#include "gpipe/timeline.h"
#include "gpipe/worker.h"

namespace gpipe {

Schedule GPipeImpl::schedule(int64_t microbatches) const {
  const PipelineSchedule& option = options_.schedule();
  TORCH_CHECK(!option.is_text() || microbatches == option.parsed()->microbatches,
              "GPipe::schedule: the schedule text is written for ",
              option.is_text() ? option.parsed()->microbatches : 0, " micro-batches, not ",
              microbatches);
  return make_schedule_for(option, static_cast<int64_t>(partitions_.size()), microbatches);
}

Schedule GPipeImpl::schedule_of_batch(int64_t samples, int64_t microbatches,
                                      const char* who) const {
  if (microbatches == options_.chunks()) return schedule(microbatches);
  // A short mini-batch (an epoch's last) splits into fewer micro-batches than chunks, as
  // Tensor::chunk does: some schedules cannot run that many.
  try {
    return schedule(microbatches);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, who, ": the mini-batch of ", samples, " samples splits into only ",
                microbatches, " micro-batches (Tensor::chunk into chunks = ", options_.chunks(),
                "), which this schedule cannot run: ", e.what_without_backtrace(),
                ". Give mini-batches that split into chunks micro-batches (a multiple of chunks "
                "samples always does), or drop the last partial one (torch::data's "
                "DataLoaderOptions::drop_last)");
  }
}

at::Tensor GPipeImpl::step(const at::Tensor& input, const at::Tensor& target,
                           const Loss& loss) {
  return step(Batch(input), target, loss);
}

at::Tensor GPipeImpl::step(const Batch& input, const at::Tensor& target, const Loss& loss) {
  const char* who = "gpipe::GPipe::step";
  check_input(input);
  TORCH_CHECK(!partitions_.empty(), who, ": the GPipe has no partitions");
  TORCH_CHECK(loss, who, ": the loss function is empty; give one that maps (output, target) to "
              "a scalar");
  for (const auto k : c10::irange(input.size())) {
    TORCH_CHECK(input[k].device() == devices_.front(), who, ": input tensor ", k, " is on ",
                input[k].device(), ", but the first partition is on ", devices_.front(),
                "; move the input there first, e.g. x.to(model->devices().front())");
  }
  std::vector<Batch> microbatches = scatter(input, options_.chunks());
  const int64_t m = static_cast<int64_t>(microbatches.size());
  const Schedule plan = schedule_of_batch(input[0].size(0), m, who);
  absl::MutexLock lock(&forward_mu_);
  // (The executor checkpoints nothing without grad.)
  const int64_t stop = is_training() && at::GradMode::is_enabled()
                           ? checkpoint_stop(options_.checkpoint(), m) : 0;
  if (!generators_checked_ && stop > 0) {
    // The lanes run at the same time (Note [Random numbers in concurrent partitions]).
    std::vector<int64_t> threads(partitions_.size());
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      for (const Action& a : plan.ranks[r]) threads[a.stage] = static_cast<int64_t>(r);
    }
    internal::check_concurrent_generators(who, partitions_, devices_, threads,
                                          /*checkpointing=*/true);
    generators_checked_ = true;
  }
  tied_->refresh();
  const bool grad_enabled = at::GradMode::is_enabled();
  internal::InputSource source(std::move(microbatches), grad_enabled);
  const int64_t last = static_cast<int64_t>(partitions_.size()) - 1;
  internal::LossSink sink(loss, target, internal::forwards_before_backwards(plan.ranks, last), who);

  internal::ExecutorSpec spec;
  spec.who = who;
  spec.partitions = &step_partitions_;
  spec.plan = [&plan](int64_t) { return plan.ranks; };
  spec.workers = internal::lane_workers(lane_workers_, plan.ranks.size());
  spec.upstream = &source;
  spec.downstream = &sink;
  spec.microbatches = m;
  spec.grad_enabled = grad_enabled;
  spec.checkpoint_stop = [mode = options_.checkpoint(), training = is_training()](int64_t n) {
    return training ? checkpoint_stop(mode, n) : int64_t{0};
  };
  spec.run = internal::next_run_id();
  // The caller's thread state, in which no deferred-statistics callback is ever added: the
  // recomputation observes no operator (Note [Deferred batch norm without replacing modules]).
  spec.recompute_state = std::make_shared<const ThreadState>();
  if (record_timeline_) spec.timeline = std::make_shared<Timeline>(devices_);
  spec.skip_layout = &skip_layout_;
  spec.copy_streams = &copy_streams_;
  const bool deferred = options_.deferred_batch_norm() && is_training();
  try {
    {
      const DeferredBatchNormRun deferred_run(batch_norms_, deferred);
      internal::run_schedule(spec);
      sink.finish();
    }
    if (deferred) commit_deferred(batch_norms_, statistics_combiner_);
    source.finish();
  } catch (...) {
    // A failed backward leaves partial gradients in the plain model's one parameter, where
    // zero_grad() clears them; a tied copy is not among parameters(), so its partial gradient
    // joins its owner's now rather than the next step's (Note [Tied parameters]).
    try {
      if (grad_enabled) tied_->sum_gradients();
    } catch (...) {
      // The step's own error is the one to report.
    }
    throw;
  }
  if (grad_enabled) tied_->sum_gradients();  // every backward of the step is done
  last_timeline_ = spec.timeline;
  return sink.loss();
}

}  // namespace gpipe
