// CPU training with default options: what a user gets who never sets a thread count. A balanced
// MLP in two CPU partitions, m micro-batches, trained through GPipe::step under each schedule and
// through forward() + backward(), and run for inference, against the plain Sequential with
// LibTorch's default threads and the plain Sequential on one core (one intra-op thread, one
// OpenBLAS thread). The pipeline's speed-up over one core is compared with the ideal
// n * m / (m + n - 1) (Note [Dividing the cores] in gpipe/worker.h).
//
//   bazel run -c opt //benchmarks:default_threads -- --json_out=/tmp/dt.json
//
// Note [Rounds against a noisy machine]: every round times one step of each configuration in
// turn, the references on one core among them, and a row's share of its ideal is the median over
// rounds of its reference's time in that round over its own: a neighbour's load that comes and
// goes over seconds slows a row and its reference alike, where medians taken one configuration
// after another compared a quiet minute with a busy one (shares above 100% in some runs). Each
// timed step follows untimed steps of its row for `--settle_ms`: OpenBLAS's threads (Debian's
// pthread build) spin for about 0.1 s after a product that used them (its THREAD_TIMEOUT, 2^28
// cycles), so a row that
// followed one with OpenBLAS's full count competed with a spinning thread and took up to twice
// its time (bimodal: forward() + backward() 40 or 80 ms, inference 10 or 18 ms in alternate
// rounds; gone with OPENBLAS_THREAD_TIMEOUT=4). A user's own loop of steps meets that only after
// a product of their own with OpenBLAS's full count (Note [Dividing the cores] in
// gpipe/worker.h). (A pause instead of the untimed steps made the pipelined rows slower still:
// inference through step() 18-22 ms against 10, the cores idle before it.)

#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
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
ABSL_FLAG(int, rounds, 15,
          "rounds, each timing one step of every configuration in turn (medians are reported)");
ABSL_FLAG(int, settle_ms, 150,
          "untimed steps of a row, for at least this long, before its timed step in a round: "
          "OpenBLAS's threads stop spinning meanwhile (Note [Rounds against a noisy machine])");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file");

namespace {

using gpipe_benchmarks::median;
using gpipe_benchmarks::ms_since;

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

// What a row times, and against which references its speed-up is read.
struct Row {
  std::string name;
  std::function<void()> step;
  bool one_core = false;   // run with one intra-op and one OpenBLAS thread
  bool inference = false;  // read against the inference references
  bool plain = false;      // the plain model: no share of the pipeline's ideal
  std::vector<double> ms = {};  // one per round
};

Row make_row(std::string name, std::function<void()> step, bool one_core, bool inference,
             bool plain = false) {
  Row r;
  r.name = std::move(name);
  r.step = std::move(step);
  r.one_core = one_core;
  r.inference = inference;
  r.plain = plain;
  return r;
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
  const int rounds = absl::GetFlag(FLAGS_rounds);
  gpipe_benchmarks::keep_freed_memory();  // Note [Keeping freed memory]
  const int intra = at::get_num_threads();
  const int blas = blas_threads();
  const at::Tensor x = at::randn({m * absl::GetFlag(FLAGS_microbatch), width});
  const at::Tensor y = at::randn({m * absl::GetFlag(FLAGS_microbatch), width});
  std::printf("Default options on the CPU: %lld partitions of %lld x (Linear(%lld) + ReLU), "
              "m = %lld, %lld rows per micro-batch; %u hardware threads, LibTorch %s with %d "
              "intra-op threads, OpenBLAS %d; medians of %d rounds\n\n",
              static_cast<long long>(n), static_cast<long long>(per),
              static_cast<long long>(width), static_cast<long long>(m),
              static_cast<long long>(absl::GetFlag(FLAGS_microbatch)),
              std::thread::hardware_concurrency(), TORCH_VERSION, intra, blas, rounds);

  std::vector<Row> rows;
  auto training = [&](torch::nn::Module& module, std::function<void()> loss) {
    return [&module, loss] {
      for (auto& p : module.parameters()) {
        if (p.grad().defined()) p.mutable_grad().zero_();
      }
      loss();
    };
  };
  auto forward_backward = [&](gpipe::GPipe& model) {
    return training(*model, [&model, &x, &y] {
      mse(gpipe::Batch(model->forward(x)), y).backward();
    });
  };
  auto inference = [&](gpipe::GPipe& model) {
    return [&model, &x] {
      at::NoGradGuard no_grad;
      model->forward(x);
    };
  };
  torch::nn::Sequential plain = make_model(n * per, width);
  const auto plain_step = training(*plain, [&] {
    mse(gpipe::Batch(plain->forward(x)), y).backward();
  });
  const auto plain_inference = [&] {
    at::NoGradGuard no_grad;
    plain->forward(x);
  };
  // The references, by their place in `rows`, [inference]: the plain model with default threads
  // and on one core, and the pipeline's own micro-batches on one core.
  size_t plain_default[2], plain_one[2], microbatches_one[2];
  for (const bool infers : {false, true}) {
    const std::string what = infers ? "inference, plain" : "plain";
    const std::function<void()> step =
        infers ? std::function<void()>(plain_inference) : std::function<void()>(plain_step);
    plain_default[infers] = rows.size();
    rows.push_back(make_row(what + ", default threads", step,
                            /*one_core=*/false, infers, /*plain=*/true));
    plain_one[infers] = rows.size();
    rows.push_back(make_row(what + ", one core", step,
                            /*one_core=*/true, infers, /*plain=*/true));
  }
  // The pipeline's own work on one core: the same micro-batches, one after another.
  const std::vector<c10::Device> cpus(n, at::kCPU);
  auto options = [&] {
    return gpipe::GPipeOptions(std::vector<int64_t>(n, 2 * per)).devices(cpus).chunks(m);
  };
  gpipe::GPipe one_thread(make_model(n * per, width),
                          gpipe::internal::with_partition_threads(options(), false));
  gpipe::GPipe one_thread_eval(make_model(n * per, width),
                               gpipe::internal::with_partition_threads(options(), false));
  one_thread_eval->eval();
  microbatches_one[false] = rows.size();
  rows.push_back(make_row("micro-batches on one core", forward_backward(one_thread),
                          /*one_core=*/true, /*inference=*/false));
  microbatches_one[true] = rows.size();
  rows.push_back(make_row("inference, micro-batches on one core", inference(one_thread_eval),
                          /*one_core=*/true, /*inference=*/true));
  // step() under each schedule; "cores not divided" is the engine before Note [Dividing the
  // cores], for comparison.
  std::vector<std::unique_ptr<gpipe::GPipe>> models;
  for (const bool divided : {true, false}) {
    for (const auto& [name, kind] :
         std::vector<std::pair<std::string, gpipe::ScheduleKind>>{
             {"GPipe", gpipe::ScheduleKind::kGPipe},
             {"1F1B", gpipe::ScheduleKind::k1F1B},
             {"ZB-H1", gpipe::ScheduleKind::kZeroBubble}}) {
      models.push_back(std::make_unique<gpipe::GPipe>(make_model(n * per, width),
                                                      options().schedule(kind)));
      gpipe::GPipe& model = *models.back();
      rows.push_back(make_row(absl::StrCat("step(), ", name, divided ? "" : ", cores not divided"),
                              training(*model,
                                       [&model, &x, &y, divided] {
                                         gpipe::internal::set_core_share(divided);
                                         model->step(x, y, mse);
                                         gpipe::internal::set_core_share(true);
                                       }),
                              /*one_core=*/false, /*inference=*/false));
    }
  }
  gpipe::GPipe model(make_model(n * per, width), options());
  rows.push_back(make_row("forward() + backward()", forward_backward(model), /*one_core=*/false,
                          /*inference=*/false));
  // The engine's decision against the other (Note [Threads of forward()]): the partitions on one
  // thread, as before the decision.
  gpipe::GPipe shared(make_model(n * per, width),
                      gpipe::internal::with_partition_threads(options(), false));
  rows.push_back(make_row("forward() + backward(), one thread", forward_backward(shared),
                          /*one_core=*/false, /*inference=*/false));
  // The engine's decision against the other (Note [Stage-local backward in one process]): each
  // partition's threads, but the one graph, whose backward runs on the calling thread.
  gpipe::GPipe one_graph(make_model(n * per, width),
                         gpipe::internal::with_stage_local_backward(options(), false));
  rows.push_back(make_row("forward() + backward(), one graph", forward_backward(one_graph),
                          /*one_core=*/false, /*inference=*/false));
  gpipe::GPipe model_eval(make_model(n * per, width), options());
  model_eval->eval();
  gpipe::GPipe shared_eval(make_model(n * per, width),
                           gpipe::internal::with_partition_threads(options(), false));
  shared_eval->eval();
  rows.push_back(make_row("inference, forward()", inference(model_eval), /*one_core=*/false,
                          /*inference=*/true));
  rows.push_back(make_row("inference, forward(), one thread", inference(shared_eval),
                          /*one_core=*/false, /*inference=*/true));
  rows.push_back(make_row(
      "inference, step()",
      [&] {
        at::NoGradGuard no_grad;
        model_eval->step(x, at::Tensor(), mse);
      },
      /*one_core=*/false, /*inference=*/true));

  // Note [Rounds against a noisy machine]: a warm-up round, then the timed ones.
  for (int round = -1; round < rounds; ++round) {
    for (Row& row : rows) {
      at::set_num_threads(row.one_core ? 1 : intra);
      set_blas_threads(row.one_core ? 1 : blas);
      const auto settle = std::chrono::steady_clock::now();
      do {
        row.step();
      } while (ms_since(settle) < absl::GetFlag(FLAGS_settle_ms));
      const auto start = std::chrono::steady_clock::now();
      row.step();
      if (round >= 0) row.ms.push_back(ms_since(start));
    }
  }
  at::set_num_threads(intra);
  set_blas_threads(blas);

  const double ideal = static_cast<double>(n * m) / static_cast<double>(m + n - 1);
  std::printf("%-44s %9s %9s %18s %13s %20s\n", "configuration", "ms", "vs plain",
              "speed-up (1 core)", "of the ideal", "of it (micro-batches)");
  std::vector<std::string> json;
  // vs plain and speed-up: against the plain model with default threads and on one core, in
  // training or inference (medians); of it: the median over rounds of the same micro-batches'
  // time on one core (the pipeline's own work) over the row's, against the ideal.
  for (const Row& row : rows) {
    const double ms = median(row.ms);
    const double plain_default_ms = median(rows[plain_default[row.inference]].ms);
    const double speedup = median(rows[plain_one[row.inference]].ms) / ms;
    double of_own = 0;
    if (!row.plain) {
      const Row& own = rows[microbatches_one[row.inference]];
      std::vector<double> shares;
      for (size_t r = 0; r < row.ms.size(); ++r) shares.push_back(own.ms[r] / row.ms[r] / ideal);
      of_own = median(shares);
    }
    std::printf("%-44s %9.2f %8.2fx %17.2fx %12.0f%% %19.0f%%\n", row.name.c_str(), ms,
                plain_default_ms / ms, speedup, 100 * speedup / ideal, 100 * of_own);
    json.push_back(absl::StrFormat(
        "{\"configuration\": \"%s\", \"ms\": %.3f, \"vs_plain_default\": %.3f, "
        "\"speedup_vs_one_core\": %.3f, \"ideal\": %.3f, \"of_ideal\": %.3f, "
        "\"of_ideal_same_microbatches\": %.3f}",
        row.name, ms, plain_default_ms / ms, speedup, ideal, speedup / ideal, of_own));
  }
  const std::string text = absl::StrCat("[\n  ", absl::StrJoin(json, ",\n  "), "\n]\n");
  std::printf("\n%s", text.c_str());
  if (!absl::GetFlag(FLAGS_json_out).empty()) std::ofstream(absl::GetFlag(FLAGS_json_out)) << text;
  return 0;
}
