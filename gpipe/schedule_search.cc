// A schedule searched from measured costs (Note [Searching a schedule] in schedule_search.h).
#include "gpipe/schedule_search.h"

#include <algorithm>
#include <functional>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace gpipe {
namespace {

// A schedule with its simulation and where it came from.
struct Candidate {
  Schedule schedule;
  ScheduleSimulation simulation;
  std::string origin;
};

bool fits(const ScheduleSimulation& sim, const std::vector<int64_t>& limit) {
  for (size_t r = 0; r < limit.size(); ++r) {
    if (sim.peak_in_flight[r] > limit[r]) return false;
  }
  return true;
}

// The list scheduler of Note [Searching a schedule], step 2: each rank's F, I and W in turn on
// the simulated clock, rank r taking at most n - r + `extra` F ahead of its I's and keeping up to
// `keep(r)` W waiting.
class ListScheduler {
 public:
  ListScheduler(int64_t m, const std::vector<ActionCosts>& costs, const std::vector<int64_t>& limit)
      : n_(static_cast<int64_t>(costs.size())), m_(m), costs_(costs), limit_(limit) {}

  Schedule run(int64_t extra, const std::function<int64_t(int64_t)>& keep) {
    Schedule out;
    out.name = "searched";
    out.stages = n_;
    out.microbatches = m_;
    out.ranks.resize(n_);
    for (int64_t r = 0; r < n_; ++r) out.stage_ranks.push_back(r);
    f_end_.assign(n_, std::vector<double>(m_, -1));
    i_end_.assign(n_, std::vector<double>(m_, -1));
    clock_.assign(n_, 0);
    f_.assign(n_, 0);
    i_.assign(n_, 0);
    w_.assign(n_, 0);
    for (int64_t left = 3 * n_ * m_; left > 0; --left) {
      int64_t rank = -1;
      Next best;
      for (int64_t r = 0; r < n_; ++r) {
        const Next next = decide(r, extra, keep(r));
        if (next.start >= 0 && (rank < 0 || next.start < best.start)) {
          rank = r;
          best = next;
        }
      }
      TORCH_INTERNAL_ASSERT(rank >= 0, "search_schedule: the list scheduler found no action");
      apply(rank, best, out);
    }
    return out;
  }

 private:
  struct Next {
    ActionType type = ActionType::kForward;
    double start = -1;  // -1: nothing this rank can decide yet
  };

  // When rank r's next F could start, or -1 (not yet known, or none left).
  double forward_ready(int64_t r) const {
    if (f_[r] >= m_) return -1;
    if (r == 0) return 0;
    const double sent = f_end_[r - 1][f_[r]];
    return sent < 0 ? -1 : sent + costs_[r - 1].transfer;
  }
  // When rank r's next I could start, or -1.
  double input_grad_ready(int64_t r) const {
    if (i_[r] >= f_[r]) return -1;
    const double own = f_end_[r][i_[r]];
    if (r == n_ - 1) return own;
    const double sent = i_end_[r + 1][i_[r]];
    return sent < 0 ? -1 : std::max(own, sent + costs_[r + 1].transfer);
  }

  Next decide(int64_t r, int64_t extra, int64_t keep) const {
    const double t = clock_[r];
    const int64_t cap = std::min(limit_[r], n_ - r + extra);
    const double ri = input_grad_ready(r);
    const double rf = f_[r] - i_[r] < cap && f_[r] - w_[r] < limit_[r] ? forward_ready(r) : -1.0;
    const int64_t waiting = i_[r] - w_[r];
    if (ri >= 0 && ri <= t) return {ActionType::kBackwardInput, t};
    if (waiting > keep) return {ActionType::kBackwardWeight, t};
    if (rf >= 0 && rf <= t) return {ActionType::kForward, t};
    if (waiting > 0) return {ActionType::kBackwardWeight, t};  // rather than idle
    if (ri >= 0 && (rf < 0 || ri <= rf)) return {ActionType::kBackwardInput, ri};
    if (rf >= 0) return {ActionType::kForward, rf};
    return {};
  }

  void apply(int64_t r, const Next& next, Schedule& out) {
    const ActionCosts& c = costs_[r];
    switch (next.type) {
      case ActionType::kForward:
        out.ranks[r].push_back({ActionType::kForward, r, f_[r]});
        clock_[r] = f_end_[r][f_[r]++] = next.start + c.forward;
        break;
      case ActionType::kBackwardInput:
        out.ranks[r].push_back({ActionType::kBackwardInput, r, i_[r]});
        clock_[r] = i_end_[r][i_[r]++] = next.start + c.backward_input;
        break;
      default:
        out.ranks[r].push_back({ActionType::kBackwardWeight, r, w_[r]++});
        clock_[r] = next.start + c.backward_weight;
    }
  }

  const int64_t n_, m_;
  const std::vector<ActionCosts>& costs_;
  const std::vector<int64_t>& limit_;
  std::vector<std::vector<double>> f_end_, i_end_;
  std::vector<double> clock_;
  std::vector<int64_t> f_, i_, w_;  // each rank's F, I and W so far
};

// Step 3 of Note [Searching a schedule]: neighbouring actions of different kinds swapped, and W
// carried up to 4 places later, while the step shortens within the limit.
int64_t improve(Candidate& c, const ScheduleSearchOptions& options,
                const std::vector<int64_t>& limit, int64_t& budget) {
  int64_t kept = 0;
  const auto try_move = [&](std::vector<Action>& actions, size_t from, size_t to) {
    if (budget <= 0) return false;
    --budget;
    const Action moved = actions[from];
    actions.erase(actions.begin() + from);
    actions.insert(actions.begin() + to, moved);
    try {
      ScheduleSimulation sim = simulate_schedule(c.schedule, options.stage_costs);
      if (sim.makespan < c.simulation.makespan * (1 - 1e-12) && fits(sim, limit)) {
        c.simulation = std::move(sim);
        ++kept;
        return true;
      }
    } catch (const c10::Error&) {
      // An order the dependencies forbid.
    }
    actions.erase(actions.begin() + to);
    actions.insert(actions.begin() + from, moved);
    return false;
  };
  for (bool better = true; better && budget > 0;) {
    better = false;
    for (std::vector<Action>& actions : c.schedule.ranks) {
      for (size_t k = 0; k + 1 < actions.size(); ++k) {
        // (Of one kind only between two stages of a rank: each stage keeps its order.)
        if (actions[k].type != actions[k + 1].type || actions[k].stage != actions[k + 1].stage) {
          better |= try_move(actions, k, k + 1);
        }
        if (actions[k].type != ActionType::kBackwardWeight) continue;
        for (size_t to = k + 2; to < std::min(actions.size(), k + 5); ++to) {
          if (actions[to].type == ActionType::kBackwardWeight) break;
          if (try_move(actions, k, to)) {
            better = true;
            break;  // (actions[k] is another action now)
          }
        }
      }
    }
  }
  return kept;
}

}  // namespace

SearchedSchedule search_schedule(int64_t microbatches, const ScheduleSearchOptions& options) {
  const char* who = "search_schedule";
  const int64_t stages = static_cast<int64_t>(options.stage_costs.size());
  const int64_t v = options.virtual_stages;
  TORCH_CHECK(stages >= 1, who, ": stage_costs is empty; give one entry per stage (rank)");
  TORCH_CHECK(v >= 1 && (!options.v_shape || v == 1), who, ": virtual_stages is ", v,
              options.v_shape ? " with v_shape; a V has its own 2 stages per rank, give 1"
                              : "; give 1 (one stage per rank) or more (interleaved)");
  TORCH_CHECK(!options.v_shape || (stages >= 2 && stages % 2 == 0), who, ": a V has 2 stages "
              "per rank, but stage_costs has ", stages, " entries; give an even number");
  TORCH_CHECK(v == 1 || (stages % v == 0 && stages >= 2 * v), who,
              ": interleaved over ranks of ", v, " stages each, but stage_costs has ", stages,
              " entries; give a multiple of ", v, " (at least 2 ranks)");
  const int64_t per_rank = options.v_shape ? 2 : v;
  const int64_t n = stages / per_rank;  // ranks
  const int64_t m = microbatches;
  TORCH_CHECK(m >= 1, who, ": the number of micro-batches must be at least 1, got ", m);
  TORCH_CHECK(v == 1 || m % n == 0, who, ": interleaved over ", n, " ranks runs a multiple of ",
              n, " micro-batches (as interleaved and zb1p do), got ", m);
  const int64_t held = per_rank * m;  // (stage, micro-batch) pairs of a rank
  std::vector<int64_t> limit = options.max_in_flight;
  if (limit.empty()) limit.assign(n, held);
  TORCH_CHECK(static_cast<int64_t>(limit.size()) == n, who, ": max_in_flight has ", limit.size(),
              " entries for ", n, " ranks; give one per rank, or none");
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(limit[r] >= 1, who, ": max_in_flight[", r, "] is ", limit[r],
                "; a rank must hold at least 1 micro-batch");
    limit[r] = std::min(limit[r], held);  // (more changes nothing)
  }
  SearchedSchedule result;
  std::vector<Candidate> candidates;
  // 1. The generated schedules of the placement that fit.
  std::vector<ScheduleKind> seeds = {ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                     ScheduleKind::kZeroBubble};
  if (options.v_shape) {
    seeds = {ScheduleKind::kZeroBubbleV};
    // (With fewer micro-batches dualpipev is zbv's order.)
    if (m >= 2 * n - 1) seeds.push_back(ScheduleKind::kDualPipeV);
  } else if (v > 1) {
    seeds = {ScheduleKind::kInterleaved, ScheduleKind::kInterleavedZeroBubble};
  }
  for (ScheduleKind kind : seeds) {
    Candidate c{make_schedule(kind, n, m, per_rank), {}, schedule_kind_name(kind)};
    c.simulation = simulate_schedule(c.schedule, options.stage_costs);
    if (!fits(c.simulation, limit)) continue;
    if (result.best_generated_name.empty() ||
        c.simulation.makespan < result.best_generated.makespan) {
      result.best_generated = c.simulation;
      result.best_generated_name = c.origin;
    }
    candidates.push_back(std::move(c));
  }
  // 2. The list scheduler over warm-up caps and keeps (one stage per rank).
  ListScheduler scheduler(m, options.stage_costs, limit);
  const int64_t most = per_rank > 1 ? -1 : *std::max_element(limit.begin(), limit.end());
  for (int64_t extra = 0; extra <= most; ++extra) {
    for (int keep = 0; keep < 3; ++keep) {
      Candidate c;
      c.schedule = scheduler.run(extra, [keep, m](int64_t r) {
        return keep == 0 ? int64_t{0} : keep == 1 ? r : m;
      });
      c.simulation = simulate_schedule(c.schedule, options.stage_costs);
      if (!fits(c.simulation, limit)) continue;
      const char* kept[] = {"0", "r", "all"};
      c.origin = absl::StrCat("greedy (cap +", extra, ", keep ", kept[keep], ")");
      candidates.push_back(std::move(c));
    }
  }
  TORCH_CHECK(!candidates.empty(), who, ": no schedule fits max_in_flight");
  // 3. Local improvement of the best few, generated ones first among equals.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.simulation.makespan < b.simulation.makespan;
                   });
  candidates.resize(std::min<size_t>(candidates.size(), 3));
  int64_t budget = options.budget;
  for (Candidate& c : candidates) {
    const int64_t kept = improve(c, options, limit, budget);
    if (kept > 0) {
      c.schedule.name = "searched";
      absl::StrAppend(&c.origin, ", improved by ", kept, " move", kept == 1 ? "" : "s");
    }
  }
  const Candidate& best = *std::min_element(candidates.begin(), candidates.end(),
                                            [](const Candidate& a, const Candidate& b) {
                                              return a.simulation.makespan < b.simulation.makespan;
                                            });
  result.schedule = best.schedule;
  result.simulation = best.simulation;
  result.origin = best.origin;
  return result;
}

}  // namespace gpipe
