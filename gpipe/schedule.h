// Pipeline schedules as data: for each worker (a device's thread or a process), the ordered
// actions of GPipe, 1F1B, interleaved 1F1B, zero-bubble (ZB-H1), ZBV, interleaved zero-bubble
// (ZB1P) and DualPipeV schedules, and GPipe's clock-cycle ticks.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

/// One task of the pipeline: micro-batch `microbatch` through partition `partition`.
struct Task2D {
  /// The micro-batch's index in the mini-batch.
  int64_t microbatch;
  /// The partition's index.
  int64_t partition;
  /// Whether both are the same task.
  bool operator==(const Task2D& other) const {
    return microbatch == other.microbatch && partition == other.partition;
  }
};

// Note [Clock-cycle schedule]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// GPipe runs micro-batch i through partition j at clock tick k = i + j. At tick k every task with
// i + j = k runs at once, one per partition, so each partition works on a different micro-batch:
//
//          partition 0   partition 1   partition 2
//   k = 0    (0, 0)
//   k = 1    (1, 0)        (0, 1)
//   k = 2    (2, 0)        (1, 1)        (0, 2)
//   k = 3                  (2, 1)        (1, 2)
//   k = 4                                (2, 2)
//
// There are m + n - 1 ticks for m micro-batches and n partitions. Within a tick the tasks are
// ordered by ascending partition (descending micro-batch). Every task comes after the tasks it
// depends on, so forward()'s lanes, each running its partitions' tasks in this order, never wait
// for each other in a circle (Note [forward() on the executor] in internal/executor.h).
// With equal stage costs the idle fraction (the "bubble") is (n - 1) / (m + n - 1).

/// The clock-cycle schedule for `microbatches` micro-batches and `partitions` partitions: one
/// entry per clock tick, each the tasks of that tick ordered by ascending partition.
///
///   auto ticks = gpipe::clock_cycles(3, 2);
///   // {{(0,0)}, {(1,0),(0,1)}, {(2,0),(1,1)}, {(2,1)}}
///
/// Throws c10::Error if either count is negative. Zero of either gives no ticks.
std::vector<std::vector<Task2D>> clock_cycles(int64_t microbatches, int64_t partitions);

/// Renders a schedule as text, one line per tick, e.g. "0: (0,0)\n1: (1,0) (0,1)\n".
std::string schedule_to_string(const std::vector<std::vector<Task2D>>& schedule);

// Note [Schedules as data]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A Schedule says, for each worker ("rank": a device's thread in one process, or a process), the
// actions it runs, in order. The model is cut into S stages (with interleaving, S = v * n chunks
// over n ranks: "virtual stages"); each stage lives on one rank (Schedule::stage_ranks). Actions
// are those of torch.distributed.pipelining, written "<stage><type><micro-batch>"
// (schedule_text.h):
//
//   F       forward of micro-batch i on stage s
//   B       its whole backward (input and weight gradients)
//   I, W    the backward split in two (zero bubble): I computes the gradient of the stage's input,
//           which stage s - 1 waits for; W the gradients of the stage's weights, which nothing
//           waits for until the optimizer step, so W can fill a bubble
//   SEND_F  stage s sends its output of i to stage s + 1 (another rank)
//   RECV_F  stage s receives its input of i from stage s - 1 (another rank)
//   SEND_B  stage s sends the gradient of its input of i to stage s - 1
//   RECV_B  stage s receives the gradient of its output of i from stage s + 1
//
// A micro-batch's activations are held on stage s from its F until its B (or its W): "in flight".
// The generators below give compute actions only; with_communication (schedule_check.h) adds the
// sends and receives in an order both sides of every pair of ranks agree on (Note [Point-to-point
// order] in distributed/process_group.h), and check_schedule refuses a schedule that cannot run.
//
//   GPipe        every F, then the B in reverse (the clock-cycle order). In flight on stage s:
//                m. Bubble (n-1)/(m+n-1).
//   1F1B         min(n-s-1, m) forwards, then one F and one B in turn, then the remaining B;
//                backwards in micro-batch order. In flight: min(n-s, m). Bubble as GPipe.
//   interleaved  Megatron-LM's order over v stages per rank (m a multiple of n): rank r holds
//                stages r, r+n, ...; in flight on rank r: min((n-r-1)*2 + (v-1)*g + 1, v*m)
//                stage-micro-batches, each 1/v of a rank's layers, g micro-batches a group (n
//                unless chosen: Note [Micro-batch groups]). Bubble GPipe's divided by v.
//   ZB-H1        1F1B with B split into I and W; stage s delays up to s W so that the next I goes
//                first. In flight: at most n. Bubble (n-1)(F+I-W) in time, 1F1B's (n-1)(F+I+W).
//   ZBV          V-shaped placement (Note [V-shaped placement]), B split into I and W.
//   DualPipeV    the same placement in DeepSeek's order (Note [V-shaped placement]).
//   ZB1P         interleaved 1F1B's order and placement with B split into I and W, rank r
//                keeping up to r W waiting (as ZB-H1's stage r); the rest fill the cool-down.
//                In flight on rank r: interleaved 1F1B's plus up to r whose W waits.

// Note [V-shaped placement]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Placement is data (Schedule::stage_ranks): interleaving puts stages r, r + n, ... on rank r;
// the V puts stages r and 2n - 1 - r on rank r, so a micro-batch goes down the ranks and back up,
// rank n - 1 runs the two middle stages with no transfer between them, and rank 0 runs the first
// and the last (the loss). ZBV (Qi et al. 2024, torch.distributed.pipelining's
// ScheduleZBVZeroBubble) orders each rank's actions as
//   warm-up    2(n - r) - 1 forwards of stage r; r pairs (F of stage 2n-1-r, F of stage r);
//              n - r triples (F, I, W) of stage 2n-1-r,
//   steady     F, I, W of stage r, then F, I, W of stage 2n-1-r, until every forward ran,
//   cool-down  the remaining I first (other ranks wait for them), the W last.
// With equal F, I and W times the bubble is nearly zero (simulate_schedule, n = 4, m = 16: 0.030,
// 1F1B 0.158) and rank 0's peak in flight is 2n half-size stage-micro-batches: 1F1B's n full
// ones. With fewer micro-batches than the warm-up's 2n - 1 the same order, shortened, runs.
// DualPipeV (DeepSeek-V3, arXiv 2412.19437) runs the same placement in eight steps: forwards of
// stage r, then of both; I W F of stage 2n-1-r; the main step F(r) B(2n-1-r) F(2n-1-r) B(r),
// whose forward-backward pairs DualPipe overlaps on a GPU (here they run in turn); then the
// backwards, the last ones split with their W queued and run oldest first at the end. It needs
// m >= 2n - 1 (its main step runs m - 2n + r + 1 times); with fewer, zbv's order runs.
// A GPipe gives each of the 2n partitions its device: rank r's two are partitions r and
// 2n - 1 - r, which should be on one device (GPipeOptions::devices).

// Note [Micro-batch groups]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Interleaving sends each micro-batch around the ranks v times, and in Megatron-LM's order a
// rank's next chunk starts on micro-batch i as soon as the group of n micro-batches before it is
// done: the output it needs left the last rank at most a task earlier. With free communication
// that costs nothing; where a hop takes time (another process on a busy machine: about 0.2-0.6 ms
// on the project's 2-core VM, docs/journal/2026-11-26-benchmarks.md, "measured in rounds, and
// micro-batch groups"), each wait for it lands on the critical path.
// A larger group g (Megatron-LM's microbatch_group_size_per_vp_stage) runs g micro-batches through
// a chunk before the next: the output then has g - n tasks' time to arrive. The price is memory:
// (v - 1)(g - n) more stage-micro-batches in flight on every rank during the warm-up. The bubble
// with free communication is the same.

/// What an action does (Note [Schedules as data]).
enum class ActionType : uint8_t {
  kForward,         ///< F
  kBackward,        ///< B
  kBackwardInput,   ///< I
  kBackwardWeight,  ///< W
  kSendForward,     ///< SEND_F
  kRecvForward,     ///< RECV_F
  kSendBackward,    ///< SEND_B
  kRecvBackward,    ///< RECV_B
};

/// One action of a schedule: `type` of micro-batch `microbatch` on stage `stage`.
struct Action {
  /// What it does.
  ActionType type = ActionType::kForward;
  /// The stage it runs on (or sends from, or receives for).
  int64_t stage = 0;
  /// The micro-batch it is for.
  int64_t microbatch = 0;
  /// Whether both have the same type, stage and micro-batch.
  bool operator==(const Action& other) const {
    return type == other.type && stage == other.stage && microbatch == other.microbatch;
  }
  /// Whether they differ in type, stage or micro-batch.
  bool operator!=(const Action& other) const { return !(*this == other); }
};

/// The action as torch.distributed.pipelining writes it: "0F3", "2SEND_B1".
std::string to_string(const Action& action);

/// Prints to_string(action).
std::ostream& operator<<(std::ostream& out, const Action& action);

/// Whether `type` is a send or a receive.
bool is_communication(ActionType type);

/// What each rank runs, in order (Note [Schedules as data]).
struct Schedule {
  /// Short name: "gpipe", "1f1b", "interleaved", "zb", or "custom" (parsed from text).
  std::string name;
  /// S: the number of stages (model chunks), in model order.
  int64_t stages = 0;
  /// m: the number of micro-batches.
  int64_t microbatches = 0;
  /// stage_ranks[s]: the rank that holds stage s.
  std::vector<int64_t> stage_ranks;
  /// ranks[r]: the actions of rank r, in the order it runs them.
  std::vector<std::vector<Action>> ranks;

  /// The number of ranks: ranks.size().
  int64_t num_ranks() const { return static_cast<int64_t>(ranks.size()); }
  /// v: stages per rank (1 unless interleaved).
  int64_t virtual_stages() const;
  /// The stages rank r holds, ascending.
  std::vector<int64_t> stages_of(int64_t rank) const;
};

/// GPipe's fill-drain over `partitions` ranks: every stage runs F0 to F(m-1), then B(m-1) to B0,
/// the order of the clock-cycle schedule.
///
///   auto schedule = gpipe::gpipe_schedule(/*partitions=*/4, /*microbatches=*/8);
Schedule gpipe_schedule(int64_t partitions, int64_t microbatches);

/// 1F1B (PipeDream-Flush, the default of Megatron-LM and DeepSpeed): the same bubble as GPipe,
/// with at most n - s micro-batches in flight on stage s.
Schedule one_f_one_b_schedule(int64_t partitions, int64_t microbatches);

/// Interleaved 1F1B (Megatron-LM) with `virtual_stages` chunks per rank: rank r holds stages
/// r, r + n, ..., the model cut into v * n stages. The bubble is GPipe's divided by v; m must be a
/// multiple of n (Megatron's rule). With v = 1 it is one_f_one_b_schedule. `microbatch_group`
/// (g, at least n; 0: n): how many micro-batches go through a chunk before the next chunk starts
/// (Megatron-LM's microbatch_group_size_per_vp_stage; Note [Micro-batch groups]); m must then be
/// a multiple of g.
///
///   auto schedule = gpipe::interleaved_schedule(/*partitions=*/2, /*microbatches=*/16,
///                                               /*virtual_stages=*/2, /*microbatch_group=*/4);
Schedule interleaved_schedule(int64_t partitions, int64_t microbatches, int64_t virtual_stages,
                              int64_t microbatch_group = 0);

/// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split into I
/// and W, stage s delaying up to s W; bubble (n - 1)(T_F + T_I - T_W), peak in flight n.
Schedule zero_bubble_schedule(int64_t partitions, int64_t microbatches);

/// ZBV (Qi et al., "Pipeline Parallelism with Controllable Memory"; torch.distributed.pipelining's
/// ScheduleZBVZeroBubble): V-shaped placement over `partitions` ranks, rank r holding stages r and
/// 2n - 1 - r (the model cut into 2n stages), each backward split into I and W. Zero bubble with
/// equal F, I and W times at 1F1B's peak activation memory (Note [V-shaped placement]).
///
///   auto schedule = gpipe::zbv_schedule(/*partitions=*/2, /*microbatches=*/8);  // 4 stages
Schedule zbv_schedule(int64_t partitions, int64_t microbatches);

/// Interleaved zero bubble (ZB1P; torch.distributed.pipelining's ScheduleInterleavedZeroBubble):
/// interleaved 1F1B's order and placement with each B split into I and W, rank r keeping up to
/// r W waiting so that they fill the cool-down's bubble. The same rules on m as interleaved.
Schedule interleaved_zero_bubble_schedule(int64_t partitions, int64_t microbatches,
                                          int64_t virtual_stages);

/// DualPipeV (DeepSeek-V3's DualPipe "cut in half"; torch.distributed.pipelining's
/// ScheduleDualPipeV): the V placement of zbv_schedule in DeepSeek's eight steps, where pairs of a
/// forward of one stage and a backward of the other (overlapped on a GPU by DualPipe) run one
/// after the other, and the backwards at the ends split into I and W (Note [V-shaped
/// placement]). Needs m >= 2n - 1; with fewer micro-batches it gives zbv's order.
Schedule dualpipev_schedule(int64_t partitions, int64_t microbatches);

/// The schedules gpipe generates.
enum class ScheduleKind {
  kGPipe,                  ///< "gpipe": gpipe_schedule
  k1F1B,                   ///< "1f1b": one_f_one_b_schedule
  kInterleaved,            ///< "interleaved": interleaved_schedule
  kZeroBubble,             ///< "zb": zero_bubble_schedule (ZB-H1)
  kZeroBubbleV,            ///< "zbv": zbv_schedule, two stages per rank in a V
  kInterleavedZeroBubble,  ///< "zb1p": interleaved_zero_bubble_schedule
  kDualPipeV               ///< "dualpipev": dualpipev_schedule, two stages per rank in a V
};

/// `kind` by its name: "gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev". Throws
/// c10::Error naming the unknown name and the known ones.
ScheduleKind schedule_kind(const std::string& name);
/// The name of `kind`, as schedule_kind reads it.
std::string schedule_kind_name(ScheduleKind kind);

/// Whether `kind` takes a number of virtual stages (kInterleaved, kInterleavedZeroBubble); zbv
/// always has two per rank, the others one.
bool takes_virtual_stages(ScheduleKind kind);

/// Whether `kind` places two stages on each rank in a V (kZeroBubbleV, kDualPipeV; Note
/// [V-shaped placement]).
bool v_shaped(ScheduleKind kind);

/// The rank that runs stage `stage` of a `kind` schedule over `ranks` ranks: on a V (zbv,
/// dualpipev) `stage` or 2 ranks - 1 - `stage` (Note [V-shaped placement]), else `stage` % `ranks`
/// (one stage per rank, or interleaved: r, r + ranks, ...). The one place this formula lives.
///
///   gpipe::stage_rank(gpipe::ScheduleKind::kZeroBubbleV, 3, 2);  // 0: stages {0, 3} on rank 0
int64_t stage_rank(ScheduleKind kind, int64_t stage, int64_t ranks);

/// The schedule of `kind` over `partitions` ranks (`virtual_stages` for kInterleaved and
/// kInterleavedZeroBubble; 1 elsewhere, or 2 for the V-shaped ones, which always have 2).
Schedule make_schedule(ScheduleKind kind, int64_t partitions, int64_t microbatches,
                       int64_t virtual_stages = 1, int64_t microbatch_group = 0);

}  // namespace gpipe
