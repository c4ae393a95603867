// CPU training with default options: what a user gets who never sets a thread count. A balanced
// MLP in two CPU partitions, m micro-batches, trained through GPipe::step under each schedule and
// through forward() + backward(), and run for inference, against the plain Sequential with
// LibTorch's default threads and the plain Sequential on one core (one intra-op thread, one
// OpenBLAS thread). The pipeline's speed-up over one core is compared with the ideal
// n * m / (m + n - 1) (Note [Dividing the cores] in gpipe/worker.h).
//
//   bazel run -c opt //benchmarks:default_threads -- --json_out=/tmp/dt.json

#include <dlfcn.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "benchmarks/timing.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/worker.h"

ABSL_FLAG(int64_t, partitions, 2, "n: CPU partitions");
ABSL_FLAG(int64_t, chunks, 16, "m: micro-batches");
ABSL_FLAG(int64_t, layers_per_partition, 4, "Linear + ReLU layers per partition");
ABSL_FLAG(int64_t, width, 384, "features of each Linear layer");
ABSL_FLAG(int64_t, microbatch, 32, "rows per micro-batch (the mini-batch is m times this)");
ABSL_FLAG(int, repeats, 7, "timed steps per configuration (the median is reported)");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file");

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

at::Tensor mse(const gpipe::Batch& out, const at::Tensor& target) {
  return torch::nn::functional::mse_loss(out[0], target);
}

// OpenBLAS's thread count, found at run time (-1 without OpenBLAS).
int blas_threads() {
  using Get = int (*)();
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : -1;
}
void set_blas_threads(int threads) {
  using Set = void (*)(int);
  auto set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set != nullptr && threads > 0) set(threads);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t n = absl::GetFlag(FLAGS_partitions);
  const int64_t m = absl::GetFlag(FLAGS_chunks);
  const int64_t per = absl::GetFlag(FLAGS_layers_per_partition);
  const int64_t width = absl::GetFlag(FLAGS_width);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  gpipe_benchmarks::keep_freed_memory();  // Note [Keeping freed memory]
  const int intra = at::get_num_threads();
  const int blas = blas_threads();
  const at::Tensor x = at::randn({m * absl::GetFlag(FLAGS_microbatch), width});
  const at::Tensor y = at::randn({m * absl::GetFlag(FLAGS_microbatch), width});
  std::printf("Default options on the CPU: %lld partitions of %lld x (Linear(%lld) + ReLU), "
              "m = %lld, %lld rows per micro-batch; %u hardware threads, LibTorch %s with %d "
              "intra-op threads, OpenBLAS %d; medians of %d steps\n\n",
              static_cast<long long>(n), static_cast<long long>(per),
              static_cast<long long>(width), static_cast<long long>(m),
              static_cast<long long>(absl::GetFlag(FLAGS_microbatch)),
              std::thread::hardware_concurrency(), TORCH_VERSION, intra, blas, repeats);

  auto train = [&](torch::nn::Module& module, const std::function<at::Tensor()>& loss) {
    return median_ms(
        [&] {
          for (auto& p : module.parameters()) {
            if (p.grad().defined()) p.mutable_grad().zero_();
          }
          loss();
        },
        repeats, /*warmup=*/true);
  };
  torch::nn::Sequential plain = make_model(n * per, width);
  auto plain_step = [&] {
    at::Tensor loss = mse(gpipe::Batch(plain->forward(x)), y);
    loss.backward();
    return loss;
  };
  auto plain_inference = [&] {
    at::NoGradGuard no_grad;
    return plain->forward(x);
  };
  const double plain_default = train(*plain, plain_step);
  const double plain_default_inference = median_ms(plain_inference, repeats, true);
  at::set_num_threads(1);
  set_blas_threads(1);
  const double plain_one = train(*plain, plain_step);
  const double plain_one_inference = median_ms(plain_inference, repeats, true);
  // The pipeline's own work on one core: the same micro-batches, one after another.
  const std::vector<c10::Device> cpus(n, at::kCPU);
  auto options = [&] {
    return gpipe::GPipeOptions(std::vector<int64_t>(n, 2 * per)).devices(cpus).chunks(m);
  };
  gpipe::GPipe one_thread(make_model(n * per, width),
                          gpipe::internal::with_partition_threads(options(), false));
  const double microbatches_one = train(*one_thread, [&] {
    at::Tensor loss = mse(gpipe::Batch(one_thread->forward(x)), y);
    loss.backward();
    return loss;
  });
  one_thread->eval();
  const double microbatches_one_inference = median_ms(
      [&] {
        at::NoGradGuard no_grad;
        one_thread->forward(x);
      },
      repeats, true);
  at::set_num_threads(intra);  // LibTorch's and OpenBLAS's defaults again
  set_blas_threads(blas);

  const double ideal = static_cast<double>(n * m) / static_cast<double>(m + n - 1);
  std::printf("%-44s %9s %9s %18s %13s %20s\n", "configuration", "ms", "vs plain",
              "speed-up (1 core)", "of the ideal", "of it (micro-batches)");
  std::vector<std::string> json;
  // of_ideal: against the plain model on one core; of_ideal_microbatches: against the same
  // micro-batches on one core (the pipeline's own work), in training or inference.
  auto report = [&](const std::string& what, double ms, double vs_default, double vs_one,
                    double vs_microbatches) {
    const double speedup = vs_one / ms;
    const double of_own = vs_microbatches > 0 ? vs_microbatches / ms / ideal : 0;
    std::printf("%-44s %9.2f %8.2fx %17.2fx %12.0f%% %19.0f%%\n", what.c_str(), ms,
                vs_default / ms, speedup, 100 * speedup / ideal, 100 * of_own);
    json.push_back(absl::StrFormat(
        "{\"configuration\": \"%s\", \"ms\": %.3f, \"vs_plain_default\": %.3f, "
        "\"speedup_vs_one_core\": %.3f, \"ideal\": %.3f, \"of_ideal\": %.3f, "
        "\"of_ideal_same_microbatches\": %.3f}",
        what, ms, vs_default / ms, speedup, ideal, speedup / ideal, of_own));
  };
  report("plain, default threads", plain_default, plain_default, plain_one, 0);
  report("plain, one core", plain_one, plain_default, plain_one, 0);
  report("micro-batches on one core", microbatches_one, plain_default, plain_one,
         microbatches_one);
  report("inference, micro-batches on one core", microbatches_one_inference,
         plain_default_inference, plain_one_inference, microbatches_one_inference);
  for (const bool divided : {true, false}) {
    // Not divided: the engine before Note [Dividing the cores], for comparison.
    gpipe::internal::set_core_share(divided);
    for (const auto& [name, kind] :
         std::vector<std::pair<std::string, gpipe::ScheduleKind>>{
             {"GPipe", gpipe::ScheduleKind::kGPipe},
             {"1F1B", gpipe::ScheduleKind::k1F1B},
             {"ZB-H1", gpipe::ScheduleKind::kZeroBubble}}) {
      gpipe::GPipe model(make_model(n * per, width), options().schedule(kind));
      report(absl::StrCat("step(), ", name, divided ? "" : ", cores not divided"),
             train(*model, [&] { return model->step(x, y, mse); }), plain_default, plain_one,
             microbatches_one);
    }
  }
  gpipe::internal::set_core_share(true);
  gpipe::GPipe model(make_model(n * per, width), options());
  report("forward() + backward()", train(*model, [&] {
           at::Tensor loss = mse(gpipe::Batch(model->forward(x)), y);
           loss.backward();
           return loss;
         }),
         plain_default, plain_one, microbatches_one);
  // The engine's decision against the other (Note [Threads of forward()]): the partitions on one
  // thread, as before the decision.
  gpipe::GPipe shared(make_model(n * per, width),
                      gpipe::internal::with_partition_threads(options(), false));
  report("forward() + backward(), one thread", train(*shared, [&] {
           at::Tensor loss = mse(gpipe::Batch(shared->forward(x)), y);
           loss.backward();
           return loss;
         }),
         plain_default, plain_one, microbatches_one);
  shared->eval();
  report("inference, forward(), one thread", median_ms(
             [&] {
               at::NoGradGuard no_grad;
               shared->forward(x);
             },
             repeats, true),
         plain_default_inference, plain_one_inference, microbatches_one_inference);
  // The engine's decision against the other (Note [Stage-local backward in one process]): each
  // partition's threads, but the one graph, whose backward runs on the calling thread.
  gpipe::GPipe one_graph(make_model(n * per, width),
                         gpipe::internal::with_stage_local_backward(options(), false));
  report("forward() + backward(), one graph", train(*one_graph, [&] {
           at::Tensor loss = mse(gpipe::Batch(one_graph->forward(x)), y);
           loss.backward();
           return loss;
         }),
         plain_default, plain_one, microbatches_one);
  model->eval();
  const double inference = median_ms(
      [&] {
        at::NoGradGuard no_grad;
        model->forward(x);
      },
      repeats, true);
  report("inference, forward()", inference, plain_default_inference, plain_one_inference,
         microbatches_one_inference);
  const double step_inference = median_ms(
      [&] {
        at::NoGradGuard no_grad;
        model->step(x, at::Tensor(), mse);
      },
      repeats, true);
  report("inference, step()", step_inference, plain_default_inference, plain_one_inference,
         microbatches_one_inference);
  const std::string text = absl::StrCat("[\n  ", absl::StrJoin(json, ",\n  "), "\n]\n");
  std::printf("\n%s", text.c_str());
  if (!absl::GetFlag(FLAGS_json_out).empty()) std::ofstream(absl::GetFlag(FLAGS_json_out)) << text;
  return 0;
}
