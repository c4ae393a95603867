// Models written in Python: a scripted module (torch.jit.script(...).save() in Python) cut into
// the layers of a Sequential whose parameters and buffers are the scripted module's own tensors.
#pragma once

#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

namespace torch {
namespace jit {
struct Module;
}  // namespace jit
}  // namespace torch

namespace gpipe {

// Note [Layers from TorchScript]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A model defined and initialised in Python reaches C++ as a scripted module. from_torchscript
// takes its children (of the module itself when it is a scripted nn.Sequential, or of a
// submodule the user names) as layers: each a ScriptedLayer, an nn::Module whose forward() calls
// the child's scripted forward on one tensor and whose parameters and buffers are registered
// from the child's own tensors (the same TensorImpls, under the child's names with '.' written
// '_': LibTorch's names take no dots). So everything gpipe does to a layer's tensors reaches the
// scripted module: an optimizer's in-place update, a move to a partition's device (Module::to
// sets the tensors' data in place), batch norm's running statistics (updated by the scripted
// code in place). train() and eval() set the scripted child's mode too. The root scripted module
// (scripted_module()) therefore holds the trained weights: its save() writes a file that
// Python's torch.jit.load reads. A ScriptedLayer cloned (a tie across devices) holds a deep copy
// of its child (and no root: save the model it was cloned from). Making the layers sets each
// child's mode to the layer's (training, as any new module), whatever mode Python saved; call
// eval() on the Sequential or the GPipe for the other. What a scripted layer cannot do: take or
// return anything but one tensor whose first dimension is the batch (refused at its first forward,
// naming the layer); and gpipe cannot see inside it, so a scripted BatchNorm is not a BatchNorm to
// gpipe: deferred batch norm does not reach it, and a checkpointed micro-batch's recomputation
// updates its running statistics a second time (train such a model with Checkpoint::kNever, or keep
// its batch norms in eval mode). Tested (tests/gpipe/torchscript_test.cc): a ResNet-like and a
// GPT-like model scripted by python3-torch, trained by a GPipe under 1F1B, against Python's
// training of the same file.

/// One child of a scripted module as a layer (Note [Layers from TorchScript]).
class ScriptedLayerImpl : public torch::nn::Cloneable<ScriptedLayerImpl> {
 public:
  /// `child` is a submodule of `root` (or root itself), named `name` there (for errors).
  ScriptedLayerImpl(const torch::jit::Module& child, const torch::jit::Module& root,
                    std::string name);
  /// Registers the child's parameters and buffers (for a clone: of a deep copy of the child).
  /// Refused on a layer that holds them: they are the scripted model's (Note [Layers from
  /// TorchScript]).
  void reset() override;
  /// The child's scripted forward on `input`; its result must be one tensor.
  at::Tensor forward(const at::Tensor& input);
  /// Sets this layer's mode and the scripted child's.
  void train(bool on = true) override;
  /// The scripted child.
  const torch::jit::Module& module() const { return *child_; }
  /// The scripted module the child belongs to. Throws c10::Error for a clone (Module::clone),
  /// which holds a deep copy of its child only.
  const torch::jit::Module& root() const;

 private:
  std::shared_ptr<torch::jit::Module> child_, root_;  // root_ null: a clone
  std::string name_;
  bool registered_ = false;  // a copy being cloned when reset() finds it set
};

/// A ScriptedLayerImpl's holder (TORCH_MODULE).
TORCH_MODULE(ScriptedLayer);

/// The layers of a scripted model as a Sequential: one ScriptedLayer per child of `module` (a
/// scripted nn.Sequential), or per child of its submodule `child` when given (e.g. "blocks" of
/// a model whose blocks are an nn.Sequential or nn.ModuleList), each under its child's name. The
/// layers' parameters are the scripted module's own tensors (Note [Layers from TorchScript]):
/// train the Sequential in a GPipe, then save `module` and Python loads the trained weights.
/// Throws c10::Error naming what is missing when there is no such child or it has no children.
///
///   torch::jit::Module scripted = torch::jit::load("gpt.pt");  // saved by Python
///   gpipe::GPipe model(gpipe::from_torchscript(scripted), gpipe::GPipeOptions({3, 2}));
///   ...  // train
///   scripted.save("gpt_trained.pt");                           // torch.jit.load reads it
torch::nn::Sequential from_torchscript(const torch::jit::Module& module,
                                       const std::string& child = "");

/// The same for the scripted module in the file `path` (torch::jit::load onto the CPU). Throws
/// c10::Error naming `path` when it cannot be loaded. scripted_module() gives the loaded module.
torch::nn::Sequential from_torchscript(const std::string& path, const std::string& child = "");

/// The scripted module whose children `layers` are (the first layer's root()), to save() the
/// trained model. Throws c10::Error when `layers`' first layer is not a ScriptedLayer.
///
///   torch::nn::Sequential layers = gpipe::from_torchscript("gpt.pt");
///   ...  // train
///   gpipe::scripted_module(layers).save("gpt_trained.pt");
const torch::jit::Module& scripted_module(const torch::nn::Sequential& layers);

}  // namespace gpipe
