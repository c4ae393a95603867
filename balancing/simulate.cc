// Simulating a pipeline step; see simulate.h.
#include "balancing/simulate.h"

#include <algorithm>
#include <limits>
#include <optional>

#include <c10/util/Exception.h>

#include "gpipe/schedule_check.h"
#include "gpipe/schedule_plan.h"

namespace gpipe {
namespace {

using Kind = TimelineEvent::Kind;

struct Running {
  Action action;
  double remaining = 0;  // microseconds of work at full speed
  double work = 0;
  double start = 0;
  int64_t transient = 0;  // working bytes while it runs
};

}  // namespace

PipelineSimulation simulate_pipeline(const Schedule& schedule, const PipelineCosts& costs) {
  check_schedule(schedule);
  TORCH_CHECK(!has_communication(schedule), "simulate_pipeline: schedule '", schedule.name,
              "' has sends and receives; give the schedule of one process's workers (without)");
  TORCH_CHECK(static_cast<int64_t>(costs.stages.size()) == schedule.stages, "simulate_pipeline: ",
              costs.stages.size(), " stage costs for a schedule of ", schedule.stages, " stages");
  TORCH_CHECK(!costs.capacity.empty() && costs.static_bytes.size() == costs.capacity.size(),
              "simulate_pipeline: capacity and static_bytes must name the same devices (",
              costs.capacity.size(), " and ", costs.static_bytes.size(), ")");
  const int64_t devices = static_cast<int64_t>(costs.capacity.size());
  for (double c : costs.capacity) {
    TORCH_CHECK(c > 0, "simulate_pipeline: a device's capacity must be positive, got ", c);
  }
  TORCH_CHECK(costs.cores.empty() || costs.cores.size() == costs.capacity.size(),
              "simulate_pipeline: cores must be empty or name every device (", costs.cores.size(),
              " for ", costs.capacity.size(), " devices)");
  for (int64_t c : costs.cores) {
    TORCH_CHECK(c >= 0, "simulate_pipeline: a device's cores must be 0 or more, got ", c);
  }
  TORCH_CHECK(costs.slice_us >= 0 && costs.wakeup_us >= 0 && costs.sleeper_credit_us >= 0,
              "simulate_pipeline: slice_us, wakeup_us and sleeper_credit_us must not be negative, "
              "got ", costs.slice_us, ", ", costs.wakeup_us, " and ", costs.sleeper_credit_us);
  const bool turns = std::any_of(costs.cores.begin(), costs.cores.end(),
                                 [](int64_t c) { return c > 0; });
  TORCH_CHECK(costs.slice_us > 0 || !turns,
              "simulate_pipeline: slice_us must be positive where a device names its cores (turns "
              "of 0 never end); got 0");
  for (int64_t s = 0; s < schedule.stages; ++s) {
    const StageCost& c = costs.stages[s];
    TORCH_CHECK(c.lane == schedule.stage_ranks[s], "simulate_pipeline: stage ", s, " is on lane ",
                c.lane, " but the schedule runs it on rank ", schedule.stage_ranks[s]);
    TORCH_CHECK(c.device >= 0 && c.device < devices, "simulate_pipeline: stage ", s,
                " names device ", c.device, "; there are ", devices);
    TORCH_CHECK(c.forward_us >= 0 && c.forward_nograd_us >= 0 && c.backward_us >= 0 &&
                    c.backward_input_us >= 0 && c.backward_weight_us >= 0 &&
                    c.recompute_us >= 0 && c.copy_us >= 0 && c.held_bytes >= 0 &&
                    c.checkpointed_bytes >= 0 && c.grad_kept_bytes >= 0 &&
                    c.forward_workspace_bytes >= 0 && c.backward_workspace_bytes >= 0 &&
                    costs.handoff_us >= 0,
                "simulate_pipeline: stage ", s, " has a negative cost");
  }
  detail::Plan plan(schedule);
  detail::place_actions(schedule, plan);

  const int64_t n = schedule.num_ranks();
  const int64_t stop = costs.checkpoint_stop;
  auto checkpointed = [&](const Action& a) { return a.microbatch < stop; };
  auto work = [&](const Action& a) {
    const StageCost& c = costs.stages[a.stage];
    const bool ck = checkpointed(a);
    switch (a.type) {
      case ActionType::kForward: return ck ? c.forward_nograd_us : c.forward_us;
      case ActionType::kBackward: return (ck ? c.recompute_us : 0) + c.backward_us;
      case ActionType::kBackwardInput: return ck ? c.recompute_us + c.backward_us
                                                 : c.backward_input_us;
      case ActionType::kBackwardWeight: return ck ? 0.0 : c.backward_weight_us;
      default: return 0.0;
    }
  };
  // What the action keeps once it ends (positive) or frees (negative), on its stage's device.
  auto kept = [&](const Action& a) -> int64_t {
    const StageCost& c = costs.stages[a.stage];
    const bool ck = checkpointed(a);
    switch (a.type) {
      case ActionType::kForward: return ck ? c.checkpointed_bytes : c.held_bytes;
      case ActionType::kBackward: return -(ck ? c.checkpointed_bytes : c.held_bytes);
      case ActionType::kBackwardInput: return ck ? -c.checkpointed_bytes : c.grad_kept_bytes;
      case ActionType::kBackwardWeight: return ck ? 0 : -(c.held_bytes + c.grad_kept_bytes);
      default: return 0;
    }
  };
  auto transient = [&](const Action& a) -> int64_t {
    const StageCost& c = costs.stages[a.stage];
    switch (a.type) {
      case ActionType::kForward: return c.forward_workspace_bytes;
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
        return checkpointed(a) ? c.held_bytes + std::max(c.forward_workspace_bytes,
                                                         c.backward_workspace_bytes)
                               : c.backward_workspace_bytes;
      default: return 0;
    }
  };
  // The time at which what `a` needs is there, or nullopt while something is not done.
  std::vector<double> done(static_cast<size_t>(schedule.stages * detail::kTypes *
                                               schedule.microbatches),
                           -1);
  std::vector<Action> local;
  std::optional<Action> remote;
  auto ready_at = [&](const Action& a) -> std::optional<double> {
    plan.needs(a, local, remote);
    double t = 0;
    for (const Action& need : local) {
      const double d = done[plan.key(need)];
      if (d < 0) return std::nullopt;
      t = std::max(t, d);
    }
    if (remote) {
      const double d = done[plan.key(*remote)];
      if (d < 0) return std::nullopt;
      // A forward's input comes from the stage before, a backward's gradient from the one after.
      const int64_t from = a.type == ActionType::kForward ? a.stage - 1 : a.stage;
      t = std::max(t, d + costs.stages[from].copy_us + costs.handoff_us);
    }
    return t;
  };

  PipelineSimulation sim;
  std::vector<int64_t> current = costs.static_bytes;
  std::vector<int64_t> working(devices, 0);
  sim.peak_bytes = current;
  auto note_peak = [&](int64_t d) {
    sim.peak_bytes[d] = std::max(sim.peak_bytes[d], current[d] + working[d]);
  };
  std::vector<std::optional<Running>> running(n);
  std::vector<size_t> next(n, 0);
  // Taking turns on a CPU's cores: each worker's CPU time (its virtual runtime) and whether it
  // holds a core now.
  auto cores_of = [&](int64_t d) { return costs.cores.empty() ? int64_t{0} : costs.cores[d]; };
  std::vector<double> vruntime(n, 0);
  std::vector<bool> on_core(n, false), woken(n, false);
  std::vector<double> since(n, 0);      // when it took its core
  std::vector<int64_t> core_of(n, -1);  // the device of that core
  // Per device: the least virtual runtime of its workers, which only grows (Linux's
  // min_vruntime): a worker waking there comes back at most sleeper_credit_us behind it.
  std::vector<double> least(devices, 0);
  auto device_of = [&](int64_t r) { return costs.stages[running[r]->action.stage].device; };
  double t = 0;
  constexpr double kEps = 1e-9;
  for (;;) {
    // Start every action that can start now; note when the others' inputs will be there.
    double wake = std::numeric_limits<double>::infinity();
    for (int64_t r = 0; r < n; ++r) {
      if (running[r] || next[r] >= schedule.ranks[r].size()) continue;
      const Action& a = schedule.ranks[r][next[r]];
      const std::optional<double> at = ready_at(a);
      if (!at) continue;
      if (*at > t + kEps) {
        wake = std::min(wake, *at);
        continue;
      }
      const double w = work(a);
      const int64_t d = costs.stages[a.stage].device;
      running[r] = Running{a, w, w, t, transient(a)};
      working[d] += running[r]->transient;
      note_peak(d);
      // A worker going straight on to its next action on the same device keeps its core.
      if (core_of[r] != d) on_core[r] = false;
      woken[r] = !on_core[r];
    }
    for (int64_t r = 0; r < n; ++r) {
      if (!running[r]) on_core[r] = false;
    }
    // Each device's workers share it.
    std::vector<int64_t> active(devices, 0);
    bool any = false;
    for (int64_t r = 0; r < n; ++r) {
      if (running[r]) {
        ++active[device_of(r)];
        any = true;
      }
    }
    if (!any && wake == std::numeric_limits<double>::infinity()) break;
    // Who holds a core, where more workers run than the device has cores.
    double turn = std::numeric_limits<double>::infinity();  // the next preemption at a slice's end
    for (int64_t d = 0; d < devices; ++d) {
      const int64_t cores = cores_of(d);
      std::vector<int64_t> on, off;
      for (int64_t r = 0; r < n; ++r) {
        if (running[r] && device_of(r) == d) (on_core[r] ? on : off).push_back(r);
      }
      auto give_core = [&](int64_t r) {
        on_core[r] = true;
        since[r] = t;
        core_of[r] = d;
      };
      if (cores > 0) {
        // A worker that slept comes back at most sleeper_credit_us behind the others.
        double now_least = std::numeric_limits<double>::infinity();
        for (int64_t r = 0; r < n; ++r) {
          if (running[r] && device_of(r) == d && !woken[r]) {
            now_least = std::min(now_least, vruntime[r]);
          }
        }
        if (now_least < std::numeric_limits<double>::infinity()) {
          least[d] = std::max(least[d], now_least);
        }
        for (int64_t r : off) {
          if (woken[r]) vruntime[r] = std::max(vruntime[r], least[d] - costs.sleeper_credit_us);
        }
      }
      if (cores == 0 || active[d] <= cores) {
        for (int64_t r : off) give_core(r);
        continue;
      }
      auto by_vruntime = [&](int64_t a, int64_t b) { return vruntime[a] < vruntime[b]; };
      auto take = [&](std::vector<int64_t>::iterator q) {
        give_core(*q);
        on.push_back(*q);
        off.erase(q);
      };
      // Free cores go to those furthest behind.
      while (static_cast<int64_t>(on.size()) < cores) {
        take(std::min_element(off.begin(), off.end(), by_vruntime));
      }
      // A worker just woken takes the core of the one furthest ahead when more than wakeup_us
      // behind it; and one that has held its core for slice_us yields it to one behind it.
      for (bool moved = true; moved && !off.empty();) {
        moved = false;
        auto q = std::min_element(off.begin(), off.end(), by_vruntime);
        auto r = std::max_element(on.begin(), on.end(), by_vruntime);
        const bool wakeup = woken[*q] && vruntime[*r] - vruntime[*q] > costs.wakeup_us;
        bool sliced = false;
        for (auto k = on.begin(); k != on.end() && !wakeup; ++k) {
          if (vruntime[*k] > vruntime[*q] && t - since[*k] >= costs.slice_us - kEps) {
            r = k;
            sliced = true;
            break;
          }
        }
        if (wakeup || sliced) {
          on_core[*r] = false;
          const int64_t yielded = *r;
          on.erase(r);
          take(q);
          off.push_back(yielded);
          woken[yielded] = false;
          moved = true;
        }
      }
      // When the next slice ends for someone ahead of the first in line.
      if (off.empty()) continue;
      const double behind = vruntime[*std::min_element(off.begin(), off.end(), by_vruntime)];
      for (int64_t r : on) {
        turn = std::min(turn, std::max(since[r] + costs.slice_us,
                                       t + std::max(0.0, behind - vruntime[r]) + 1e-3));
      }
    }
    std::fill(woken.begin(), woken.end(), false);
    auto rate = [&](int64_t r) {
      if (!on_core[r]) return 0.0;
      const int64_t d = device_of(r);
      const int64_t cores = cores_of(d);
      const int64_t sharing = cores == 0 ? active[d] : std::min(active[d], cores);
      return std::min(1.0, costs.capacity[d] / static_cast<double>(sharing));
    };
    double until = std::min(wake, std::max(turn, t + kEps));
    for (int64_t r = 0; r < n; ++r) {
      if (running[r] && on_core[r]) until = std::min(until, t + running[r]->remaining / rate(r));
    }
    for (int64_t r = 0; r < n; ++r) {
      if (!running[r] || !on_core[r]) continue;
      running[r]->remaining -= (until - t) * rate(r);
      vruntime[r] += until - t;
    }
    t = until;
    for (int64_t r = 0; r < n; ++r) {
      if (!running[r] || running[r]->remaining > kEps * std::max(1.0, running[r]->work)) continue;
      const Running x = *running[r];
      running[r].reset();
      ++next[r];
      const Action& a = x.action;
      const StageCost& c = costs.stages[a.stage];
      const int64_t d = c.device;
      done[plan.key(a)] = t;
      current[d] += kept(a);
      note_peak(d);
      working[d] -= x.transient;
      sim.step_us = std::max(sim.step_us, t);
      // The timeline, as the executor records it.
      TimelineEvent e{Kind::kCompute, a.microbatch, a.stage};
      e.start_us = x.start;
      e.end_us = t;
      const bool ck = checkpointed(a);
      switch (a.type) {
        case ActionType::kForward:
          e.checkpointed = ck;
          sim.events.push_back(e);
          if (c.copy_us > 0 && a.stage + 1 < schedule.stages) {
            TimelineEvent copy{Kind::kCopy, a.microbatch, a.stage + 1, a.stage};
            copy.start_us = t;
            copy.end_us = t + c.copy_us;
            sim.events.push_back(copy);
          }
          break;
        case ActionType::kBackward:
        case ActionType::kBackwardInput: {
          double begin = x.start;
          if (ck && c.recompute_us > 0 && x.work > 0) {
            TimelineEvent re{Kind::kRecompute, a.microbatch, a.stage};
            re.start_us = x.start;
            re.end_us = begin = x.start + (t - x.start) * c.recompute_us / x.work;
            sim.events.push_back(re);
          }
          e.kind = a.type == ActionType::kBackward || ck ? Kind::kBackward : Kind::kBackwardInput;
          e.start_us = begin;
          sim.events.push_back(e);
          break;
        }
        case ActionType::kBackwardWeight:
          if (!ck) {
            e.kind = Kind::kBackwardWeight;
            sim.events.push_back(e);
          }
          break;
        default: break;
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(next[r] == schedule.ranks[r].size(), "simulate_pipeline: schedule '",
                schedule.name, "' stalls at rank ", r, " action ", next[r]);
  }
  return sim;
}

}  // namespace gpipe
