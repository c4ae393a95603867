// Every schedule of GPipe::step on 2 CPU partitions (one worker and one intra-op thread each):
// step time against the same micro-batches' forward and backward on one thread, as a fraction of
// the schedule's ideal, and the peak memory of the activations, each configuration in a child
// process of its own. With --device=cuda every partition is on cuda:0 (and the one-thread
// baseline too): the step time against the plain model's and the activations' peak from LibTorch's
// CUDA allocator. Results: docs/benchmarks.md.
//
//   bazel run -c opt //benchmarks:schedule_efficiency -- --microbatches=4,8,16,32
//   schedule_efficiency --device=cuda --width=2048 --batch=8192
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "benchmarks/reference_runner.h"
#include "benchmarks/timing.h"
#include "gpipe/gpipe.h"
#include "gpipe/schedule_check.h"
#include "gpipe/internal/stream.h"
#include "gpipe/worker.h"

ABSL_FLAG(std::string, schedules, "gpipe,1f1b,interleaved,zb,zbv,zb1p,dualpipev",
          "schedules to run");
ABSL_FLAG(std::string, microbatches, "4,8,16,32", "micro-batches per mini-batch");
ABSL_FLAG(int64_t, batch, 1024, "samples per mini-batch");
ABSL_FLAG(int64_t, width, 512, "features of each of the 8 Linear layers");
ABSL_FLAG(int, steps, 5, "timed steps per configuration (the median is reported)");
ABSL_FLAG(std::string, device, "cpu",
          "cpu (2 partitions, a core each) or cuda (every partition on cuda:0)");

namespace {

constexpr int64_t kLayers = 8;  // Linear + ReLU each: 16 modules

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  const int64_t w = absl::GetFlag(FLAGS_width);
  for (int64_t k = 0; k < kLayers; ++k) {
    seq->push_back(torch::nn::Linear(w, w));
    seq->push_back(torch::nn::ReLU());
  }
  return seq;
}

at::Tensor mse(const gpipe::Batch& out, const at::Tensor& target) {
  return (out[0] - target).pow(2).mean();
}

bool on_cuda() {
  const std::string device = absl::GetFlag(FLAGS_device);
  TORCH_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, not '", device,
              "'");
  return device == "cuda";
}

// One configuration: prints "ms <median step ms>" (and on CUDA "peak <bytes allocated>").
int child(const std::string& config) {
  gpipe_benchmarks::keep_freed_memory();
  const std::vector<std::string> parts = absl::StrSplit(config, ':');
  int64_t m = 0;
  TORCH_CHECK(parts.size() == 2 && absl::SimpleAtoi(parts[1], &m), "bad --child ", config);
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  const int64_t w = absl::GetFlag(FLAGS_width);
  const c10::Device device = on_cuda() ? c10::Device("cuda:0") : c10::Device(c10::kCPU);
  torch::manual_seed(1);
  const at::Tensor x = at::randn({batch, w}).to(device);
  const at::Tensor y = at::randn({batch, w}).to(device);
  if (!on_cuda()) gpipe::set_intra_op_threads(1);
  torch::nn::Sequential model = make_model();
  model->to(device);
  if (parts[0] == "idle") {
    std::printf("ms 0\n");
    return 0;
  }
  std::function<void()> step;
  std::unique_ptr<gpipe::GPipe> pipe;
  if (parts[0] == "plain") {
    // The same micro-batches, one after the other, on this thread.
    step = [&] {
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      const std::vector<at::Tensor> xs = x.chunk(m), ys = y.chunk(m);
      for (size_t i = 0; i < xs.size(); ++i) {
        (mse(gpipe::Batch(model->forward(xs[i])), ys[i]) *
         (static_cast<double>(xs[i].size(0)) / batch)).backward();
      }
    };
  } else {
    const gpipe::ScheduleKind kind = gpipe::schedule_kind(parts[0]);
    // Interleaved, zb1p, zbv and dualpipev: two stages per rank, each half of a rank's layers.
    const bool interleaved = gpipe::takes_virtual_stages(kind) || gpipe::v_shaped(kind);
    const std::vector<int64_t> balance =
        interleaved ? std::vector<int64_t>{4, 4, 4, 4} : std::vector<int64_t>{8, 8};
    pipe = std::make_unique<gpipe::GPipe>(
        model, gpipe::GPipeOptions(balance)
                   .devices(std::vector<c10::Device>(balance.size(), device))
                   .chunks(m)
                   .checkpoint(gpipe::Checkpoint::kNever)
                   .schedule(gpipe::PipelineSchedule::of(
                       kind, gpipe::takes_virtual_stages(kind) ? 2 : 1)));
    (*pipe)->record_timeline(true);
    step = [&] {
      for (auto& p : (*pipe)->parameters()) p.mutable_grad() = at::Tensor();
      (*pipe)->step(x, y, mse);
    };
  }
  // On CUDA a step ends when the device has finished its work.
  const std::function<void()> timed = [&] {
    step();
    gpipe::internal::synchronize(device);
  };
  std::printf("ms %.3f\n", gpipe_benchmarks::median_ms(timed, absl::GetFlag(FLAGS_steps),
                                                  /*warmup=*/true));
  if (on_cuda()) {
    std::printf("peak %lld\n",
                static_cast<long long>(gpipe::internal::peak_memory_allocated(device)));
  }
  if (pipe) {
    // The last step's bubble on its timeline: the lanes' idle share of the step.
    double first = 1e300, last = 0, busy = 0;
    for (const gpipe::TimelineEvent& e : (*pipe)->last_timeline()) {
      first = std::min(first, e.start_us);
      last = std::max(last, e.end_us);
      busy += e.end_us - e.start_us;
    }
    std::printf("bubble %.4f\n", 1 - busy / (2 * (last - first)));
  }
  return 0;
}

// The value after "<key> " in a child's output.
double value_of(const std::string& output, const std::string& key) {
  double v = 0;
  const size_t at = output.find(key + " ");
  TORCH_CHECK(at != std::string::npos, "no ", key, " in: ", output);
  const size_t from = at + key.size() + 1;
  TORCH_CHECK(absl::SimpleAtod(output.substr(from, output.find('\n', at) - from), &v), "bad ",
              key, " in: ", output);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_child).empty()) return child(absl::GetFlag(FLAGS_child));
  const std::string self = "/proc/self/exe";
  const std::vector<std::string> args{
      absl::StrCat("--batch=", absl::GetFlag(FLAGS_batch)),
      absl::StrCat("--width=", absl::GetFlag(FLAGS_width)),
      absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps)),
      absl::StrCat("--device=", absl::GetFlag(FLAGS_device))};
  const auto run = [&](const std::string& config) {
    return gpipe::bench::spawn_child(self, config, args);
  };
  const bool cuda = on_cuda();
  const int64_t idle = cuda ? 0 : run("idle:1").second;
  const int64_t w = absl::GetFlag(FLAGS_width);
  const double model_mib = 2.0 * kLayers * (w * w + w) * 4 / 1048576.0;  // parameters + grads
  // On CUDA the inputs and targets are in the allocator's count too.
  const double inputs_mib = 2.0 * absl::GetFlag(FLAGS_batch) * w * 4 / 1048576.0;
  if (cuda) {
    std::printf("GPipe::step with every partition on cuda:0, 8 x Linear(%lld) + ReLU, batch "
                "%lld, checkpointing off; LibTorch %s. 1 GPU = the plain model's step on cuda:0 "
                "(the same micro-batches one after the other); vs 1 GPU = its time / the step's "
                "(no speed-up is possible: one device); activations = peak allocated - parameters "
                "and gradients (%.0f MiB) - inputs and targets (%.0f MiB)\n\n",
                static_cast<long long>(w), static_cast<long long>(absl::GetFlag(FLAGS_batch)),
                TORCH_VERSION, model_mib, inputs_mib);
  } else {
    std::printf("GPipe::step on 2 CPU partitions (one worker, one intra-op thread each), 8 x "
              "Linear(%lld) + ReLU, batch %lld, checkpointing off; LibTorch %s. ideal = one "
              "thread's time / 2 / (1 - the schedule's simulated bubble, F = I = W = 1); "
              "measured bubble = idle share of the lanes in the last step's timeline; activations = peak "
              "resident - idle process - parameters and gradients (%.0f MiB)"
              "\n\n",
              static_cast<long long>(w), static_cast<long long>(absl::GetFlag(FLAGS_batch)),
              TORCH_VERSION, model_mib);
  }
  std::printf("%-12s %4s %10s %10s %9s %9s %9s %16s\n", "schedule", "m", "step ms",
              cuda ? "1 GPU" : "1 thread", "bubble", "measured", cuda ? "vs 1 GPU" : "of ideal",
              "activations MiB");
  // (--child, from reference_runner.h: one configuration, "schedule:m" or "plain:m".)
  for (const std::string& mb :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_microbatches), ','))) {
    int64_t m = 0;
    TORCH_CHECK(absl::SimpleAtoi(mb, &m), "bad --microbatches entry ", mb);
    const double one = value_of(run(absl::StrCat("plain:", m)).first, "ms");
    for (const std::string& name :
         std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_schedules), ','))) {
      const gpipe::ScheduleKind kind = gpipe::schedule_kind(name);
      const gpipe::Schedule schedule = gpipe::make_schedule(
          kind, 2, m, /*virtual_stages=*/gpipe::takes_virtual_stages(kind) ? 2 : 1);
      const double bubble = gpipe::simulate_schedule(schedule).bubble;
      const auto [output, peak] = run(absl::StrCat(name, ":", m));
      const double ms = value_of(output, "ms");
      // (On one GPU the partitions' kernels overlap on their streams: the lanes' busy time then
      // exceeds the step and says nothing of a bubble.)
      const double measured = cuda ? std::nan("") : value_of(output, "bubble");
      const double ideal = cuda ? one : one / 2 / (1 - bubble);
      const double activations =
          cuda ? value_of(output, "peak") / 1048576.0 - model_mib - inputs_mib
               : (peak - idle) / 1048576.0 - model_mib;
      std::printf("%-12s %4lld %10.1f %10.1f %8.1f%% %8.1f%% %8.0f%% %16.1f\n", name.c_str(),
                  static_cast<long long>(m), ms, one, 100 * bubble, 100 * measured,
                  100 * ideal / ms, activations);
      std::fflush(stdout);
    }
  }
  return 0;
}
