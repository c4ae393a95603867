// Saving in one process as a crash or a mismatch finds it: a save that fails leaves the previous
// file whole and no temporary file; a refused load changes nothing (Notes [Saving and resuming],
// [Atomic saves] in gpipe/saved_training.h).
#include "gpipe/saved_training.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gpipe/internal/atomic_file.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;
namespace fs = std::filesystem;

// A fresh folder of this test process, removed when the test ends.
class Folder {
 public:
  explicit Folder(const std::string& name)
      : path_(fs::temp_directory_path() / absl::StrCat("gpipe_save_", name, "_", ::getpid())) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~Folder() {
    std::error_code ignored;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ignored);
    fs::remove_all(path_, ignored);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  // The names in the folder.
  std::set<std::string> names() const {
    std::set<std::string> out;
    for (const auto& entry : fs::directory_iterator(path_)) {
      out.insert(entry.path().filename().string());
    }
    return out;
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

// Runs a commit hook for as long as it lives (internal::set_commit_hook).
struct CommitHook {
  explicit CommitHook(std::function<void(const std::string&)> hook) {
    internal::set_commit_hook(std::move(hook));
  }
  ~CommitHook() { internal::set_commit_hook(nullptr); }
};

nn::Sequential small_model(int64_t outputs, int seed) {
  at::manual_seed(seed);
  nn::Sequential seq(nn::Linear(6, 8), nn::Tanh(), nn::Linear(8, outputs));
  seq->to(at::kDouble);
  return seq;
}

// `steps` Adam steps of `model` on random data.
void train(nn::Sequential& model, torch::optim::Adam& adam, int steps) {
  for (int k = 0; k < steps; ++k) {
    adam.zero_grad();
    model->forward(at::randn({4, 6}, at::kDouble)).pow(2).sum().backward();
    adam.step();
  }
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : tensors) out.push_back(t.detach().clone());
  return out;
}

// Adam's state of `p` (its optimizer's state is keyed by a string of the TensorImpl's address in
// LibTorch 1.x, by the address itself in 2.x).
template <typename Map>
const torch::optim::AdamParamState& adam_state_of(const Map& states, const at::Tensor& p) {
  const void* impl = p.unsafeGetTensorImpl();
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;
    key << impl;
    return static_cast<const torch::optim::AdamParamState&>(*states.at(key.str()));
  } else {
    return static_cast<const torch::optim::AdamParamState&>(*states.at(const_cast<void*>(impl)));
  }
}

// Adam's state of each of `params` (step, moments), copied.
std::vector<at::Tensor> adam_state(torch::optim::Adam& adam,
                                   const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : params) {
    const torch::optim::AdamParamState& state = adam_state_of(adam.state(), p);
    out.push_back(at::tensor({state.step()}, at::kLong));
    out.push_back(state.exp_avg().clone());
    out.push_back(state.exp_avg_sq().clone());
  }
  return out;
}

// Every tensor of `a` equals `b`'s, bit for bit.
void check_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  CATCH_REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) CATCH_CHECK(at::equal(a[k], b[k]));
}

CATCH_TEST_CASE("A save that fails before its file is in place leaves the previous file whole "
                "and no temporary file",
                "[save]") {
  Folder folder("crash");
  const std::string path = folder / "run.pt";
  nn::Sequential model = small_model(3, 1);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  train(model, adam, 2);
  save_training(path, *model, &adam, 2);
  const std::string saved = gpipe::internal::read_whole_file(path, "test");
  const std::vector<at::Tensor> at_step_2 = copies(model->parameters());

  train(model, adam, 2);
  {
    // Killed after the new file's bytes are on the disk, before its rename.
    CommitHook crash([&](const std::string& p) {
      if (p == path) throw std::runtime_error("killed before the rename");
    });
    CATCH_CHECK_THROWS_WITH(save_training(path, *model, &adam, 4),
                            gpipe_test::contains("killed before the rename"));
  }
  CATCH_CHECK(folder.names() == std::set<std::string>{"run.pt"});
  CATCH_CHECK(gpipe::internal::read_whole_file(path, "test") == saved);
  CATCH_CHECK(saved_step(path) == 2);  // the newest save is still step 2's
  CATCH_CHECK(saved_step(folder / "none.pt") == -1);
  nn::Sequential other = small_model(3, 2);
  torch::optim::Adam adam2(other->parameters(), torch::optim::AdamOptions(0.01));
  CATCH_CHECK(load_training(path, *other, &adam2) == 2);
  check_equal(other->parameters(), at_step_2);

  // Not killed: the new save replaces the old one.
  save_training(path, *model, &adam, 4);
  CATCH_CHECK(saved_step(path) == 4);
  CATCH_CHECK(load_training(path, *other, &adam2) == 4);
  check_equal(other->parameters(), model->parameters());
  CATCH_CHECK(folder.names() == std::set<std::string>{"run.pt"});
}

CATCH_TEST_CASE("A save that cannot write its file throws naming the path and leaves no "
                "temporary file",
                "[save]") {
  Folder folder("unwritable");
  nn::Sequential model = small_model(3, 1);
  // The path is a folder that holds a file: the rename into place fails.
  const std::string taken = folder / "taken.pt";
  fs::create_directories(taken);
  std::ofstream(taken + "/keep") << "x";
  CATCH_CHECK_THROWS_WITH(save_training(taken, *model, nullptr, 1),
                          gpipe_test::contains("gpipe::save_training: cannot write '" + taken +
                                               "'"));
  CATCH_CHECK(folder.names() == std::set<std::string>{"taken.pt"});
  // A folder that is not there.
  const std::string missing = folder / "missing/run.pt";
  CATCH_CHECK_THROWS_WITH(save_training(missing, *model, nullptr, 1),
                          gpipe_test::contains("cannot write '" + missing + "'"));
  // A folder this process may not write to (root may write anywhere).
  if (::geteuid() != 0) {
    Folder locked("locked");
    ::chmod(locked.path().c_str(), 0555);
    const std::string path = locked / "run.pt";
    CATCH_CHECK_THROWS_WITH(save_training(path, *model, nullptr, 1),
                            gpipe_test::contains("cannot write '" + path + "'"));
    CATCH_CHECK(locked.names().empty());
  }
}

CATCH_TEST_CASE("A refused load leaves every parameter and the optimizer's state as they were",
                "[save]") {
  Folder folder("refused");
  const std::string path = folder / "run.pt";
  nn::Sequential saved = small_model(3, 1);
  torch::optim::Adam adam(saved->parameters(), torch::optim::AdamOptions(0.01));
  train(saved, adam, 2);
  save_training(path, *saved, &adam, 2);

  // The last tensors differ: "2.weight" and "2.bias" are [4, 8] and [4] here.
  nn::Sequential other = small_model(4, 2);
  torch::optim::Adam other_adam(other->parameters(), torch::optim::AdamOptions(0.01));
  train(other, other_adam, 1);
  std::vector<at::Tensor> params = copies(other->parameters());
  std::vector<at::Tensor> state = adam_state(other_adam, other->parameters());
  CATCH_CHECK_THROWS_WITH(load_training(path, *other, &other_adam),
                          gpipe_test::contains("'2.weight' in '" + path + "' is [3, 8] Double, "
                                               "but the module's is [4, 8] Double"));
  check_equal(other->parameters(), params);
  check_equal(adam_state(other_adam, other->parameters()), state);

  // The same model, an optimizer over fewer parameters: refused before the module changes.
  nn::Sequential same = small_model(3, 3);
  std::vector<at::Tensor> three = same->parameters();
  three.pop_back();
  torch::optim::Adam fewer(three, torch::optim::AdamOptions(0.01));
  params = copies(same->parameters());
  CATCH_CHECK_THROWS_WITH(load_training(path, *same, &fewer),
                          gpipe_test::contains("parameter group 0 in '" + path +
                                               "' has 4 parameter(s), but this optimizer's "
                                               "has 3"));
  check_equal(same->parameters(), params);

  // An optimizer over the parameters in another order: the moments do not fit their parameters.
  std::vector<at::Tensor> reversed = same->parameters();
  std::reverse(reversed.begin(), reversed.end());
  torch::optim::Adam backwards(reversed, torch::optim::AdamOptions(0.01));
  CATCH_CHECK_THROWS_WITH(load_training(path, *same, &backwards),
                          gpipe_test::contains("the optimizer's 'exp_avg' of '2.bias' in '" +
                                               path + "' is [8, 6], but the parameter is [3]"));
  check_equal(same->parameters(), params);
  CATCH_CHECK(backwards.state().empty());
}

CATCH_TEST_CASE("A load into the saved layout refuses an optimizer of another kind and replaces "
                "the state the optimizer had with the saved one",
                "[save]") {
  Folder folder("optimizer_state");
  const std::string path = folder / "run.pt";
  nn::Sequential saved = small_model(3, 1);
  std::vector<at::Tensor> params = saved->parameters();
  torch::optim::Adam adam(params, torch::optim::AdamOptions(0.01));
  // Only the first parameter has a gradient, so only it has a state when saved.
  adam.zero_grad();
  params[0].mutable_grad() = at::ones_like(params[0]);
  adam.step();
  CATCH_REQUIRE(adam.state().size() == 1);
  save_training(path, *saved, &adam, 1);

  nn::Sequential same = small_model(3, 2);
  torch::optim::AdamW adamw(same->parameters(), torch::optim::AdamWOptions(0.01));
  CATCH_CHECK_THROWS_WITH(load_training(path, *same, &adamw),
                          gpipe_test::contains("holds the state of the optimizer Adam, but it is "
                                               "loaded into an optimizer of AdamW"));
  CATCH_CHECK(adamw.state().empty());

  // An optimizer that has stepped every parameter: after the load only the saved state is left,
  // as when the saved run went on.
  torch::optim::Adam used(same->parameters(), torch::optim::AdamOptions(0.01));
  train(same, used, 2);
  CATCH_REQUIRE(used.state().size() == 4);
  CATCH_CHECK(load_training(path, *same, &used) == 1);
  CATCH_CHECK(used.state().size() == 1);
  check_equal(adam_state(used, {same->parameters()[0]}), adam_state(adam, {params[0]}));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
