// The planner (balancing/plan.h) and its simulation (balancing/simulate.h): the simulation agrees
// with the schedules' own simulator where their models meet, shares a device's cores and counts
// memory as its Note says; plans fit their limit, come fastest first, refuse clearly, survive JSON,
// and build pipelines that train as the plain model; predicted memory is checked against the
// bytes a pipeline really allocates.
#include "tests/gpipe/test_util.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <set>

#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "balancing/plan.h"
#include "benchmarks/memory_meter.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_search.h"
#include "gpipe/schedule_text.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

Schedule schedule_of(ScheduleKind kind, int64_t n, int64_t m, int64_t v = 1) {
  return kind == ScheduleKind::kInterleaved ? interleaved_schedule(n, m, v)
                                            : make_schedule(kind, n, m);
}

// Stages of equal costs F = 1, I = 1, W = 1 (B = 2), one device per lane unless `device` >= 0.
PipelineCosts equal_costs(const Schedule& s, double capacity, int64_t device = -1) {
  PipelineCosts c;
  const int64_t lanes = s.num_ranks();
  for (int64_t stage = 0; stage < s.stages; ++stage) {
    StageCost st;
    st.lane = s.stage_ranks[stage];
    st.device = device >= 0 ? device : st.lane;
    st.forward_us = st.forward_nograd_us = st.recompute_us = 1;
    st.backward_input_us = st.backward_weight_us = 1;
    st.backward_us = 2;
    st.held_bytes = 100;
    st.checkpointed_bytes = 10;
    c.stages.push_back(st);
  }
  const int64_t devices = device >= 0 ? device + 1 : lanes;
  c.capacity.assign(devices, capacity);
  c.static_bytes.assign(devices, 1000);
  return c;
}

CATCH_TEST_CASE("The simulation of free workers agrees with simulate_schedule for every schedule",
                "[balancing][plan][simulate]") {
  const ScheduleKind kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                     ScheduleKind::kInterleaved, ScheduleKind::kZeroBubble);
  const int64_t n = GENERATE(2, 3, 4);
  const int64_t m = GENERATE(4, 8);
  const int64_t v = kind == ScheduleKind::kInterleaved ? 2 : 1;
  if (kind == ScheduleKind::kInterleaved && m % n != 0) return;
  CATCH_CAPTURE(schedule_kind_name(kind), n, m);
  const Schedule s = schedule_of(kind, n, m, v);
  const PipelineSimulation sim = simulate_pipeline(s, equal_costs(s, 1.0));
  const ScheduleSimulation reference = simulate_schedule(s);
  CATCH_CHECK(sim.step_us == gpipe_test::Approx(reference.makespan).epsilon(1e-9));
  // Memory: each stage on a device of its own keeps its peak of micro-batches in flight.
  for (int64_t r = 0; r < n; ++r) {
    CATCH_CHECK(sim.peak_bytes[r] == 1000 + 100 * reference.peak_in_flight[r]);
  }
  // The timeline has every compute action once.
  int64_t forwards = 0;
  for (const TimelineEvent& e : sim.events) forwards += e.kind == TimelineEvent::Kind::kCompute;
  CATCH_CHECK(forwards == s.stages * m);
}

CATCH_TEST_CASE("Workers sharing a device of one core take the sum of their work",
                "[balancing][plan][simulate]") {
  const ScheduleKind kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                     ScheduleKind::kZeroBubble);
  const int64_t n = GENERATE(2, 3);
  const int64_t m = 6;
  const Schedule s = schedule_of(kind, n, m);
  // One device with the capacity of one worker: it is never idle while work remains, and each of
  // the n * m micro-batch-stages costs F + B = 3.
  CATCH_CHECK(simulate_pipeline(s, equal_costs(s, 1.0, 0)).step_us ==
              gpipe_test::Approx(3.0 * n * m).epsilon(1e-9));
  // More than one worker's capacity, less than n: between the sum and the free schedule.
  const double shared = simulate_pipeline(s, equal_costs(s, (n + 1) / 2.0, 0)).step_us;
  CATCH_CHECK(shared > simulate_schedule(s).makespan);
  CATCH_CHECK(shared < 3.0 * n * m);
}

CATCH_TEST_CASE("More workers than cores take turns, approaching processor sharing as they shorten",
                "[balancing][plan][simulate]") {
  const ScheduleKind kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                     ScheduleKind::kZeroBubble);
  const int64_t n = 3, m = 6;
  CATCH_CAPTURE(schedule_kind_name(kind));
  const Schedule s = schedule_of(kind, n, m);
  // Three workers on one device of two cores.
  const PipelineCosts shared = equal_costs(s, 2.0, 0);
  const PipelineSimulation sharing = simulate_pipeline(s, shared);
  auto turns = [&](int64_t cores, double capacity, double turn) {
    PipelineCosts c = shared;
    c.cores = {cores};
    c.capacity = {capacity};
    c.slice_us = c.sleeper_credit_us = turn;
    c.wakeup_us = turn / 2;
    return simulate_pipeline(s, c);
  };
  // A core for each worker: nobody waits for one, as under processor sharing.
  const PipelineSimulation roomy = turns(3, 2.0, 4.0);
  CATCH_CHECK(roomy.step_us == sharing.step_us);
  CATCH_CHECK(roomy.events.size() == sharing.events.size());
  // One core: never idle while work remains, each of the n * m micro-batch-stages F + B = 3.
  CATCH_CHECK(turns(1, 1.0, 4.0).step_us == gpipe_test::Approx(3.0 * n * m).epsilon(1e-9));
  // Two cores: turns of a fiftieth of an action come within 3% of processor sharing; turns of
  // whole actions change zero bubble's step (GPipe's and 1F1B's equal stages end alike).
  CATCH_CHECK(turns(2, 2.0, 0.02).step_us ==
              gpipe_test::Approx(sharing.step_us).epsilon(0.03));
  if (kind == ScheduleKind::kZeroBubble) {
    CATCH_CHECK(std::abs(turns(2, 2.0, 4.0).step_us - sharing.step_us) > 0.01 * sharing.step_us);
  }
  // And it never beats the work over the cores.
  CATCH_CHECK(turns(2, 2.0, 4.0).step_us >= 3.0 * n * m / 2 - 1e-9);
}

CATCH_TEST_CASE("A worker woken behind the one on the core takes it, within its sleeper credit",
                "[balancing][plan][simulate]") {
  // Two stages on one core, GPipe's schedule, 2 micro-batches: stage 0 F = B = 1, stage 1 F = 4,
  // B = 1; turns of 10. Worked by hand (times in microseconds):
  const Schedule s = gpipe_schedule(2, 2);
  PipelineCosts c = equal_costs(s, 1.0, 0);
  for (StageCost& st : c.stages) st.forward_us = st.forward_nograd_us = st.backward_us = 1;
  c.stages[1].forward_us = c.stages[1].forward_nograd_us = 4;
  // When stage `stage`'s forward (or backward) of `microbatch` ended.
  auto end_of = [](const PipelineSimulation& sim, int64_t stage, int64_t microbatch,
                   bool backward = false) {
    const auto kind = backward ? TimelineEvent::Kind::kBackward : TimelineEvent::Kind::kCompute;
    for (const TimelineEvent& e : sim.events) {
      if (e.kind == kind && e.partition == stage && e.microbatch == microbatch) return e.end_us;
    }
    return -1.0;
  };
  // Processor sharing: at 1 stage 0's F1 and stage 1's F0 share the core; F1 ends at 3, F0 at 6.
  // Then stage 1's F1 (6-10) and B1 (10-11); stage 0's B1 and stage 1's B0 share the core to 13;
  // stage 0's B0 13-14.
  PipelineSimulation sim = simulate_pipeline(s, c);
  CATCH_CHECK(end_of(sim, 0, 1) == gpipe_test::Approx(3));
  CATCH_CHECK(end_of(sim, 1, 0) == gpipe_test::Approx(6));
  CATCH_CHECK(end_of(sim, 0, 1, true) == gpipe_test::Approx(13));
  CATCH_CHECK(sim.step_us == gpipe_test::Approx(14));
  c.cores = {1};
  c.slice_us = 10;
  c.wakeup_us = 0.5;
  // Turns, credit 10: at 1 stage 1 wakes with 0 run against stage 0's 1, more than the wake-up
  // lead behind: it takes the core (F0 1-5), and stage 0's F1 runs 5-6. At 11 stage 0 wakes for
  // B1 with 2 run against stage 1's 9: it takes the core (B1 11-12), stage 1's B0 runs 12-13,
  // stage 0's B0 13-14.
  c.sleeper_credit_us = 10;
  sim = simulate_pipeline(s, c);
  CATCH_CHECK(end_of(sim, 1, 0) == gpipe_test::Approx(5));
  CATCH_CHECK(end_of(sim, 0, 1) == gpipe_test::Approx(6));
  CATCH_CHECK(end_of(sim, 0, 1, true) == gpipe_test::Approx(12));
  CATCH_CHECK(sim.step_us == gpipe_test::Approx(14));
  // Credit 0: a woken worker comes back level with the least run, never behind the one on the
  // core: stage 0 keeps the core for F1 (1-2), stage 1's F0 runs 2-6; at 11 stage 1 keeps it for
  // B0 (11-12), then stage 0's B1 runs 12-13 and its B0 13-14.
  c.sleeper_credit_us = 0;
  sim = simulate_pipeline(s, c);
  CATCH_CHECK(end_of(sim, 0, 1) == gpipe_test::Approx(2));
  CATCH_CHECK(end_of(sim, 1, 0) == gpipe_test::Approx(6));
  CATCH_CHECK(end_of(sim, 0, 1, true) == gpipe_test::Approx(13));
  CATCH_CHECK(sim.step_us == gpipe_test::Approx(14));
}

CATCH_TEST_CASE("The simulation counts checkpointed micro-batches and recomputation as its Note says",
                "[balancing][plan][simulate]") {
  // One stage, GPipe's schedule, 4 micro-batches: all F, then B in reverse.
  const Schedule s = gpipe_schedule(1, 4);
  PipelineCosts c = equal_costs(s, 1.0);
  c.stages[0].forward_workspace_bytes = 7;
  c.stages[0].backward_workspace_bytes = 3;
  // Not checkpointed: 4 x held, plus the backward's working memory at the first B's start.
  c.checkpoint_stop = 0;
  PipelineSimulation sim = simulate_pipeline(s, c);
  CATCH_CHECK(sim.peak_bytes[0] == 1000 + 4 * 100 + 7);  // the last F's end, its workspace still on
  CATCH_CHECK(sim.step_us == gpipe_test::Approx(4 * 1 + 4 * 2));
  // All checkpointed: 4 x checkpointed bytes; each B recomputes (held + the larger workspace).
  c.checkpoint_stop = 4;
  sim = simulate_pipeline(s, c);
  CATCH_CHECK(sim.peak_bytes[0] == 1000 + 4 * 10 + 100 + 7);
  CATCH_CHECK(sim.step_us == gpipe_test::Approx(4 * 1 + 4 * (1 + 2)));
  int64_t recomputes = 0;
  for (const TimelineEvent& e : sim.events) recomputes += e.kind == TimelineEvent::Kind::kRecompute;
  CATCH_CHECK(recomputes == 4);
}

CATCH_TEST_CASE("A hand-over between workers delays what crosses them, and is measured",
                "[balancing][plan][simulate]") {
  // Two stages, one micro-batch: F0, F1, B1, B0 in a chain crossing the workers twice.
  const Schedule s = gpipe_schedule(2, 1);
  PipelineCosts c = equal_costs(s, 1.0);
  c.handoff_us = 5;
  CATCH_CHECK(simulate_pipeline(s, c).step_us == gpipe_test::Approx(1 + 5 + 1 + 2 + 5 + 2));
  c.handoff_us = -1;
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c), gpipe_test::contains("negative cost"));
  const double measured = handoff_us(20);
  CATCH_CHECK(measured > 0);
  CATCH_CHECK(measured < 1e6);  // a thread woken within a second
}

CATCH_TEST_CASE("Copies on one link run one after another, each direction on its own",
                "[balancing][plan][simulate]") {
  // Two stages on two devices, F = 1, B = 2, a copy of 3 each way, 4 micro-batches (GPipe).
  // Forward copies queue on the link: they arrive at 4, 7, 10, 13, so stage 1's forwards end at
  // 5, 8, 11, 14; its backwards (reverse order) end at 16, 18, 20, 22; their gradients queue on the
  // way back and arrive at 19, 22, 25, 28; stage 0's backwards end at 21, 24, 27, 30.
  const Schedule s = gpipe_schedule(2, 4);
  PipelineCosts c = equal_costs(s, 1.0);
  c.stages[0].copy_us = 3;
  const PipelineSimulation sim = simulate_pipeline(s, c);
  CATCH_CHECK(sim.step_us == gpipe_test::Approx(30));
  std::vector<double> starts;
  for (const TimelineEvent& e : sim.events) {
    if (e.kind == TimelineEvent::Kind::kCopy) starts.push_back(e.start_us);
  }
  std::sort(starts.begin(), starts.end());
  CATCH_CHECK(starts == std::vector<double>{1, 4, 7, 10});
  // Copies shorter than what separates them never wait: stage 1's backwards end at 7.5 ... 13.5,
  // the last gradient arrives at 14, and stage 0's last backward ends at 16.
  c.stages[0].copy_us = 0.5;
  CATCH_CHECK(simulate_pipeline(s, c).step_us == gpipe_test::Approx(16));
}

CATCH_TEST_CASE("The simulation refuses costs that do not match the schedule",
                "[balancing][plan][simulate][errors]") {
  const Schedule s = gpipe_schedule(2, 4);
  PipelineCosts c = equal_costs(s, 1.0);
  c.stages.pop_back();
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c), gpipe_test::contains("1 stage costs for a schedule of 2"));
  c = equal_costs(s, 1.0);
  c.stages[1].lane = 0;
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c),
                          gpipe_test::contains("stage 1 is on lane 0 but the schedule runs it on rank 1"));
  c = equal_costs(s, 1.0);
  c.stages[0].backward_us = -1;
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c), gpipe_test::contains("negative cost"));
  c = equal_costs(s, 0.0);
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c), gpipe_test::contains("capacity must be positive"));
  c = equal_costs(s, 1.0);
  c.cores = {2};
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c),
                          gpipe_test::contains("cores must be empty or name every device (1 for 2"));
  c.cores = {2, -1};
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c),
                          gpipe_test::contains("cores must be 0 or more, got -1"));
  c.slice_us = 0;
  c.cores = {2, 2};
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c),
                          gpipe_test::contains("slice_us must be positive where a device names"));
  c.cores = {};
  c.slice_us = -3;
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c),
                          gpipe_test::contains("must not be negative, got -3, 0 and 0"));
}

// A profile made by hand: `layers` equal layers whose costs grow with the micro-batch b.
PipelineProfile synthetic(int64_t layers, int64_t devices, int64_t batch = 32,
                          int64_t param_bytes = 4000) {
  PipelineProfile p;
  p.devices.assign(devices, c10::Device(c10::kCPU));
  p.batch = batch;
  p.input_bytes = 100 * batch;
  p.cores = devices;
  p.threads = 1;
  for (int64_t b : {int64_t{1}, batch}) {
    LayerProfile lp;
    lp.batch = b;
    for (int64_t k = 0; k < layers; ++k) {
      LayerStats s;
      s.name = std::to_string(k);
      s.type = "Synthetic";
      s.forward_us = 20 + 10.0 * b;
      s.forward_nograd_us = 15 + 8.0 * b;
      s.backward_us = 40 + 20.0 * b;
      s.backward_input_us = 25 + 10.0 * b;
      s.backward_weight_us = 25 + 10.0 * b;
      s.held_bytes = 1000 * b;
      s.forward_peak_bytes = 1200 * b;
      s.backward_peak_bytes = 600 * b;
      s.param_bytes = param_bytes;
      s.input_bytes = s.output_bytes = 100 * b;
      lp.layers.push_back(s);
    }
    p.sizes.push_back(lp);
  }
  return p;
}

int64_t peak_of(const PipelinePlan& p) {
  return *std::max_element(p.peak_bytes.begin(), p.peak_bytes.end());
}

CATCH_TEST_CASE("A profile's layer at an unprofiled micro-batch is interpolated linearly",
                "[balancing][plan]") {
  const PipelineProfile p = synthetic(4, 2, 32);
  CATCH_CHECK(p.layer(0, 1).forward_us == gpipe_test::Approx(30));
  CATCH_CHECK(p.layer(0, 32).forward_us == gpipe_test::Approx(340));
  CATCH_CHECK(p.layer(2, 8).forward_us == gpipe_test::Approx(20 + 80));
  CATCH_CHECK(p.layer(3, 8).held_bytes == 8000);
  CATCH_CHECK(p.layer(3, 8).param_bytes == 4000);
  CATCH_CHECK_THROWS_WITH(p.layer(4, 8), gpipe_test::contains("no layer 4"));
}

CATCH_TEST_CASE("A calibration scales a candidate's times by its ratio at the micro-batch size",
                "[balancing][plan]") {
  PipelineProfile p = synthetic(4, 2, 32);
  PipelinePlan plan;
  plan.balance = {2, 2};
  plan.devices = p.devices;
  plan.chunks = 32;  // micro-batches of 1
  plan.checkpoint = Checkpoint::kNever;
  const double plain = predict(p, plan).step_us;
  p.calibration = {{1, 2.0}, {32, 1.0}};
  CATCH_CHECK(p.time_scale(1) == gpipe_test::Approx(2.0));
  CATCH_CHECK(p.time_scale(32) == gpipe_test::Approx(1.0));
  CATCH_CHECK(p.time_scale(64) == gpipe_test::Approx(1.0));
  CATCH_CHECK(p.time_scale(4) == gpipe_test::Approx(2.0 - std::log(4.0) / std::log(32.0)));
  CATCH_CHECK(predict(p, plan).step_us == gpipe_test::Approx(2 * plain));
  // Zero bubble's I and W are scaled by the ratio times the split; F and B by the ratio alone.
  plan.schedule = ScheduleKind::kZeroBubble;
  p.calibration = {};
  const PipelineCosts before = pipeline_costs(p, plan, OptimizerKind::kMomentum);
  p.calibration = {{1, 2.0, 1.5}, {32, 1.0, 1.0}};
  CATCH_CHECK(p.split_scale(1) == gpipe_test::Approx(3.0));
  CATCH_CHECK(p.split_scale(32) == gpipe_test::Approx(1.0));
  const PipelineCosts after = pipeline_costs(p, plan, OptimizerKind::kMomentum);
  for (size_t k = 0; k < after.stages.size(); ++k) {
    CATCH_CHECK(after.stages[k].forward_us == gpipe_test::Approx(2 * before.stages[k].forward_us));
    CATCH_CHECK(after.stages[k].backward_us ==
                gpipe_test::Approx(2 * before.stages[k].backward_us));
    CATCH_CHECK(after.stages[k].backward_input_us ==
                gpipe_test::Approx(3 * before.stages[k].backward_input_us));
    CATCH_CHECK(after.stages[k].backward_weight_us ==
                gpipe_test::Approx(3 * before.stages[k].backward_weight_us));
  }
  // And it survives JSON; a profile saved without a split scales I and W as the rest.
  const PipelineProfile back = PipelineProfile::from_json(p.to_json());
  CATCH_REQUIRE(back.calibration.size() == 2);
  CATCH_CHECK(back.calibration[0].batch == 1);
  CATCH_CHECK(back.calibration[0].ratio == 2.0);
  CATCH_CHECK(back.calibration[0].split == 1.5);
  std::string old = p.to_json();
  // (Each calibration's keys come sorted, "split" last: from the comma before it to its line's
  // end.)
  for (size_t at; (at = old.find("\"split\"")) != std::string::npos;) {
    const size_t comma = old.rfind(',', at);
    old.erase(comma, old.find('\n', at) - comma);
  }
  CATCH_REQUIRE(old.find("split") == std::string::npos);
  CATCH_CHECK(PipelineProfile::from_json(old).split_scale(1) == gpipe_test::Approx(2.0));
}

CATCH_TEST_CASE("Plans come fastest first, each within the memory limit, and the limit changes "
                "the pick", "[balancing][plan]") {
  const PipelineProfile profile = synthetic(8, 2);
  const std::vector<PipelinePlan> free = plan(profile, PlanOptions().top(1000));
  CATCH_REQUIRE(free.size() > 20);
  for (size_t k = 1; k < free.size(); ++k) CATCH_CHECK(free[k - 1].step_us <= free[k].step_us);
  // Only micro-batch counts the mini-batch of 32 splits into (12 makes 11 pieces, 24 makes 16).
  for (const PipelinePlan& p : free) {
    const int64_t rows = (32 + p.chunks - 1) / p.chunks;
    CATCH_CHECK((32 + rows - 1) / rows == p.chunks);
  }
  // Two cores and equal layers: the fastest runs two workers.
  CATCH_CAPTURE(free.front().describe());
  CATCH_CHECK(free.front().balance.size() / free.front().virtual_stages == 2);
  // Each plan's numbers are its own simulation's.
  PipelinePlan again = free[3];
  predict(profile, again);
  CATCH_CHECK(again.step_us == free[3].step_us);
  CATCH_CHECK(again.peak_bytes == free[3].peak_bytes);
  // A hand-made plan whose virtual stages its schedule cannot run is refused, not simulated.
  PipelinePlan odd = free.front();
  odd.schedule = ScheduleKind::k1F1B;
  odd.virtual_stages = 2;
  odd.balance = {2, 2, 2, 2};
  CATCH_CHECK_THROWS_WITH(predict(profile, odd),
                          gpipe_test::contains("2 virtual stages given for the 1f1b schedule"));
  // A limit below the fastest's peak: every plan fits it, and the first is no longer that one.
  const int64_t limit = peak_of(free.front()) - 1;
  const std::vector<PipelinePlan> fit = plan(profile, PlanOptions().top(1000).memory_limit(limit));
  CATCH_REQUIRE(!fit.empty());
  for (const PipelinePlan& p : fit) CATCH_CHECK(peak_of(p) <= limit);
  CATCH_CHECK(fit.front().step_us >= free.front().step_us);
  CATCH_CHECK(fit.size() < free.size());
  // top
  CATCH_CHECK(plan(profile, PlanOptions().top(5)).size() == 5);
}

// `synthetic` with layer k's times scaled by 1, 2, 3, 1, 2, 3, ... and its weight gradient a
// quarter of its input gradient: stages of unequal costs, where a searched order can beat the
// generated ones (Note [Searched plans]).
PipelineProfile uneven(int64_t layers, int64_t devices) {
  PipelineProfile p = synthetic(layers, devices);
  for (LayerProfile& lp : p.sizes) {
    for (size_t k = 0; k < lp.layers.size(); ++k) {
      LayerStats& l = lp.layers[k];
      const double scale = 1.0 + static_cast<double>(k % 3);
      l.forward_us *= scale;
      l.forward_nograd_us *= scale;
      l.backward_input_us *= 1.6 * scale;
      l.backward_weight_us *= 0.4 * scale;
      l.backward_us = l.backward_input_us + l.backward_weight_us;
    }
  }
  return p;
}

CATCH_TEST_CASE(
    "A searched plan is faster than every generated plan of its shape and survives "
    "JSON",
    "[balancing][plan][search]") {
  const PipelineProfile profile = uneven(7, 3);
  const std::vector<PipelinePlan> all = plan(profile, PlanOptions().top(100000));
  std::vector<PipelinePlan> searched;
  for (const PipelinePlan& p : all) {
    if (!p.schedule_text.empty()) searched.push_back(p);
  }
  CATCH_REQUIRE(!searched.empty());
  for (const PipelinePlan& s : searched) {
    CATCH_CAPTURE(s.describe());
    CATCH_CHECK(s.checkpoint == Checkpoint::kNever);
    // (Searched in a V, interleaved, or one stage per worker.)
    const bool v_shape = s.schedule == ScheduleKind::kZeroBubbleV;
    const bool interleaved = s.schedule == ScheduleKind::kInterleavedZeroBubble;
    CATCH_CHECK((s.schedule == ScheduleKind::kZeroBubble || v_shape || interleaved));
    CATCH_CHECK(s.virtual_stages == (v_shape || interleaved ? 2 : 1));
    CATCH_CHECK(s.balance.size() >= 2);
    CATCH_CHECK(s.describe().find("schedule searched") != std::string::npos);
    int64_t rivals = 0;
    for (const PipelinePlan& g : all) {
      if (!g.schedule_text.empty() || g.balance != s.balance || g.chunks != s.chunks ||
          g.checkpoint != s.checkpoint) {
        continue;
      }
      ++rivals;
      CATCH_CHECK(s.step_us < g.step_us);
    }
    // zbv, or interleaved and zb1p, or gpipe, 1f1b and zb at least
    CATCH_CHECK(rivals >= (v_shape ? 1 : interleaved ? 2 : 3));
    // Its numbers are its text's simulation; the text survives JSON.
    PipelinePlan again = s;
    predict(profile, again);
    CATCH_CHECK(again.step_us == s.step_us);
    const PipelinePlan back = PipelinePlan::from_json(s.to_json());
    CATCH_CHECK(back.schedule_text == s.schedule_text);
    CATCH_CHECK(back.describe() == s.describe());
  }
  // Under a memory limit, searched plans fit it too.
  const int64_t limit = peak_of(searched.front());
  for (const PipelinePlan& p : plan(profile, PlanOptions().top(100000).memory_limit(limit))) {
    CATCH_CHECK(peak_of(p) <= limit);
  }
  // A searched plan's JSON must carry a text that fits its partitions and micro-batches.
  std::string json = searched.front().to_json();
  const size_t at = json.find("\"schedule_text\"");
  CATCH_REQUIRE(at != std::string::npos);
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json(json.substr(0, json.rfind(',', at)) + "\n}"),
                          gpipe_test::contains("no \"schedule_text\""));
  PipelinePlan other = searched.front();
  other.chunks += 1;
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json(other.to_json()),
                          gpipe_test::contains("the searched schedule runs") &&
                              gpipe_test::contains("micro-batches but \"chunks\" is"));
  other = searched.front();
  other.schedule_text = "";
  std::string empty_text = other.to_json();
  // (Written as zb, or as zbv for one searched in a V.)
  CATCH_REQUIRE(empty_text.find("\"searched\"") == std::string::npos);
  const std::string kind = "\"" + schedule_kind_name(other.schedule) + "\"";
  const size_t kind_at = empty_text.find(kind);
  CATCH_REQUIRE(kind_at != std::string::npos);
  CATCH_CHECK_THROWS_WITH(
      PipelinePlan::from_json(empty_text.replace(kind_at, kind.size(),
                                                 "\"searched\", \"schedule_text\": \"\"")),
      gpipe_test::contains("the schedule is \"searched\" but its \"schedule_text\" is empty"));
  CATCH_CHECK_THROWS_WITH(
      PipelinePlan::from_json(json.replace(json.find("\"searched\""), 10, "\"zb\"")),
      gpipe_test::contains("\"schedule_text\" is given but the schedule is zb"));
  other = searched.front();
  other.schedule_text = "0F0 0X0\n";
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json(other.to_json()),
                          gpipe_test::contains("\"schedule_text\" is not a schedule"));
  // Without the search, no plan is searched.
  for (const PipelinePlan& p : plan(profile, PlanOptions().top(100000).search(false))) {
    CATCH_CHECK(p.schedule_text.empty());
  }
}

CATCH_TEST_CASE("The planner refuses clearly when nothing fits, and says what would help",
                "[balancing][plan][errors]") {
  // Parameters of 1 MB per layer: 8 layers, momentum (3x), on at most two devices.
  const PipelineProfile heavy = synthetic(8, 2, 32, 1 << 20);
  CATCH_CHECK_THROWS_WITH(plan(heavy, PlanOptions().memory_limit(1 << 20)),
                          gpipe_test::contains("no plan fits in 1048576 bytes") &&
                              gpipe_test::contains("more devices"));
  // Small parameters: the activations are the excess, with a limit between the static bytes and
  // the least any plan needs.
  const PipelineProfile light = synthetic(8, 2, 32, 100);
  const std::vector<PipelinePlan> all = plan(light, PlanOptions().top(100000));
  const PipelinePlan& least = *std::min_element(
      all.begin(), all.end(),
      [](const PipelinePlan& a, const PipelinePlan& b) { return peak_of(a) < peak_of(b); });
  const PipelineCosts costs = pipeline_costs(light, least, OptimizerKind::kMomentum);
  const int64_t fixed = *std::max_element(costs.static_bytes.begin(), costs.static_bytes.end());
  const int64_t limit = (fixed + peak_of(least)) / 2;
  CATCH_REQUIRE(fixed < limit);
  CATCH_REQUIRE(limit < peak_of(least));
  CATCH_CHECK_THROWS_WITH(plan(light, PlanOptions().memory_limit(limit)),
                          gpipe_test::contains("activations are the excess") &&
                              gpipe_test::contains("smaller mini-batch"));
  CATCH_CHECK_THROWS_WITH(plan(light, PlanOptions().partitions({3})),
                          gpipe_test::contains("cannot plan 3 partitions on 2 device(s)"));
  CATCH_CHECK_THROWS_WITH(plan(light, PlanOptions().virtual_stages(1)),
                          gpipe_test::contains("virtual_stages"));
}

CATCH_TEST_CASE("Profiles and plans survive JSON, and bad JSON is named",
                "[balancing][plan][json]") {
  const PipelineProfile profile = synthetic(6, 3);
  const PipelineProfile back = PipelineProfile::from_json(profile.to_json());
  const std::vector<PipelinePlan> a = plan(profile), b = plan(back);
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    CATCH_CHECK(a[k].describe() == b[k].describe());
    const PipelinePlan p = PipelinePlan::from_json(a[k].to_json());
    CATCH_CHECK(p.describe() == a[k].describe());
    CATCH_CHECK(p.devices == a[k].devices);
    CATCH_CHECK(p.threads == a[k].threads);
  }
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json("{\"balance\": [1]}"),
                          gpipe_test::contains("no \"devices\""));
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json("not json"), gpipe_test::contains("not JSON"));
  CATCH_CHECK_THROWS_WITH(
      PipelinePlan::from_json("{\"balance\": [2, 1], \"devices\": [\"cpu\"], \"chunks\": 2, "
                              "\"checkpoint\": \"never\", \"schedule\": \"gpipe\", "
                              "\"virtual_stages\": 1, \"threads\": 1}"),
      gpipe_test::contains("2 partitions in \"balance\" but 1 \"devices\""));
  CATCH_CHECK_THROWS_WITH(
      PipelinePlan::from_json("{\"balance\": [1], \"devices\": [\"cpu\"], \"chunks\": 2, "
                              "\"checkpoint\": \"sometimes\", \"schedule\": \"gpipe\", "
                              "\"virtual_stages\": 1, \"threads\": 1}"),
      gpipe_test::contains("unknown checkpoint mode 'sometimes'"));
  CATCH_CHECK_THROWS_WITH(
      PipelinePlan::from_json("{\"balance\": [1, 1], \"devices\": [\"cpu\", \"cpu\"], "
                              "\"chunks\": 2, \"checkpoint\": \"never\", \"schedule\": "
                              "\"1f1b\", \"virtual_stages\": 2, \"threads\": 1}"),
      gpipe_test::contains("virtual_stages is 2 but the schedule is 1f1b; virtual stages are "
                           "for the interleaved schedule"));
  CATCH_CHECK_THROWS_WITH(
      PipelinePlan::from_json("{\"balance\": [1, 1], \"devices\": [\"cpu\", \"cpu\"], "
                              "\"chunks\": 2, \"checkpoint\": \"never\", \"schedule\": "
                              "\"zbv\", \"virtual_stages\": 1, \"threads\": 1}"),
      gpipe_test::contains("the schedule is zbv, which puts 2 partitions on each worker in a V, "
                           "but virtual_stages is 1; give 2"));
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json("{\"devices\": [\"cpu\"], \"batch\": 4}"),
                          gpipe_test::contains("no \"input_bytes\""));
}

nn::Sequential mlp(int64_t width, int64_t layers) {
  nn::Sequential seq;
  for (int64_t k = 0; k < layers; ++k) {
    seq->push_back(nn::Linear(width, width));
    seq->push_back(nn::Tanh());
  }
  seq->push_back(nn::Linear(width, 4));
  return seq;
}

// Three SGD steps (momentum) of `plain` and of `pipe`, a pipeline of a copy of it, on (x, y): the
// same gradients at each. The plain model's loss over the micro-batches as the schedule weighs
// them: with cross-entropy's mean and equal micro-batches, the mean over the mini-batch either way.
void train_as_plain(nn::Sequential& plain, GPipe& pipe, const at::Tensor& x, const at::Tensor& y) {
  torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD pipe_opt(pipe->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto loss = [](const Batch& out, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(out.tensor(), target);
  };
  for (int step = 0; step < 3; ++step) {
    plain_opt.zero_grad();
    pipe_opt.zero_grad();
    loss(Batch(plain->forward(x)), y).backward();
    pipe->step(x, y, loss);
    check_same_grads(plain->parameters(), pipe->parameters(), 1e-5);
    plain_opt.step();
    pipe_opt.step();
  }
}

CATCH_TEST_CASE("A plan from a real profile builds a pipeline that trains as the plain model",
                "[balancing][plan][transparency]") {
  at::manual_seed(0);
  nn::Sequential model = mlp(32, 3);
  const at::Tensor x = at::randn({16, 32});
  const at::Tensor y = at::randint(4, {16});
  const PipelineProfile profile =
      profile_pipeline(model, x, {at::kCPU, at::kCPU},
                       PipelineProfileOptions().timeout(std::chrono::milliseconds(50)));
  CATCH_CHECK(profile.sizes.size() == 3);  // 1, 4 and 16
  CATCH_CHECK(profile.sizes[1].batch == 4);
  CATCH_CHECK(profile.layers() == 7);
  CATCH_CHECK(profile.copies.empty());  // one device
  CATCH_CHECK(profile.optimizers.size() == optimizer_kinds().size());  // each kind, on the CPU
  CATCH_REQUIRE(profile.calibration.size() == 2);  // whole-model steps at micro-batches of 1 and 4
  CATCH_CHECK(profile.calibration[0].batch == 1);
  CATCH_CHECK(profile.calibration[1].batch == 4);
  for (const auto& c : profile.calibration) {
    CATCH_CHECK(c.ratio > 0);
    CATCH_CHECK(c.split > 0);
  }
  for (const LayerStats& l : profile.sizes.back().layers) {
    CATCH_CHECK(l.forward_us > 0);
    CATCH_CHECK(l.held_bytes >= l.output_bytes);
    CATCH_CHECK(l.forward_peak_bytes >= l.held_bytes);
  }
  CATCH_CHECK(profile.sizes.back().layers[1].backward_input_us > 0);  // a Tanh: no weights
  CATCH_CHECK(profile.sizes.back().layers[1].backward_weight_us == 0);
  CATCH_CHECK(profile.sizes.back().layers[0].backward_input_us == 0);  // the input needs none
  const ScheduleKind kind =
      GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
               ScheduleKind::kZeroBubble, ScheduleKind::kInterleavedZeroBubble,
               ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV);
  const PipelinePlan best =
      plan(profile, PlanOptions().schedules({kind}).partitions({2}).chunks({2, 4})).front();
  CATCH_CAPTURE(best.describe());
  CATCH_CHECK(best.schedule == kind);
  CATCH_CHECK(best.balance.size() == (kind == ScheduleKind::kGPipe || kind == ScheduleKind::k1F1B ||
                                              kind == ScheduleKind::kZeroBubble
                                          ? 2u
                                          : 4u));
  nn::Sequential plain = mlp(32, 3);
  nn::Sequential copy = mlp(32, 3);
  for (size_t k = 0; k < plain->parameters().size(); ++k) {
    torch::NoGradGuard no_grad;
    copy->parameters()[k].copy_(plain->parameters()[k]);
  }
  GPipe pipe(copy, best.options());
  train_as_plain(plain, pipe, x, y);
}

CATCH_TEST_CASE("search_plan searches on a plan's own costs within its limit and predicts the result",
                "[balancing][plan][search]") {
  PipelineProfile profile = uneven(7, 3);
  profile.handoff_us = 50;  // what the planner's model has and the search's has not
  const PipelinePlan zb = plan(profile, PlanOptions()
                                            .partitions({3})
                                            .chunks({8})
                                            .schedules({ScheduleKind::kZeroBubble})
                                            .checkpoints({Checkpoint::kNever})
                                            .search(false)
                                            .top(1))
                              .front();
  const int64_t limit = GENERATE(int64_t{2}, int64_t{3}, int64_t{8});
  CATCH_CAPTURE(limit);
  SearchedSchedule found;
  const PipelinePlan s = search_plan(profile, zb, limit, {}, &found);
  CATCH_CHECK(s.balance == zb.balance);
  CATCH_CHECK(s.chunks == 8);
  CATCH_REQUIRE(!s.schedule_text.empty());
  const Schedule text = parse_schedule(s.schedule_text);
  CATCH_CHECK(text.ranks == found.schedule.ranks);
  // Within the limit, and never longer than the best generated schedule there.
  for (int64_t held : found.simulation.peak_in_flight) CATCH_CHECK(held <= limit);
  if (limit >= 3) {  // (1F1B holds 3 on its first rank: no generated schedule fits 2)
    CATCH_CHECK(found.best_generated_name != "");
    CATCH_CHECK(found.simulation.makespan <= found.best_generated.makespan);
  }
  // Its numbers are the planner's prediction of its text, not the search's own simulation.
  PipelinePlan again = zb;
  again.schedule_text = s.schedule_text;
  predict(profile, again);
  CATCH_CHECK(s.step_us == again.step_us);
  CATCH_CHECK(s.peak_bytes == again.peak_bytes);
  CATCH_CHECK(s.step_us > found.simulation.makespan);
  // Each stage's costs are the plan's: the search's first F on rank 0 lasts stage 0's forward.
  const PipelineCosts costs = pipeline_costs(profile, zb, OptimizerKind::kMomentum);
  CATCH_CHECK(found.simulation.actions[0].front().end - found.simulation.actions[0].front().start ==
              gpipe_test::Approx(costs.stages[0].forward_us));
  PipelinePlan interleaved = zb;
  interleaved.virtual_stages = 2;
  CATCH_CHECK_THROWS_WITH(search_plan(profile, interleaved, limit),
                          gpipe_test::contains("virtual_stages 2"));
  CATCH_CHECK_THROWS_WITH(search_plan(profile, zb, 0),
                          gpipe_test::contains("max_in_flight must be at least 1, got 0"));
  PipelinePlan one_worker = zb;  // all of zb's partitions interleaved on one worker
  one_worker.schedule = ScheduleKind::kInterleavedZeroBubble;
  one_worker.virtual_stages = static_cast<int64_t>(zb.balance.size());
  CATCH_CHECK_THROWS_WITH(search_plan(profile, one_worker, limit),
                          gpipe_test::contains("an interleaved plan needs 2 or more workers and a "
                                               "multiple of them as micro-batches; it has 1 "
                                               "worker(s)"));
  PipelinePlan uneven_split = zb;
  uneven_split.chunks = 24;  // 32 samples in pieces of 2: 16
  CATCH_CHECK_THROWS_WITH(search_plan(profile, uneven_split, limit),
                          gpipe_test::contains("a mini-batch of 32 does not split into 24"));
}

// `plan`'s options (4 micro-batches of mlp(32, 3)) run `expected`'s actions and train as the plain
// model (train_as_plain).
void train_plan_as_plain(const PipelinePlan& plan, const Schedule& expected) {
  at::manual_seed(0);
  nn::Sequential plain = mlp(32, 3);
  nn::Sequential copy = mlp(32, 3);
  for (size_t k = 0; k < plain->parameters().size(); ++k) {
    torch::NoGradGuard no_grad;
    copy->parameters()[k].copy_(plain->parameters()[k]);
  }
  GPipe pipe(copy, plan.options());
  CATCH_CHECK(pipe->schedule(4).ranks == expected.ranks);
  const at::Tensor x = at::randn({16, 32});
  const at::Tensor y = at::randint(4, {16});
  train_as_plain(plain, pipe, x, y);
}

CATCH_TEST_CASE("A searched plan's options run its schedule and train as the plain model",
                "[balancing][plan][search][transparency]") {
  // Stage 1 twice as slow with a light W: the search's order is not zero bubble's.
  ScheduleSearchOptions search;
  search.stage_costs = {{1, 1, 1, 0}, {2, 3, 0.5, 0}};
  search.max_in_flight = {4, 4};
  const Schedule found = search_schedule(4, search).schedule;
  CATCH_REQUIRE(found.ranks != make_schedule(ScheduleKind::kZeroBubble, 2, 4).ranks);
  PipelinePlan p;
  p.balance = {4, 3};
  p.devices = {at::kCPU, at::kCPU};
  p.chunks = 4;
  p.checkpoint = Checkpoint::kNever;
  p.schedule = ScheduleKind::kZeroBubble;
  p.schedule_text = schedule_text(found);
  train_plan_as_plain(PipelinePlan::from_json(p.to_json()), found);
}

CATCH_TEST_CASE("A schedule searched in a V or interleaved runs as its plan's options and "
                "trains as the plain model",
                "[balancing][plan][search][v_shape][interleaved][transparency]") {
  const bool v_shape = GENERATE(true, false);  // else interleaved
  CATCH_CAPTURE(v_shape);
  const std::vector<int64_t> placement =
      v_shape ? std::vector<int64_t>{0, 1, 1, 0} : std::vector<int64_t>{0, 1, 0, 1};
  // The first of some uneven costs of 4 stages over 2 workers where the search finds an order of
  // its own (Note [Searching a schedule]).
  Schedule found;
  for (unsigned seed = 1; seed <= 40 && found.name != "searched"; ++seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<double> time(0.3, 3.0), transfer(0, 0.5);
    ScheduleSearchOptions search;
    search.v_shape = v_shape;
    search.virtual_stages = v_shape ? 1 : 2;
    for (int s = 0; s < 4; ++s) {
      search.stage_costs.push_back({time(gen), time(gen), time(gen), transfer(gen)});
    }
    found = search_schedule(4, search).schedule;
  }
  CATCH_REQUIRE(found.name == "searched");
  CATCH_REQUIRE(found.stage_ranks == placement);
  PipelinePlan p;
  p.balance = {2, 2, 2, 1};
  p.devices = std::vector<c10::Device>(4, at::kCPU);
  p.chunks = 4;
  p.checkpoint = Checkpoint::kNever;
  p.schedule = v_shape ? ScheduleKind::kZeroBubbleV : ScheduleKind::kInterleavedZeroBubble;
  p.virtual_stages = 2;
  p.schedule_text = schedule_text(found);
  const PipelinePlan back = PipelinePlan::from_json(p.to_json());
  CATCH_CHECK(back.schedule == p.schedule);  // read from the text's placement
  CATCH_CHECK(back.virtual_stages == 2);
  CATCH_CHECK(back.describe().find("schedule searched (2 stages per worker)") != std::string::npos);
  // Its placement is its own: as one stage per worker (virtual_stages 1) it is refused.
  PipelinePlan flat = p;
  flat.virtual_stages = 1;
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json(flat.to_json()),
                          gpipe_test::contains("the searched schedule has 2 worker(s) but "
                                               "\"balance\" 4 partitions and virtual_stages 1"));
  train_plan_as_plain(back, found);
}

CATCH_TEST_CASE("The planner searches V-shaped and interleaved schedules too, and keeps one only "
                "where it beats its placement's generated ones",
                "[balancing][plan][search][v_shape][interleaved]") {
  const bool v_shape = GENERATE(true, false);  // else interleaved
  CATCH_CAPTURE(v_shape);
  const PipelineProfile profile = uneven(7, 2);
  const std::vector<ScheduleKind> kinds =
      v_shape ? std::vector<ScheduleKind>{ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}
              : std::vector<ScheduleKind>{ScheduleKind::kInterleaved,
                                          ScheduleKind::kInterleavedZeroBubble};
  const std::vector<PipelinePlan> all =
      plan(profile, PlanOptions().schedules(kinds).virtual_stages(2).partitions({2})
                        .checkpoints({Checkpoint::kNever}).top(100000));
  int64_t searched = 0;
  for (const PipelinePlan& s : all) {
    if (s.schedule_text.empty()) continue;
    ++searched;
    CATCH_CAPTURE(s.describe());
    CATCH_CHECK(s.schedule == (v_shape ? ScheduleKind::kZeroBubbleV
                                       : ScheduleKind::kInterleavedZeroBubble));
    CATCH_CHECK(parse_schedule(s.schedule_text).stage_ranks ==
                (v_shape ? std::vector<int64_t>{0, 1, 1, 0} : std::vector<int64_t>{0, 1, 0, 1}));
    for (const PipelinePlan& g : all) {
      if (g.schedule_text.empty() && g.balance == s.balance && g.chunks == s.chunks) {
        CATCH_CHECK(s.step_us < g.step_us);
      }
    }
  }
  CATCH_CAPTURE(all.size());
  CATCH_CHECK(searched >= 1);
}
CATCH_TEST_CASE("The predicted peak memory of one partition is within 15% of what it allocates",
                "[balancing][plan][memory]") {
  // Tensor bytes as the allocator gives them out (Note [Counting CPU memory]); one partition runs
  // on one thread, so the peak does not depend on timing.
  gpipe_benchmarks::MemoryMeter& meter = gpipe_benchmarks::MemoryMeter::install();
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways);
  const int64_t chunks = GENERATE(1, 4);
  CATCH_CAPTURE(static_cast<int>(mode), chunks);
  at::manual_seed(0);
  const at::Tensor x = at::randn({512, 256});
  const at::Tensor y = at::randint(4, {512});
  const PipelineProfile profile =
      profile_pipeline(mlp(256, 4), x, {at::kCPU},
                       PipelineProfileOptions().timeout(std::chrono::milliseconds(20))
                           // Times only, and one plan to choose from: not needed here (its step
                           // of 512 one-sample micro-batches took 20 s under the sanitizers).
                           .calibrate(false));
  PipelinePlan p =
      plan(profile, PlanOptions().chunks({chunks}).checkpoints({mode}).schedules({ScheduleKind::kGPipe}))
          .front();
  CATCH_REQUIRE(p.balance.size() == 1);
  nn::Sequential model = mlp(256, 4);
  GPipe pipe(model, p.options());
  torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto loss = [](const Batch& out, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(out.tensor(), target);
  };
  int64_t peak = 0;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    meter.reset_peak();
    pipe->step(x, y, loss);
    if (step > 0) peak = std::max(peak, meter.peak());
    opt.step();
  }
  CATCH_CAPTURE(p.describe(), peak);
  const double predicted = static_cast<double>(p.peak_bytes.front());
  CATCH_CHECK(predicted == gpipe_test::Approx(static_cast<double>(peak)).epsilon(0.15));
  // And it is not the static bytes alone: the activations count.
  const PipelineCosts costs = pipeline_costs(profile, p, OptimizerKind::kMomentum);
  CATCH_CHECK(static_cast<double>(costs.static_bytes.front()) < 0.85 * static_cast<double>(peak));
}

// `synthetic` on a CPU and `gpus` GPUs (no GPU needed: a profile is data), the GPUs' layers
// `speedup` times faster; copies between any two devices at 10 GB/s after 20 us.

PipelineProfile cpu_and_gpus(int64_t layers, int64_t gpus, double speedup) {
  PipelineProfile p = synthetic(layers, 1 + gpus);
  p.devices = {c10::Device(c10::kCPU)};
  for (int64_t g = 0; g < gpus; ++g) p.devices.emplace_back(c10::kCUDA, g);
  PipelineProfile::DeviceKind gpu;
  gpu.device = p.devices[1];
  gpu.sizes = p.sizes;
  for (LayerProfile& lp : gpu.sizes) {
    lp.device = gpu.device;
    for (LayerStats& l : lp.layers) {
      for (double* t : {&l.forward_us, &l.forward_nograd_us, &l.backward_us,
                        &l.backward_input_us, &l.backward_weight_us}) {
        *t /= speedup;
      }
    }
  }
  p.other_kinds = {gpu};
  for (const c10::Device& from : p.devices) {
    for (const c10::Device& to : p.devices) {
      if (from != to) p.copies.push_back({from, to, 20, 10000});
    }
  }
  return p;
}

// Stage s's compute time (F + B) of `plan` at its micro-batch size, on its device.
std::vector<double> stage_times(const PipelineProfile& profile, const std::vector<int64_t>& balance,
                                const std::vector<c10::Device>& devices, int64_t b) {
  std::vector<double> out;
  int64_t first = 0;
  for (size_t s = 0; s < balance.size(); ++s) {
    double t = 0;
    for (int64_t k = first; k < first + balance[s]; ++k) {
      const LayerStats l = profile.layer(k, b, devices[s]);
      t += l.forward_us + l.backward_us;
    }
    out.push_back(t);
    first += balance[s];
  }
  return out;
}

// A link between processes of round numbers: messages 50 us + 1000 B/us, all-reduce steps 20 us +
// 500 B/us.
ProcessLinkStats round_link() {
  ProcessLinkStats link;
  link.latency_us = 50;
  link.bytes_per_us = 1000;
  link.allreduce_step_us = 20;
  link.allreduce_bytes_per_us = 500;
  return link;
}

// Partitions {1, 3} as a process each on cuda:0 and cuda:1, 4 micro-batches, no checkpointing.
PipelinePlan two_gpu_processes() {
  PipelinePlan g;
  g.balance = {1, 3};
  g.devices = {c10::Device(c10::kCUDA, 0), c10::Device(c10::kCUDA, 1)};
  g.chunks = 4;
  g.checkpoint = Checkpoint::kNever;
  g.processes = true;
  return g;
}

CATCH_TEST_CASE("An all-reduce over replicas costs Gloo's ring, and a message its latency and bytes",
                "[balancing][plan][replicas]") {
  const ProcessLinkStats link = round_link();
  CATCH_CHECK(link.message_us(0) == 0);
  CATCH_CHECK(link.message_us(10000) == gpipe_test::Approx(50 + 10));
  CATCH_CHECK(link.allreduce_us(10000, 1) == 0);
  // 2(r-1) steps of 20 us, each moving bytes / r at 500 B/us.
  CATCH_CHECK(link.allreduce_us(10000, 2) == gpipe_test::Approx(2 * 20 + 10000.0 / 500));
  CATCH_CHECK(link.allreduce_us(10000, 4) == gpipe_test::Approx(6 * 20 + 1.5 * 10000 / 500));
  CATCH_CHECK_THROWS_WITH(link.allreduce_us(10, 0), gpipe_test::contains("0 replicas"));
  // Through a ring in shared memory where the message fits in one, on Gloo beyond.
  ProcessLinkStats ringed = round_link();
  ringed.ring.latency_us = 5;
  ringed.ring.bytes_per_us = 4000;
  ringed.ring.max_message = 8000;
  CATCH_CHECK(ringed.ring.measured());
  CATCH_CHECK(ringed.message_us(8000) == gpipe_test::Approx(5 + 2));
  // Past the ring: a record through it saying so, then the header and the data on Gloo.
  CATCH_CHECK(ringed.message_us(8001) == gpipe_test::Approx(5 + 50 + 50 + 8.001));
  CATCH_CHECK(ringed.allreduce_us(10000, 2) == link.allreduce_us(10000, 2));  // always Gloo
  const ProcessLinkStats none;
  CATCH_CHECK(!none.measured());
  CATCH_CHECK(!none.valid());
  CATCH_CHECK(link.valid());
  for (double ProcessLinkStats::*field :
       {&ProcessLinkStats::latency_us, &ProcessLinkStats::allreduce_step_us}) {
    ProcessLinkStats negative = link;
    negative.*field = -1;
    CATCH_CHECK(!negative.valid());
  }
  CATCH_CHECK(!none.ring.measured());
  CATCH_CHECK_THROWS_WITH(none.message_us(8), gpipe_test::contains("measure_gloo_link"));
  CATCH_CHECK_THROWS_WITH(none.allreduce_us(8, 2), gpipe_test::contains("measure_gloo_link"));
}

CATCH_TEST_CASE("Stages all on GPUs in processes of their own send and all-reduce on NCCL where "
                "the profile has its numbers, others on Gloo",
                "[balancing][plan][replicas][nccl]") {
  GpuLinkStats nccl;
  CATCH_CHECK(!nccl.measured());
  CATCH_CHECK_THROWS_WITH(nccl.message_us(8), gpipe_test::contains("measure_nccl_link"));
  CATCH_CHECK_THROWS_WITH(nccl.allreduce_us(8, 2), gpipe_test::contains("measure_nccl_link"));
  CATCH_CHECK(!nccl.valid());
  nccl = {4, 100000, 3, 50000};
  CATCH_CHECK(nccl.valid());
  for (double GpuLinkStats::*field :
       {&GpuLinkStats::latency_us, &GpuLinkStats::allreduce_step_us}) {
    GpuLinkStats negative = nccl;
    negative.*field = -1;
    CATCH_CHECK(!negative.valid());
    CATCH_CHECK(negative.measured());  // (measured, but no link)
  }
  CATCH_CHECK(nccl.message_us(0) == 0);
  // A header's message and the data's: 2 x 4 us + 200000 B at 100000 B/us.
  CATCH_CHECK(nccl.message_us(200000) == gpipe_test::Approx(2 * 4 + 2.0));
  CATCH_CHECK(nccl.allreduce_us(200000, 4) == gpipe_test::Approx(6 * 3 + 1.5 * 200000 / 50000));

  PipelineProfile gpus = cpu_and_gpus(4, 2, 4.0);
  for (LayerProfile& lp : gpus.sizes) {
    for (LayerStats& l : lp.layers) l.trainable_param_bytes = l.param_bytes = 40000;
  }
  for (PipelineProfile::DeviceKind& kind : gpus.other_kinds) {
    for (LayerProfile& lp : kind.sizes) {
      for (LayerStats& l : lp.layers) l.trainable_param_bytes = l.param_bytes = 40000;
    }
  }
  gpus.process_link = round_link();
  PipelinePlan g = two_gpu_processes();
  g.replicas = 4;
  const int64_t out = gpus.layer(0, 8, g.devices[0]).output_bytes;
  const PipelineCosts on_gloo = pipeline_costs(gpus, g, ParameterMemory{});
  gpus.process_link.nccl = nccl;
  const PipelineCosts on_nccl = pipeline_costs(gpus, g, ParameterMemory{});
  // GPU to GPU: no copies through the CPU, no rings, NCCL's numbers.
  CATCH_CHECK(on_nccl.stages[0].copy_us == gpipe_test::Approx(nccl.message_us(out)));
  CATCH_CHECK(on_gloo.stages[0].copy_us > on_nccl.stages[0].copy_us);
  for (size_t s = 0; s < 2; ++s) {
    CATCH_CHECK(on_nccl.stages[s].allreduce_us ==
                gpipe_test::Approx(nccl.allreduce_us(40000 * g.balance[s], 4) +
                                   nccl.allreduce_us(4, 4)));
  }
  CATCH_CHECK(predict(gpus, g).step_us < [&] {
    PipelineProfile gloo = gpus;
    gloo.process_link.nccl = GpuLinkStats{};
    return predict(gloo, g).step_us;
  }());
  // A stage on the CPU: an NCCL group carries GPU tensors only, so the plan stays on Gloo.
  PipelinePlan mixed = g;
  mixed.devices = {c10::Device(c10::kCPU), c10::Device(c10::kCUDA, 0)};
  gpus.process_link.nccl = GpuLinkStats{};
  const PipelineCosts mixed_gloo = pipeline_costs(gpus, mixed, ParameterMemory{});
  gpus.process_link.nccl = nccl;
  const PipelineCosts mixed_nccl = pipeline_costs(gpus, mixed, ParameterMemory{});
  CATCH_CHECK(mixed_nccl.stages[0].copy_us == mixed_gloo.stages[0].copy_us);
  CATCH_CHECK(mixed_nccl.stages[0].allreduce_us == mixed_gloo.stages[0].allreduce_us);
  // Two workers on one GPU: NCCL refuses two ranks on a device, so Gloo.
  PipelinePlan shared = g;
  shared.devices = {c10::Device(c10::kCUDA, 1), c10::Device(c10::kCUDA, 1)};
  const PipelineCosts shared_nccl = pipeline_costs(gpus, shared, ParameterMemory{});
  CATCH_CHECK(shared_nccl.stages[0].allreduce_us ==
              gpipe_test::Approx(gpus.process_link.allreduce_us(40000, 4) +
                                 gpus.process_link.allreduce_us(4, 4)));
  // One process's pipeline, replicated: on Gloo.
  PipelinePlan one = g;
  one.processes = false;
  CATCH_CHECK(pipeline_costs(gpus, one, ParameterMemory{}).step_allreduce_us ==
              gpipe_test::Approx(gpus.process_link.allreduce_us(4 * 40000, 4)));
  // It survives JSON, and is checked.
  const std::string text = gpus.to_json();
  const GpuLinkStats back = PipelineProfile::from_json(text).process_link.nccl;
  CATCH_CHECK(back.latency_us == 4);
  CATCH_CHECK(back.bytes_per_us == 100000);
  CATCH_CHECK(back.allreduce_step_us == 3);
  CATCH_CHECK(back.allreduce_bytes_per_us == 50000);
  std::string bad = text;
  const std::string field = "\"allreduce_bytes_per_us\": 50000";
  CATCH_REQUIRE(bad.find(field) != std::string::npos);
  bad.replace(bad.find(field), field.size(), "\"allreduce_bytes_per_us\": 0");
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(bad),
                          gpipe_test::contains("the process link's nccl latencies must not be "
                                               "negative"));
}

CATCH_TEST_CASE("A plan says which backend its stages were predicted on, and keeps it in its file",
                "[balancing][plan][replicas][nccl]") {
  PipelineProfile gpus = cpu_and_gpus(4, 2, 4.0);
  gpus.process_link = round_link();
  PipelinePlan g = two_gpu_processes();
  predict(gpus, g);
  CATCH_CHECK(g.backend == "gloo");  // no NCCL numbers in the profile
  CATCH_CHECK_THAT(g.describe(), gpipe_test::contains("a process per worker on Gloo: "));
  gpus.process_link.nccl = {4, 100000, 3, 50000};
  predict(gpus, g);
  CATCH_CHECK(g.backend == "nccl");
  CATCH_CHECK_THAT(g.describe(), gpipe_test::contains("a process per worker on NCCL: "));
  const std::string text = g.to_json();
  CATCH_CHECK(PipelinePlan::from_json(text).backend == "nccl");
  // A stage on the CPU: Gloo; replicas of one process: Gloo; one process alone: none.
  PipelinePlan mixed = g;
  mixed.devices[0] = c10::Device(c10::kCPU);
  predict(gpus, mixed);
  CATCH_CHECK(mixed.backend == "gloo");
  PipelinePlan one = g;
  one.processes = false;
  one.replicas = 2;
  predict(gpus, one);
  CATCH_CHECK(one.backend == "gloo");
  CATCH_CHECK_THAT(one.describe(), gpipe_test::contains(", 2 replicas on Gloo: "));
  one.replicas = 1;
  predict(gpus, one);
  CATCH_CHECK(one.backend.empty());
  CATCH_CHECK(one.describe().find(" on ") == std::string::npos);
  CATCH_CHECK(PipelinePlan::from_json(one.to_json()).backend.empty());
  // Files without it (written before) read as unknown; a wrong one is named.
  std::string old = text;
  const std::string field = "\"backend\": \"nccl\",\n  ";  // (the keys in order)
  CATCH_REQUIRE(old.find(field) != std::string::npos);
  old.erase(old.find(field), field.size());
  CATCH_CHECK(PipelinePlan::from_json(old).backend.empty());
  std::string bad = text;
  bad.replace(bad.find("\"nccl\""), 6, "\"mpi\"");
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json(bad),
                          gpipe_test::contains("the predicted backend is \"mpi\"; give \"gloo\" or "
                                               "\"nccl\""));
  CATCH_CHECK_THROWS_WITH(PipelinePlan::from_json(
                              std::string(text).replace(text.find("\"processes\": true"), 17,
                                                        "\"processes\": false")),
                          gpipe_test::contains("runs in one process without replicas; leave "
                                               "\"backend\" out"));
}

CATCH_TEST_CASE("Each worker's step ends with its stages' all-reduces after its last action",
                "[balancing][plan][simulate][replicas]") {
  // GPipe, 2 stages, 1 micro-batch: F0 [0, 1], F1 [1, 2], B1 [2, 4], B0 [4, 6].
  const Schedule s = gpipe_schedule(2, 1);
  PipelineCosts c = equal_costs(s, 1.0);
  CATCH_CHECK(simulate_pipeline(s, c).step_us == gpipe_test::Approx(6));
  c.stages[1].allreduce_us = 7;  // worker 1 ends at 4
  CATCH_CHECK(simulate_pipeline(s, c).step_us == gpipe_test::Approx(4 + 7));
  c.stages[0].allreduce_us = 7;  // worker 0 ends at 6
  CATCH_CHECK(simulate_pipeline(s, c).step_us == gpipe_test::Approx(6 + 7));
  c.step_allreduce_us = 5;  // after every worker's end
  CATCH_CHECK(simulate_pipeline(s, c).step_us == gpipe_test::Approx(6 + 7 + 5));
  c.stages[0].allreduce_us = -1;
  CATCH_CHECK_THROWS_WITH(simulate_pipeline(s, c), gpipe_test::contains("negative cost"));
  // Interleaved: a worker's two stages reduce one after the other.
  const Schedule v = interleaved_schedule(2, 2, 2);
  PipelineCosts cv = equal_costs(v, 1.0);
  const PipelineSimulation base = simulate_pipeline(v, cv);
  double worker0_end = 0;
  for (const TimelineEvent& e : base.events) {
    if (v.stage_ranks[e.partition] == 0) worker0_end = std::max(worker0_end, e.end_us);
  }
  cv.stages[0].allreduce_us = 1000;
  cv.stages[2].allreduce_us = 2000;
  CATCH_CHECK(simulate_pipeline(v, cv).step_us == gpipe_test::Approx(worker0_end + 3000));
}

CATCH_TEST_CASE("A plan with replicas all-reduces each stage's gradients, and one with processes "
                "sends its activations on the link",
                "[balancing][plan][replicas]") {
  PipelineProfile profile = synthetic(4, 2, 32, /*param_bytes=*/40000);
  for (LayerProfile& lp : profile.sizes) {
    for (LayerStats& l : lp.layers) l.trainable_param_bytes = l.param_bytes;
  }
  PipelinePlan p;
  p.balance = {1, 3};
  p.devices = profile.devices;
  p.chunks = 4;
  p.checkpoint = Checkpoint::kNever;
  // Without a link, neither is planned.
  p.replicas = 4;
  CATCH_CHECK_THROWS_WITH(pipeline_costs(profile, p, ParameterMemory{}),
                          gpipe_test::contains("4 replicas but the profile has no link between "
                                               "processes"));
  p.replicas = 1;
  p.processes = true;
  CATCH_CHECK_THROWS_WITH(predict(profile, p), gpipe_test::contains("a process per worker"));
  profile.process_link = round_link();
  const ProcessLinkStats& link = profile.process_link;

  p.processes = false;
  const PipelineCosts one = pipeline_costs(profile, p, ParameterMemory{});
  const double alone = predict(profile, p).step_us;
  // One process's pipeline replicated: the whole model's gradients after the step.
  p.replicas = 4;
  const PipelineCosts whole = pipeline_costs(profile, p, ParameterMemory{});
  CATCH_CHECK(one.step_allreduce_us == 0);
  CATCH_CHECK(whole.step_allreduce_us == gpipe_test::Approx(link.allreduce_us(4 * 40000, 4)));
  for (size_t s = 0; s < 2; ++s) CATCH_CHECK(whole.stages[s].allreduce_us == 0);
  CATCH_CHECK(predict(profile, p).step_us ==
              gpipe_test::Approx(alone + whole.step_allreduce_us));
  CATCH_CHECK_THROWS_WITH((p.replicas = 0, predict(profile, p)),
                          gpipe_test::contains("replicas 0; give 1 or more"));

  p.replicas = 1;
  p.processes = true;
  const PipelineCosts apart = pipeline_costs(profile, p, ParameterMemory{});
  const int64_t out = profile.layer(0, 8).output_bytes;
  CATCH_CHECK(apart.stages[0].copy_us == gpipe_test::Approx(50 + out / 1000.0));
  {
    // Stages on one machine: their rings, where the activations fit in one.
    PipelineProfile ringed = profile;
    ringed.process_link.ring = {5, 4000, out};
    CATCH_CHECK(pipeline_costs(ringed, p, ParameterMemory{}).stages[0].copy_us ==
                gpipe_test::Approx(5 + out / 4000.0));
    ringed.process_link.ring.max_message = out - 1;
    CATCH_CHECK(pipeline_costs(ringed, p, ParameterMemory{}).stages[0].copy_us ==
                gpipe_test::Approx(5 + 50 + 50 + out / 1000.0));
  }
  const double in_processes = predict(profile, p).step_us;
  CATCH_CHECK(in_processes > alone);
  // Stages in processes, replicated: each worker its own stage's gradients after its last action.
  p.replicas = 4;
  const PipelineCosts four = pipeline_costs(profile, p, ParameterMemory{});
  CATCH_CHECK(four.step_allreduce_us == 0);
  for (size_t s = 0; s < 2; ++s) {
    const int64_t grads = 40000 * p.balance[s];
    CATCH_CHECK(four.stages[s].allreduce_us ==
                gpipe_test::Approx(link.allreduce_us(grads, 4) + link.allreduce_us(4, 4)));
    CATCH_CHECK(four.stages[s].copy_us == apart.stages[s].copy_us);
  }
  const double replicated = predict(profile, p).step_us;
  CATCH_CHECK(replicated > in_processes + four.stages[0].allreduce_us - 1e-6);  // worker 0 last
  CATCH_CHECK(replicated <= in_processes + four.stages[1].allreduce_us + 1e-6);
  p.replicas = 1;
  // A GPU stage reaches Gloo through the CPU, both ways.
  PipelineProfile gpus = cpu_and_gpus(4, 2, 4.0);
  gpus.process_link = link;
  PipelinePlan g = p;
  g.devices = {c10::Device(c10::kCUDA, 0), c10::Device(c10::kCUDA, 1)};
  const int64_t gout = gpus.layer(0, 8).output_bytes;
  CATCH_CHECK(pipeline_costs(gpus, g, ParameterMemory{}).stages[0].copy_us ==
              gpipe_test::Approx(gpus.copy_us(g.devices[0], c10::kCPU, gout) +
                                 link.message_us(gout) +
                                 gpus.copy_us(c10::kCPU, g.devices[1], gout)));

  // plan() carries both into its plans, and they survive JSON.
  CATCH_CHECK_THROWS_WITH(plan(synthetic(4, 2), PlanOptions().replicas(2)),
                          gpipe_test::contains("need the profile's link between processes"));
  const std::vector<PipelinePlan> plans =
      plan(profile, PlanOptions().processes(true).replicas(8).search(false));
  for (const PipelinePlan& q : plans) {
    CATCH_CHECK(q.processes);
    CATCH_CHECK(q.replicas == 8);
    CATCH_CHECK_THAT(q.describe(), gpipe_test::contains("a process per worker, 8 replicas"));
    const PipelinePlan back = PipelinePlan::from_json(q.to_json());
    CATCH_CHECK(back.processes);
    CATCH_CHECK(back.replicas == 8);
    PipelinePlan again = back;
    CATCH_CHECK(predict(profile, again).step_us == gpipe_test::Approx(q.step_us));
  }
  // A plan file from before: one process, no replicas.
  const PipelinePlan old = PipelinePlan::from_json(
      "{\"balance\": [2, 2], \"devices\": [\"cpu\", \"cpu\"], \"chunks\": 2, \"checkpoint\": "
      "\"never\", \"schedule\": \"gpipe\", \"virtual_stages\": 1, \"threads\": 1}");
  CATCH_CHECK(!old.processes);
  CATCH_CHECK(old.replicas == 1);
}

CATCH_TEST_CASE("A V-shaped plan puts partitions r and 2n - 1 - r on worker r, whose turn sends "
                "nothing between processes",
                "[balancing][plan][v_shape]") {
  PipelineProfile profile = cpu_and_gpus(8, 2, 4.0);
  profile.process_link = round_link();
  const c10::Device gpu0(c10::kCUDA, 0), gpu1(c10::kCUDA, 1);
  const ScheduleKind kind = GENERATE(ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV);
  CATCH_CAPTURE(schedule_kind_name(kind));
  const std::vector<PipelinePlan> plans =
      plan(profile, PlanOptions().schedules({kind}).partitions({2}).chunks({4}).top(100000));
  int64_t on_gpus = 0;
  for (const PipelinePlan& p : plans) {
    CATCH_CAPTURE(p.describe());
    CATCH_CHECK(p.schedule == kind);
    CATCH_CHECK(p.virtual_stages == 2);
    CATCH_REQUIRE(p.devices.size() == 4);
    CATCH_CHECK(p.devices[0] == p.devices[3]);
    CATCH_CHECK(p.devices[1] == p.devices[2]);
    CATCH_CHECK(p.devices[0] != p.devices[1]);
    on_gpus += p.devices[0] == gpu0 && p.devices[1] == gpu1;
    const PipelinePlan back = PipelinePlan::from_json(p.to_json());
    CATCH_CHECK(back.schedule == kind);
    CATCH_CHECK(back.virtual_stages == 2);
    CATCH_CHECK(back.devices == p.devices);
  }
  CATCH_CHECK(on_gpus > 0);

  // Worker r runs partitions r and 3 - r; the turn (partition 1 to 2) stays on worker 1's GPU: no
  // copy, and with a process per worker no message. One micro-batch crosses two links each way.
  PipelinePlan p;
  p.balance = {2, 2, 2, 2};
  p.devices = {gpu0, gpu1, gpu1, gpu0};
  p.chunks = 1;
  p.checkpoint = Checkpoint::kNever;
  p.schedule = ScheduleKind::kZeroBubbleV;
  p.virtual_stages = 2;
  const PipelineCosts local = pipeline_costs(profile, p, ParameterMemory{});
  const int64_t out = profile.layer(1, 32).output_bytes;
  const double copy = profile.copy_us(gpu0, gpu1, out);
  CATCH_REQUIRE(local.stages.size() == 4);
  for (int64_t s = 0; s < 4; ++s) CATCH_CHECK(local.stages[s].lane == std::min(s, 3 - s));
  CATCH_CHECK(local.stages[0].copy_us == gpipe_test::Approx(copy));
  CATCH_CHECK(local.stages[1].copy_us == 0);
  CATCH_CHECK(local.stages[2].copy_us == gpipe_test::Approx(copy));
  p.processes = true;
  profile.process_link.latency_us = 1e6;  // a message outweighs everything else
  const PipelineCosts apart = pipeline_costs(profile, p, ParameterMemory{});
  // (Gloo through the CPU, as Note [Stages and replicas in the plan] says.)
  const double message = profile.copy_us(gpu0, c10::kCPU, out) +
                         profile.process_link.message_us(out) +
                         profile.copy_us(c10::kCPU, gpu1, out);
  CATCH_CHECK(apart.stages[0].copy_us == gpipe_test::Approx(message));
  CATCH_CHECK(apart.stages[1].copy_us == 0);
  CATCH_CHECK(apart.stages[2].copy_us == gpipe_test::Approx(message));
  // F0 > F1 F2 > F3, then the gradients back the same way: four messages.
  double compute = 0;
  for (const StageCost& c : apart.stages) compute += c.forward_us + c.backward_us;
  const double step = predict(profile, p).step_us;
  CATCH_CHECK(step >= 4 * message);
  CATCH_CHECK(step <= 4 * message + compute + 100 * profile.handoff_us + 1);
}

CATCH_TEST_CASE("A worker of several stages is balanced by their sum, not by each stage alone",
                "[balancing][plan][v_shape]") {
  // Six layers of uneven time in four stages on two workers. The balance of least bottleneck
  // stage, {2, 1, 2, 1}, and every one of at most two layers a stage (the least memory, as the
  // layers' bytes are equal) leave one worker 19 (on a V) or 18 (interleaved) of 33 units; the
  // best balance of the workers' sums leaves 17.
  const std::vector<double> units = {2, 8, 9, 2, 3, 9};
  PipelineProfile profile = synthetic(6, 2);
  for (LayerProfile& lp : profile.sizes) {
    for (size_t k = 0; k < units.size(); ++k) {
      LayerStats& l = lp.layers[k];
      l.forward_us = l.forward_nograd_us = 100 * units[k];
      l.backward_us = 200 * units[k];
      l.backward_input_us = l.backward_weight_us = 100 * units[k];
    }
  }
  const ScheduleKind kind = GENERATE(ScheduleKind::kZeroBubbleV, ScheduleKind::kInterleaved);
  CATCH_CAPTURE(schedule_kind_name(kind));
  // Worker r holds stages r and 3 - r on a V, r and r + 2 interleaved.
  const std::vector<size_t> worker_of = v_shaped(kind) ? std::vector<size_t>{0, 1, 1, 0}
                                                       : std::vector<size_t>{0, 1, 0, 1};
  const auto busiest = [&](const std::vector<int64_t>& balance) {
    double load[2] = {0, 0};
    size_t k = 0;
    for (size_t s = 0; s < balance.size(); ++s) {
      for (int64_t j = 0; j < balance[s]; ++j) load[worker_of[s]] += units[k++];
    }
    return std::max(load[0], load[1]);
  };
  double least = 1e9;  // over all 10 balances of 6 layers in 4 stages
  for (int64_t a = 1; a <= 3; ++a) {
    for (int64_t b = 1; a + b <= 4; ++b) {
      for (int64_t c = 1; a + b + c <= 5; ++c) {
        least = std::min(least, busiest({a, b, c, 6 - a - b - c}));
      }
    }
  }
  CATCH_CHECK(least == 17);
  CATCH_CHECK(busiest({2, 1, 2, 1}) > least);
  const std::vector<PipelinePlan> plans =
      plan(profile, PlanOptions().partitions({2}).schedules({kind}).chunks({4})
                        .checkpoints({Checkpoint::kNever}).search(false).top(100));
  double best_found = 1e9;
  for (const PipelinePlan& p : plans) best_found = std::min(best_found, busiest(p.balance));
  CATCH_CHECK(best_found == least);
}

CATCH_TEST_CASE("A profile's link between processes survives JSON and is checked",
                "[balancing][plan][replicas][json]") {
  PipelineProfile profile = synthetic(4, 2);
  CATCH_CHECK(!PipelineProfile::from_json(profile.to_json()).process_link.measured());
  profile.process_link = round_link();
  const std::string text = profile.to_json();
  const ProcessLinkStats back = PipelineProfile::from_json(text).process_link;
  CATCH_CHECK(back.latency_us == 50);
  CATCH_CHECK(back.bytes_per_us == 1000);
  CATCH_CHECK(back.allreduce_step_us == 20);
  CATCH_CHECK(back.allreduce_bytes_per_us == 500);
  CATCH_CHECK(!back.ring.measured());  // (a profile from before the rings: every message on Gloo)
  profile.process_link.ring = {5, 4000, 8000};
  const ProcessLinkStats ringed = PipelineProfile::from_json(profile.to_json()).process_link;
  CATCH_CHECK(ringed.ring.latency_us == 5);
  CATCH_CHECK(ringed.ring.bytes_per_us == 4000);
  CATCH_CHECK(ringed.ring.max_message == 8000);
  profile.process_link.ring.max_message = 0;  // not measured: not written
  CATCH_CHECK(!PipelineProfile::from_json(profile.to_json()).process_link.ring.measured());
  std::string bad_ring = text;
  const size_t link_at = bad_ring.find("\"process_link\": {");
  CATCH_REQUIRE(link_at != std::string::npos);
  bad_ring.insert(link_at + std::string("\"process_link\": {").size(),
                  "\"ring\": {\"latency_us\": 5, \"bytes_per_us\": 0, \"max_message\": 8000}, ");
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(bad_ring),
                          gpipe_test::contains("ring must have"));
  std::string bad = text;
  const std::string field = "\"allreduce_bytes_per_us\": 500";
  const size_t at = bad.find(field);
  CATCH_REQUIRE(at != std::string::npos);
  bad.replace(at, field.size(), "\"allreduce_bytes_per_us\": 0");
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(bad),
                          gpipe_test::contains("allreduce_bytes_per_us must be positive"));
}

CATCH_TEST_CASE("The planner tries every placement of kinds and balances by each device's times",
                "[balancing][plan][placement]") {
  const PipelineProfile profile = cpu_and_gpus(8, 2, 4.0);
  const c10::Device cpu(c10::kCPU), gpu0(c10::kCUDA, 0), gpu1(c10::kCUDA, 1);
  const std::vector<PipelinePlan> all =
      plan(profile, PlanOptions().top(100000).search(false).schedules({ScheduleKind::kGPipe}));
  std::set<std::vector<std::string>> seen;
  for (const PipelinePlan& p : all) {
    std::vector<std::string> names;
    for (const c10::Device& d : p.devices) names.push_back(d.str());
    seen.insert(names);
  }
  // Each sequence of kinds once, the GPUs in their order.
  const std::set<std::vector<std::string>> expected{
      {"cpu"},           {"cuda:0"},          {"cpu", "cuda:0"},          {"cuda:0", "cpu"},
      {"cuda:0", "cuda:1"}, {"cpu", "cuda:0", "cuda:1"}, {"cuda:0", "cpu", "cuda:1"},
      {"cuda:0", "cuda:1", "cpu"}};
  CATCH_CHECK(seen == expected);
  // Each placement once: no two candidates alike.
  std::set<std::string> candidates;
  for (const PipelinePlan& p : all) {
    CATCH_CHECK(candidates.insert(p.to_json()).second);
  }
  auto find = [&](const std::vector<c10::Device>& devices, int64_t m) {
    std::vector<PipelinePlan> out;
    for (const PipelinePlan& p : all) {
      if (p.devices == devices && p.chunks == m && p.checkpoint == Checkpoint::kNever) {
        out.push_back(p);
      }
    }
    CATCH_REQUIRE(!out.empty());
    return out;
  };
  // One worker: the GPU's layers are 4 times faster, and so is its step.
  CATCH_CHECK(find({cpu}, 4).front().step_us ==
              gpipe_test::Approx(4 * find({gpu0}, 4).front().step_us));
  // Unlike workers: the balance of least bottleneck on each device's times is among the
  // candidates (checked against every balance), and it is not the one of equal layers.
  for (const std::vector<c10::Device>& devices :
       std::vector<std::vector<c10::Device>>{{cpu, gpu0}, {gpu0, cpu}, {gpu0, cpu, gpu1}}) {
    CATCH_CAPTURE(devices);
    const int64_t b = 32 / 4;
    double best = 1e300;
    const int64_t n = static_cast<int64_t>(devices.size());
    std::vector<int64_t> balance(n, 1);
    std::function<void(int64_t, int64_t)> every = [&](int64_t s, int64_t left) {
      if (s == n - 1) {
        balance[s] = left;
        const std::vector<double> t = stage_times(profile, balance, devices, b);
        best = std::min(best, *std::max_element(t.begin(), t.end()));
        return;
      }
      for (int64_t k = 1; k <= left - (n - 1 - s); ++k) {
        balance[s] = k;
        every(s + 1, left - k);
      }
    };
    every(0, 8);
    double got = 1e300;
    for (const PipelinePlan& p : find(devices, 4)) {
      const std::vector<double> t = stage_times(profile, p.balance, devices, b);
      got = std::min(got, *std::max_element(t.begin(), t.end()));
    }
    CATCH_CHECK(got == gpipe_test::Approx(best));
  }
  // The CPU holds one layer of eight beside a GPU four times faster (1 against 7 / 4).
  std::vector<std::vector<int64_t>> balances;
  for (const PipelinePlan& p : find({cpu, gpu0}, 4)) balances.push_back(p.balance);
  CATCH_CHECK(std::find(balances.begin(), balances.end(), std::vector<int64_t>{1, 7}) !=
              balances.end());
  // The fastest plan keeps the CPU out.
  const PipelinePlan fastest = plan(profile, PlanOptions().search(false)).front();
  CATCH_CAPTURE(fastest.describe());
  CATCH_CHECK(std::find(fastest.devices.begin(), fastest.devices.end(), cpu) ==
              fastest.devices.end());
  // Devices of one kind, and a profile of several kinds without their numbers (written before
  // them): the first n devices in their order, as before.
  PipelineProfile older = profile;
  older.other_kinds.clear();
  for (const PipelineProfile& q : {synthetic(6, 3), older}) {
    for (const PipelinePlan& p : plan(q, PlanOptions().top(100000).search(false))) {
      const size_t n = p.devices.size() / static_cast<size_t>(p.virtual_stages);  // workers
      for (size_t s = 0; s < p.devices.size(); ++s) {
        // (On a V, worker r holds partitions r and 2n - 1 - r.)
        const size_t worker = !v_shaped(p.schedule) ? s % n : s < n ? s : 2 * n - 1 - s;
        CATCH_CHECK(p.devices[s] == q.devices[worker]);
      }
    }
  }
}

CATCH_TEST_CASE("A profile's other kinds of device survive JSON and are checked",
                "[balancing][plan][placement]") {
  const PipelineProfile profile = cpu_and_gpus(6, 1, 3.0);
  const PipelineProfile back = PipelineProfile::from_json(profile.to_json());
  CATCH_REQUIRE(back.other_kinds.size() == 1);
  CATCH_CHECK(back.other_kinds[0].device == c10::Device(c10::kCUDA, 0));
  const c10::Device gpu(c10::kCUDA, 0);
  CATCH_CHECK(back.layer(2, 8, gpu).forward_us == gpipe_test::Approx(profile.layer(2, 8).forward_us / 3));
  CATCH_CHECK(back.layer(2, 8).forward_us == gpipe_test::Approx(profile.layer(2, 8).forward_us));
  PipelinePlan p;
  p.balance = {2, 4};
  p.devices = {c10::Device(c10::kCPU), gpu};
  p.chunks = 4;
  PipelinePlan q = p;
  predict(profile, p);
  predict(back, q);
  CATCH_CHECK(p.step_us == gpipe_test::Approx(q.step_us));
  // Without its other kinds (a profile written before them), the GPU is planned as the CPU.
  PipelineProfile older = profile;
  older.other_kinds.clear();
  PipelinePlan r = PipelinePlan(p);
  predict(older, r);
  CATCH_CHECK(r.step_us > p.step_us);
  std::string json = profile.to_json();
  const std::string device = "\"device\": \"cuda:0\"";
  const size_t at = json.find(device);
  CATCH_REQUIRE(at != std::string::npos);
  json.replace(at, device.size(), "\"device\": \"cpu\"");
  CATCH_CHECK_THROWS_WITH(PipelineProfile::from_json(json),
                          gpipe_test::contains("must be unlike the first device"));
}

CATCH_TEST_CASE("profile_copies measures both directions between a CPU and a GPU",
                "[balancing][plan][cuda]") {
  const std::vector<CopyStats> copies =
      profile_copies({at::kCPU, c10::Device("cuda:0"), at::kCPU});
  CATCH_REQUIRE(copies.size() == 2);
  for (const CopyStats& c : copies) {
    CATCH_CHECK(c.from != c.to);
    CATCH_CHECK(c.latency_us > 0);
    CATCH_CHECK(c.bytes_per_us > 100);  // over 100 MB/s on any PCIe or NVLink
    CATCH_CHECK(c.time_us(1 << 20) > c.latency_us);
  }
}

CATCH_TEST_CASE("profile_pipeline profiles and calibrates the layers on each kind of device",
                "[balancing][plan][placement][cuda]") {
  at::manual_seed(0);
  const nn::Sequential model = mlp(256, 4);
  const at::Tensor x = at::randn({64, 256});
  const c10::Device gpu("cuda:0"), cpu(at::kCPU);
  const PipelineProfile p = profile_pipeline(
      model, x, {gpu, cpu},
      PipelineProfileOptions().timeout(std::chrono::milliseconds(200)).min_batch(8));
  CATCH_REQUIRE(p.other_kinds.size() == 1);
  const PipelineProfile::DeviceKind& other = p.other_kinds[0];
  CATCH_CHECK(other.device == cpu);
  CATCH_REQUIRE(other.sizes.size() == p.sizes.size());
  for (size_t k = 0; k < p.sizes.size(); ++k) {
    CATCH_CHECK(other.sizes[k].batch == p.sizes[k].batch);
    CATCH_CHECK(other.sizes[k].device == cpu);
    CATCH_CHECK(p.sizes[k].device == gpu);
  }
  CATCH_CHECK(!p.calibration.empty());
  CATCH_CHECK(!other.calibration.empty());
  // Each stage is predicted on its own device's numbers, and both orders are planned.
  CATCH_CHECK(p.layer(0, 64, cpu).forward_us != p.layer(0, 64, gpu).forward_us);
  std::set<std::string> first;
  for (const PipelinePlan& q :
       plan(p, PlanOptions().partitions({2}).top(100000).search(false))) {
    first.insert(q.devices.front().str());
  }
  CATCH_CHECK(first == std::set<std::string>{"cpu", "cuda:0"});
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
