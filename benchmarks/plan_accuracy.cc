// How close the planner's predictions come (balancing/plan.h): for configurations of ResNet-8,
// AmoebaNet-D (6, 64) and an MLP on CPU partitions — 2 and 3 of them, several micro-batch
// counts, every checkpoint mode and every schedule, and a searched schedule at 16 micro-batches
// (gpipe::search_plan) — the predicted and the measured step time and peak memory side by side,
// from one profile per model; then the planner's pick against the trainers' defaults within the
// defaults' memory.
//
//   bazel run -c opt //benchmarks:plan_accuracy -- --json_out=/tmp/plan_accuracy.json
//   plan_accuracy --devices=cuda:0,cpu --rounds=1   # on a GPU (tools/gpu_check.sh)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "balancing/plan.h"
#include "benchmarks/memory_meter.h"
#include "benchmarks/timing.h"
#include "examples/models/amoebanet.h"
#include "examples/models/resnet.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/stream.h"
#include "gpipe/schedule_text.h"
#include "gpipe/trace.h"
#include "gpipe/worker.h"

ABSL_FLAG(std::string, models, "resnet8,amoebanet,mlp", "models to check: resnet8, amoebanet, mlp");
ABSL_FLAG(int, repeats, 5, "timed steps per configuration (the median is reported)");
ABSL_FLAG(int, rounds, 3,
          "rounds of profile, predictions and measurements; the summary compares the medians over "
          "rounds (each round's errors are printed too)");
ABSL_FLAG(double, timeout, 2.0, "seconds of profiling per micro-batch size");
ABSL_FLAG(int64_t, cores, 0, "the machine's cores for the planner (0: all)");
ABSL_FLAG(std::string, json_out, "", "write the results here as JSON");
ABSL_FLAG(std::string, svg_dir, "",
          "write each configuration's predicted and measured timelines here (SVG, and Chrome "
          "trace JSON), and each model's profile (JSON)");
ABSL_FLAG(bool, detail, false,
          "print each partition's busy time per kind of work, predicted and measured");
ABSL_FLAG(std::string, child, "",
          "(internal) run one model, one round, in this process and write its rows here");
ABSL_FLAG(std::string, devices, "cpu,cpu,cpu",
          "the devices the planner plans on (comma-separated; a configuration of more partitions "
          "than devices is left out): on one GPU, cuda:0,cuda:0,cuda:0 puts every partition on it "
          "and cuda:0,cpu lets the planner place two (Note [Placement]); on a GPU the measured "
          "peak is its context plus the caching allocator's peak reserved");
ABSL_FLAG(bool, compare_defaults, true,
          "also measure the planner's pick against the trainers' defaults (ResNet-8, AmoebaNet-D)");

namespace {

using gpipe::Checkpoint;
using gpipe::ScheduleKind;
using gpipe_benchmarks::MemoryMeter;

struct Model {
  std::string name;
  std::string title;
  std::function<torch::nn::Sequential()> make;
  std::vector<int64_t> sample;  // one sample's shape
  int64_t batch = 128;
};

Model find_model(const std::string& name) {
  if (name == "resnet8") {
    return {name, "ResNet-8 (1 x 28 x 28, batch 128)",
            [] { return gpipe::models::resnet_cifar(8, 10, 1); }, {1, 28, 28}, 128};
  }
  if (name == "amoebanet") {
    return {name, "AmoebaNet-D (6, 64) (1 x 28 x 28, batch 128)",
            [] { return gpipe::models::amoebanet_d(6, 64, 10, 1); }, {1, 28, 28}, 128};
  }
  if (name == "mlp") {
    return {name, "MLP (8 x Linear 1024 + ReLU, batch 512)",
            [] {
              torch::nn::Sequential seq;
              int64_t in = 512;
              for (int k = 0; k < 8; ++k) {
                seq->push_back(torch::nn::Linear(in, 1024));
                seq->push_back(torch::nn::ReLU());
                in = 1024;
              }
              seq->push_back(torch::nn::Linear(1024, 10));
              return seq;
            },
            {512}, 512};
  }
  TORCH_CHECK(false, "--models: unknown model '", name, "'; use resnet8, amoebanet, mlp");
}

struct Config {
  int64_t partitions;
  int64_t chunks;
  Checkpoint checkpoint;
  ScheduleKind schedule;
  // A schedule searched on the configuration's own costs (gpipe::search_plan, within ZB-H1's
  // in-flight micro-batches) instead of `schedule`'s generated one.
  bool searched = false;
};

// Every checkpoint mode and every schedule over the three models, 2 and 3 partitions (zbv and
// dualpipev: 2 workers, 4 partitions in a V); each model's last row a searched schedule at m = 16
// (issue 40: within 10% of its prediction).
std::vector<Config> configs_of(const std::string& model) {
  using C = Checkpoint;
  using S = ScheduleKind;
  if (model == "resnet8") {  // 5 layers: no 3 x 2 interleaving
    return {{2, 4, C::kExceptLast, S::kGPipe},
            {2, 8, C::kNever, S::k1F1B},
            {3, 4, C::kAlways, S::kGPipe},
            {2, 8, C::kExceptLast, S::kZeroBubble},
            {2, 4, C::kNever, S::kInterleaved},
            {2, 8, C::kNever, S::kZeroBubbleV},
            {2, 16, C::kNever, S::kZeroBubble, true}};
  }
  if (model == "amoebanet") {
    return {{2, 4, C::kExceptLast, S::kGPipe},
            {3, 6, C::kNever, S::k1F1B},
            {2, 8, C::kAlways, S::kZeroBubble},
            {3, 6, C::kExceptLast, S::kInterleaved},
            {2, 16, C::kNever, S::kGPipe},
            {2, 8, C::kNever, S::kDualPipeV},
            {2, 16, C::kNever, S::kZeroBubble, true}};
  }
  return {{2, 4, C::kNever, S::kGPipe},
          {3, 8, C::kExceptLast, S::k1F1B},
          {2, 8, C::kAlways, S::kInterleaved},
          {3, 12, C::kNever, S::kZeroBubble},
          {2, 2, C::kExceptLast, S::kZeroBubble},
          {2, 8, C::kExceptLast, S::kZeroBubbleV},
          {2, 16, C::kNever, S::kZeroBubble, true}};
}

struct Measured {
  double step_ms = 0;
  double optimizer_ms = 0;  // the optimizer's step after it (median), Note [The optimizer's step]
  double cpu_ms = 0;  // the process's CPU time per timed step (user and system), mean
  int64_t peak_bytes = 0;
  std::vector<gpipe::TimelineEvent> events;  // the last step's, with --svg_dir or --detail
};

// "partition j: F 12.3 ms, B 20.1 ms, ...": the time of each kind of work per partition.
std::string busy(const std::vector<gpipe::TimelineEvent>& events) {
  std::map<int64_t, std::map<std::string, double>> sums;
  for (const gpipe::TimelineEvent& e : events) {
    using K = gpipe::TimelineEvent::Kind;
    const char* kind = e.kind == K::kCompute       ? "F"
                       : e.kind == K::kRecompute   ? "R"
                       : e.kind == K::kBackward    ? "B"
                       : e.kind == K::kBackwardInput ? "I"
                       : e.kind == K::kBackwardWeight ? "W"
                                                   : "copy";
    sums[e.partition][kind] += (e.end_us - e.start_us) / 1000;
  }
  std::string out;
  for (const auto& [partition, kinds] : sums) {
    absl::StrAppend(&out, "    partition ", partition, ":");
    for (const auto& [kind, ms] : kinds) absl::StrAppendFormat(&out, " %s %.1f ms", kind, ms);
    absl::StrAppend(&out, "\n");
  }
  return out;
}

std::vector<c10::Device> devices_from_flag() {
  std::vector<c10::Device> out;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_devices), ',')) {
    TORCH_CHECK(!name.empty(), "--devices: an empty name in '", absl::GetFlag(FLAGS_devices),
                "'; give devices such as cuda:0,cpu");
    out.emplace_back(std::string(name));
  }
  return out;
}

// Trains `plan`'s pipeline for a few steps (SGD with momentum) and measures GPipe::step: the
// median time and the largest peak over the timed steps on the plan's first device: CPU tensor
// bytes, or on a GPU its context (the driver's bytes in use beyond the caching allocator's
// reserve) plus the allocator's peak reserved, as the planner predicts it (Note [Device
// overhead]).
Measured measure(const Model& model, const gpipe::PipelinePlan& plan, const at::Tensor& x_cpu,
                 const at::Tensor& y_cpu, int repeats, const std::string& svg) {
  const c10::Device first = plan.devices.front();
  const at::Tensor x = x_cpu.to(first);
  const at::Tensor y = y_cpu.to(plan.devices.back());
  auto synchronize = [&] {
    for (const c10::Device& d : plan.devices) gpipe::internal::synchronize(d);
  };
  // (What the profile and the configurations before cached would count in the peak reserved.)
  gpipe::internal::release_cached_memory(first);
  at::manual_seed(0);
  torch::nn::Sequential seq = model.make();
  // (Recording costs a little per task: only where the events are used.)
  const bool record = !svg.empty() || absl::GetFlag(FLAGS_detail);
  gpipe::GPipe pipe(seq, plan.options());
  pipe->record_timeline(record);
  torch::optim::SGD optimizer(pipe->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  gpipe::set_intra_op_threads(static_cast<int>(plan.threads));
  auto loss = [](const gpipe::Batch& out, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(out.tensor(), target);
  };
  MemoryMeter& meter = MemoryMeter::install();
  Measured m;
  std::vector<double> times, optimizer_times;
  auto cpu_ms = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return 1e3 * static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           1e-3 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  for (int r = 0; r < repeats + 2; ++r) {
    optimizer.zero_grad();
    synchronize();
    meter.reset_peak();
    gpipe::internal::reset_peak_memory(first);
    const double cpu_before = cpu_ms();
    const auto start = std::chrono::steady_clock::now();
    pipe->step(x, y, loss);
    synchronize();
    const double ms = gpipe_benchmarks::ms_since(start);
    if (r >= 2) {  // the first steps make the gradients and the optimizer's state
      m.cpu_ms += (cpu_ms() - cpu_before) / repeats;
      times.push_back(ms);
      int64_t peak = meter.peak();
      if (first.is_cuda()) {
        const gpipe::internal::DeviceMemoryUse use = gpipe::internal::device_memory_use(first);
        peak = (use.used - use.reserved) + use.peak_reserved;
      }
      m.peak_bytes = std::max(m.peak_bytes, peak);
    }
    const auto stepping = std::chrono::steady_clock::now();
    optimizer.step();
    synchronize();
    if (r >= 2) optimizer_times.push_back(gpipe_benchmarks::ms_since(stepping));
  }
  m.step_ms = gpipe_benchmarks::median(times);
  m.optimizer_ms = gpipe_benchmarks::median(optimizer_times);
  m.events = pipe->last_timeline();
  if (!svg.empty()) {
    gpipe::write_file(svg, gpipe::timeline_svg(pipe->last_timeline(), pipe->devices()));
    gpipe::write_file(svg.substr(0, svg.size() - 4) + ".json",
                      gpipe::chrome_trace_json(pipe->last_timeline(), pipe->devices()));
  }
  return m;
}

double error(double predicted, double measured) { return (predicted - measured) / measured; }

// --detail: the plan's costs, its predicted work against the CPU time measured, the prediction
// under processor sharing (no turns on the cores), and each partition's busy time.
void print_detail(const gpipe::PipelineProfile& profile, const gpipe::PipelinePlan& plan,
                  const gpipe::PipelineSimulation& sim, const Measured& got) {
  const gpipe::PipelineCosts costs =
      gpipe::pipeline_costs(profile, plan, gpipe::OptimizerKind::kMomentum);
  // (The zero-bubble family splits B into I and W: zb, zbv, zb1p, dualpipev.)
  const bool split = plan.schedule != ScheduleKind::kGPipe &&
                     plan.schedule != ScheduleKind::k1F1B &&
                     plan.schedule != ScheduleKind::kInterleaved;
  double work_us = 0;
  for (const gpipe::StageCost& s : costs.stages) {
    const int64_t kept = plan.chunks - costs.checkpoint_stop;  // micro-batches not checkpointed
    work_us += static_cast<double>(costs.checkpoint_stop) *
                   (s.forward_nograd_us + s.recompute_us + s.backward_us) +
               static_cast<double>(kept) *
                   (s.forward_us + (split ? s.backward_input_us + s.backward_weight_us
                                          : s.backward_us));
  }
  const int64_t v = std::max<int64_t>(1, plan.virtual_stages);
  const gpipe::Schedule schedule =
      plan.schedule_text.empty()
          ? gpipe::make_schedule(plan.schedule, static_cast<int64_t>(plan.balance.size()) / v,
                                 plan.chunks, v)
          : gpipe::parse_schedule(plan.schedule_text);
  gpipe::PipelineCosts sharing = costs;
  sharing.cores.clear();
  const double predicted_ms = sim.step_us / 1000;
  const double sharing_ms = gpipe::simulate_pipeline(schedule, sharing).step_us / 1000;
  for (const gpipe::StageCost& s : costs.stages) {
    std::printf("  stage on lane %lld: F %.0f us, B %.0f us (I %.0f, W %.0f), recompute %.0f us\n",
                static_cast<long long>(s.lane), s.forward_us, s.backward_us, s.backward_input_us,
                s.backward_weight_us, s.recompute_us);
  }
  std::printf("  predicted work %.1f ms (%.2f cores); under processor sharing %.1f ms (%+.1f%%)\n",
              work_us / 1000, work_us / 1000 / predicted_ms, sharing_ms,
              100 * error(sharing_ms, got.step_ms));
  std::printf("  predicted:\n%s  measured (CPU time %.1f ms per step, %.2f cores):\n%s",
              busy(sim.events).c_str(), got.cpu_ms, got.cpu_ms / got.step_ms,
              busy(got.events).c_str());
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 == 1 ? v[h] : (v[h - 1] + v[h]) / 2;
}

double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

// One round of one model in this process: profile, then each configuration predicted and
// measured (and, with `compare`, the defaults against the planner's pick). Prints a table and
// returns the rows as JSON.
nlohmann::json run_model(const std::string& name, bool compare, const std::string& svg_dir) {
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const std::vector<c10::Device> devices = devices_from_flag();
  const bool all_cpu = std::all_of(devices.begin(), devices.end(),
                                   [](const c10::Device& d) { return d.is_cpu(); });
  nlohmann::json rows = nlohmann::json::array();
  const Model model = find_model(name);
  at::manual_seed(0);
  std::vector<int64_t> shape{model.batch};
  shape.insert(shape.end(), model.sample.begin(), model.sample.end());
  const at::Tensor x = at::randn(shape);
  const at::Tensor y = at::randint(10, {model.batch});
  const auto started = std::chrono::steady_clock::now();
  const gpipe::PipelineProfile profile = gpipe::profile_pipeline(
      model.make(), x, devices,
      gpipe::PipelineProfileOptions()
          .timeout(std::chrono::duration<double>(absl::GetFlag(FLAGS_timeout)))
          .threads(1)
          .cores(absl::GetFlag(FLAGS_cores))
          .min_batch(model.batch / 32));
  std::vector<int64_t> sizes;
  for (const gpipe::LayerProfile& p : profile.sizes) sizes.push_back(p.batch);
  std::printf("%s: %lld layers, profiled at micro-batches of %s in %.1f s; CPU capacity "
              "%.2f workers; hand-over %.0f us; calibration %s\n",
              model.title.c_str(), static_cast<long long>(profile.layers()),
              absl::StrJoin(sizes, ", ").c_str(), gpipe_benchmarks::ms_since(started) / 1000,
              profile.cpu_capacity, profile.handoff_us,
              absl::StrJoin(profile.calibration, ", ",
                            [](std::string* out, const gpipe::PipelineProfile::Calibration& c) {
                              absl::StrAppendFormat(out, "x%.2f (I, W x%.2f) at %d", c.ratio,
                                                    c.split, c.batch);
                            })
                  .c_str());
  if (!svg_dir.empty()) {
    gpipe::write_file(svg_dir + "/" + name + "_profile.json", profile.to_json());
  }
  int index = 0;
  for (const Config& c : configs_of(name)) {
    if (c.partitions > static_cast<int64_t>(devices.size())) continue;
    gpipe::PipelinePlan plan =
        gpipe::plan(profile, gpipe::PlanOptions()
                                 .partitions({c.partitions})
                                 .chunks({c.chunks})
                                 .checkpoints({c.checkpoint})
                                 .schedules({c.schedule})
                                 .search(false)  // each row measures its named schedule
                                 .top(1))
            .front();
    if (c.searched) plan = gpipe::search_plan(profile, plan, std::min(c.partitions, c.chunks));
    gpipe::PipelinePlan predicted = plan;
    const gpipe::PipelineSimulation sim = gpipe::predict(profile, predicted);
    const std::string stem = svg_dir.empty() ? "" : absl::StrCat(svg_dir, "/", name, "_", index);
    if (!stem.empty()) {
      gpipe::write_file(stem + "_predicted.svg", gpipe::timeline_svg(sim.events, plan.devices));
      gpipe::write_file(stem + "_predicted.json",
                        gpipe::chrome_trace_json(sim.events, plan.devices));
    }
    const Measured got =
        measure(model, plan, x, y, repeats, stem.empty() ? "" : stem + "_measured.svg");
    const double pred_ms = predicted.step_us / 1000;
    const int64_t pred_bytes = predicted.peak_bytes.front();
    std::printf("%-10s %-58s %9.1f %9.1f %+6.1f%% %9.1f %9.1f %+6.1f%%\n", name.c_str(),
                plan.describe().substr(0, 58).c_str(), pred_ms, got.step_ms,
                100 * error(pred_ms, got.step_ms), mib(pred_bytes), mib(got.peak_bytes),
                100 * error(static_cast<double>(pred_bytes), static_cast<double>(got.peak_bytes)));
    if (absl::GetFlag(FLAGS_detail)) print_detail(profile, plan, sim, got);
    rows.push_back({{"model", name},
                    {"configuration", plan.describe()},
                    {"plan", nlohmann::json::parse(plan.to_json())},
                    {"predicted_ms", pred_ms},
                    {"measured_ms", got.step_ms},
                    {"predicted_optimizer_ms", predicted.optimizer_us / 1000},
                    {"measured_optimizer_ms", got.optimizer_ms},
                    {"predicted_bytes", pred_bytes},
                    {"measured_bytes", got.peak_bytes},
                    {"cpu_capacity", profile.cpu_capacity}});
    ++index;
  }
  if (compare && all_cpu && name != "mlp") {
    // The trainers' defaults: 2 CPU partitions balanced by time, 4 micro-batches, checkpoint
    // except_last, GPipe's schedule; the planner within the memory they were measured to take,
    // with at most 2 partitions as they have.
    const gpipe::PipelinePlan defaults =
        gpipe::plan(profile, gpipe::PlanOptions()
                                 .partitions({2})
                                 .chunks({4})
                                 .checkpoints({Checkpoint::kExceptLast})
                                 .schedules({ScheduleKind::kGPipe})
                                 .top(1))
            .front();
    Measured base = measure(model, defaults, x, y, repeats, "");
    const gpipe::PipelinePlan pick =
        gpipe::plan(profile, gpipe::PlanOptions().partitions({1, 2}).memory_limit(base.peak_bytes))
            .front();
    // The two alternately, three times each (the machine's speed drifts over seconds): the
    // medians.
    std::vector<double> base_ms{base.step_ms}, pick_ms;
    Measured got;
    for (int k = 0; k < 3; ++k) {
      got = measure(model, pick, x, y, repeats, "");
      pick_ms.push_back(got.step_ms);
      if (k < 2) base_ms.push_back(measure(model, defaults, x, y, repeats, "").step_ms);
    }
    base.step_ms = median_of(base_ms);
    got.step_ms = median_of(pick_ms);
    rows.push_back({{"model", name},
                    {"defaults", defaults.describe()},
                    {"defaults_ms", base.step_ms},
                    {"defaults_bytes", base.peak_bytes},
                    {"pick", pick.describe()},
                    {"pick_plan", nlohmann::json::parse(pick.to_json())},
                    {"pick_ms", got.step_ms},
                    {"pick_bytes", got.peak_bytes}});
  }
  return rows;
}

// Runs this program again for one model and one round; returns its rows (its table printed), or
// null when the run failed.
nlohmann::json spawn(const std::string& self, const std::string& name, bool compare) {
  const std::string rows_path = absl::StrCat("/tmp/gpipe-plan-accuracy-", getpid(), ".json");
  std::vector<std::string> args{self,
                                "--child=" + rows_path,
                                "--models=" + name,
                                absl::StrCat("--compare_defaults=", compare),
                                absl::StrCat("--repeats=", absl::GetFlag(FLAGS_repeats)),
                                absl::StrCat("--timeout=", absl::GetFlag(FLAGS_timeout)),
                                absl::StrCat("--cores=", absl::GetFlag(FLAGS_cores)),
                                "--devices=" + absl::GetFlag(FLAGS_devices),
                                absl::StrCat("--detail=", absl::GetFlag(FLAGS_detail)),
                                "--svg_dir=" + absl::GetFlag(FLAGS_svg_dir)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ);
  TORCH_CHECK(rc == 0, "cannot start ", self, ": error ", rc);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    // (The other models still run: on a lent GPU each minute counts.)
    std::fprintf(stderr, "plan_accuracy: the run of %s failed (status %d); its rows are left out\n",
                 name.c_str(), status);
    std::remove(rows_path.c_str());
    return nullptr;
  }
  std::ifstream in(rows_path);
  const nlohmann::json rows = nlohmann::json::parse(in);
  std::remove(rows_path.c_str());
  return rows;
}

// "median x%, worst y%" of `errors` (fractions), or "none" for no rows.
std::string summary(const std::vector<double>& errors) {
  if (errors.empty()) return "none";
  return absl::StrFormat("median %.1f%%, worst %.1f%%", 100 * median_of(errors),
                         100 * *std::max_element(errors.begin(), errors.end()));
}

}  // namespace

int main(int argc, char** argv) {
  // Each row as it is measured, also into a file: a run stopped by its time limit keeps them.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  absl::ParseCommandLine(argc, argv);
  const std::string child = absl::GetFlag(FLAGS_child);
  if (!child.empty()) {
    MemoryMeter::install();  // before any tensor (Note [Counting CPU memory])
    gpipe_benchmarks::keep_freed_memory();
    try {
      const nlohmann::json rows = run_model(absl::GetFlag(FLAGS_models),
                                            absl::GetFlag(FLAGS_compare_defaults),
                                            absl::GetFlag(FLAGS_svg_dir));
      std::ofstream(child) << rows.dump(1);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "plan_accuracy: %s\n", e.what_without_backtrace());
      return 1;
    }
    return 0;
  }
  // Each model and round in a process of its own: a process's earlier work (its heap, the
  // kernels' caches) moved the next model's profile and steps by 10-20% here.
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const std::vector<std::string> names(absl::StrSplit(absl::GetFlag(FLAGS_models), ','));
  const std::string self = "/proc/self/exe";
  struct Outcome {
    std::string model, plan;  // (one configuration over the rounds that planned it)
    nlohmann::json key;
    std::vector<double> pred_ms, meas_ms, pred_mib, meas_mib, pred_opt_ms, meas_opt_ms;
  };
  std::vector<Outcome> outcomes;
  nlohmann::json all = nlohmann::json::array();
  // (Rewritten after each model: a run stopped by its time limit keeps what it measured.)
  auto write_json = [&all] {
    const std::string path = absl::GetFlag(FLAGS_json_out);
    if (path.empty()) return;
    // (Renamed into place: a run stopped while writing leaves the previous file whole.)
    std::ofstream(path + ".part") << all.dump(1) << "\n";
    std::rename((path + ".part").c_str(), path.c_str());
  };
  std::vector<std::string> comparisons;
  bool failed = false;
  try {
    for (int round = 0; round < rounds; ++round) {
      std::printf("round %d\n%-10s %-58s %9s %9s %7s %9s %9s %7s\n", round + 1, "model",
                  "configuration", "pred ms", "meas ms", "error", "pred MiB", "meas MiB", "error");
      std::vector<double> time_errors, memory_errors;
      for (const std::string& name : names) {
        const bool last = round + 1 == rounds;
        nlohmann::json rows = spawn(self, name, last && absl::GetFlag(FLAGS_compare_defaults));
        if (rows.is_null()) {
          failed = true;
          continue;
        }
        for (nlohmann::json& row : rows) {
          row["round"] = round + 1;
          all.push_back(row);
          if (row.contains("defaults")) {
            const double base = row["defaults_ms"].get<double>();
            const double pick = row["pick_ms"].get<double>();
            comparisons.push_back(absl::StrFormat(
                "%s: defaults (%s) measured %.1f ms, %.1f MiB; the planner's pick within %.1f "
                "MiB (%s) measured %.1f ms, %.1f MiB: %.2fx the defaults' speed",
                name, row["defaults"].get<std::string>(), base,
                mib(row["defaults_bytes"].get<int64_t>()),
                mib(row["defaults_bytes"].get<int64_t>()), row["pick"].get<std::string>(), pick,
                mib(row["pick_bytes"].get<int64_t>()), base / pick));
            continue;
          }
          const double pm = row["predicted_ms"], mm = row["measured_ms"];
          const double pb = mib(row["predicted_bytes"]), mb = mib(row["measured_bytes"]);
          time_errors.push_back(std::abs(error(pm, mm)));
          memory_errors.push_back(std::abs(error(pb, mb)));
          // (The same configuration: the plan's file without its predictions.)
          nlohmann::json key = row["plan"];
          key.erase("predicted");
          auto it = std::find_if(outcomes.begin(), outcomes.end(), [&](const Outcome& o) {
            return o.model == name && o.key == key;
          });
          if (it == outcomes.end()) {
            outcomes.emplace_back();
            outcomes.back().model = name;
            outcomes.back().plan = row["configuration"].get<std::string>();
            outcomes.back().key = std::move(key);
            it = outcomes.end() - 1;
          }
          Outcome& o = *it;
          o.pred_ms.push_back(pm);
          o.meas_ms.push_back(mm);
          o.pred_mib.push_back(pb);
          o.meas_mib.push_back(mb);
          o.pred_opt_ms.push_back(row["predicted_optimizer_ms"].get<double>());
          o.meas_opt_ms.push_back(row["measured_optimizer_ms"].get<double>());
        }
        write_json();
      }
      std::printf("round %d, %zu configurations: time error %s; memory error %s\n\n", round + 1,
                  time_errors.size(), summary(time_errors).c_str(),
                  summary(memory_errors).c_str());
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "plan_accuracy: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "plan_accuracy: %s\n", e.what());
    return 1;
  }
  // The medians over rounds, side by side.
  // (The optimizer's step after each step, SGD with momentum: Note [The optimizer's step].)
  std::printf("medians over %d round(s)\n%-10s %-58s %9s %9s %7s %9s %9s %7s %8s %8s %7s\n",
              rounds, "model", "configuration", "pred ms", "meas ms", "error", "pred MiB",
              "meas MiB", "error", "pred opt", "meas opt", "error");
  std::vector<double> time_errors, memory_errors, optimizer_errors;
  for (const Outcome& o : outcomes) {
    const double pm = median_of(o.pred_ms), mm = median_of(o.meas_ms);
    const double pb = median_of(o.pred_mib), mb = median_of(o.meas_mib);
    const double po = median_of(o.pred_opt_ms), mo = median_of(o.meas_opt_ms);
    time_errors.push_back(std::abs(error(pm, mm)));
    memory_errors.push_back(std::abs(error(pb, mb)));
    optimizer_errors.push_back(std::abs(error(po, mo)));
    std::printf("%-10s %-58s %9.1f %9.1f %+6.1f%% %9.1f %9.1f %+6.1f%% %8.2f %8.2f %+6.1f%%\n",
                o.model.c_str(), o.plan.substr(0, 58).c_str(), pm, mm, 100 * error(pm, mm), pb, mb,
                100 * error(pb, mb), po, mo, 100 * error(po, mo));
  }
  std::printf("\n%zu configurations: time error %s; memory error %s\n", time_errors.size(),
              summary(time_errors).c_str(), summary(memory_errors).c_str());
  std::printf("the optimizer's step after it: error %s\n", summary(optimizer_errors).c_str());
  for (const std::string& line : comparisons) std::printf("%s\n", line.c_str());
  write_json();
  return failed ? 1 : 0;
}
