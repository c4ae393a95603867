// The pipeline; see pipeline.h, Note [Clock-cycle schedule] in schedule.h and the Notes below.
#include "gpipe/pipeline.h"

#include <exception>
#include <memory>

#include <c10/core/StreamGuard.h>

#include "absl/synchronization/notification.h"
#include "gpipe/checkpoint.h"
#include "gpipe/copy.h"
#include "gpipe/dependency.h"
#include "gpipe/schedule.h"
#include "gpipe/skip_tracker.h"
#include "gpipe/thread_state.h"

namespace gpipe {

// Note [Backward order]
// ~~~~~~~~~~~~~~~~~~~~~
// GPipe's backward visits, on each partition, the micro-batches in reverse order. gpipe never runs
// a backward loop of its own; it adds edges to the autograd graph and lets the autograd engine
// find the order. Before micro-batch i enters partition j, the fence forks the lane tensor of
// micro-batch i-1 (which holds partition j's output for it) and joins the phony into micro-batch
// i's lane (dependency.h). The fork's backward node then waits for the gradient of micro-batch i
// at partition j's input: partition j's backward for micro-batch i-1 starts only after the one for
// micro-batch i has finished. Across partitions the data edges (and the copies) already order
// everything. The "lane" is the batch's first floating-point tensor (Batch::lane). When micro-batch
// i-1 was checkpointed at partition j, its lane comes out of a RecomputeBackward node (Note
// [Checkpoint and recompute]) and the fork adds the phony to that node instead of making its own:
// the recomputation then also waits for micro-batch i, which it did behind the fork anyway. When
// micro-batch i is checkpointed at partition j, the phony becomes an extra next edge of its
// CheckpointBackward instead of being joined into its lane: the fork then waits for the end of
// that task's backward, as it would behind the join (a little earlier: before the gradient's copy
// to partition j-1 is queued). Each checkpointed task so costs two autograd nodes fewer. With
// stage-local backward (Note [Stage-local backward in one process]) there are no such edges.

namespace {

// The state of one task within a clock tick.
struct Slot {
  int64_t microbatch = 0;
  size_t partition = 0;
  Batch output{std::vector<at::Tensor>{}};
  const Batch* input = nullptr;
  std::function<Batch(const Batch&)> stage;  // the partition, in the micro-batch's context
  std::unique_ptr<Checkpointing> checkpointing;
  at::Tensor dependency;  // checkpointed: the previous micro-batch's fork's phony, if any
  std::exception_ptr error;
  bool submitted = false;  // handed to a worker thread
  absl::Notification done;
};

// Waits, when a tick is left early by an exception on this thread, for the tasks already handed to
// workers: they point into the tick's slots and the batches.
class TickGuard {
 public:
  explicit TickGuard(std::vector<std::unique_ptr<Slot>>& slots) : slots_(slots) {}
  ~TickGuard() {
    for (auto& slot : slots_) {
      if (slot->submitted) {
        slot->done.WaitForNotification();
      }
    }
  }

 private:
  std::vector<std::unique_ptr<Slot>>& slots_;
};

// When recorded work started: the host time and, for work on a CUDA stream, a mark on it (Note
// [Device times] in timeline.cc).
Timeline::Started start(const PipelineSpec& spec, const c10::Stream& stream) {
  return spec.timeline ? spec.timeline->start(stream) : Timeline::Started{};
}

// Adds `event`, which started at `started` and ends now (on `stream`), to the timeline if one is
// recorded.
void record(const PipelineSpec& spec, const TimelineEvent& event,
            const Timeline::Started& started, const c10::Stream& stream) {
  if (spec.timeline) spec.timeline->finish(event, started, stream);
}

// Runs one task on the current thread, on its partition's compute stream.
void compute(const PipelineSpec& spec, Slot& slot) {
  const c10::Stream& stream = spec.compute_streams[slot.partition];
  const Timeline::Started started = start(spec, stream);
  try {
    c10::StreamGuard stream_guard(stream);
    slot.output = slot.checkpointing ? slot.checkpointing->checkpoint() : slot.stage(*slot.input);
  } catch (...) {
    slot.error = std::current_exception();
  }
  TimelineEvent event{TimelineEvent::Kind::kCompute, slot.microbatch,
                      static_cast<int64_t>(slot.partition)};
  event.checkpointed = slot.checkpointing != nullptr;
  record(spec, event, started, stream);
}

void depend_lanes(Batch& before, Batch& after) {
  const int64_t b = before.lane();
  const int64_t a = after.lane();
  if (b >= 0 && a >= 0) {
    depend(before[b], after[a]);
  }
}

}  // namespace

void run_pipeline(const PipelineSpec& spec, std::vector<Batch>& batches) {
  const int64_t m = static_cast<int64_t>(batches.size());
  const int64_t n = static_cast<int64_t>(spec.devices.size());
  const auto& copy_streams = *spec.copy_streams;
  // Captured once: every task on a worker thread runs under the caller's thread-local state
  // (Note [Thread-local state in workers]).
  const std::unique_ptr<ThreadState> caller_state =
      spec.workers->size() > 0 ? std::make_unique<ThreadState>() : nullptr;
  // Each micro-batch's context: its skips (Note [Skips and checkpointing]) and its identity.
  const bool skips = spec.skip_layout != nullptr && !spec.skip_layout->empty();
  std::vector<TaskContext> contexts(m);
  std::vector<MicroBatchSkips*> trackers(m, nullptr);
  for (int64_t i = 0; i < m; ++i) {
    contexts[i].microbatch = MicroBatch{spec.run, i};
    if (skips) {
      auto tracker = std::make_shared<MicroBatchSkips>(spec.skip_layout);
      trackers[i] = tracker.get();
      contexts[i].skips = std::move(tracker);
    }
  }

  // On an error, drop the skips still held (see MicroBatchSkips::clear).
  struct ClearOnError {
    std::vector<MicroBatchSkips*>& trackers;
    int exceptions = std::uncaught_exceptions();
    ~ClearOnError() {
      if (std::uncaught_exceptions() > exceptions) {
        for (MicroBatchSkips* tracker : trackers) {
          if (tracker != nullptr) tracker->clear();
        }
      }
    }
  } clear_on_error{trackers};

  for (const std::vector<Task2D>& tick : clock_cycles(m, n)) {
    // Fence: dependencies and copies, on this thread. A checkpointed task takes its dependency's
    // phony into its CheckpointBackward instead of a join (Note [Backward order]).
    std::vector<at::Tensor> phonies(tick.size());
    for (size_t k = 0; k < tick.size(); ++k) {
      const int64_t i = tick[k].microbatch;
      const int64_t j = tick[k].partition;
      if (spec.stage_backward) {
        // No edges between micro-batches: each partition's backward is an engine call of its own.
      } else if (i > 0 && i < spec.checkpoint_stop) {
        const int64_t lane = batches[i - 1].lane();
        if (lane >= 0) {
          auto forked = fork(batches[i - 1][lane]);
          batches[i - 1][lane] = std::move(forked.first);
          phonies[k] = std::move(forked.second);
        }
      } else if (i > 0) {
        depend_lanes(batches[i - 1], batches[i]);
      }
      if (j > 0) {
        if (trackers[i] != nullptr) {
          const Timeline::Started skips_started{spec.timeline ? spec.timeline->now_us() : 0,
                                                nullptr};
          for (int64_t from : trackers[i]->fence(i, j, spec.compute_streams, copy_streams)) {
            record(spec, {TimelineEvent::Kind::kSkipCopy, i, j, from, 1}, skips_started,
                   copy_streams[j][i]);
          }
          if (spec.stage_backward) {
            // Partition j pops its skips behind Handoffs to their stashing partitions' backward
            // (Note [Stage-local backward in one process]).
            trackers[i]->cut(j, [&spec, i, j](int64_t from, const at::Tensor& tensor) {
              return spec.stage_backward->hand_off_skip(tensor, static_cast<size_t>(from), i,
                                                        static_cast<size_t>(j));
            });
          }
        }
        // LibTorch runs a copy from a CUDA device on the source's current stream, else on the
        // destination's.
        const c10::Stream& copy_stream = has_streams(copy_streams[j - 1][i].device())
                                             ? copy_streams[j - 1][i]
                                             : copy_streams[j][i];
        const Timeline::Started copy_started = start(spec, copy_stream);
        batches[i].values() = copy(std::move(batches[i].values()), copy_streams[j - 1][i],
                                   copy_streams[j][i]);
        record(spec,
               {TimelineEvent::Kind::kCopy, i, j, j - 1, static_cast<int64_t>(batches[i].size())},
               copy_started, copy_stream);
        if (spec.stage_backward) {
          spec.stage_backward->hand_off(batches[i], static_cast<size_t>(j - 1), i);
        }
      }
    }

    // Compute: hand each task to its device's worker; run the caller's own tasks last, so that
    // the other workers are busy meanwhile (Note [Workers and the calling thread]).
    std::vector<std::unique_ptr<Slot>> slots;
    slots.reserve(tick.size());
    TickGuard guard(slots);
    for (size_t k = 0; k < tick.size(); ++k) {
      const int64_t i = tick[k].microbatch;
      const size_t j = static_cast<size_t>(tick[k].partition);
      if (j > 0) {
        batches[i].values() =
            wait(std::move(batches[i].values()), copy_streams[j][i], spec.compute_streams[j]);
      }
      auto slot = std::make_unique<Slot>();
      slot->microbatch = i;
      slot->partition = j;
      slot->input = &batches[i];
      slot->stage = [stage = spec.stages[j], context = contexts[i]](const Batch& b) {
        TaskScope scope(context);
        return stage(b);
      };
      if (i < spec.checkpoint_stop) {
        slot->checkpointing = std::make_unique<Checkpointing>(
            slot->stage, batches[i], spec.devices[j], spec.recompute_state, spec.grad_records[j],
            spec.params_keys[j]);
        slot->dependency = std::move(phonies[k]);
        if (spec.timeline) {
          slot->checkpointing->record_to(spec.timeline, i, static_cast<int64_t>(j));
        }
      }
      Slot* s = slot.get();
      slots.push_back(std::move(slot));
      if (!spec.workers->runs_inline(j)) {
        // Marked submitted only once the worker has it: a submit that fails (out of memory)
        // leaves nothing for TickGuard to wait for.
        spec.workers->for_partition(j).submit([s, &spec, state = caller_state.get()] {
          {
            ThreadStateGuard guard(*state);
            compute(spec, *s);
          }
          s->done.Notify();
        });
        s->submitted = true;
      }
    }
    for (auto& slot : slots) {
      if (spec.workers->runs_inline(slot->partition)) {
        compute(spec, *slot);
        slot->done.Notify();
      }
    }

    // Collect the tick's outputs in order, once every task has finished (attach_dependency
    // touches other tasks' nodes); keep the first error.
    for (auto& slot : slots) {
      slot->done.WaitForNotification();
    }
    std::exception_ptr first_error;
    for (auto& slot : slots) {
      if (slot->error) {
        if (!first_error) {
          first_error = slot->error;
        }
        continue;
      }
      if (first_error) {
        continue;
      }
      const int64_t i = slot->microbatch;
      const size_t j = slot->partition;
      Batch& out = slot->output;
      if (slot->checkpointing) {
        slot->checkpointing->attach_dependency(slot->dependency);
      }
      if (static_cast<int64_t>(j) < n - 1) {
        out.values() = wait(std::move(out.values()), spec.compute_streams[j], copy_streams[j][i]);
      }
      if (slot->checkpointing) {
        slot->checkpointing->recompute(out);
      }
      batches[i] = std::move(out);
    }
    if (first_error) {
      std::rethrow_exception(first_error);
    }
  }
  if (spec.stage_backward) {
    // The last partition's backward too runs on its worker, not on the thread that calls
    // backward(), which runs the first partition's (Note [Stage-local backward in one process]).
    for (int64_t i = 0; i < m; ++i) {
      spec.stage_backward->hand_off(batches[i], static_cast<size_t>(n - 1), i, /*last=*/true);
    }
  }
}

}  // namespace gpipe
