// The timeline written out: a real training step's Chrome trace parses and holds every task in
// clock-cycle order, every recomputation before its backward, and a named track per partition;
// the SVG pictures draw every event and cell.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <torch/cuda.h>

#include "absl/strings/str_format.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/trace.h"
#include "tests/gpipe/json.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace testing {
namespace {

using gpipe_test::Json;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / name).string();
}

torch::nn::Sequential linear_stack(int64_t layers) {
  torch::nn::Sequential seq;
  for (int64_t k = 0; k < layers; ++k) {
    seq->push_back(torch::nn::Linear(4, 4));
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

struct TraceEvent {
  std::string cat;
  int64_t microbatch, partition, tid;
  double ts, dur;
};

CATCH_TEST_CASE("a training step's Chrome trace holds every task in clock-cycle order and every "
                "recomputation before its backward",
                "[trace]") {
  const int64_t partitions = 3;
  const int64_t chunks = GENERATE(1, 4);
  const bool workers = GENERATE(false, true);
  CATCH_CAPTURE(chunks, workers);
  GPipe model(linear_stack(3),
              gpipe::internal::with_partition_threads(GPipeOptions({2, 2, 2})
                                                          .devices({at::kCPU, at::kCPU, at::kCPU})
                                                          .chunks(chunks)
                                                          .checkpoint(Checkpoint::kExceptLast),
                                                      workers));
  model->record_timeline(true);
  model->train();
  model->forward(at::randn({8, 4}).requires_grad_(true)).sum().backward();
  const std::string path = temp_path("gpipe_trace_test.json");
  model->write_chrome_trace(path);
  const Json trace = Json::parse(read_file(path));
  std::remove(path.c_str());

  std::map<int64_t, std::string> track_names;
  std::vector<TraceEvent> events;
  for (const Json& e : trace["traceEvents"].array) {
    if (e["ph"].string == "M") {
      if (e["name"].string == "thread_name") {
        track_names[static_cast<int64_t>(e["tid"].number)] = e["args"]["name"].string;
      }
      continue;
    }
    CATCH_REQUIRE(e["ph"].string == "X");
    CATCH_CHECK(e["dur"].number >= 0);
    CATCH_CHECK(e["pid"].number == 0);  // host times only on the CPU
    events.push_back(TraceEvent{e["cat"].string,
                                static_cast<int64_t>(e["args"]["microbatch"].number),
                                static_cast<int64_t>(e["args"]["partition"].number),
                                static_cast<int64_t>(e["tid"].number), e["ts"].number,
                                e["dur"].number});
    CATCH_CHECK(events.back().tid == events.back().partition);  // one track per partition
  }
  CATCH_CHECK(track_names == std::map<int64_t, std::string>{{0, "partition 0 (cpu)"},
                                                            {1, "partition 1 (cpu)"},
                                                            {2, "partition 2 (cpu)"}});
  auto of_kind = [&](const std::string& cat) {
    std::vector<TraceEvent> out;
    for (const TraceEvent& e : events) {
      if (e.cat == cat) out.push_back(e);
    }
    std::sort(out.begin(), out.end(),
              [](const TraceEvent& a, const TraceEvent& b) { return a.ts < b.ts; });
    return out;
  };
  // Every task once. On one thread, ordered by start time, their clock ticks i + j never go back;
  // with a thread per partition a partition runs ahead as far as its inputs allow, and only the
  // order per partition (below) and the dependencies hold.
  std::vector<TraceEvent> tasks = of_kind("compute");
  std::set<std::pair<int64_t, int64_t>> seen;
  for (const TraceEvent& t : tasks) seen.emplace(t.microbatch, t.partition);
  CATCH_CHECK(tasks.size() == static_cast<size_t>(chunks * partitions));
  CATCH_CHECK(seen.size() == static_cast<size_t>(chunks * partitions));
  for (size_t k = 1; k < tasks.size() && !workers; ++k) {
    CATCH_CHECK(tasks[k - 1].microbatch + tasks[k - 1].partition <=
                tasks[k].microbatch + tasks[k].partition);
  }
  // A task starts after the same micro-batch's task on the previous partition ended.
  for (const TraceEvent& t : tasks) {
    for (const TraceEvent& before : tasks) {
      if (before.microbatch == t.microbatch && before.partition == t.partition - 1) {
        CATCH_CHECK(before.ts + before.dur <= t.ts);
      }
    }
  }
  // kExceptLast: micro-batches 0 .. chunks - 2 are recomputed on every partition, each before the
  // backward through its recomputed layers, in reverse micro-batch order on each partition.
  std::vector<TraceEvent> recomputes = of_kind("recompute");
  std::vector<TraceEvent> backwards = of_kind("backward");
  CATCH_CHECK(recomputes.size() == static_cast<size_t>((chunks - 1) * partitions));
  CATCH_CHECK(backwards.size() == recomputes.size());
  for (const TraceEvent& r : recomputes) {
    CATCH_CHECK(r.microbatch < chunks - 1);
    for (const TraceEvent& b : backwards) {
      if (b.microbatch == r.microbatch && b.partition == r.partition) {
        CATCH_CHECK(r.ts + r.dur <= b.ts);
      }
    }
    for (const TraceEvent& t : tasks) {
      if (t.microbatch == r.microbatch && t.partition == r.partition) {
        CATCH_CHECK(t.ts + t.dur <= r.ts);
      }
    }
  }
  for (int64_t j = 0; j < partitions; ++j) {
    std::vector<int64_t> order;
    for (const TraceEvent& r : recomputes) {
      if (r.partition == j) order.push_back(r.microbatch);
    }
    CATCH_CHECK(std::is_sorted(order.rbegin(), order.rend()));
    // Forward, each partition takes the micro-batches in order.
    std::vector<int64_t> forward_order;
    for (const TraceEvent& t : tasks) {
      if (t.partition == j) forward_order.push_back(t.microbatch);
    }
    CATCH_CHECK(std::is_sorted(forward_order.begin(), forward_order.end()));
  }
}

CATCH_TEST_CASE("copy_overlap counts the part of each copy during which its GPU computed another "
                "micro-batch",
                "[trace][copy]") {
  using Kind = TimelineEvent::Kind;
  auto event = [](Kind kind, int64_t i, int64_t j, int64_t from, double start, double end) {
    TimelineEvent e{kind, i, j};
    e.from = from;
    e.device_start_us = start;
    e.device_end_us = end;
    return e;
  };
  const std::vector<c10::Device> devices{c10::Device("cuda:0"), at::kCPU};
  // Micro-batch 0 leaves the GPU during [10, 20]; the GPU computes micro-batch 1 during [5, 12],
  // micro-batch 2 during [15, 30] and [16, 18] (inside the last: counted once), and micro-batch 0
  // itself before (not another micro-batch). The CPU's work and the host-only event do not count.
  std::vector<TimelineEvent> events{
      event(Kind::kCopy, 0, 1, 0, 10, 20),      event(Kind::kCompute, 1, 0, -1, 5, 12),
      event(Kind::kCompute, 2, 0, -1, 15, 30),  event(Kind::kRecompute, 2, 0, -1, 16, 18),
      event(Kind::kCompute, 0, 0, -1, 0, 20),   event(Kind::kCompute, 1, 1, -1, 10, 20),
      TimelineEvent{Kind::kCompute, 3, 0}};
  CopyOverlap o = copy_overlap(events, devices);
  CATCH_CHECK(o.copy_us == 10);
  CATCH_CHECK(o.overlapped_us == 2 + 5);
  // A copy into the GPU is the receiver's: micro-batch 3 arrives on [40, 50] beside micro-batch 4.
  const std::vector<c10::Device> reversed{at::kCPU, c10::Device("cuda:0")};
  events = {event(Kind::kCopy, 3, 1, 0, 40, 50), event(Kind::kCompute, 4, 1, -1, 45, 60),
            event(Kind::kCompute, 4, 0, -1, 40, 50)};
  o = copy_overlap(events, reversed);
  CATCH_CHECK(o.copy_us == 10);
  CATCH_CHECK(o.overlapped_us == 5);
}

CATCH_TEST_CASE("the schedule's pictures draw every event and every cell", "[trace]") {
  GPipe model(linear_stack(2), GPipeOptions({2, 2})
                                   .devices({at::kCPU, at::kCPU})
                                   .chunks(3)
                                   .checkpoint(Checkpoint::kAlways));
  model->record_timeline(true);
  model->forward(at::randn({6, 4}).requires_grad_(true)).sum().backward();
  const std::vector<TimelineEvent> events = model->last_timeline();
  const std::string svg = timeline_svg(events, model->devices());
  auto count = [](const std::string& text, const std::string& what) {
    int64_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  CATCH_CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  CATCH_CHECK(svg.find("</svg>") == svg.size() - 7);
  // One box with a tooltip per event: 6 tasks, 4 copies, 6 recomputations, 6 backwards.
  CATCH_CHECK(count(svg, "<title>") == static_cast<int64_t>(events.size()));
  CATCH_CHECK(events.size() == 6 + 3 + 6 + 6);
  CATCH_CHECK(count(svg, "partition 1 (cpu)") == 1);
  const std::string path = temp_path("gpipe_trace_test.svg");
  model->write_timeline_svg(path);
  CATCH_CHECK(read_file(path) == svg);
  std::remove(path.c_str());

  // The ideal schedule: a forward and a backward cell per task.
  const std::string ideal = schedule_svg(4, 3, 3);
  CATCH_CHECK(count(ideal, "<rect x=") == 2 * 4 * 3);
  CATCH_CHECK(ideal.find("(n-1)/(m+n-1) = 33%") != std::string::npos);
  CATCH_CHECK_THROWS_WITH(schedule_svg(0, 2), gpipe_test::contains("got 0 and 2"));
}

CATCH_TEST_CASE("events with device times appear again at those times in a device-time process, "
                "and the picture draws them there",
                "[trace]") {
  // Two tasks on partition 0, the second with device times later than its host times.
  std::vector<TimelineEvent> events(2, TimelineEvent{TimelineEvent::Kind::kCompute, 0, 0});
  events[0].start_us = 10;
  events[0].end_us = 20;
  events[1].microbatch = 1;
  events[1].start_us = 20;
  events[1].end_us = 25;
  events[1].device_start_us = 120;
  events[1].device_end_us = 170;
  CATCH_CHECK_FALSE(events[0].has_device_times());
  CATCH_CHECK(events[1].has_device_times());
  const Json trace = Json::parse(chrome_trace_json(events, {c10::Device("cuda:0")}));
  std::map<int64_t, std::string> processes;
  std::set<std::pair<int64_t, int64_t>> tracks;  // (pid, tid) named
  std::vector<std::string> spans;  // "pid micro-batch ts dur"
  for (const Json& e : trace["traceEvents"].array) {
    const int64_t pid = static_cast<int64_t>(e["pid"].number);
    if (e["name"].string == "process_name") {
      processes[pid] = e["args"]["name"].string;
    } else if (e["name"].string == "thread_name") {
      CATCH_CHECK(e["args"]["name"].string == "partition 0 (cuda:0)");
      tracks.emplace(pid, static_cast<int64_t>(e["tid"].number));
    } else if (e["ph"].string == "X") {
      spans.push_back(absl::StrFormat("%d %d %g %g", pid,
                                      static_cast<int64_t>(e["args"]["microbatch"].number),
                                      e["ts"].number, e["dur"].number));
    }
  }
  CATCH_CHECK(processes ==
              std::map<int64_t, std::string>{{0, "gpipe (host time)"}, {1, "gpipe (device time)"}});
  CATCH_CHECK(tracks == std::set<std::pair<int64_t, int64_t>>{{0, 0}, {1, 0}});
  CATCH_CHECK(spans == std::vector<std::string>{"0 0 10 10", "0 1 20 5", "1 1 120 50"});
  const std::string svg = timeline_svg(events, {});
  CATCH_CHECK(svg.find("(device time)") != std::string::npos);
  CATCH_CHECK(svg.find("<title>0: 10.0-20.0 us</title>") != std::string::npos);
  CATCH_CHECK(svg.find("<title>1: 120.0-170.0 us</title>") != std::string::npos);
}

CATCH_TEST_CASE("on CUDA the trace has each task's device times, in clock-cycle order on the "
                "device and never before the host issued it",
                "[trace][cuda]") {
  const int64_t chunks = 4;
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  const c10::Device first(at::kCUDA, 0);
  const c10::Device second(at::kCUDA, static_cast<c10::DeviceIndex>(count > 1 ? 1 : 0));
  GPipe model(linear_stack(2), GPipeOptions({2, 2})
                                   .devices({first, second})
                                   .chunks(chunks)
                                   .checkpoint(Checkpoint::kExceptLast));
  model->record_timeline(true);
  model->train();
  model->forward(at::randn({8, 4}, first).requires_grad_(true)).sum().backward();
  const std::vector<TimelineEvent> events = model->last_timeline();
  // The device's clock reads 0.5 us steps (cudaEventElapsedTime); allow for that and rounding.
  const double resolution = 2;
  std::map<std::pair<int64_t, int64_t>, TimelineEvent> tasks, recomputes, backwards;
  for (const TimelineEvent& e : events) {
    if (e.kind == TimelineEvent::Kind::kSkipCopy) continue;
    CATCH_CHECK(e.has_device_times());
    CATCH_CHECK(e.device_end_us >= e.device_start_us);
    CATCH_CHECK(e.device_start_us + resolution >= e.start_us);  // not before it was issued
    const auto key = std::make_pair(e.microbatch, e.partition);
    if (e.kind == TimelineEvent::Kind::kCompute) tasks[key] = e;
    if (e.kind == TimelineEvent::Kind::kRecompute) recomputes[key] = e;
    if (e.kind == TimelineEvent::Kind::kBackward) backwards[key] = e;
  }
  CATCH_REQUIRE(tasks.size() == static_cast<size_t>(2 * chunks));
  CATCH_CHECK(recomputes.size() == static_cast<size_t>(2 * (chunks - 1)));
  for (const auto& [key, t] : tasks) {
    const auto [i, j] = key;
    if (i > 0) {  // the partition's stream runs its micro-batches one after another
      CATCH_CHECK(tasks.at({i - 1, j}).device_end_us <= t.device_start_us + resolution);
    }
    if (j > 0) {  // after the previous partition's task and the copy
      CATCH_CHECK(tasks.at({i, j - 1}).device_end_us <= t.device_start_us + resolution);
    }
    if (recomputes.count(key) > 0) {
      CATCH_CHECK(t.device_end_us <= recomputes.at(key).device_start_us + resolution);
      CATCH_CHECK(recomputes.at(key).device_end_us <=
                  backwards.at(key).device_start_us + resolution);
    }
  }
  const std::string path = temp_path("gpipe_trace_cuda_test.json");
  model->write_chrome_trace(path);
  const Json trace = Json::parse(read_file(path));
  std::remove(path.c_str());
  int64_t device_events = 0;
  for (const Json& e : trace["traceEvents"].array) {
    device_events += e["ph"].string == "X" && e["pid"].number == 1 ? 1 : 0;
  }
  CATCH_CHECK(device_events == static_cast<int64_t>(events.size()));
}

CATCH_TEST_CASE("writing a trace says what is missing or which file cannot be written",
                "[trace][errors]") {
  GPipe quiet(linear_stack(1), GPipeOptions({2}).devices({at::kCPU}).chunks(2));
  quiet->forward(at::randn({4, 4}));
  CATCH_CHECK_THROWS_WITH(quiet->write_chrome_trace(temp_path("never.json")),
                          gpipe_test::contains("record_timeline(true)"));
  GPipe model(linear_stack(1), GPipeOptions({2}).devices({at::kCPU}).chunks(2));
  model->record_timeline(true);
  model->forward(at::randn({4, 4}));
  CATCH_CHECK_THROWS_WITH(model->write_chrome_trace("/nonexistent-dir/trace.json"),
                          gpipe_test::contains("cannot open '/nonexistent-dir/trace.json'"));
}

CATCH_TEST_CASE("recording is a switch at run time: forwards and steps record while it is on",
                "[trace]") {
  GPipe model(linear_stack(2), GPipeOptions({2, 2}).devices({at::kCPU, at::kCPU}).chunks(3));
  CATCH_CHECK(!model->is_recording_timeline());
  const at::Tensor x = at::randn({6, 4});
  model->forward(x);
  CATCH_CHECK(model->last_timeline().empty());
  const auto count = [&](TimelineEvent::Kind kind) {
    int64_t n = 0;
    for (const TimelineEvent& e : model->last_timeline()) n += e.kind == kind ? 1 : 0;
    return n;
  };
  model->record_timeline(true);
  CATCH_CHECK(model->is_recording_timeline());
  model->forward(x);
  CATCH_CHECK(count(TimelineEvent::Kind::kCompute) == 3 * 2);  // every micro-batch, partition
  const LossFunction loss = [](const Batch& out, const at::Tensor& y) {
    return (out.tensor() - y).pow(2).mean();
  };
  model->step(x, at::randn({6, 4}), loss);
  CATCH_CHECK(count(TimelineEvent::Kind::kCompute) == 3 * 2);
  CATCH_CHECK(count(TimelineEvent::Kind::kBackward) == 3 * 2);
  model->record_timeline(false);
  model->forward(x);
  CATCH_CHECK(model->last_timeline().empty());
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
