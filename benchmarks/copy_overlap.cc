// How much of the copies between a GPU and the CPU run while that GPU computes another
// micro-batch (Note [Links on copy streams] in gpipe/internal/link.h, Note [Copy streams] in
// gpipe/internal/copy.h): a {cuda:0, cpu} and a {cpu, cuda:0} pipeline of 2048-wide layers (eight
// Linear layers on the GPU, a Tanh on the CPU) under GPipe::step with GPipe's schedule and 1F1B,
// and through forward() and the loss's backward(), from the device times of the last step's
// timeline (of the activations' copies: the gradients' are not recorded), with copies from the
// CPU staged in pinned memory (the default) and from pageable memory. On the compute stream no
// copy could overlap its GPU's computation (0%). "lag" is the host time from when the first
// activation copy was ready to read (issued, or to the CPU landed) to the receiving partition's
// first forward: how long the receiving lane took to start (Note [Dividing the cores] in gpipe/worker.h); with
// --cores=engine,libtorch each pipeline runs also with every thread count as LibTorch starts it
// (the engine's division off).
// Needs a GPU; writes each configuration's timeline as SVG and Chrome-trace JSON with --trace_dir.
//
//   copy_overlap --chunks=8 --rows=4096 --steps=9 --rounds=3 --trace_dir=/tmp/overlap
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "benchmarks/timing.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/copy.h"
#include "gpipe/internal/stream.h"
#include "gpipe/worker.h"
#include "gpipe/trace.h"

ABSL_FLAG(std::string, schedules, "gpipe,1f1b,forward",
          "schedules to run under step(), and \"forward\": forward() + backward()");
ABSL_FLAG(int64_t, chunks, 8, "micro-batches per step");
ABSL_FLAG(int64_t, rows, 4096, "samples per step");
ABSL_FLAG(int64_t, width, 2048, "features of each Linear layer");
ABSL_FLAG(int, steps, 5, "timed steps per configuration (the median is reported)");
ABSL_FLAG(int, rounds, 1, "times to run every configuration, in turn");
ABSL_FLAG(std::string, trace_dir, "", "write each configuration's last timeline here (SVG, JSON)");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file");
ABSL_FLAG(std::string, cores, "engine",
          "thread counts to run with: engine (the engine divides the cores), libtorch (as "
          "LibTorch starts them), or both, comma-separated");

namespace {

namespace nn = torch::nn;
using gpipe::TimelineEvent;

// Eight Linear layers on the GPU and one elementwise layer on the CPU: the copies are long enough
// to be seen beside computation, and the GPU computes longer than the CPU takes to produce (or
// consume) a micro-batch, so that the GPU does not wait idle for the next copy (with three Linear
// layers on an H100 it did: then no copy can overlap computation that has already ended).
std::pair<nn::Sequential, std::vector<int64_t>> make_model(bool gpu_first, int64_t w) {
  torch::manual_seed(0);
  nn::Sequential seq;
  if (!gpu_first) seq->push_back(nn::Tanh());
  for (int k = 0; k < 8; ++k) {
    seq->push_back(nn::Linear(w, w));
    seq->push_back(nn::ReLU());
  }
  if (gpu_first) seq->push_back(nn::Tanh());
  return {seq, gpu_first ? std::vector<int64_t>{16, 1} : std::vector<int64_t>{1, 16}};
}

struct Result {
  std::string name;
  double step_ms = 0;
  gpipe::CopyOverlap overlap;
  double lag_ms = -1;  // -1: no copy into partition 1 recorded
};

// The host time from the first activation copy into partition 1 (its issue's end, or where it
// was measured on the GPU, its landing, whichever came later: a copy to the CPU is read once it
// has landed) to partition 1's first forward.
double receiver_lag_ms(const std::vector<TimelineEvent>& events) {
  double copied = -1, computed = -1;
  for (const TimelineEvent& e : events) {
    if (e.partition != 1) continue;
    const double ready = std::max(e.end_us, e.has_device_times() ? e.device_end_us : e.end_us);
    if (e.kind == TimelineEvent::Kind::kCopy && (copied < 0 || ready < copied)) copied = ready;
    if (e.kind == TimelineEvent::Kind::kCompute && (computed < 0 || e.start_us < computed)) {
      computed = e.start_us;
    }
  }
  return copied < 0 || computed < 0 ? -1 : (computed - copied) / 1e3;
}

// `pinned`: whether activations and gradients from the CPU are staged in pinned memory (the
// default), or copied from pageable memory as LibTorch's `to()` does.
// `engine_cores`: whether the engine divides the cores (else LibTorch's thread counts stay).
// `schedule` "forward": forward() and the loss's backward() (GPipe's order), else step().
Result run(const std::string& schedule, bool gpu_first, bool pinned, bool engine_cores) {
  const bool through_forward = schedule == "forward";
  gpipe::internal::set_pinned_staging(pinned);
  gpipe::internal::set_core_share(engine_cores);
  const int64_t w = absl::GetFlag(FLAGS_width), rows = absl::GetFlag(FLAGS_rows);
  const c10::Device gpu("cuda:0");
  const std::vector<c10::Device> devices =
      gpu_first ? std::vector<c10::Device>{gpu, at::kCPU} : std::vector<c10::Device>{at::kCPU, gpu};
  auto [model, balance] = make_model(gpu_first, w);
  gpipe::GPipe pipe(model, gpipe::GPipeOptions(balance)
                               .devices(devices)
                               .chunks(absl::GetFlag(FLAGS_chunks))
                               .checkpoint(gpipe::Checkpoint::kNever)
                               .schedule(gpipe::schedule_kind(
                                   through_forward ? std::string("gpipe") : schedule)));
  pipe->record_timeline(true);
  const auto loss = [](const gpipe::Batch& out, const at::Tensor& target) {
    return (out[0] - target.to(out[0].device())).pow(2).mean();
  };
  const at::Tensor x = at::randn({rows, w}, devices.front());
  const at::Tensor y = at::randn({rows, w});
  Result r;
  r.name = absl::StrFormat("%s {%s, %s} %s%s", schedule, devices[0].str(), devices[1].str(),
                           pinned ? "pinned" : "pageable", engine_cores ? "" : " libtorch");
  r.step_ms = gpipe_benchmarks::median_ms(
      [&] {
        for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
        if (through_forward) {
          loss(gpipe::Batch(pipe->forward(x)), y).backward();
        } else {
          pipe->step(x, y, loss);
        }
        gpipe::internal::synchronize(gpu);
      },
      absl::GetFlag(FLAGS_steps), /*warmup=*/true);
  r.overlap = gpipe::copy_overlap(pipe->last_timeline(), devices);
  r.lag_ms = receiver_lag_ms(pipe->last_timeline());
  const std::string dir = absl::GetFlag(FLAGS_trace_dir);
  if (!dir.empty()) {
    const std::string stem = absl::StrFormat("%s/%s_%s_%s%s", dir, schedule,
                                             gpu_first ? "gpu_cpu" : "cpu_gpu",
                                             pinned ? "pinned" : "pageable",
                                             engine_cores ? "" : "_libtorch");
    gpipe::write_file(stem + ".svg", gpipe::timeline_svg(pipe->last_timeline(), devices));
    gpipe::write_file(stem + ".json", gpipe::chrome_trace_json(pipe->last_timeline(), devices));
  }
  return r;
}

// What the lanes' threads run on: the CPUs of the affinity mask, all the system's, LibTorch's
// intra-op threads (its default) and a cgroup's CPU quota, if any.
void print_cpus() {
  cpu_set_t set;
  const int mask = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : -1;
  std::string quota = "none";
  if (std::ifstream f("/sys/fs/cgroup/cpu.max"); f) std::getline(f, quota);
  std::printf("cpus: %d in the affinity mask, %u in the system; intra-op threads %d (default "
              "%d); cgroup cpu.max: %s\n",
              mask, std::thread::hardware_concurrency(), at::get_num_threads(),
              at::intraop_default_num_threads(), quota.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  print_cpus();
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "copy_overlap needs a GPU; none is visible\n");
    return 1;
  }
  gpipe_benchmarks::keep_freed_memory();
  std::vector<bool> cores;
  for (const absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_cores), ',')) {
    if (c != "engine" && c != "libtorch") {
      std::fprintf(stderr, "--cores: unknown '%s'; give engine, libtorch or both\n",
                   std::string(c).c_str());
      return 1;
    }
    cores.push_back(c == "engine");
  }
  std::vector<Result> results;
  std::printf("%-43s %9s %12s %12s %9s\n", "pipeline", "step ms", "copies ms", "overlapped",
              "lag ms");
  const std::vector<std::string> schedules = absl::StrSplit(absl::GetFlag(FLAGS_schedules), ',');
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (const std::string& schedule : schedules) {
      for (const bool gpu_first : {true, false}) {
        for (const bool pinned : {true, false}) {
          for (const bool engine_cores : cores) {
            const Result r = run(schedule, gpu_first, pinned, engine_cores);
            std::printf("%-43s %9.2f %12.2f %11.1f%% %9.2f\n", r.name.c_str(), r.step_ms,
                        r.overlap.copy_us / 1e3,
                        100 * r.overlap.overlapped_us / r.overlap.copy_us, r.lag_ms);
            std::fflush(stdout);
            results.push_back(r);
          }
        }
      }
    }
  }
  gpipe::internal::set_core_share(true);
  if (const std::string out = absl::GetFlag(FLAGS_json_out); !out.empty()) {
    std::string json = "[";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      json += absl::StrFormat(
          "%s\n {\"pipeline\": \"%s\", \"step_ms\": %.3f, \"copy_ms\": %.3f, "
          "\"overlapped_ms\": %.3f, \"lag_ms\": %.3f}",
          i ? "," : "", r.name, r.step_ms, r.overlap.copy_us / 1e3, r.overlap.overlapped_us / 1e3,
          r.lag_ms);
    }
    gpipe::write_file(out, json + "\n]\n");
  }
  return 0;
}
