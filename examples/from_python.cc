// A model written and initialised in Python, trained by gpipe and saved back for Python: the
// scripted nn.Sequential in --model (torch.jit.script(model).save(path)) cut into its children,
// balanced by time over two devices, trained with step() under 1F1B on synthetic data (the
// formula of tests/gpipe/scripted_models.py), and saved to --out, which torch.jit.load reads.
//
//   /usr/bin/python3 tests/gpipe/scripted_models.py make /tmp/models
//   bazel-bin/examples/from_python --model=/tmp/models/gpt.pt --out=/tmp/models/gpt_gpipe.pt
#include <cstdio>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <ATen/ATen.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "balancing/balance.h"
#include "gpipe/gpipe.h"
#include "gpipe/torchscript.h"

ABSL_FLAG(std::string, model, "", "a scripted nn.Sequential, saved by Python's torch.jit.save");
ABSL_FLAG(std::string, child, "",
          "the submodule whose children are the layers (empty: the model's own children)");
ABSL_FLAG(std::string, input, "4,4,5", "the shape of a mini-batch's input, the batch first");
ABSL_FLAG(std::string, target, "4,4,5", "the shape of its target (mean squared error)");
ABSL_FLAG(int, chunks, 2, "micro-batches per mini-batch");
ABSL_FLAG(int, steps, 3, "training steps");
ABSL_FLAG(std::string, out, "", "where to save the trained scripted model (empty: nowhere)");

namespace {

std::vector<int64_t> shape(const std::string& text) {
  std::vector<int64_t> out;
  for (const std::string& part : std::vector<std::string>(absl::StrSplit(text, ','))) {
    int64_t value = 0;
    TORCH_CHECK(absl::SimpleAtoi(part, &value) && value > 0,
                "a shape is sizes separated by commas, such as 4,4,5; got '", text, "'");
    out.push_back(value);
  }
  return out;
}

// sin(0.1 * arange(n) + shift) in `sizes`: the data scripted_models.py trains on.
at::Tensor synthetic(const std::vector<int64_t>& sizes, double shift) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return at::sin(0.1 * at::arange(n, at::kDouble) + shift).reshape(sizes);
}

// Two devices: two GPUs, else a GPU and the CPU, else the CPU twice.
std::vector<c10::Device> two_devices() {
  const size_t gpus = torch::cuda::device_count();
  if (gpus >= 2) return {c10::Device("cuda:0"), c10::Device("cuda:1")};
  if (gpus == 1) return {c10::Device("cuda:0"), c10::Device(c10::kCPU)};
  return {c10::Device(c10::kCPU), c10::Device(c10::kCPU)};
}

}  // namespace

static int run(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::vector<int64_t> input = shape(absl::GetFlag(FLAGS_input));
  const std::vector<int64_t> target = shape(absl::GetFlag(FLAGS_target));
  const std::vector<c10::Device> devices = two_devices();
  const int chunks = absl::GetFlag(FLAGS_chunks);
  // [from_python]
  torch::jit::Module scripted = torch::jit::load(absl::GetFlag(FLAGS_model));
  scripted.to(at::kDouble);
  torch::nn::Sequential layers = gpipe::from_torchscript(scripted, absl::GetFlag(FLAGS_child));
  const std::vector<int64_t> balance = gpipe::balance_by_time(
      2, layers, synthetic(input, 0), gpipe::BalanceByTimeOptions().device(devices[0]));
  gpipe::GPipe model(layers, gpipe::GPipeOptions(balance)
                                 .devices(devices)
                                 .chunks(chunks)
                                 .checkpoint(gpipe::Checkpoint::kNever)  // scripted batch norms
                                 .schedule(gpipe::ScheduleKind::k1F1B));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05));
  const auto mse = [](const gpipe::Batch& out, const at::Tensor& y) {
    return torch::nn::functional::mse_loss(out.tensor(), y.to(out.tensor().device()));
  };
  for (int step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    sgd.zero_grad();
    const at::Tensor x = synthetic(input, step).to(devices[0]);
    const at::Tensor loss = model->step(x, synthetic(target, step + 0.5), mse);
    sgd.step();
    std::printf("step %d: loss %.17g\n", step + 1, loss.item<double>());
  }
  scripted.to(at::kCPU);  // (its layers sit on the partitions' devices)
  if (!absl::GetFlag(FLAGS_out).empty()) scripted.save(absl::GetFlag(FLAGS_out));
  // [from_python]
  std::printf(
      "balance {%s} on {%s}; saved to '%s'\n", absl::StrJoin(balance, ", ").c_str(),
      absl::StrJoin(devices, ", ", [](std::string* s, const c10::Device& d) { s->append(d.str()); })
          .c_str(),
      absl::GetFlag(FLAGS_out).c_str());
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {  // the message, without LibTorch's backtrace
    std::fprintf(stderr, "from_python: %s\n", e.what_without_backtrace());
    return 2;
  }
}
