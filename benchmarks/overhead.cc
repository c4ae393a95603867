// GPipe's overhead per task (one micro-batch through one partition) over a hand-written loop that
// does the same arithmetic: 8 Linear(16, 16) layers, batch 256, on the CPU with one intra-op
// thread, so that what is left is the library's own cost.
//
//   bazel run -c opt //benchmarks:overhead -- --repeats=30 --json_out=/tmp/overhead.json
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/version.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "benchmarks/timing.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/partition_threads.h"

ABSL_FLAG(int, repeats, 30,
          "timed rounds per configuration; each round times the floor, then GPipe, and the median "
          "of the per-round differences is the overhead");
ABSL_FLAG(int, warmup, 5, "untimed steps before timing");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file");
ABSL_FLAG(bool, partition_threads, false,
          "each partition on a thread of its own, and with it stage-local backward (Note "
          "[Stage-local backward in one process]): the cost of the hand-offs and of the check "
          "of the graph (Note [Where a backward may cut]) beside the floor's one thread");
ABSL_FLAG(int, count_rounds, 0,
          "instead of timing: after the warm-up, run the floor and then GPipe this many rounds "
          "each, in count_floor_rounds() and count_gpipe_rounds(), whose instructions "
          "benchmarks/overhead_instructions.sh counts under callgrind (noise-free; one "
          "configuration per run, --only)");
ABSL_FLAG(std::string, only, "",
          "run only the configurations named here, comma-separated as partitions x chunks : "
          "checkpoint, e.g. --only=4x128:except_last,4x128:never (default: all)");

namespace {

using gpipe_benchmarks::median;

namespace nn = torch::nn;
constexpr int64_t kLayers = 8;
constexpr int64_t kWidth = 16;
constexpr int64_t kBatch = 256;

nn::Sequential make_model() {
  at::manual_seed(0);
  nn::Sequential seq;
  for (int64_t k = 0; k < kLayers; ++k) seq->push_back(nn::Linear(kWidth, kWidth));
  return seq;
}

void zero_grads(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

double time_us(const std::function<void()>& step) {
  const auto start = std::chrono::steady_clock::now();
  step();
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(stop - start).count();
}

// Times `a` and `b` alternately, so that both see the same machine noise. Returns the medians of
// a, of b, and of the per-round differences b - a, in microseconds.
std::tuple<double, double, double> paired_us(const std::function<void()>& a,
                                             const std::function<void()>& b) {
  for (int k = 0; k < absl::GetFlag(FLAGS_warmup); ++k) {
    a();
    b();
  }
  std::vector<double> ta, tb, diff;
  for (int k = 0; k < absl::GetFlag(FLAGS_repeats); ++k) {
    ta.push_back(time_us(a));
    tb.push_back(time_us(b));
    diff.push_back(tb.back() - ta.back());
  }
  return {median(ta), median(tb), median(diff)};
}

// The rounds that benchmarks/overhead_instructions.sh counts (callgrind's --toggle-collect names
// these two functions): out of line, and not folded into one (GCC's identical code folding would
// make the two one function).
#if defined(__GNUC__) && !defined(__clang__)
#define GPIPE_COUNTED __attribute__((noipa))
#else
#define GPIPE_COUNTED __attribute__((noinline))
#endif
GPIPE_COUNTED void count_floor_rounds(const std::function<void()>& step, int rounds) {
  for (int k = 0; k < rounds; ++k) step();
}
GPIPE_COUNTED void count_gpipe_rounds(const std::function<void()>& step, int rounds) {
  for (int k = 0; k < rounds; ++k) step();
}

struct Row {
  int64_t partitions;
  int64_t chunks;
  std::string checkpoint;
  double plain_us;
  double floor_us;
  double gpipe_us;
  double overhead_per_task_us;
  // kNever only (else NaN): the overhead over a stricter floor that runs one backward call over
  // all micro-batches, as GPipe does, instead of one call per micro-batch.
  double overhead_single_backward_us;
};

// Whether --only names this configuration (or is empty).
bool selected(int64_t partitions, int64_t chunks, const std::string& checkpoint) {
  const std::string only = absl::GetFlag(FLAGS_only);
  if (only.empty()) return true;
  const std::string name = absl::StrFormat("%dx%d:%s", partitions, chunks, checkpoint);
  for (absl::string_view part : absl::StrSplit(only, ',')) {
    if (part == name) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  at::set_num_threads(1);
  const at::Tensor x = at::randn({kBatch, kWidth});

  // The plain Sequential on the whole batch.
  nn::Sequential plain = make_model();
  const auto plain_params = plain->parameters();
  auto plain_step = [&] {
    zero_grads(plain_params);
    plain->forward(x).sum().backward();
  };

  std::vector<Row> rows;
  for (const int64_t chunks : {1, 8, 32, 128}) {
    const std::vector<at::Tensor> micro = x.chunk(chunks);
    const int64_t m = static_cast<int64_t>(micro.size());
    // The floor without checkpointing: forward each micro-batch, then backward each.
    auto floor_never = [&] {
      zero_grads(plain_params);
      std::vector<at::Tensor> outs;
      for (const at::Tensor& mb : micro) outs.push_back(plain->forward(mb));
      for (auto it = outs.rbegin(); it != outs.rend(); ++it) it->sum().backward();
    };
    // A stricter floor: forward each micro-batch, then one backward call for all of them.
    auto floor_single_backward = [&] {
      zero_grads(plain_params);
      std::vector<at::Tensor> losses;
      for (const at::Tensor& mb : micro) losses.push_back(plain->forward(mb).sum());
      torch::autograd::backward(losses);
    };
    // The floor with the recomputation of kExceptLast done by hand: every micro-batch but the
    // last runs once without grad, then again with grad just before its backward.
    auto floor_except_last = [&] {
      zero_grads(plain_params);
      std::vector<at::Tensor> outs;
      for (int64_t i = 0; i < m; ++i) {
        if (i < m - 1) {
          at::NoGradGuard no_grad;
          outs.push_back(plain->forward(micro[i]));
        } else {
          outs.push_back(plain->forward(micro[i]));
        }
      }
      for (int64_t i = m - 1; i >= 0; --i) {
        at::Tensor out = i < m - 1 ? plain->forward(micro[i]) : outs[i];
        out.sum().backward();
      }
    };
    for (const int64_t partitions : {1, 4}) {
      for (const gpipe::Checkpoint mode : {gpipe::Checkpoint::kNever, gpipe::Checkpoint::kExceptLast}) {
        if (!selected(partitions, chunks,
                      mode == gpipe::Checkpoint::kNever ? "never" : "except_last")) {
          continue;
        }
        std::vector<int64_t> balance(partitions, kLayers / partitions);
        // One thread for the CPU's partitions, as the floor runs (Note [Threads of forward()]:
        // by default they would get threads of their own): what is left is the library's cost.
        gpipe::GPipe model(make_model(),
                           gpipe::internal::with_partition_threads(
                               gpipe::GPipeOptions(balance)
                                   .devices(std::vector<c10::Device>(partitions, at::kCPU))
                                   .chunks(chunks)
                                   .checkpoint(mode),
                               absl::GetFlag(FLAGS_partition_threads)));
        const auto params = model->parameters();
        auto gpipe_step = [&] {
          zero_grads(params);
          model->forward(x).sum().backward();
        };
        const bool never = mode == gpipe::Checkpoint::kNever;
        const std::function<void()> floor_step =
            never ? std::function<void()>(floor_never) : std::function<void()>(floor_except_last);
        if (const int rounds = absl::GetFlag(FLAGS_count_rounds); rounds > 0) {
          for (int k = 0; k < absl::GetFlag(FLAGS_warmup); ++k) {
            floor_step();
            gpipe_step();
          }
          count_floor_rounds(floor_step, rounds);
          count_gpipe_rounds(gpipe_step, rounds);
          std::printf("counted %d rounds of %lld x %lld:%s (%lld tasks a round)\n", rounds,
                      static_cast<long long>(partitions), static_cast<long long>(chunks),
                      never ? "never" : "except_last", static_cast<long long>(m * partitions));
          continue;
        }
        const double plain_us = std::get<0>(paired_us(plain_step, plain_step));
        const auto [floor_us, gpipe_us, diff_us] = paired_us(floor_step, gpipe_step);
        const double tasks = static_cast<double>(m * partitions);
        const double single =
            never ? std::get<2>(paired_us(floor_single_backward, gpipe_step)) / tasks : NAN;
        rows.push_back(Row{partitions, chunks, never ? "never" : "except_last", plain_us, floor_us,
                           gpipe_us, diff_us / tasks, single});
      }
    }
  }

  std::printf("GPipe overhead per task (8 x Linear(16,16), batch %lld, CPU, 1 intra-op thread, "
              "LibTorch %s, medians of %d paired rounds)\n\n",
              static_cast<long long>(kBatch), TORCH_VERSION, absl::GetFlag(FLAGS_repeats));
  std::printf("%10s %7s %12s %10s %10s %10s %17s %24s\n", "partitions", "chunks", "checkpoint",
              "plain us", "floor us", "gpipe us", "overhead/task us",
              "vs 1-backward floor us");
  std::vector<std::string> json_rows;
  for (const Row& r : rows) {
    std::printf("%10lld %7lld %12s %10.1f %10.1f %10.1f %17.1f %24s\n",
                static_cast<long long>(r.partitions), static_cast<long long>(r.chunks),
                r.checkpoint.c_str(), r.plain_us, r.floor_us, r.gpipe_us, r.overhead_per_task_us,
                std::isnan(r.overhead_single_backward_us)
                    ? "-"
                    : absl::StrFormat("%.1f", r.overhead_single_backward_us).c_str());
    json_rows.push_back(absl::StrFormat(
        "{\"partitions\": %d, \"chunks\": %d, \"checkpoint\": \"%s\", \"plain_us\": %.1f, "
        "\"floor_us\": %.1f, \"gpipe_us\": %.1f, \"overhead_per_task_us\": %.2f, "
        "\"overhead_vs_single_backward_floor_us\": %s}",
        r.partitions, r.chunks, r.checkpoint, r.plain_us, r.floor_us, r.gpipe_us,
        r.overhead_per_task_us,
        std::isnan(r.overhead_single_backward_us)
            ? "null"
            : absl::StrFormat("%.2f", r.overhead_single_backward_us)));
  }
  const std::string json = absl::StrCat("[\n  ", absl::StrJoin(json_rows, ",\n  "), "\n]\n");
  std::printf("\n%s", json.c_str());
  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_json_out)) << json;
  }
  return 0;
}
