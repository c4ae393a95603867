// Cut points (issue 39 item 2): each section of a model cut at its cut points computes and holds
// only its own part. A model of 4 stretches whose costs are 1:2:3:4 (k residual Linear blocks
// each); per section: its own layers' forward time run plainly, the section's forward time (its
// own layers plus the code before it on a placeholder at batch 1), and the bytes its parameters
// and its copy of the model hold, against the whole model's.
//
//   bazel run -c opt //benchmarks:cut_points -- --width=512 --batch=64 --repeats=100 [--view]
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "benchmarks/timing.h"
#include "gpipe/cut_point.h"

ABSL_FLAG(int64_t, width, 512, "features of each Linear layer");
ABSL_FLAG(int64_t, batch, 64, "rows of the input (one micro-batch)");
ABSL_FLAG(int, repeats, 30, "timed runs per measurement (the median is shown)");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(bool, view, false,
          "begin forward() with x.view({x.size(0), -1}), which an empty batch cannot run: the "
          "sections' placeholders are then a batch of one zero sample");

namespace {

namespace nn = torch::nn;

// Stretch k (1 to 4) is k blocks x + relu(Linear(x)); a cut point after each of the first three.
struct CostedImpl : nn::Cloneable<CostedImpl> {
  CostedImpl(int64_t width, bool view) : width(width), view(view) { reset(); }
  void reset() override {
    stretches.clear();
    cuts.clear();
    for (int64_t k = 1; k <= 4; ++k) {
      nn::ModuleList blocks;
      for (int64_t b = 0; b < k; ++b) blocks->push_back(nn::Linear(width, width));
      stretches.push_back(register_module("stretch" + std::to_string(k), blocks));
      if (k < 4) cuts.push_back(register_module("cut" + std::to_string(k), gpipe::CutPoint()));
    }
  }
  // Stretch k's blocks on x.
  static at::Tensor run(const nn::ModuleList& blocks, at::Tensor x) {
    for (const auto& block : *blocks) x = x + at::relu(block->as<nn::Linear>()->forward(x));
    return x;
  }
  at::Tensor forward(at::Tensor x) {
    if (view) x = x.view({x.size(0), -1});
    for (size_t k = 0; k < stretches.size(); ++k) {
      x = run(stretches[k], x);
      if (k < cuts.size()) x = cuts[k](x);
    }
    return x;
  }
  int64_t width;
  bool view;
  std::vector<nn::ModuleList> stretches;
  std::vector<gpipe::CutPoint> cuts;
};
TORCH_MODULE(Costed);

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += static_cast<int64_t>(t.storage().nbytes());
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  gpipe_benchmarks::keep_freed_memory();  // Note [Keeping freed memory]
  const int64_t width = absl::GetFlag(FLAGS_width);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const c10::Device device(absl::GetFlag(FLAGS_device));
  const bool cuda = device.is_cuda();
  Costed model(width, absl::GetFlag(FLAGS_view));
  model->to(device);
  const at::Tensor x =
      at::randn({absl::GetFlag(FLAGS_batch), width}, at::TensorOptions().device(device));
  nn::Sequential sections = gpipe::cut(model, x);
  sections->to(device);
  at::NoGradGuard no_grad;
  const auto timed = [&](const std::function<void()>& fn) {
    return gpipe_benchmarks::median_ms(
        [&] {
          fn();
          if (cuda) torch::cuda::synchronize();
        },
        repeats, /*warmup=*/true);
  };
  std::printf(
      "Cut points: 4 stretches of 1, 2, 3, 4 x (x + relu(Linear(%lld))), batch %lld, %s, "
      "%d intra-op threads, placeholders of %d sample(s); medians of %d runs\n\n",
      static_cast<long long>(width), static_cast<long long>(absl::GetFlag(FLAGS_batch)),
      device.str().c_str(), at::get_num_threads(), absl::GetFlag(FLAGS_view) ? 1 : 0, repeats);
  std::printf(
      "| section | blocks | its layers, plainly (ms) | section forward (ms) | added (ms) | "
      "parameters (MiB) | its copy holds (MiB) |\n|---|---|---|---|---|---|---|\n");
  const int64_t whole = bytes_of(model->parameters());
  // Each section's input: the model's activation at its cut point.
  std::vector<at::Tensor> inputs{x};
  for (size_t k = 0; k + 1 < model->stretches.size(); ++k) {
    inputs.push_back(CostedImpl::run(model->stretches[k], inputs.back()));
  }
  double own_total = 0, section_total = 0;
  for (size_t k = 0; k < sections->size(); ++k) {
    const auto section = std::dynamic_pointer_cast<gpipe::SectionImpl>(sections->ptr(k));
    const double own = timed([&] { CostedImpl::run(model->stretches[k], inputs[k]); });
    const double mine = timed([&] { section->forward(inputs[k]); });
    own_total += own;
    section_total += mine;
    std::printf("| %zu | %zu | %.3f | %.3f | %+.3f (%+.1f%%) | %.2f | %.2f |\n", k, k + 1, own,
                mine, mine - own, 100 * (mine - own) / own, mib(bytes_of(section->parameters())),
                mib(bytes_of(section->model()->parameters())));
  }
  const double plain = timed([&] { model->forward(x); });
  // One section spanning the 4 stretches: its 3 cut points inactive.
  nn::Sequential one = gpipe::cut(model, x, {4});
  one->to(device);
  const double spanning = timed([&] { one->forward(x); });
  std::printf(
      "\nThe whole model plainly: %.3f ms (its stretches one by one: %.3f ms; the sections "
      "one by one: %.3f ms); one section spanning all four (3 inactive cut points): %.3f "
      "ms; its parameters %.2f MiB.\n",
      plain, own_total, section_total, spanning, mib(whole));
  return 0;
}
