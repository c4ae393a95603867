// Loading a save into another layout (internal, not API): every tensor and optimizer state of a
// save named by its layer in the whole Sequential, and read back by those names into any layout
// (Note [Saves that outlive their layout] in gpipe/saved_training.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include "gpipe/grad_scaler.h"
#include "gpipe/tied_parameters.h"

namespace gpipe {
namespace internal {

// Keys of a save's archive (letters and underscores only, as LibTorch's archives take them).
inline constexpr const char* kNames = "gpipe_names";
inline constexpr const char* kTensors = "gpipe_tensors";
inline constexpr const char* kRandom = "gpipe_random";
inline constexpr const char* kLayout = "gpipe_layout";
inline constexpr const char* kStep = "gpipe_step";
inline constexpr const char* kOptimizer = "gpipe_optimizer";
inline constexpr const char* kScaler = "gpipe_grad_scaler";
// Each of kNames' tensors by its name in the whole Sequential ("" where not known).
inline constexpr const char* kLayerNames = "gpipe_layer_names";
// The optimizer's kind (optimizer_kind), and each of its parameters' (in its groups' order)
// name in the whole Sequential.
inline constexpr const char* kOptimizerKind = "gpipe_optimizer_kind";
inline constexpr const char* kOptimizerNames = "gpipe_optimizer_names";

// One layer of a layout: the prefix of its tensors' names in the module that holds it
// ("partitions.1.3." in a GPipe) and its index in the whole Sequential.
struct PlacedLayer {
  std::string prefix;
  int64_t index = 0;
  std::shared_ptr<torch::nn::Module> layer;
};

// A module's tensor names (as its named_parameters() gives them, buffers as "buffer <name>") to
// their names in the whole Sequential ("<layer index>.<name in the layer>", "buffer ...").
using LayerNames = std::unordered_map<std::string, std::string>;

// Every parameter and buffer of `module`, by name (buffers as "buffer <name>", so that the two
// never mix).
std::vector<std::pair<std::string, at::Tensor>> state_of(const torch::nn::Module& module);

// Whether `names` (a save file's kNames list) are exactly `module`'s tensors' names (state_of):
// then the file was saved from the same layout and loads exactly.
bool same_tensor_names(const c10::IValue& names, const torch::nn::Module& module);

LayerNames layer_names(const std::vector<PlacedLayer>& layers);
// Of a Sequential or a GPipe; empty for any other module (its layout is not known).
LayerNames layer_names(const torch::nn::Module& module);
// For each place of each tie (its name in the whole Sequential), the tie's other places.
std::unordered_map<std::string, std::vector<std::string>> tie_aliases(const std::vector<Tie>& ties);
// The ties of a Sequential or a GPipe (a Sequential's: the tensors two layers hold).
std::vector<Tie> ties_of(const torch::nn::Module& module);

// The name of `optimizer`'s kind as a save records it ("Adam", "SGD", ...; "" for another).
std::string optimizer_kind(const torch::optim::Optimizer& optimizer);
// Each parameter's optimizer state moved to the parameter's device, for an optimizer kind that
// optimizer_kind names (LibTorch's Optimizer::load keeps the devices the state was saved from).
void place_moments_on_parameters(torch::optim::Optimizer& optimizer);

// A save's files (of one process, or of a save across processes) read into a module of another
// layout by the layer names they hold. Nothing changes until apply(); everything is checked
// before (every tensor found, of its shape and dtype; every optimizer state found, of the
// optimizer's kind and its parameter's shape; the steps agree).
class ReshardedLoad {
 public:
  // `whole`: the module holds the whole model, so a saved tensor it lacks is refused; else
  // `layers` (if not negative) is the model's number of layers, and a save that holds a layer
  // past them is refused.
  ReshardedLoad(torch::nn::Module& module, LayerNames names, std::vector<Tie> ties,
                torch::optim::Optimizer* optimizer, GradScaler* scaler, bool whole,
                int64_t layers = -1);
  // Reads the save at `path`: a file of one process's save, or else a folder that a save across
  // processes committed (its files as the manifest lists them, checked, but for the random
  // generators'). Returns the folder's count of saves (0 for a file).
  int64_t read(const std::string& path);
  // Checks the files against the module, the optimizer and the scaler; returns the step.
  int64_t check();
  // Copies the save into the module, the optimizer and the scaler.
  void apply();

 private:
  struct Saved {
    at::Tensor tensor;
    std::string path;
  };
  struct SavedState {  // a parameter's optimizer state; null: the parameter had none
    std::shared_ptr<torch::serialize::InputArchive> state;
    std::string kind, path;
  };
  // Reads a file of the save (`bytes`, read from `path`).
  void add(const std::string& path, const std::string& bytes);
  std::unique_ptr<torch::optim::OptimizerParamState> state_for(const at::Tensor& param,
                                                               const std::string& name);

  torch::nn::Module& module_;
  LayerNames names_;
  std::unordered_map<std::string, std::vector<std::string>> aliases_;
  torch::optim::Optimizer* optimizer_;
  GradScaler* scaler_;
  bool whole_;
  int64_t layers_;
  bool saved_optimizer_ = false;                        // a file held an optimizer's state
  std::map<std::string, Saved> tensors_;                // by name in the whole Sequential
  std::map<std::string, SavedState> states_;            // the same
  std::vector<std::pair<int64_t, std::string>> steps_;  // each file's step and path
  std::optional<int64_t> manifest_step_;
  std::optional<GradScaler> scaler_state_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;  // (the module's, the saved)
  std::vector<std::pair<at::Tensor, std::unique_ptr<torch::optim::OptimizerParamState>>>
      states_to_set_;
};

}  // namespace internal
}  // namespace gpipe
