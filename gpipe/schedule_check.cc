// Checking, completing and simulating schedules; see Note [Checking a schedule].
#include "gpipe/schedule_check.h"

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/internal/schedule_plan.h"
#include "gpipe/schedule_search.h"

namespace gpipe {
namespace {

using internal::counterpart;
using internal::kTypes;
using internal::place_actions;
using internal::Plan;
using internal::where;

// Every compute action once; every transfer where (and only where) a tensor crosses ranks.
void check_complete(const Schedule& s, const Plan& plan) {
  auto missing = [&](const Action& a, const char* why) {
    TORCH_CHECK(false, "schedule '", s.name, "': rank ", s.stage_ranks[a.stage], " never runs '",
                to_string(a), "'", why);
  };
  for (int64_t stage = 0; stage < s.stages; ++stage) {
    for (int64_t i = 0; i < s.microbatches; ++i) {
      const Action f{ActionType::kForward, stage, i};
      const Action b{ActionType::kBackward, stage, i};
      const Action in{ActionType::kBackwardInput, stage, i};
      const Action w{ActionType::kBackwardWeight, stage, i};
      if (!plan.has(f)) missing(f, "");
      if (plan.has(b) && (plan.has(in) || plan.has(w))) {
        TORCH_CHECK(false, where(plan, plan.has(in) ? in : w), ": micro-batch ", i, " of stage ",
                    stage, " also runs a whole backward ('", to_string(b), "')");
      }
      if (plan.has(in) && !plan.has(w)) missing(w, " (its I runs)");
      if (plan.has(w) && !plan.has(in)) missing(in, " (its W runs)");
      if (!plan.has(b) && !plan.has(in)) missing(b, " (nor I and W)");
      if (!plan.comm()) continue;
      const bool next = stage + 1 < s.stages && plan.crosses(stage, stage + 1);
      const bool previous = stage > 0 && plan.crosses(stage, stage - 1);
      const Action sends[] = {{ActionType::kSendForward, stage, i},
                              {ActionType::kSendBackward, stage, i}};
      const bool crossing[] = {next, previous};
      for (int k = 0; k < 2; ++k) {
        const Action& send = sends[k];
        const Action recv = counterpart(send);
        if (crossing[k]) {
          if (!plan.has(send)) missing(send, ": its neighbour is on another rank");
          if (!plan.has(recv)) missing(recv, ": its neighbour is on another rank");
        } else {
          for (const Action& a : {send, recv}) {
            TORCH_CHECK(a.stage < 0 || a.stage >= s.stages || !plan.has(a), where(plan, a),
                        ": nothing to transfer (no neighbouring stage on another rank)");
          }
        }
      }
    }
  }
}

// What each action needs on its rank comes before it.
void check_order(const Schedule& s, const Plan& plan) {
  std::vector<Action> local;
  std::optional<Action> remote;
  for (const auto& actions : s.ranks) {
    for (const Action& a : actions) {
      plan.needs(a, local, remote);
      for (const Action& need : local) {
        TORCH_CHECK(plan.position_of(need) < plan.position_of(a), where(plan, a),
                    ": runs before '", to_string(need), "', which it needs (action ",
                    plan.position_of(need), ")");
      }
    }
  }
}

// Every pair of ranks posts its transfers in one order (Note [Point-to-point order]).
void check_pairs(const Schedule& s) {
  std::map<std::pair<int64_t, int64_t>, std::vector<Action>> posted;  // (rank, peer) -> in order
  for (int64_t r = 0; r < s.num_ranks(); ++r) {
    for (const Action& a : s.ranks[r]) {
      if (is_communication(a.type)) posted[{r, s.stage_ranks[counterpart(a).stage]}].push_back(a);
    }
  }
  for (const auto& [ranks, mine] : posted) {
    const auto& [r, peer] = ranks;
    if (peer < r) continue;
    const std::vector<Action>& theirs = posted[{peer, r}];
    for (size_t k = 0; k < mine.size() && k < theirs.size(); ++k) {
      TORCH_CHECK(counterpart(mine[k]) == theirs[k], "schedule '", s.name, "': ranks ", r,
                  " and ", peer, " post their transfers in different orders: the transfer ", k,
                  " between them is '", to_string(mine[k]), "' on rank ", r, " but '",
                  to_string(theirs[k]), "' on rank ", peer, " (it would be '",
                  to_string(counterpart(mine[k])),
                  "'); both sides must post them in the same order (NCCL matches by order)");
    }
  }
}

double cost(const ActionCosts& costs, ActionType type) {
  switch (type) {
    case ActionType::kForward: return costs.forward;
    case ActionType::kBackward: return costs.backward_input + costs.backward_weight;
    case ActionType::kBackwardInput: return costs.backward_input;
    case ActionType::kBackwardWeight: return costs.backward_weight;
    default: return 0;
  }
}

// Runs the schedule on a simulated clock (Note [Checking a schedule]) with each stage's costs
// (a transfer costs its sending stage's); throws on a deadlock.
ScheduleSimulation run(const Plan& plan, const std::vector<ActionCosts>& stage_costs) {
  const Schedule& s = plan.schedule();
  const int64_t n = s.num_ranks();
  std::vector<double> done(static_cast<size_t>(s.stages * kTypes * s.microbatches), -1);
  // Transfers between each pair of ranks: (rank, peer) -> post times, in order; completions.
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<Action, double>>> posted;
  std::map<std::pair<int64_t, int64_t>, size_t> completed;
  auto complete = [&](int64_t a, int64_t b) {
    auto key = std::minmax(a, b);
    auto& mine = posted[{key.first, key.second}];
    auto& theirs = posted[{key.second, key.first}];
    size_t& k = completed[{key.first, key.second}];
    for (; k < mine.size() && k < theirs.size(); ++k) {
      double t = std::max(mine[k].second, theirs[k].second);
      if (k > 0) t = std::max(t, done[plan.key(mine[k - 1].first)]);
      const Action& send = mine[k].first.type == ActionType::kSendForward ||
                                   mine[k].first.type == ActionType::kSendBackward
                               ? mine[k].first
                               : theirs[k].first;
      done[plan.key(mine[k].first)] = done[plan.key(theirs[k].first)] =
          t + stage_costs[send.stage].transfer;
    }
  };

  ScheduleSimulation sim;
  sim.busy.assign(n, 0);
  sim.peak_in_flight.assign(n, 0);
  sim.stage_peak_in_flight.assign(s.stages, 0);
  sim.actions.resize(n);
  std::vector<int64_t> in_flight(n, 0), stage_in_flight(s.stages, 0);
  std::vector<size_t> next(n, 0);
  std::vector<double> clock(n, 0);
  std::vector<Action> local;
  std::optional<Action> remote;
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < n; ++r) {
      for (; next[r] < s.ranks[r].size(); ++next[r], progress = true) {
        const Action& a = s.ranks[r][next[r]];
        if (is_communication(a.type)) {
          const int64_t peer = s.stage_ranks[counterpart(a).stage];
          posted[{r, peer}].emplace_back(a, clock[r]);
          complete(r, peer);
          continue;
        }
        plan.needs(a, local, remote);
        double start = clock[r];
        bool ready = true;
        for (const Action& need : local) {
          ready = ready && done[plan.key(need)] >= 0;
          start = std::max(start, done[plan.key(need)]);
        }
        if (remote) {
          ready = ready && done[plan.key(*remote)] >= 0;
          start = std::max(start, done[plan.key(*remote)] + stage_costs[remote->stage].transfer);
        }
        if (!ready) break;
        const double end = start + cost(stage_costs[a.stage], a.type);
        done[plan.key(a)] = clock[r] = end;
        sim.busy[r] += end - start;
        sim.makespan = std::max(sim.makespan, end);
        sim.actions[r].push_back({a, r, start, end});
        const int64_t change = a.type == ActionType::kForward ? 1
                               : a.type == ActionType::kBackward ||
                                       a.type == ActionType::kBackwardWeight
                                   ? -1
                                   : 0;
        in_flight[r] += change;
        stage_in_flight[a.stage] += change;
        sim.peak_in_flight[r] = std::max(sim.peak_in_flight[r], in_flight[r]);
        sim.stage_peak_in_flight[a.stage] =
            std::max(sim.stage_peak_in_flight[a.stage], stage_in_flight[a.stage]);
      }
    }
  }
  std::vector<std::string> waiting;
  for (int64_t r = 0; r < n; ++r) {
    if (next[r] == s.ranks[r].size()) continue;
    const Action& a = s.ranks[r][next[r]];
    plan.needs(a, local, remote);
    std::vector<std::string> on;
    for (const Action& need : local) {
      if (done[plan.key(need)] < 0) on.push_back(to_string(need));
    }
    if (remote) on.push_back(to_string(*remote));
    waiting.push_back(absl::StrCat("rank ", r, " at action ", next[r], " ('", to_string(a),
                                   "') waits for '", absl::StrJoin(on, "', '"), "'"));
  }
  TORCH_CHECK(waiting.empty(), "schedule '", s.name, "' deadlocks: ",
              absl::StrJoin(waiting, "; "));
  double busy = 0;
  for (double b : sim.busy) busy += b;
  sim.bubble = sim.makespan > 0 ? 1 - busy / (n * sim.makespan) : 0;
  return sim;
}

// Every check of Note [Checking a schedule] but the deadlock (run's).
void validate(const Schedule& schedule, Plan& plan) {
  place_actions(schedule, plan);
  check_complete(schedule, plan);
  check_order(schedule, plan);
  if (plan.comm()) check_pairs(schedule);
}

ScheduleSimulation check(const Schedule& schedule, const std::vector<ActionCosts>& stage_costs) {
  Plan plan(schedule);
  validate(schedule, plan);
  return run(plan, stage_costs);
}

void check_costs(const ActionCosts& costs, const char* who, const std::string& which) {
  TORCH_CHECK(costs.forward > 0 && costs.backward_input > 0 && costs.backward_weight > 0 &&
                  costs.transfer >= 0,
              who, ": action costs must be positive (transfers: not negative), got ", which, "F ",
              costs.forward, ", I ", costs.backward_input, ", W ", costs.backward_weight,
              ", transfer ", costs.transfer);
}

}  // namespace

void check_schedule(const Schedule& schedule) {
  check(schedule, std::vector<ActionCosts>(static_cast<size_t>(schedule.stages)));
}

bool has_communication(const Schedule& schedule) {
  for (const auto& actions : schedule.ranks) {
    for (const Action& a : actions) {
      if (is_communication(a.type)) return true;
    }
  }
  return false;
}

ScheduleSimulation simulate_schedule(const Schedule& schedule, const ActionCosts& costs) {
  check_costs(costs, "simulate_schedule", "");
  return check(schedule, std::vector<ActionCosts>(static_cast<size_t>(schedule.stages), costs));
}

ScheduleSimulation simulate_schedule(const Schedule& schedule,
                                     const std::vector<ActionCosts>& stage_costs) {
  TORCH_CHECK(static_cast<int64_t>(stage_costs.size()) == schedule.stages,
              "simulate_schedule: ", stage_costs.size(), " stage costs for the ", schedule.stages,
              " stages of schedule '", schedule.name, "'; give one per stage");
  for (size_t s = 0; s < stage_costs.size(); ++s) {
    check_costs(stage_costs[s], "simulate_schedule", absl::StrCat("stage ", s, "'s "));
  }
  return check(schedule, stage_costs);
}

Schedule with_communication(const Schedule& schedule) {
  Plan plan(schedule);
  validate(schedule, plan);
  const ScheduleSimulation sim =
      run(plan, std::vector<ActionCosts>(static_cast<size_t>(schedule.stages)));
  if (plan.comm()) return schedule;
  // The transfers, each keyed by when its send runs in the simulated run.
  struct Transfer {
    std::tuple<double, int64_t, int64_t> when;  // (end of its producer, rank, position)
    Action send;
  };
  std::map<std::pair<int64_t, int64_t>, std::vector<Transfer>> pairs;  // (low rank, high rank)
  const auto& ranks = schedule.stage_ranks;
  for (int64_t r = 0; r < schedule.num_ranks(); ++r) {
    for (const SimulatedAction& done : sim.actions[r]) {
      const std::optional<Action> send = plan.send_after(done.action);
      if (!send) continue;
      const int64_t peer = ranks[counterpart(*send).stage];
      pairs[std::minmax(r, peer)].push_back(
          {{done.end, r, plan.position_of(done.action)}, *send});
    }
  }
  for (auto& [key, transfers] : pairs) {
    std::sort(transfers.begin(), transfers.end(),
              [](const Transfer& x, const Transfer& y) { return x.when < y.when; });
  }
  Schedule out = schedule;
  std::map<std::pair<int64_t, int64_t>, size_t> posted;  // (rank, peer) -> transfers posted
  for (int64_t r = 0; r < schedule.num_ranks(); ++r) {
    auto& actions = out.ranks[r];
    actions.clear();
    // Posts rank r's side of its transfers with `peer`, in their order, up to `last`.
    auto post_until = [&](int64_t peer, const Action& last) {
      const auto& transfers = pairs[std::minmax(r, peer)];
      size_t& k = posted[{r, peer}];
      auto mine = [&](size_t at) {
        const Action& send = transfers[at].send;
        return ranks[send.stage] == r ? send : counterpart(send);
      };
      for (size_t before = 0; before < k; ++before) {
        if (mine(before) == last) return;  // posted with an earlier transfer
      }
      for (bool found = false; !found; ++k) {
        TORCH_INTERNAL_ASSERT(k < transfers.size(), "with_communication: '", to_string(last),
                              "' is not among the transfers of ranks ", r, " and ", peer);
        actions.push_back(mine(k));
        found = mine(k) == last;
      }
    };
    std::vector<Action> local;
    std::optional<Action> remote;
    for (const Action& a : schedule.ranks[r]) {
      plan.needs(a, local, remote);
      if (remote) {
        const Action receive = remote->type == ActionType::kForward
                                   ? Action{ActionType::kRecvForward, a.stage, a.microbatch}
                                   : Action{ActionType::kRecvBackward, a.stage, a.microbatch};
        post_until(ranks[remote->stage], receive);
      }
      actions.push_back(a);
      if (const std::optional<Action> send = plan.send_after(a)) {
        post_until(ranks[counterpart(*send).stage], *send);
      }
    }
  }
  check(out, std::vector<ActionCosts>(static_cast<size_t>(out.stages)));
  return out;
}

}  // namespace gpipe
