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

namespace gpipe {
namespace {

constexpr int64_t kTypes = 8;
// The most (stage, micro-batch) pairs a schedule may have (its tables hold kTypes entries each).
constexpr int64_t kMaxSize = 1 << 22;

// The other side of a transfer: SEND_F(s, i) <-> RECV_F(s + 1, i),
// SEND_B(s, i) <-> RECV_B(s - 1, i).
Action counterpart(const Action& a) {
  switch (a.type) {
    case ActionType::kSendForward: return {ActionType::kRecvForward, a.stage + 1, a.microbatch};
    case ActionType::kRecvForward: return {ActionType::kSendForward, a.stage - 1, a.microbatch};
    case ActionType::kSendBackward: return {ActionType::kRecvBackward, a.stage - 1, a.microbatch};
    case ActionType::kRecvBackward: return {ActionType::kSendBackward, a.stage + 1, a.microbatch};
    default: TORCH_INTERNAL_ASSERT(false, "counterpart of a compute action");
  }
}

// The schedule's sizes, checked before anything is sized by them.
void check_sizes(const Schedule& s) {
  const std::string name = absl::StrCat("schedule '", s.name, "'");
  TORCH_CHECK(s.stages >= 1 && s.microbatches >= 1, name,
              ": needs at least 1 stage and 1 micro-batch, got ", s.stages, " and ",
              s.microbatches);
  TORCH_CHECK(s.stages <= kMaxSize / s.microbatches, name, ": ", s.stages, " stages x ",
              s.microbatches, " micro-batches is more than ", kMaxSize,
              " (stage, micro-batch) pairs");
}

// Where each action of a schedule is, and what each needs.
class Plan {
 public:
  explicit Plan(const Schedule& schedule) : s_(schedule), comm_(has_communication(schedule)) {
    check_sizes(schedule);
    const size_t size = static_cast<size_t>(s_.stages * kTypes * s_.microbatches);
    rank_.assign(size, -1);
    position_.assign(size, -1);
  }

  const Schedule& schedule() const { return s_; }
  bool comm() const { return comm_; }
  int64_t key(const Action& a) const {
    return (a.stage * kTypes + static_cast<int64_t>(a.type)) * s_.microbatches + a.microbatch;
  }
  bool has(const Action& a) const { return rank_[key(a)] >= 0; }
  int64_t rank_of(const Action& a) const { return rank_[key(a)]; }
  int64_t position_of(const Action& a) const { return position_[key(a)]; }
  void place(const Action& a, int64_t rank, int64_t position) {
    rank_[key(a)] = rank;
    position_[key(a)] = position;
  }
  bool crosses(int64_t stage, int64_t neighbour) const {
    return s_.stage_ranks[stage] != s_.stage_ranks[neighbour];
  }
  // The action that computes the gradient stage s sends back for micro-batch i: I if split.
  Action input_gradient(int64_t s, int64_t i) const {
    const Action split{ActionType::kBackwardInput, s, i};
    return has(split) ? split : Action{ActionType::kBackward, s, i};
  }

  // The send that follows compute action `a` where its tensor crosses to another rank: F's
  // output to the next stage, B's (or I's) input gradient to the previous one.
  std::optional<Action> send_after(const Action& a) const {
    const int64_t s = a.stage;
    if (a.type == ActionType::kForward && s + 1 < s_.stages && crosses(s, s + 1)) {
      return Action{ActionType::kSendForward, s, a.microbatch};
    }
    if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) && s > 0 &&
        crosses(s, s - 1)) {
      return Action{ActionType::kSendBackward, s, a.microbatch};
    }
    return std::nullopt;
  }

  // What `a` needs: on its own rank (`local`, which must come before it), and, for a compute
  // action whose input comes from another rank in a schedule without transfers, that action.
  void needs(const Action& a, std::vector<Action>& local, std::optional<Action>& remote) const {
    local.clear();
    remote.reset();
    const int64_t s = a.stage;
    const int64_t i = a.microbatch;
    auto from_neighbour = [&](const Action& producer, const Action& receive, int64_t neighbour) {
      if (!crosses(s, neighbour)) {
        local.push_back(producer);
      } else if (comm_) {
        local.push_back(receive);
      } else {
        remote = producer;
      }
    };
    switch (a.type) {
      case ActionType::kForward:
        if (s > 0) {
          from_neighbour({ActionType::kForward, s - 1, i}, {ActionType::kRecvForward, s, i}, s - 1);
        }
        break;
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
        local.push_back({ActionType::kForward, s, i});
        if (s + 1 < s_.stages) {
          from_neighbour(input_gradient(s + 1, i), {ActionType::kRecvBackward, s, i}, s + 1);
        }
        break;
      case ActionType::kBackwardWeight: local.push_back({ActionType::kBackwardInput, s, i}); break;
      case ActionType::kSendForward: local.push_back({ActionType::kForward, s, i}); break;
      case ActionType::kSendBackward: local.push_back(input_gradient(s, i)); break;
      case ActionType::kRecvForward:
      case ActionType::kRecvBackward: break;
    }
  }

 private:
  const Schedule& s_;
  bool comm_;
  std::vector<int64_t> rank_;
  std::vector<int64_t> position_;
};

std::string where(const Plan& plan, const Action& a) {
  return absl::StrCat("schedule '", plan.schedule().name, "': rank ", plan.rank_of(a), ", action ",
                      plan.position_of(a), " ('", to_string(a), "')");
}

// The shape of the schedule, and where every action is (each once).
void place_actions(const Schedule& s, Plan& plan) {
  const std::string name = absl::StrCat("schedule '", s.name, "'");
  TORCH_CHECK(!s.ranks.empty(), name, ": has no ranks");
  TORCH_CHECK(static_cast<int64_t>(s.stage_ranks.size()) == s.stages, name, ": ", s.stages,
              " stages but stage_ranks has ", s.stage_ranks.size(), " entries");
  std::vector<bool> holds(s.ranks.size(), false);
  for (int64_t stage = 0; stage < s.stages; ++stage) {
    const int64_t r = s.stage_ranks[stage];
    TORCH_CHECK(r >= 0 && r < s.num_ranks(), name, ": stage ", stage, " is on rank ", r,
                ", but the ranks are 0 to ", s.num_ranks() - 1);
    holds[r] = true;
  }
  for (int64_t r = 0; r < s.num_ranks(); ++r) {
    TORCH_CHECK(holds[r], name, ": rank ", r, " holds no stage");
    for (int64_t p = 0; p < static_cast<int64_t>(s.ranks[r].size()); ++p) {
      const Action& a = s.ranks[r][p];
      const std::string at =
          absl::StrCat(name, ": rank ", r, ", action ", p, " ('", to_string(a), "')");
      TORCH_CHECK(static_cast<int64_t>(a.type) < kTypes, at, ": unknown action type ",
                  static_cast<int>(a.type));
      TORCH_CHECK(a.stage >= 0 && a.stage < s.stages, at, ": the stages are 0 to ", s.stages - 1);
      TORCH_CHECK(a.microbatch >= 0 && a.microbatch < s.microbatches, at,
                  ": the micro-batches are 0 to ", s.microbatches - 1);
      TORCH_CHECK(s.stage_ranks[a.stage] == r, at, ": stage ", a.stage, " is on rank ",
                  s.stage_ranks[a.stage]);
      if (is_communication(a.type)) {
        const int64_t peer = counterpart(a).stage;
        TORCH_CHECK(peer >= 0 && peer < s.stages, at, ": nothing to transfer (stage ", a.stage,
                    peer < 0 ? " is the first)" : " is the last)");
      }
      TORCH_CHECK(!plan.has(a), at, ": runs twice (also action ", plan.position_of(a), ")");
      plan.place(a, r, p);
    }
  }
}

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

// Runs the schedule on a simulated clock (Note [Checking a schedule]); throws on a deadlock.
ScheduleSimulation run(const Plan& plan, const ActionCosts& costs) {
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
      done[plan.key(mine[k].first)] = done[plan.key(theirs[k].first)] = t + costs.transfer;
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
          start = std::max(start, done[plan.key(*remote)] + costs.transfer);
        }
        if (!ready) break;
        const double end = start + cost(costs, a.type);
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

ScheduleSimulation check(const Schedule& schedule, const ActionCosts& costs) {
  Plan plan(schedule);
  validate(schedule, plan);
  return run(plan, costs);
}

}  // namespace

void check_schedule(const Schedule& schedule) { check(schedule, ActionCosts{}); }

bool has_communication(const Schedule& schedule) {
  for (const auto& actions : schedule.ranks) {
    for (const Action& a : actions) {
      if (is_communication(a.type)) return true;
    }
  }
  return false;
}

ScheduleSimulation simulate_schedule(const Schedule& schedule, const ActionCosts& costs) {
  TORCH_CHECK(costs.forward > 0 && costs.backward_input > 0 && costs.backward_weight > 0 &&
                  costs.transfer >= 0,
              "simulate_schedule: action costs must be positive (transfers: not negative), got F ",
              costs.forward, ", I ", costs.backward_input, ", W ", costs.backward_weight,
              ", transfer ", costs.transfer);
  return check(schedule, costs);
}

Schedule with_communication(const Schedule& schedule) {
  Plan plan(schedule);
  validate(schedule, plan);
  const ScheduleSimulation sim = run(plan, ActionCosts{});
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
  check(out, ActionCosts{});
  return out;
}

}  // namespace gpipe
