// Models written in Python: a ResNet-like and a GPT-like nn.Sequential scripted by python3-torch
// (tests/gpipe/scripted_models.py), cut into layers by from_torchscript and trained by a GPipe
// under 1F1B, take Python's own training steps (losses and weights), and the scripted module
// gpipe trained saves a file that Python's torch.jit.load reads with those weights (Note [Layers
// from TorchScript] in gpipe/torchscript.h).
#include "gpipe/torchscript.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "gpipe/gpipe.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace testing {
namespace {

namespace fs = std::filesystem;

// As scripted_models.py: the batch, its micro-batches and the steps.
constexpr int64_t kBatch = 4, kChunks = 2;
constexpr int kSteps = 3;

// The Python script: where Bazel's runfiles put it, else beside this file.
std::string script() {
  const std::string runfile = "tests/gpipe/scripted_models.py";
  if (fs::exists(runfile)) return runfile;
  return (fs::path(__FILE__).parent_path() / "scripted_models.py").string();
}

// Runs the script (with the system's python3, which python3-torch serves) with `args`; its exit
// code.
int python(const std::string& args) {
  return std::system(absl::StrCat("/usr/bin/python3 ", script(), " ", args).c_str());
}

// sin(0.1 * arange(n) + step + shift) in `shape`, as scripted_models.py's data().
at::Tensor data(std::vector<int64_t> shape, int step, double shift) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return at::sin(0.1 * at::arange(n, at::kDouble) + (step + shift)).reshape(shape);
}

std::vector<double> read_losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  for (double v; in >> v;) out.push_back(v);
  return out;
}

at::Tensor mse(const Batch& out, const at::Tensor& target) {
  return torch::nn::functional::mse_loss(out[0], target);
}

struct Case {
  std::string name;
  std::vector<int64_t> balance, x_shape, y_shape;
  Checkpoint checkpoint;
};

CATCH_TEST_CASE(
    "a model scripted in Python trains in a GPipe under 1F1B as Python trains it and saves a file "
    "that Python loads with the trained weights",
    "[torchscript][python]") {
  const Case c = GENERATE(
      // Its batch norms are scripted: no recomputation (Note [Layers from TorchScript]).
      Case{"resnet", {2, 2, 2}, {kBatch, 2, 6, 6}, {kBatch, 3}, Checkpoint::kNever},
      Case{"gpt", {2, 3}, {kBatch, 4, 5}, {kBatch, 4, 5}, Checkpoint::kExceptLast});
  CATCH_INFO(c.name);
  const fs::path folder =
      fs::temp_directory_path() / absl::StrCat("gpipe_torchscript_", c.name, "_", ::getpid());
  fs::create_directories(folder);
  CATCH_REQUIRE(python("make " + folder.string()) == 0);

  torch::jit::Module scripted = torch::jit::load((folder / (c.name + ".pt")).string());
  torch::nn::Sequential layers = from_torchscript(scripted);
  CATCH_CHECK(&scripted_module(layers) != nullptr);
  // The layers' parameters are the scripted module's own tensors.
  std::vector<at::Tensor> mine = layers->parameters(), theirs;
  for (const auto& p : scripted.parameters()) theirs.push_back(p);
  CATCH_REQUIRE(mine.size() == theirs.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    CATCH_CHECK(mine[k].unsafeGetTensorImpl() == theirs[k].unsafeGetTensorImpl());
  }

  GPipe model(layers, GPipeOptions(c.balance)
                          .chunks(kChunks)
                          .schedule(ScheduleKind::k1F1B)
                          .checkpoint(c.checkpoint));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05));
  const std::vector<double> expected = read_losses((folder / (c.name + "_losses.txt")).string());
  CATCH_REQUIRE(expected.size() == static_cast<size_t>(kSteps));
  for (int step = 0; step < kSteps; ++step) {
    sgd.zero_grad();
    const double loss =
        model->step(data(c.x_shape, step, 0.0), data(c.y_shape, step, 0.5), mse).item<double>();
    sgd.step();
    CATCH_CHECK(std::abs(loss - expected[step]) <= 1e-9);
  }
  // Python's trained weights, in C++, and gpipe's trained file, in Python.
  torch::jit::Module trained = torch::jit::load((folder / (c.name + "_trained.pt")).string());
  std::vector<at::Tensor> want;
  for (const auto& p : trained.parameters()) want.push_back(p);
  for (const auto& b : trained.buffers()) want.push_back(b);
  std::vector<at::Tensor> got;
  for (const auto& p : scripted.parameters()) got.push_back(p);
  for (const auto& b : scripted.buffers()) got.push_back(b);
  CATCH_REQUIRE(want.size() == got.size());
  for (size_t k = 0; k < want.size(); ++k) CATCH_CHECK(max_diff(want[k], got[k]) <= 1e-9);
  const std::string saved = (folder / (c.name + "_gpipe.pt")).string();
  scripted_module(layers).save(saved);
  CATCH_CHECK(python("check " + saved + " " + (folder / (c.name + "_trained.pt")).string()) == 0);
  fs::remove_all(folder);
}

CATCH_TEST_CASE(
    "from_torchscript refuses a submodule that is not there and one without children and a file "
    "it cannot load naming each",
    "[torchscript][python]") {
  const fs::path folder =
      fs::temp_directory_path() / absl::StrCat("gpipe_torchscript_bad_", ::getpid());
  fs::create_directories(folder);
  CATCH_REQUIRE(python("make " + folder.string()) == 0);
  torch::jit::Module scripted = torch::jit::load((folder / "gpt.pt").string());
  CATCH_CHECK_THROWS_WITH(from_torchscript(scripted, "blocks"),
                          gpipe_test::contains("has no submodule 'blocks' ('blocks' is not "
                                               "there; the submodules there are: 0, 1, 2, 3, "
                                               "4)"));
  // Layer 1, a Block: its children are layers, the last of which takes a tensor of another width.
  const torch::nn::Sequential inner = from_torchscript(scripted, "1");
  CATCH_CHECK(inner->size() == 6);
  CATCH_CHECK_THROWS_WITH(from_torchscript(scripted, "3"),
                          gpipe_test::contains("submodule '3' has no children"));
  CATCH_CHECK_THROWS_WITH(from_torchscript((folder / "none.pt").string()),
                          gpipe_test::contains("cannot load '" + (folder / "none.pt").string()));
  fs::remove_all(folder);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
