// Schedules as data: the clock-cycle ticks and the generators of Note [Schedules as data].
#include "gpipe/schedule.h"

#include <algorithm>
#include <functional>
#include <ostream>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace gpipe {

std::vector<std::vector<Task2D>> clock_cycles(int64_t microbatches, int64_t partitions) {
  TORCH_CHECK(microbatches >= 0, "clock_cycles: the number of micro-batches must be >= 0, got ",
              microbatches);
  TORCH_CHECK(partitions >= 0, "clock_cycles: the number of partitions must be >= 0, got ",
              partitions);
  std::vector<std::vector<Task2D>> ticks;
  if (microbatches == 0 || partitions == 0) {
    return ticks;
  }
  const int64_t m = microbatches;
  const int64_t n = partitions;
  ticks.reserve(m + n - 1);
  for (int64_t k = 0; k < m + n - 1; ++k) {
    std::vector<Task2D> tick;
    // j ranges over the partitions that have a micro-batch i = k - j in [0, m).
    for (int64_t j = std::max<int64_t>(1 + k - m, 0); j < std::min<int64_t>(1 + k, n); ++j) {
      tick.push_back(Task2D{k - j, j});
    }
    ticks.push_back(std::move(tick));
  }
  return ticks;
}

std::string schedule_to_string(const std::vector<std::vector<Task2D>>& schedule) {
  std::string out;
  for (size_t k = 0; k < schedule.size(); ++k) {
    absl::StrAppend(&out, k, ":");
    for (const Task2D& task : schedule[k]) {
      absl::StrAppendFormat(&out, " (%d,%d)", task.microbatch, task.partition);
    }
    out += "\n";
  }
  return out;
}

namespace {

const char* type_name(ActionType type) {
  switch (type) {
    case ActionType::kForward: return "F";
    case ActionType::kBackward: return "B";
    case ActionType::kBackwardInput: return "I";
    case ActionType::kBackwardWeight: return "W";
    case ActionType::kSendForward: return "SEND_F";
    case ActionType::kRecvForward: return "RECV_F";
    case ActionType::kSendBackward: return "SEND_B";
    case ActionType::kRecvBackward: return "RECV_B";
  }
  return "?";
}

void check_counts(const char* what, int64_t partitions, int64_t microbatches) {
  TORCH_CHECK(partitions >= 1, what, ": the number of partitions must be at least 1, got ",
              partitions);
  TORCH_CHECK(microbatches >= 1, what, ": the number of micro-batches must be at least 1, got ",
              microbatches);
}

// A schedule of `n` ranks holding one stage each, rank r stage r.
Schedule one_stage_per_rank(std::string name, int64_t n, int64_t m) {
  Schedule schedule;
  schedule.name = std::move(name);
  schedule.stages = n;
  schedule.microbatches = m;
  schedule.ranks.resize(n);
  for (int64_t s = 0; s < n; ++s) schedule.stage_ranks.push_back(s);
  return schedule;
}

Action forward(int64_t s, int64_t i) { return {ActionType::kForward, s, i}; }

// The 1F1B shape of one rank's order: `warmup` forwards, then a forward and a backward in turn
// until `total` forwards ran, then the remaining backwards. `next_forward(k)` and
// `next_backward(k)` add the k-th of each.
void warm_up_then_alternate(int64_t warmup, int64_t total,
                            const std::function<void(int64_t)>& next_forward,
                            const std::function<void(int64_t)>& next_backward) {
  int64_t f = 0;
  int64_t b = 0;
  while (f < warmup) next_forward(f++);
  while (f < total) {
    next_forward(f++);
    next_backward(b++);
  }
  while (b < total) next_backward(b++);
}

}  // namespace

std::string to_string(const Action& action) {
  return absl::StrCat(action.stage, type_name(action.type), action.microbatch);
}

std::ostream& operator<<(std::ostream& out, const Action& action) {
  return out << to_string(action);
}

bool is_communication(ActionType type) {
  return type == ActionType::kSendForward || type == ActionType::kRecvForward ||
         type == ActionType::kSendBackward || type == ActionType::kRecvBackward;
}

int64_t Schedule::virtual_stages() const {
  return ranks.empty() ? 0 : (stages + num_ranks() - 1) / num_ranks();
}

std::vector<int64_t> Schedule::stages_of(int64_t rank) const {
  std::vector<int64_t> held;
  for (int64_t s = 0; s < static_cast<int64_t>(stage_ranks.size()); ++s) {
    if (stage_ranks[s] == rank) held.push_back(s);
  }
  return held;
}

Schedule gpipe_schedule(int64_t partitions, int64_t microbatches) {
  check_counts("gpipe_schedule", partitions, microbatches);
  Schedule schedule = one_stage_per_rank("gpipe", partitions, microbatches);
  for (int64_t s = 0; s < partitions; ++s) {
    auto& actions = schedule.ranks[s];
    for (int64_t i = 0; i < microbatches; ++i) actions.push_back(forward(s, i));
    for (int64_t i = microbatches - 1; i >= 0; --i) {
      actions.push_back({ActionType::kBackward, s, i});
    }
  }
  return schedule;
}

Schedule one_f_one_b_schedule(int64_t partitions, int64_t microbatches) {
  check_counts("one_f_one_b_schedule", partitions, microbatches);
  const int64_t n = partitions;
  const int64_t m = microbatches;
  Schedule schedule = one_stage_per_rank("1f1b", n, m);
  for (int64_t s = 0; s < n; ++s) {
    auto& actions = schedule.ranks[s];
    warm_up_then_alternate(
        std::min(n - s - 1, m), m, [&](int64_t i) { actions.push_back(forward(s, i)); },
        [&](int64_t i) { actions.push_back({ActionType::kBackward, s, i}); });
  }
  return schedule;
}

Schedule interleaved_schedule(int64_t partitions, int64_t microbatches, int64_t virtual_stages,
                              int64_t microbatch_group) {
  check_counts("interleaved_schedule", partitions, microbatches);
  TORCH_CHECK(virtual_stages >= 1,
              "interleaved_schedule: the number of virtual stages (model chunks per rank) must be "
              "at least 1, got ", virtual_stages);
  const int64_t n = partitions;
  const int64_t m = microbatches;
  const int64_t v = virtual_stages;
  TORCH_CHECK(microbatch_group >= 0, "interleaved_schedule: the micro-batch group must be 0 (the "
              "number of partitions) or more, got ", microbatch_group);
  if (v == 1) {
    Schedule schedule = one_f_one_b_schedule(n, m);
    schedule.name = "interleaved";
    return schedule;
  }
  // Note [Micro-batch groups]: g micro-batches go through a chunk before the next chunk starts.
  const int64_t g = microbatch_group == 0 ? n : microbatch_group;
  TORCH_CHECK(g >= n, "interleaved_schedule: the micro-batch group (", g, ") must be at least the "
              "number of partitions (", n, "): with fewer, the first partition's next chunk "
              "would wait for a micro-batch the last partition has not reached; 0 means ", n);
  TORCH_CHECK(m % g == 0, "interleaved_schedule: the number of micro-batches (", m,
              ") must be a multiple of ", g == n ? "the number of partitions (" : "the micro-batch "
              "group (", g, ") with more than one virtual stage, e.g. ", (m / g + 1) * g);
  Schedule schedule;
  schedule.name = "interleaved";
  schedule.stages = n * v;
  schedule.microbatches = m;
  schedule.ranks.resize(n);
  for (int64_t s = 0; s < n * v; ++s) {
    schedule.stage_ranks.push_back(stage_rank(ScheduleKind::kInterleaved, s, n));
  }
  // Megatron-LM's order: the k-th forward of a rank runs chunk (k / g) % v on micro-batch
  // (k / (g v)) g + k % g, so each group of g micro-batches goes through every chunk before the
  // next group starts; the k-th backward runs the chunks in reverse.
  const int64_t total = v * m;
  auto microbatch = [&](int64_t k) { return (k / (g * v)) * g + k % g; };
  auto chunk = [&](int64_t k) { return (k / g) % v; };
  for (int64_t r = 0; r < n; ++r) {
    auto& actions = schedule.ranks[r];
    warm_up_then_alternate(
        std::min((n - r - 1) * 2 + (v - 1) * g, total),
        total, [&](int64_t k) { actions.push_back(forward(chunk(k) * n + r, microbatch(k))); },
        [&](int64_t k) {
          actions.push_back({ActionType::kBackward, (v - 1 - chunk(k)) * n + r, microbatch(k)});
        });
  }
  return schedule;
}

namespace {

// `schedule` with each B split into its I and a W: rank r keeps up to r W waiting, each run after
// the I that makes r + 1 wait (oldest first), the rest at the end, in the cool-down's bubble.
// On 1F1B this is ZB-H1: stage r keeps up to n - r micro-batches in flight as in 1F1B plus r
// whose W waits, n in all (the first stage's 1F1B peak). On interleaved 1F1B it is ZB1P (measured
// on simulate_schedule with equal F, I and W: n = 4, m = 16, v = 2 bubble 0.030, against 0.059
// with none waiting, 0.086 for interleaved 1F1B, and no better with n - 1 - r waiting).
Schedule split_backwards(Schedule schedule, std::string name) {
  schedule.name = std::move(name);
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    std::vector<Action> actions;
    std::vector<Action> pending;
    size_t next = 0;
    for (const Action& a : schedule.ranks[r]) {
      if (a.type != ActionType::kBackward) {
        actions.push_back(a);
        continue;
      }
      actions.push_back({ActionType::kBackwardInput, a.stage, a.microbatch});
      pending.push_back({ActionType::kBackwardWeight, a.stage, a.microbatch});
      if (pending.size() - next > r) actions.push_back(pending[next++]);
    }
    while (next < pending.size()) actions.push_back(pending[next++]);
    schedule.ranks[r] = std::move(actions);
  }
  return schedule;
}

}  // namespace

Schedule zero_bubble_schedule(int64_t partitions, int64_t microbatches) {
  check_counts("zero_bubble_schedule", partitions, microbatches);
  return split_backwards(one_f_one_b_schedule(partitions, microbatches), "zb");
}

namespace {

// One rank's ZBV order (Note [V-shaped placement]): rank r holds stage r (chunk 0, on the way
// down) and stage 2n - 1 - r (chunk 1, on the way back). Counters cap at m, so that fewer
// micro-batches than the warm-up's 2n - 1 give the same shape, shortened.
std::vector<Action> zbv_rank(int64_t n, int64_t m, int64_t r) {
  const int64_t s0 = r;
  const int64_t s1 = 2 * n - 1 - r;
  std::vector<Action> actions;
  int64_t f0 = 0, f1 = 0, i0 = 0, i1 = 0, w0 = 0, w1 = 0;
  const auto f = [&](int64_t s, int64_t& k) {
    if (k < m) actions.push_back(forward(s, k++));
  };
  const auto i = [&](int64_t s, int64_t& k, int64_t done) {
    if (k < done) actions.push_back({ActionType::kBackwardInput, s, k++});
  };
  const auto w = [&](int64_t s, int64_t& k, int64_t done) {
    if (k < done) actions.push_back({ActionType::kBackwardWeight, s, k++});
  };
  // Warm-up: chunk 0 runs ahead by 2(n - r) - 1 micro-batches; then chunk 1 starts, and from the
  // (r + 1)-th on each chunk-1 forward's backward follows at once (its gradient comes back down
  // the V in the time of the forwards between).
  for (int64_t k = 0; k < 2 * (n - r) - 1; ++k) f(s0, f0);
  for (int64_t k = 0; k < r; ++k) {
    f(s1, f1);
    f(s0, f0);
  }
  for (int64_t k = 0; k < n - r; ++k) {
    f(s1, f1);
    i(s1, i1, f1);
    w(s1, w1, i1);
  }
  // Steady: F, I, W of chunk 0, then of chunk 1, until every forward ran.
  while (f0 < m || f1 < f0) {
    f(s0, f0);
    i(s0, i0, f0);
    w(s0, w0, i0);
    f(s1, f1);
    i(s1, i1, f1);
    w(s1, w1, i1);
  }
  // Cool-down: the remaining input gradients first (other ranks wait for them), their weight
  // gradients after.
  for (int64_t k = 0; k < r; ++k) {
    i(s0, i0, m);
    i(s1, i1, m);
  }
  while (i0 < m || i1 < m) {
    i(s0, i0, m);
    w(s0, w0, i0);
    i(s1, i1, m);
  }
  while (w1 < m) w(s1, w1, m);
  while (w0 < m) w(s0, w0, m);
  return actions;
}

// One rank's DualPipeV order (Note [V-shaped placement]), DeepSeek's eight steps with m >= 2n - 1
// micro-batches. Chunk 0 is stage r, chunk 1 stage 2n - 1 - r. A "zero-bubble" backward runs I
// and queues its W; a weight pass runs the oldest queued W; the pairs DualPipe overlaps (F of one
// chunk beside B of the other) run here one after the other, F first.
class DualPipeVRank {
 public:
  DualPipeVRank(int64_t n, int64_t m, int64_t r) : n_(n), m_(m), r_(r), s_{r, 2 * n - 1 - r} {}

  std::vector<Action> actions() {
    const int64_t n = n_, r = r_;
    // Each step's actions: F<c>, B<c> (whole), I<c> (B split, its W queued), W (the oldest).
    repeat(2 * (n - r - 1), "F0");              // 1: nF0
    repeat(r + 1, "F0 F1");                     // 2: nF0F1
    repeat(n - r - 1, "I1 W F1");               // 3: nB1W1F1
    repeat(m_ - 2 * n + r + 1, "F0 B1 F1 B0");  // 4: nF0B1F1B0
    repeat(n - r - 1, "B1 F1 B0");              // 5: nB1F1B0
    // 6: nB1B0, the second half splitting their backwards (from the middle on; on an even rank
    // from chunk 0's backward of the middle pair, on an odd one from chunk 1's).
    const int64_t half = (r + 1) / 2;
    for (int64_t k = 0; k < r + 1; ++k) {
      b(1, k > half || (k == half && r % 2 == 1));
      b(0, k >= half);
    }
    repeat(n - r - 1, "W I0");  // 7: nWB0
    repeat(r + 1, "W");         // 8: nW
    return std::move(out_);
  }

 private:
  // Runs `steps` (space-separated actions, as in actions()) `times` times.
  void repeat(int64_t times, absl::string_view steps) {
    for (int64_t k = 0; k < times; ++k) {
      for (absl::string_view step : absl::StrSplit(steps, ' ')) {
        const int c = step.size() > 1 ? step[1] - '0' : 0;
        switch (step[0]) {
          case 'F':
            f(c);
            break;
          case 'B':
            b(c);
            break;
          case 'I':
            b(c, /*split=*/true);
            break;
          default:
            w();
        }
      }
    }
  }
  void f(int c) { out_.push_back(forward(s_[c], forwards_[c]++)); }
  // Chunk c's next backward: whole, or its I with its W queued.
  void b(int c, bool split = false) {
    const int64_t i = backwards_[c]++;
    if (!split) {
      out_.push_back({ActionType::kBackward, s_[c], i});
      return;
    }
    out_.push_back({ActionType::kBackwardInput, s_[c], i});
    queued_.push_back({ActionType::kBackwardWeight, s_[c], i});
  }
  void w() { out_.push_back(queued_[next_w_++]); }

  const int64_t n_, m_, r_;
  const int64_t s_[2];
  int64_t forwards_[2] = {0, 0};
  int64_t backwards_[2] = {0, 0};
  std::vector<Action> queued_;
  size_t next_w_ = 0;
  std::vector<Action> out_;
};

// The V placement over n ranks (stage_rank): stage s on rank s, or 2n - 1 - s.
Schedule v_placement(std::string name, int64_t n, int64_t m) {
  Schedule schedule;
  schedule.name = std::move(name);
  schedule.stages = 2 * n;
  schedule.microbatches = m;
  for (int64_t s = 0; s < 2 * n; ++s) {
    schedule.stage_ranks.push_back(stage_rank(ScheduleKind::kZeroBubbleV, s, n));
  }
  return schedule;
}

}  // namespace

Schedule dualpipev_schedule(int64_t partitions, int64_t microbatches) {
  check_counts("dualpipev_schedule", partitions, microbatches);
  const int64_t n = partitions;
  // Fewer than 2n - 1 micro-batches leave DualPipeV no steady step: ZBV's order, shortened.
  if (microbatches < 2 * n - 1) {
    Schedule schedule = zbv_schedule(n, microbatches);
    schedule.name = "dualpipev";
    return schedule;
  }
  Schedule schedule = v_placement("dualpipev", n, microbatches);
  for (int64_t r = 0; r < n; ++r) {
    schedule.ranks.push_back(DualPipeVRank(n, microbatches, r).actions());
  }
  return schedule;
}

Schedule zbv_schedule(int64_t partitions, int64_t microbatches) {
  check_counts("zbv_schedule", partitions, microbatches);
  const int64_t n = partitions;
  Schedule schedule = v_placement("zbv", n, microbatches);
  for (int64_t r = 0; r < n; ++r) schedule.ranks.push_back(zbv_rank(n, microbatches, r));
  return schedule;
}

Schedule interleaved_zero_bubble_schedule(int64_t partitions, int64_t microbatches,
                                          int64_t virtual_stages) {
  const char* who = "interleaved_zero_bubble_schedule";
  check_counts(who, partitions, microbatches);
  TORCH_CHECK(virtual_stages >= 1, who, ": the number of virtual stages (model chunks per rank) "
              "must be at least 1, got ", virtual_stages);
  TORCH_CHECK(virtual_stages == 1 || microbatches % partitions == 0, who, ": the number of "
              "micro-batches (", microbatches, ") must be a multiple of the number of partitions (",
              partitions, ") with more than one virtual stage, e.g. ",
              (microbatches / partitions + 1) * partitions);
  return split_backwards(interleaved_schedule(partitions, microbatches, virtual_stages), "zb1p");
}

ScheduleKind schedule_kind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGPipe;
  if (name == "1f1b") return ScheduleKind::k1F1B;
  if (name == "interleaved") return ScheduleKind::kInterleaved;
  if (name == "zb") return ScheduleKind::kZeroBubble;
  if (name == "zbv") return ScheduleKind::kZeroBubbleV;
  if (name == "zb1p") return ScheduleKind::kInterleavedZeroBubble;
  if (name == "dualpipev") return ScheduleKind::kDualPipeV;
  TORCH_CHECK(false, "unknown schedule '", name,
              "': expected gpipe, 1f1b, interleaved, zb, zbv, zb1p or dualpipev");
}

std::string schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZeroBubble: return "zb";
    case ScheduleKind::kZeroBubbleV:
      return "zbv";
    case ScheduleKind::kInterleavedZeroBubble:
      return "zb1p";
    case ScheduleKind::kDualPipeV:
      return "dualpipev";
  }
  return "?";
}

bool takes_virtual_stages(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kInterleavedZeroBubble;
}

bool v_shaped(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleV || kind == ScheduleKind::kDualPipeV;
}

int64_t stage_rank(ScheduleKind kind, int64_t stage, int64_t ranks) {
  const int64_t stages = v_shaped(kind) ? 2 * ranks : stage + 1;
  TORCH_CHECK(ranks >= 1 && stage >= 0 && stage < stages, "stage_rank: stage ", stage, " over ",
              ranks, " ranks is not a stage of ", schedule_kind_name(kind),
              v_shaped(kind) ? "; a V has 2 stages per rank, 0 to 2 ranks - 1" : "",
              " (give ranks >= 1 and a stage from 0)");
  if (v_shaped(kind)) return stage < ranks ? stage : 2 * ranks - 1 - stage;
  return stage % ranks;
}

Schedule make_schedule(ScheduleKind kind, int64_t partitions, int64_t microbatches,
                       int64_t virtual_stages, int64_t microbatch_group) {
  const bool v_shape = v_shaped(kind);
  TORCH_CHECK(virtual_stages == 1 || takes_virtual_stages(kind) || (v_shape && virtual_stages == 2),
              "make_schedule: ", virtual_stages, " virtual stages given for the ",
              schedule_kind_name(kind), " schedule; ",
              v_shape
                  ? absl::StrCat(schedule_kind_name(kind), " always has 2 (1 or 2 may be given)")
                  : std::string("only interleaved and zb1p take more than 1"));
  TORCH_CHECK(microbatch_group == 0 || kind == ScheduleKind::kInterleaved,
              "make_schedule: a micro-batch group of ", microbatch_group, " given for the ",
              schedule_kind_name(kind), " schedule; only interleaved takes one (0: none)");
  switch (kind) {
    case ScheduleKind::kGPipe: return gpipe_schedule(partitions, microbatches);
    case ScheduleKind::k1F1B: return one_f_one_b_schedule(partitions, microbatches);
    case ScheduleKind::kInterleaved:
      return interleaved_schedule(partitions, microbatches, virtual_stages, microbatch_group);
    case ScheduleKind::kZeroBubble: return zero_bubble_schedule(partitions, microbatches);
    case ScheduleKind::kZeroBubbleV:
      return zbv_schedule(partitions, microbatches);
    case ScheduleKind::kInterleavedZeroBubble:
      return interleaved_zero_bubble_schedule(partitions, microbatches, virtual_stages);
    case ScheduleKind::kDualPipeV:
      return dualpipev_schedule(partitions, microbatches);
  }
  TORCH_CHECK(false, "make_schedule: unknown schedule kind");
}

}  // namespace gpipe
