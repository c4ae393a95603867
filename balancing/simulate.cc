// Simulating a pipeline step; see simulate.h. The model (Note [Simulating a step]) in parts: what
// one action costs (work_us, kept_bytes, transient_bytes), when what an action needs is there
// (Dependencies), memory accounting per device (Memory), workers sharing a device and taking turns
// on a CPU's cores (Cores), and the event loop that runs them all (Simulator).
#include "balancing/simulate.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "gpipe/schedule_check.h"
#include "gpipe/internal/schedule_plan.h"

namespace gpipe {
namespace {

using Kind = TimelineEvent::Kind;

constexpr double kEps = 1e-9;
constexpr double kNever = std::numeric_limits<double>::infinity();

// Throws unless `costs` fit `schedule` (stages, lanes, devices) and no cost is negative.
void check_costs(const Schedule& schedule, const PipelineCosts& costs) {
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
                    c.allreduce_us >= 0 && costs.handoff_us >= 0 && costs.step_allreduce_us >= 0,
                "simulate_pipeline: stage ", s, " has a negative cost");
  }
}

// What worker `rank` does after its last action: its stages' all-reduces over the replicas.
double allreduce_after(const Schedule& schedule, const PipelineCosts& costs, int64_t rank) {
  double us = 0;
  for (int64_t s = 0; s < schedule.stages; ++s) {
    if (schedule.stage_ranks[s] == rank) us += costs.stages[s].allreduce_us;
  }
  return us;
}

// Whether `a`'s micro-batch is checkpointed.
bool checkpointed(const PipelineCosts& costs, const Action& a) {
  return a.microbatch < costs.checkpoint_stop;
}

// The microseconds of work `a` takes at full speed.
double work_us(const PipelineCosts& costs, const Action& a) {
  const StageCost& c = costs.stages[a.stage];
  const bool ck = checkpointed(costs, a);
  switch (a.type) {
    case ActionType::kForward: return ck ? c.forward_nograd_us : c.forward_us;
    case ActionType::kBackward: return (ck ? c.recompute_us : 0) + c.backward_us;
    case ActionType::kBackwardInput: return ck ? c.recompute_us + c.backward_us
                                               : c.backward_input_us;
    case ActionType::kBackwardWeight: return ck ? 0.0 : c.backward_weight_us;
    default: return 0.0;
  }
}

// What `a` keeps once it ends (positive) or frees (negative), on its stage's device.
int64_t kept_bytes(const PipelineCosts& costs, const Action& a) {
  const StageCost& c = costs.stages[a.stage];
  const bool ck = checkpointed(costs, a);
  switch (a.type) {
    case ActionType::kForward: return ck ? c.checkpointed_bytes : c.held_bytes;
    case ActionType::kBackward: return -(ck ? c.checkpointed_bytes : c.held_bytes);
    case ActionType::kBackwardInput: return ck ? -c.checkpointed_bytes : c.grad_kept_bytes;
    case ActionType::kBackwardWeight: return ck ? 0 : -(c.held_bytes + c.grad_kept_bytes);
    default: return 0;
  }
}

// The working memory `a` holds on its stage's device while it runs.
int64_t transient_bytes(const PipelineCosts& costs, const Action& a) {
  const StageCost& c = costs.stages[a.stage];
  switch (a.type) {
    case ActionType::kForward: return c.forward_workspace_bytes;
    case ActionType::kBackward:
    case ActionType::kBackwardInput:
      return checkpointed(costs, a) ? c.held_bytes + std::max(c.forward_workspace_bytes,
                                                              c.backward_workspace_bytes)
                                    : c.backward_workspace_bytes;
    default: return 0;
  }
}

// A worker's action while it runs.
struct Running {
  Action action;
  double remaining = 0;  // microseconds of work at full speed
  double work = 0;
  double start = 0;
  int64_t transient = 0;  // working bytes while it runs
};

// Puts `x`, ended at `end`, on the timeline as the executor records it: compute (or its
// recomputation and backward), and a forward's copy to the next stage.
void record(const Schedule& schedule, const PipelineCosts& costs, const Running& x, double end,
            const std::optional<std::pair<double, double>>& copy,
            std::vector<TimelineEvent>& events) {
  const Action& a = x.action;
  const StageCost& c = costs.stages[a.stage];
  TimelineEvent e{Kind::kCompute, a.microbatch, a.stage};
  e.start_us = x.start;
  e.end_us = end;
  const bool ck = checkpointed(costs, a);
  switch (a.type) {
    case ActionType::kForward:
      e.checkpointed = ck;
      events.push_back(e);
      if (c.copy_us > 0 && a.stage + 1 < schedule.stages) {
        TimelineEvent sent{Kind::kCopy, a.microbatch, a.stage + 1, a.stage};
        sent.start_us = copy ? copy->first : end;
        sent.end_us = copy ? copy->second : end + c.copy_us;
        events.push_back(sent);
      }
      break;
    case ActionType::kBackward:
    case ActionType::kBackwardInput: {
      double begin = x.start;
      if (ck && c.recompute_us > 0 && x.work > 0) {
        TimelineEvent re{Kind::kRecompute, a.microbatch, a.stage};
        re.start_us = x.start;
        re.end_us = begin = x.start + (end - x.start) * c.recompute_us / x.work;
        events.push_back(re);
      }
      e.kind = a.type == ActionType::kBackward || ck ? Kind::kBackward : Kind::kBackwardInput;
      e.start_us = begin;
      events.push_back(e);
      break;
    }
    case ActionType::kBackwardWeight:
      if (!ck) {
        e.kind = Kind::kBackwardWeight;
        events.push_back(e);
      }
      break;
    default: break;
  }
}

// When each action ended, and so when what an action needs is there (internal::Plan::needs): its
// own worker's actions at once, another worker's handoff_us and the copy later.
class Dependencies {
 public:
  Dependencies(const Schedule& schedule, const PipelineCosts& costs)
      : schedule_(schedule),
        costs_(costs),
        plan_(schedule),
        done_(static_cast<size_t>(schedule.stages * internal::kTypes * schedule.microbatches), -1),
        sent_(done_.size()) {
    internal::place_actions(schedule, plan_);
  }

  // The time at which what `a` needs is there, or nullopt while something is not done.
  std::optional<double> ready_at(const Action& a) {
    plan_.needs(a, local_, remote_);
    double t = 0;
    for (const Action& need : local_) {
      const double d = done_[plan_.key(need)];
      if (d < 0) return std::nullopt;
      t = std::max(t, d);
    }
    if (remote_) {
      const size_t key = plan_.key(*remote_);
      if (done_[key] < 0) return std::nullopt;
      // What another worker sent arrives after its copy (copy()), and is handed over.
      t = std::max(t, std::max(done_[key], sent_[key].end) + costs_.handoff_us);
    }
    return t;
  }

  // Notes that `a` ended at `t`, and queues the copy of what it sends to another worker.
  void end(const Action& a, double t) {
    const size_t key = plan_.key(a);
    done_[key] = t;
    if (const std::optional<Copy> c = copy(a, t)) sent_[key] = *c;
  }

  // The copy that `a`, ended at `done`, sends to another worker (Note [Simulating a step]): a
  // forward's output to the next stage, a backward's (or I's) input gradient to the one before,
  // on the link between their devices (one direction of it; between two stages of one device,
  // theirs alone), after what that link carries already. Nothing for a W, for the pipeline's ends,
  // or for a neighbour on the same worker.
  struct Copy {
    double start = -1;
    double end = -1;  // -1: nothing sent
  };
  std::optional<Copy> copy(const Action& a, double done) {
    const bool forward = a.type == ActionType::kForward;
    if (!forward && a.type != ActionType::kBackward && a.type != ActionType::kBackwardInput) {
      return std::nullopt;
    }
    const int64_t to = forward ? a.stage + 1 : a.stage - 1;
    if (to < 0 || to >= schedule_.stages ||
        schedule_.stage_ranks[to] == schedule_.stage_ranks[a.stage]) {
      return std::nullopt;
    }
    // A forward's output costs its stage's copy; a gradient the copy of the stage it goes to.
    const double us = costs_.stages[forward ? a.stage : to].copy_us;
    if (us <= 0) return Copy{done, done};
    const int64_t devices = static_cast<int64_t>(costs_.capacity.size());
    const int64_t d_from = costs_.stages[a.stage].device, d_to = costs_.stages[to].device;
    const int64_t link = d_from != d_to ? d_from * devices + d_to
                                        : devices * devices + a.stage * schedule_.stages + to;
    double& free = link_free_[link];
    Copy c{std::max(done, free), 0};
    c.end = free = c.start + us;
    return c;
  }

  // The copy that `a` sent when it ended, if any (for the timeline).
  std::optional<Copy> sent(const Action& a) const {
    const Copy& c = sent_[plan_.key(a)];
    return c.end < 0 ? std::nullopt : std::optional<Copy>(c);
  }

 private:
  const Schedule& schedule_;
  const PipelineCosts& costs_;
  internal::Plan plan_;
  std::vector<double> done_;     // per action (Plan::key): when it ended, -1 before
  std::vector<Copy> sent_;       // per action: the copy of what it sent another worker
  std::map<int64_t, double> link_free_;  // per link (copy()): when its last copy ends
  std::vector<Action> local_;  // what ready_at's action needs, from its own worker and another
  std::optional<Action> remote_;
};

// Memory accounting per device (Note [Simulating a step]): the bytes kept (the static bytes and
// what the micro-batches in flight keep), the running actions' working memory, and the peak of
// their sum at any action's start or end.
class Memory {
 public:
  explicit Memory(const PipelineCosts& costs)
      : kept_(costs.static_bytes),
        working_(costs.static_bytes.size(), 0),
        peak_(costs.static_bytes) {}

  // Notes an action starting on device d with `transient` bytes of working memory.
  void start(int64_t d, int64_t transient) {
    working_[d] += transient;
    note_peak(d);
  }
  // Notes an action ending on device d: it keeps `kept` bytes more (frees -kept when negative);
  // its working memory counts at the peak with them, then goes.
  void end(int64_t d, int64_t kept, int64_t transient) {
    kept_[d] += kept;
    note_peak(d);
    working_[d] -= transient;
  }
  // Per device: the largest bytes held at once.
  const std::vector<int64_t>& peak() const { return peak_; }

 private:
  // Raises device d's peak to what it holds now.
  void note_peak(int64_t d) { peak_[d] = std::max(peak_[d], kept_[d] + working_[d]); }

  std::vector<int64_t> kept_, working_, peak_;
};

// The CPU-contention model (Note [Simulating a step]): a device's running workers share it, and
// where it names its cores and more workers run than that, they take turns on them as Linux's
// scheduler gives them. Per worker: its CPU time (its virtual runtime) and whether it holds a
// core now, since when and on which device.
class Cores {
 public:
  Cores(const PipelineCosts& costs, int64_t workers)
      : costs_(costs),
        vruntime_(workers, 0),
        on_core_(workers, false),
        woken_(workers, false),
        since_(workers, 0),
        core_of_(workers, -1),
        least_(costs.capacity.size(), 0) {}

  // Notes worker r starting an action on device d: it wakes, unless it goes straight on from its
  // last action on the same device, which keeps its core.
  void start(int64_t r, int64_t d) {
    if (core_of_[r] != d) on_core_[r] = false;
    woken_[r] = !on_core_[r];
  }

  // Gives out the cores at `t`, given each worker's device (-1: it runs nothing) and each device's
  // running workers; returns the next preemption at a slice's end (kNever: none).
  double assign(double t, const std::vector<int64_t>& device, const std::vector<int64_t>& active);

  // Worker r's speed on device d, where `active` workers run: 0 off its core, else its share.
  double rate(int64_t r, int64_t d, int64_t active) const {
    if (!on_core_[r]) return 0.0;
    const int64_t cores = cores_of(d);
    const int64_t sharing = cores == 0 ? active : std::min(active, cores);
    return std::min(1.0, costs_.capacity[d] / static_cast<double>(sharing));
  }

  // Whether worker r holds a core now.
  bool on_core(int64_t r) const { return on_core_[r]; }

  // Notes worker r running for `us` microseconds.
  void ran(int64_t r, double us) { vruntime_[r] += us; }

 private:
  using Workers = std::vector<int64_t>;

  // Device d's cores; 0: its workers share it without turns (processor sharing).
  int64_t cores_of(int64_t d) const { return costs_.cores.empty() ? int64_t{0} : costs_.cores[d]; }

  // Orders workers by virtual runtime, the furthest behind first.
  auto by_vruntime() const {
    return [this](int64_t a, int64_t b) { return vruntime_[a] < vruntime_[b]; };
  }

  // Gives worker r a core of device d at `t`.
  void give_core(int64_t r, int64_t d, double t) {
    on_core_[r] = true;
    since_[r] = t;
    core_of_[r] = d;
  }

  // Moves the waiting worker *q onto a core of device d at `t`.
  void take(int64_t d, double t, Workers& on, Workers& off, Workers::iterator q) {
    give_core(*q, d, t);
    on.push_back(*q);
    off.erase(q);
  }

  // Who holds device d's cores at `t` (`device` and `active` as for assign); returns when the next
  // slice there ends for a worker ahead of the first in line (kNever: none).
  double assign_device(int64_t d, double t, const std::vector<int64_t>& device, int64_t active);

  // A worker that slept comes back at most sleeper_credit_us behind the others: behind device d's
  // least virtual runtime, which only grows (Linux's min_vruntime).
  void credit_sleepers(int64_t d, const std::vector<int64_t>& device, const Workers& off);

  // A worker just woken takes the core of the one furthest ahead when more than wakeup_us behind
  // it; and one that has held its core for slice_us yields it to one behind it.
  void preempt(int64_t d, double t, Workers& on, Workers& off);

  const PipelineCosts& costs_;
  std::vector<double> vruntime_;
  std::vector<bool> on_core_, woken_;
  std::vector<double> since_;     // when it took its core
  std::vector<int64_t> core_of_;  // the device of that core
  std::vector<double> least_;     // per device: the least virtual runtime of its workers
};

double Cores::assign(double t, const std::vector<int64_t>& device,
                     const std::vector<int64_t>& active) {
  for (size_t r = 0; r < device.size(); ++r) {
    if (device[r] < 0) on_core_[r] = false;
  }
  double turn = kNever;
  for (int64_t d = 0; d < static_cast<int64_t>(active.size()); ++d) {
    turn = std::min(turn, assign_device(d, t, device, active[d]));
  }
  std::fill(woken_.begin(), woken_.end(), false);
  return turn;
}

double Cores::assign_device(int64_t d, double t, const std::vector<int64_t>& device,
                            int64_t active) {
  const int64_t cores = cores_of(d);
  Workers on, off;
  for (size_t r = 0; r < device.size(); ++r) {
    if (device[r] == d) (on_core_[r] ? on : off).push_back(static_cast<int64_t>(r));
  }
  if (cores > 0) credit_sleepers(d, device, off);
  if (cores == 0 || active <= cores) {
    for (int64_t r : off) give_core(r, d, t);
    return kNever;
  }
  // Free cores go to those furthest behind.
  while (static_cast<int64_t>(on.size()) < cores) {
    take(d, t, on, off, std::min_element(off.begin(), off.end(), by_vruntime()));
  }
  preempt(d, t, on, off);
  // When the next slice ends for someone ahead of the first in line.
  if (off.empty()) return kNever;
  const double behind = vruntime_[*std::min_element(off.begin(), off.end(), by_vruntime())];
  double turn = kNever;
  for (int64_t r : on) {
    turn = std::min(turn, std::max(since_[r] + costs_.slice_us,
                                   t + std::max(0.0, behind - vruntime_[r]) + 1e-3));
  }
  return turn;
}

void Cores::credit_sleepers(int64_t d, const std::vector<int64_t>& device, const Workers& off) {
  double now_least = kNever;
  for (size_t r = 0; r < device.size(); ++r) {
    if (device[r] == d && !woken_[r]) now_least = std::min(now_least, vruntime_[r]);
  }
  if (now_least < kNever) least_[d] = std::max(least_[d], now_least);
  for (int64_t r : off) {
    if (woken_[r]) vruntime_[r] = std::max(vruntime_[r], least_[d] - costs_.sleeper_credit_us);
  }
}

void Cores::preempt(int64_t d, double t, Workers& on, Workers& off) {
  for (bool moved = true; moved && !off.empty();) {
    moved = false;
    auto q = std::min_element(off.begin(), off.end(), by_vruntime());
    auto r = std::max_element(on.begin(), on.end(), by_vruntime());
    const bool wakeup = woken_[*q] && vruntime_[*r] - vruntime_[*q] > costs_.wakeup_us;
    bool sliced = false;
    for (auto k = on.begin(); k != on.end() && !wakeup; ++k) {
      if (vruntime_[*k] > vruntime_[*q] && t - since_[*k] >= costs_.slice_us - kEps) {
        r = k;
        sliced = true;
        break;
      }
    }
    if (wakeup || sliced) {
      on_core_[*r] = false;
      const int64_t yielded = *r;
      on.erase(r);
      take(d, t, on, off, q);
      off.push_back(yielded);
      woken_[yielded] = false;
      moved = true;
    }
  }
}

// The event loop: starts each worker's actions in order as what they need is there, runs the
// workers on their devices' cores to the next event (an action's end, an input's arrival, a
// slice's end), and ends the actions done.
class Simulator {
 public:
  Simulator(const Schedule& schedule, const PipelineCosts& costs)
      : schedule_(schedule),
        costs_(costs),
        n_(schedule.num_ranks()),
        devices_(static_cast<int64_t>(costs.capacity.size())),
        dependencies_(schedule, costs),
        memory_(costs),
        cores_(costs, n_),
        running_(n_),
        next_(n_, 0) {}

  // Runs the schedule to its end (an error where it stalls); once.
  PipelineSimulation run();

 private:
  // Starts every action that can start now; returns when the first of the others' inputs will be
  // there (kNever: none).
  double start_ready();

  // Runs the workers on cores from now to `until`, or to the first end of their actions before.
  void advance(double until, const std::vector<int64_t>& device,
               const std::vector<int64_t>& active);

  // Ends the actions done by now: what they keep or free, when they ended, their timeline.
  void end_done();

  const Schedule& schedule_;
  const PipelineCosts& costs_;
  const int64_t n_;        // workers
  const int64_t devices_;
  Dependencies dependencies_;
  Memory memory_;
  Cores cores_;
  std::vector<std::optional<Running>> running_;  // per worker: its action now
  std::vector<size_t> next_;                     // per worker: its next action's index
  double t_ = 0;                                 // now, microseconds
  PipelineSimulation sim_;
};

PipelineSimulation Simulator::run() {
  for (;;) {
    const double wake = start_ready();
    // Each device's workers share it.
    std::vector<int64_t> device(n_, -1), active(devices_, 0);
    bool any = false;
    for (int64_t r = 0; r < n_; ++r) {
      if (!running_[r]) continue;
      device[r] = costs_.stages[running_[r]->action.stage].device;
      ++active[device[r]];
      any = true;
    }
    if (!any && wake == kNever) break;
    const double turn = cores_.assign(t_, device, active);
    advance(std::min(wake, std::max(turn, t_ + kEps)), device, active);
    end_done();
  }
  for (int64_t r = 0; r < n_; ++r) {
    TORCH_CHECK(next_[r] == schedule_.ranks[r].size(), "simulate_pipeline: schedule '",
                schedule_.name, "' stalls at rank ", r, " action ", next_[r]);
  }
  sim_.peak_bytes = memory_.peak();
  sim_.step_us += costs_.step_allreduce_us;  // after every worker (Note [Simulating a step])
  return std::move(sim_);
}

double Simulator::start_ready() {
  double wake = kNever;
  for (int64_t r = 0; r < n_; ++r) {
    if (running_[r] || next_[r] >= schedule_.ranks[r].size()) continue;
    const Action& a = schedule_.ranks[r][next_[r]];
    const std::optional<double> at = dependencies_.ready_at(a);
    if (!at) continue;
    if (*at > t_ + kEps) {
      wake = std::min(wake, *at);
      continue;
    }
    const double w = work_us(costs_, a);
    const int64_t d = costs_.stages[a.stage].device;
    running_[r] = Running{a, w, w, t_, transient_bytes(costs_, a)};
    memory_.start(d, running_[r]->transient);
    cores_.start(r, d);
  }
  return wake;
}

void Simulator::advance(double until, const std::vector<int64_t>& device,
                        const std::vector<int64_t>& active) {
  auto rate = [&](int64_t r) { return cores_.rate(r, device[r], active[device[r]]); };
  for (int64_t r = 0; r < n_; ++r) {
    if (running_[r] && cores_.on_core(r)) {
      until = std::min(until, t_ + running_[r]->remaining / rate(r));
    }
  }
  for (int64_t r = 0; r < n_; ++r) {
    if (!running_[r] || !cores_.on_core(r)) continue;
    running_[r]->remaining -= (until - t_) * rate(r);
    cores_.ran(r, until - t_);
  }
  t_ = until;
}

void Simulator::end_done() {
  for (int64_t r = 0; r < n_; ++r) {
    if (!running_[r] || running_[r]->remaining > kEps * std::max(1.0, running_[r]->work)) {
      continue;
    }
    const Running x = *running_[r];
    running_[r].reset();
    ++next_[r];
    const Action& a = x.action;
    dependencies_.end(a, t_);
    memory_.end(costs_.stages[a.stage].device, kept_bytes(costs_, a), x.transient);
    const bool last = next_[r] == schedule_.ranks[r].size();
    sim_.step_us =
        std::max(sim_.step_us, t_ + (last ? allreduce_after(schedule_, costs_, r) : 0.0));
    std::optional<std::pair<double, double>> copy;
    if (const auto c = dependencies_.sent(a)) copy = std::make_pair(c->start, c->end);
    record(schedule_, costs_, x, t_, copy, sim_.events);
  }
}

}  // namespace

PipelineSimulation simulate_pipeline(const Schedule& schedule, const PipelineCosts& costs) {
  check_costs(schedule, costs);
  return Simulator(schedule, costs).run();
}

}  // namespace gpipe
