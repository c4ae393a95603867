// The CPU as a pipeline of cores: a balanced model in n partitions, each with one worker thread
// and one intra-op thread, against the same GPipe with every task on the calling thread (same
// partitions, same micro-batches), for training steps (backward as one autograd graph, and
// stage-local: each partition's backward on its worker) and for inference, m = 1 ... 32
// micro-batches. The speed-up is compared with the ideal clock-cycle speed-up n * m / (m + n - 1).
//
//   bazel run -c opt //benchmarks:pipeline_efficiency -- --partitions=2 --json_out=/tmp/pe.json
//   bazel run -c opt //benchmarks:pipeline_efficiency -- --model=gpt_4_128 --microbatch=8
//
// With --model, a bundled model (examples/models/registry.h) balanced by time instead: a GPT's
// micro-batches are --microbatch sequences of --sequence tokens.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "balancing/balance.h"
#include "benchmarks/timing.h"
#include "examples/models/registry.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/gpipe.h"
#include "gpipe/worker.h"

ABSL_FLAG(int64_t, partitions, 2, "n: partitions (at most the cores)");
ABSL_FLAG(int64_t, max_chunks, 32, "largest m (m = 1, 2, 4, ... up to this)");
ABSL_FLAG(int64_t, layers_per_partition, 4, "Linear + ReLU layers per partition");
ABSL_FLAG(int64_t, width, 512, "features of each Linear layer");
ABSL_FLAG(int64_t, microbatch, 32, "rows per micro-batch (the mini-batch is m times this)");
ABSL_FLAG(int, repeats, 7, "timed steps per configuration (the median is reported)");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file");
ABSL_FLAG(std::string, model, "mlp",
          "mlp (the Linear + ReLU model above), or a bundled model such as gpt_4_128");
ABSL_FLAG(int64_t, sequence, 64, "tokens per sequence of a GPT (--model=gpt_...)");

namespace {

using gpipe_benchmarks::median_ms;

torch::nn::Sequential make_model(int64_t layers, int64_t width) {
  at::manual_seed(0);
  torch::nn::Sequential seq;
  for (int64_t k = 0; k < layers; ++k) {
    seq->push_back(torch::nn::Linear(width, width));
    seq->push_back(torch::nn::ReLU());
  }
  return seq;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t n = absl::GetFlag(FLAGS_partitions);
  const int64_t per = absl::GetFlag(FLAGS_layers_per_partition);
  const int64_t width = absl::GetFlag(FLAGS_width);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  gpipe::set_intra_op_threads(1);  // one thread for every task, wherever it runs
  gpipe_benchmarks::keep_freed_memory();  // Note [Keeping freed memory]
  std::vector<int64_t> balance(n, 2 * per);
  const std::string model_name = absl::GetFlag(FLAGS_model);
  // The model and a mini-batch of m micro-batches.
  std::function<torch::nn::Sequential()> make = [&] { return make_model(n * per, width); };
  std::function<at::Tensor(int64_t)> input = [&](int64_t m) {
    return at::randn({m * absl::GetFlag(FLAGS_microbatch), width});
  };
  if (model_name != "mlp") {
    gpipe::models::NamedModel named = gpipe::models::make_model(model_name);
    if (named.vocabulary > 0) named.sample_shape = {absl::GetFlag(FLAGS_sequence)};
    named.model = nullptr;  // a fresh model for each GPipe
    make = [model_name] {
      at::manual_seed(0);
      return gpipe::models::make_model(model_name).model;
    };
    input = [named](int64_t m) {
      return gpipe::models::sample_batch(named, m * absl::GetFlag(FLAGS_microbatch));
    };
    balance = gpipe::balance_by_time(n, make(), input(1));
    std::printf("%s: micro-batches of [%s], balanced by time\n", model_name.c_str(),
                absl::StrJoin(input(1).sizes(), ", ").c_str());
  }

  const std::string what =
      model_name == "mlp"
          ? absl::StrFormat("%d partitions of %d x (Linear(%d, %d) + ReLU), %d rows per "
                            "micro-batch",
                            n, per, width, width, absl::GetFlag(FLAGS_microbatch))
          : absl::StrFormat("%s in %d partitions {%s}", model_name, n,
                            absl::StrJoin(balance, ", "));
  std::printf("Pipeline efficiency on the CPU: %s, one intra-op thread; %u hardware threads; "
              "LibTorch %s; medians of %d steps\n\n",
              what.c_str(), std::thread::hardware_concurrency(), TORCH_VERSION, repeats);
  std::printf("%31s %3s %12s %12s %9s %7s %14s\n", "mode", "m", "1 thread ms", "pipeline ms",
              "speed-up", "ideal", "of the ideal");
  std::vector<std::string> json;
  for (const char* mode : {"training", "training, stage-local backward", "inference"}) {
    const bool training = std::string(mode) != "inference";
    const bool stage_local = std::string(mode) == "training, stage-local backward";
    for (int64_t m = 1; m <= absl::GetFlag(FLAGS_max_chunks); m *= 2) {
      const at::Tensor x = input(m);
      double ms[2];
      for (const bool workers : {false, true}) {
        gpipe::GPipe model(make(), gpipe::internal::with_stage_local_backward(
                                       gpipe::internal::with_partition_threads(
                                           gpipe::GPipeOptions(balance)
                                               .devices(std::vector<c10::Device>(n, at::kCPU))
                                               .chunks(m)
                                               .checkpoint(gpipe::Checkpoint::kNever),
                                           workers),
                                       workers && stage_local));
        std::function<void()> step;
        if (training) {
          model->train();
          step = [&] {
            for (auto& p : model->parameters()) {
              if (p.grad().defined()) p.mutable_grad().zero_();
            }
            model->forward(x).to(at::kFloat).sum().backward();
          };
        } else {
          model->eval();
          step = [&] {
            at::NoGradGuard no_grad;
            model->forward(x);
          };
        }
        ms[workers ? 1 : 0] = median_ms(step, repeats, /*warmup=*/true);
      }
      const double speedup = ms[0] / ms[1];
      const double ideal = static_cast<double>(n * m) / (m + n - 1);
      std::printf("%31s %3lld %12.2f %12.2f %8.2fx %6.2fx %13.0f%%\n", mode,
                  static_cast<long long>(m), ms[0], ms[1], speedup, ideal,
                  100 * speedup / ideal);
      json.push_back(absl::StrFormat(
          "{\"model\": \"%s\", \"mode\": \"%s\", \"partitions\": %d, \"chunks\": %d, "
          "\"one_thread_ms\": %.3f, "
          "\"pipeline_ms\": %.3f, \"speedup\": %.3f, \"ideal\": %.3f, \"of_ideal\": %.3f}",
          model_name, mode, n, m, ms[0], ms[1], speedup, ideal, speedup / ideal));
    }
  }
  const std::string text = absl::StrCat("[\n  ", absl::StrJoin(json, ",\n  "), "\n]\n");
  std::printf("\n%s", text.c_str());
  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_json_out)) << text;
  }
  return 0;
}
