// The runner behind the reference's benchmarks (resnet101_speed, amoebanetd_speed,
// amoebanetd_memory, unet_memory): experiments as torchgpipe's benchmarks define them, run at full
// size on CUDA devices or at a reduced size on the CPU, each printed as a table and JSON.
//
// Speed: training epochs over a synthetic data set (the same random batch every step, as the
// reference), throughput per epoch, the first epochs skipped, the rest averaged.
// Memory: each experiment in a fresh child process (this program again, with --child), two
// training iterations; the peak memory of each device from LibTorch's allocator (CUDA), or the
// child's peak resident memory (CPU: every partition shares it), less an idle child's.
#pragma once

#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "benchmarks/timing.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/partition.h"
#include "gpipe/skip_layout.h"
#include "gpipe/internal/stream.h"
#include "gpipe/worker.h"

extern char** environ;

// The flags every reference benchmark takes (each program is one translation unit).
ABSL_FLAG(std::string, size, "auto", "full (CUDA), reduced (CPU), or auto (full where CUDA is)");
ABSL_FLAG(std::string, experiments, "", "run only these, comma-separated (default: all)");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file");
ABSL_FLAG(bool, stage_local_backward, true,
          "CPU pipelines: each partition runs its own backward on its worker "
          "(Note [Stage-local backward in one process]; false: the one graph)");
ABSL_FLAG(std::string, child, "",
          "memory benchmarks, internal: run this one experiment and report (\"idle\": nothing)");

namespace gpipe {
namespace bench {

/// One experiment: a model, and either the plain model on one device (empty balance: the
/// reference's baseline) or a GPipe with a balance over devices 0 ... n-1.
struct Experiment {
  std::string name;
  std::function<torch::nn::Sequential()> make;
  std::vector<int64_t> balance;
  int64_t batch = 1;
  int64_t chunks = 1;
  Checkpoint checkpoint = Checkpoint::kExceptLast;
  std::vector<int64_t> sample_shape;  // one input sample (C x H x W)
  /// Classes of the cross-entropy target, or 0 for a segmentation target shaped as the output
  /// (binary cross-entropy with logits).
  int64_t classes = 1000;
  bool rmsprop = false;  // else SGD(lr = 0.1), as the reference
};

/// The devices of an experiment: cuda:0 ... cuda:n-1 on CUDA, else the CPU n times.
inline std::vector<c10::Device> devices_for(const Experiment& e, bool cuda) {
  const size_t n = std::max<size_t>(e.balance.size(), 1);
  std::vector<c10::Device> devices;
  for (size_t j = 0; j < n; ++j) {
    devices.push_back(cuda ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(j))
                           : c10::Device(c10::kCPU));
  }
  return devices;
}

/// A training step's pieces for an experiment: the model (plain or GPipe), input, target, loss.
struct Setup {
  torch::nn::Sequential plain{nullptr};
  GPipe pipe{nullptr};
  at::Tensor input, target;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::vector<c10::Device> devices;
  bool segmentation;  // binary cross-entropy against a mask, else cross-entropy against classes
  bool stage_local = false;  // GPipe::stage_local_backward()
  int64_t parameters = 0;

  Setup(const Experiment& e, bool cuda)
      : devices(devices_for(e, cuda)), segmentation(e.classes == 0) {
    at::manual_seed(0);
    torch::nn::Sequential model = e.make();
    const bool cpu_pipeline = !cuda && e.balance.size() > 1;
    if (e.balance.empty()) {
      plain = model;
      plain->to(devices.front());
    } else {
      stage_local = cpu_pipeline && absl::GetFlag(FLAGS_stage_local_backward);
      pipe = GPipe(model,
                   gpipe::internal::with_stage_local_backward(
                       gpipe::internal::with_partition_threads(GPipeOptions(e.balance)
                                                                   .devices(devices)
                                                                   .chunks(e.chunks)
                                                                   .checkpoint(e.checkpoint),
                                                               cpu_pipeline),
                       stage_local));
    }
    std::vector<at::Tensor> params = plain ? plain->parameters() : pipe->parameters();
    for (const at::Tensor& p : params) parameters += p.numel();
    if (e.rmsprop) {
      optimizer = std::make_unique<torch::optim::RMSprop>(params);
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
    }
    std::vector<int64_t> shape{e.batch};
    shape.insert(shape.end(), e.sample_shape.begin(), e.sample_shape.end());
    input = at::rand(shape).to(devices.front());
    if (!segmentation) {
      target = at::randint(e.classes, {e.batch}, at::kLong).to(devices.back());
    }
  }

  void step() {
    at::Tensor out = plain ? plain->forward(input) : pipe->forward(input);
    at::Tensor loss;
    if (segmentation) {
      // A random mask shaped as the output, drawn at the first step (the output's shape is the
      // model's to say).
      if (!target.defined()) target = at::rand_like(out);
      loss = at::binary_cross_entropy_with_logits(out, target);
    } else {
      loss = at::cross_entropy_loss(out, target);
    }
    loss.backward();
    optimizer->step();
    optimizer->zero_grad();
  }
};

inline void synchronize_all(const std::vector<c10::Device>& devices) {
  for (const c10::Device& d : devices) gpipe::internal::synchronize(d);
}

inline std::string device_list(const std::vector<c10::Device>& devices) {
  return absl::StrJoin(devices, ",", [](std::string* s, const c10::Device& d) {
    s->append(d.str());
  });
}

/// Keeps freed memory (glibc's return of it to the system costs page faults every step) and, on
/// the CPU, divides the cores among the partitions.
inline void prepare_process(const Experiment& e, bool cuda) {
  gpipe_benchmarks::keep_freed_memory();  // Note [Keeping freed memory]
  if (!cuda) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    set_intra_op_threads(std::max<int>(1, cores / static_cast<int>(std::max<size_t>(
                                                                  e.balance.size(), 1))));
  }
}

/// Runs the speed experiments; prints a table and JSON (also to `json_out` when not empty).
inline void run_speed(const std::string& title, const std::vector<Experiment>& experiments,
                      bool cuda, int64_t dataset_size, int epochs, int skip_epochs,
                      const std::string& json_out) {
  std::printf("%s, on %s; LibTorch %s; %lld samples per epoch, %d epochs, the first %d skipped\n\n",
              title.c_str(), cuda ? "CUDA" : "the CPU", TORCH_VERSION,
              static_cast<long long>(dataset_size), epochs, skip_epochs);
  std::printf("%-12s %9s %6s %7s %-26s %-11s %14s %9s\n", "experiment", "partitions", "chunks",
              "batch", "devices", "backward", "samples/s", "speed-up");
  std::vector<std::string> json;
  double first = 0;
  for (const Experiment& e : experiments) {
    prepare_process(e, cuda);
    Setup setup(e, cuda);
    std::vector<double> throughputs;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      synchronize_all(setup.devices);
      const auto start = std::chrono::steady_clock::now();
      for (int64_t done = 0; done < dataset_size; done += e.batch) setup.step();
      synchronize_all(setup.devices);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (epoch >= skip_epochs) throughputs.push_back(dataset_size / seconds);
    }
    double mean = 0;
    for (double t : throughputs) mean += t / throughputs.size();
    if (first == 0) first = mean;
    const char* backward = setup.stage_local ? "stage-local" : "one thread";
    if (cuda) backward = "engine";  // the autograd engine's device threads
    std::printf("%-12s %9zu %6lld %7lld %-26s %-11s %14.3f %8.3fx\n", e.name.c_str(),
                std::max<size_t>(e.balance.size(), 1), static_cast<long long>(e.chunks),
                static_cast<long long>(e.batch), device_list(setup.devices).c_str(), backward,
                mean, mean / first);
    std::fflush(stdout);
    json.push_back(absl::StrFormat(
        "{\"experiment\": \"%s\", \"partitions\": %d, \"balance\": [%s], \"chunks\": %d, "
        "\"batch\": %d, \"devices\": \"%s\", \"stage_local_backward\": %s, "
        "\"samples_per_second\": %.3f, \"speedup\": %.3f}",
        e.name, std::max<size_t>(e.balance.size(), 1), absl::StrJoin(e.balance, ", "), e.chunks,
        e.batch, device_list(setup.devices), setup.stage_local ? "true" : "false", mean,
        mean / first));
  }
  const std::string text = absl::StrCat("[\n  ", absl::StrJoin(json, ",\n  "), "\n]\n");
  std::printf("\n%s", text.c_str());
  if (!json_out.empty()) std::ofstream(json_out) << text;
}

/// In a child process: runs experiment `e` for two iterations and prints each device's peak
/// (CUDA) and the parameter count as "gpipe-memory:" lines. Null: the idle child (kIdle).
inline int memory_child(const Experiment* e, bool cuda) {
  if (e == nullptr) return 0;
  prepare_process(*e, cuda);
  Setup setup(*e, cuda);
  for (int k = 0; k < 2; ++k) setup.step();
  synchronize_all(setup.devices);
  std::printf("gpipe-memory: parameters %lld\n", static_cast<long long>(setup.parameters));
  if (cuda) {
    for (const c10::Device& d : devices_for(*e, cuda)) {
      std::printf("gpipe-memory: device %s %lld\n", d.str().c_str(),
                  static_cast<long long>(gpipe::internal::peak_memory_allocated(d)));
    }
  }
  return 0;
}

/// The name of the child process that runs nothing (its memory is the baseline).
constexpr const char* kIdle = "idle";

/// Runs `self --child=<name> <args>` and returns its output and peak resident bytes.
inline std::pair<std::string, int64_t> spawn_child(const std::string& self, const std::string& name,
                                                   const std::vector<std::string>& args) {
  const std::string out_path = absl::StrCat("/tmp/gpipe-memory-", getpid(), ".txt");
  std::vector<std::string> argv_s{self, "--child=" + name};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  TORCH_CHECK(rc == 0, "cannot start ", self, ": error ", rc);
  int status = 0;
  struct rusage usage {};
  wait4(pid, &status, 0, &usage);
  std::ifstream in(out_path);
  std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(out_path.c_str());
  TORCH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child for ", name,
              " failed (status ", status, "):\n", output);
  return {output, static_cast<int64_t>(usage.ru_maxrss) * 1024};
}

/// Runs the memory experiments, each in a child process; prints a table and JSON.
inline void run_memory(const std::string& title, const std::vector<Experiment>& experiments,
                       bool cuda, double param_scale, const std::string& self,
                       const std::vector<std::string>& child_args, const std::string& json_out) {
  std::printf("%s, on %s; LibTorch %s; 2 training iterations per experiment, each in its own "
              "process; model memory = parameter bytes x %.0f\n\n",
              title.c_str(), cuda ? "CUDA" : "the CPU", TORCH_VERSION, param_scale);
  const int64_t idle = cuda ? 0 : spawn_child(self, kIdle, child_args).second;
  if (!cuda) {
    std::printf("(CPU: peak resident memory of the whole process, less an idle process's %.0f "
                "MiB)\n",
                idle / 1048576.0);
  }
  std::printf("%-12s %9s %6s %6s %14s %14s %14s %16s\n", "experiment", "partitions", "chunks",
              "batch", "parameters", "model MiB", "total MiB", "activations MiB");
  std::vector<std::string> json;
  for (const Experiment& e : experiments) {
    auto [output, rss] = spawn_child(self, e.name, child_args);
    int64_t parameters = 0;
    int64_t total = 0;
    for (absl::string_view line : absl::StrSplit(output, '\n')) {
      long long value = 0;
      char device[64];
      if (std::sscanf(std::string(line).c_str(), "gpipe-memory: parameters %lld", &value) == 1) {
        parameters = value;
      } else if (std::sscanf(std::string(line).c_str(), "gpipe-memory: device %63s %lld", device,
                             &value) == 2) {
        total += value;
      }
    }
    if (!cuda) total = rss - idle;
    const double model_bytes = parameters * 4.0 * param_scale;
    std::printf("%-12s %9zu %6lld %6lld %14lld %14.1f %14.1f %16.1f\n", e.name.c_str(),
                std::max<size_t>(e.balance.size(), 1), static_cast<long long>(e.chunks),
                static_cast<long long>(e.batch), static_cast<long long>(parameters),
                model_bytes / 1048576.0, total / 1048576.0, (total - model_bytes) / 1048576.0);
    std::fflush(stdout);
    json.push_back(absl::StrFormat(
        "{\"experiment\": \"%s\", \"partitions\": %d, \"balance\": [%s], \"chunks\": %d, "
        "\"batch\": %d, \"parameters\": %d, \"model_bytes\": %.0f, \"total_bytes\": %d, "
        "\"activation_bytes\": %.0f}",
        e.name, std::max<size_t>(e.balance.size(), 1), absl::StrJoin(e.balance, ", "), e.chunks,
        e.batch, parameters, model_bytes, total, total - model_bytes));
  }
  const std::string text = absl::StrCat("[\n  ", absl::StrJoin(json, ",\n  "), "\n]\n");
  std::printf("\n%s", text.c_str());
  if (!json_out.empty()) std::ofstream(json_out) << text;
}

/// The experiments named in `only` (comma-separated; all when empty) that the devices can run:
/// on CUDA, those needing more GPUs than present are left out with a note.
inline std::vector<Experiment> select(const std::vector<Experiment>& experiments, bool cuda,
                                      const std::string& only) {
  std::vector<Experiment> out;
  const std::vector<std::string> names = absl::StrSplit(only, ',', absl::SkipEmpty());
  for (const Experiment& e : experiments) {
    if (!names.empty() && std::find(names.begin(), names.end(), e.name) == names.end()) continue;
    const int64_t needed = static_cast<int64_t>(std::max<size_t>(e.balance.size(), 1));
    if (cuda && needed > static_cast<int64_t>(torch::cuda::device_count())) {
      std::printf("(%s left out: it needs %lld GPUs, %lld present)\n", e.name.c_str(),
                  static_cast<long long>(needed),
                  static_cast<long long>(torch::cuda::device_count()));
      continue;
    }
    out.push_back(e);
  }
  return out;
}

/// The main of a memory benchmark: in a child (`child` not empty), runs that experiment (or
/// nothing, for kIdle) and reports; else runs every selected experiment in a child of its own.
inline int memory_main(const std::string& title, const std::vector<Experiment>& experiments,
                       bool cuda, double param_scale, const std::string& size,
                       const std::string& child, const std::string& only,
                       const std::string& json_out) {
  if (!child.empty()) {
    const Experiment* chosen = nullptr;
    for (const Experiment& e : experiments) {
      if (e.name == child) chosen = &e;
    }
    TORCH_CHECK(chosen != nullptr || child == kIdle, "--child: no experiment '", child, "'");
    return memory_child(chosen, cuda);
  }
  run_memory(title, select(experiments, cuda, only), cuda, param_scale, "/proc/self/exe",
             {"--size=" + size}, json_out);
  return 0;
}

/// Whether to run the full-size experiments: on CUDA when `size` is "full", or "auto" and
/// `gpus_needed` GPUs are present.
inline bool use_cuda(const std::string& size, int64_t gpus_needed) {
  TORCH_CHECK(size == "auto" || size == "full" || size == "reduced",
              "--size must be auto, full or reduced, got '", size, "'");
  if (size == "reduced") return false;
  const bool enough = torch::cuda::is_available() &&
                      static_cast<int64_t>(torch::cuda::device_count()) >= gpus_needed;
  TORCH_CHECK(size != "full" || torch::cuda::is_available(),
              "--size=full needs CUDA devices; none is available");
  return enough || size == "full";
}

}  // namespace bench
}  // namespace gpipe
