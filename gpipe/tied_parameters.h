// Tied parameters: one parameter of the model used by layers in several partitions (a
// transformer's token embedding and the output projection that shares its weight), kept as one
// parameter while each device that uses it holds its own copy.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/ordered_dict.h>

namespace gpipe {

// Note [Tied parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A tie is a parameter the plain model uses in several layers: one tensor held by two layers
// (found by identity, as Slapo finds them), or two tensors the user names as one (pairs of names,
// as Varuna's shared_weights). In the plain model its gradient is the sum of every use's, and the
// optimizer steps it once. A pipeline keeps that:
//
// - Each tie has an owner, its first place in layer order. Every other place on the owner's
//   device uses the owner itself when it is the same tensor; a place on another device cannot (a
//   tensor lives on one device), so its layer is cloned there (Module::clone) and holds a copy.
//   Two tensors named as one: the second is a copy, wherever it is.
// - Copies take the owner's value at construction and again before each forward or step (an
//   optimizer step or a load may have changed it), so they are equal whenever they are used.
// - Copies' gradients are added to the owner's at the end of the backward (GPipe::step: when the
//   step's backwards are done; forward(): an end-of-backward callback queued behind the
//   pipeline's own, Note [A callback the failed backward drops]), and the copies' own are reset.
//   A step that fails adds them too, before it rethrows: the plain model's one parameter keeps a
//   failed backward's partial gradient until zero_grad(), which cannot reach a copy. After a
//   forward()'s failed backward the copies keep theirs until the next forward() or step() (the
//   engine may still be running nodes of that graph on a device's thread when the failure
//   reaches the dropped callback); that one adds them to the owner's gradient unless the owner's
//   was cleared meanwhile (undefined or all zeros, as zero_grad() leaves it), and otherwise
//   drops them. The owner's gradient is then exactly the plain model's when the user retries
//   after zero_grad(), and when they go on accumulating after a failure that reached the
//   owner's place (one that stopped before it, the owner's gradient still undefined, loses the
//   copies' parts: call zero_grad() after a failed backward).
// - parameters() and named_parameters() of a GPipe (and of a PipelineStage and a DataParallel)
//   list every parameter once, a tie under its owner's name, and no copy; an optimizer over them
//   steps a tie once. torch::nn::Module's own (through a Module&, or a parent module) list each
//   place, copies too: an optimizer must not be given those.
// - Across processes (PipelineStage), each stage holding a tie keeps its own tensor; after each
//   step's backward the stages sum its gradient (Note [Ties across stages] in
//   gpipe/distributed/internal/tied_stages.h).

/// Pairs of parameter names, as the Sequential's named_parameters() gives them
/// ("<layer name>.<parameter>", e.g. "0.weight"), each naming two tensors that are one parameter
/// of the model (Varuna's shared_weights).
using TiedNames = std::vector<std::pair<std::string, std::string>>;

/// One tied parameter: its places, in the Sequential's order (named_parameters()'s names).
struct Tie {
  std::vector<std::string> names;
  /// The index in the Sequential of the layer of each place.
  std::vector<int64_t> layers;
};

/// The ties of `module`: every tensor that two or more layers hold, joined with the `named` pairs,
/// in the order of their first place. Throws c10::Error (prefixed by `who`) for a name that is not
/// a parameter of `module`, or a pair whose shapes, dtypes or requires_grad differ.
std::vector<Tie> find_ties(const torch::nn::Sequential& module, const TiedNames& named,
                           const char* who);

/// `module` as it is, or, where a layer shares a tensor with a layer on another device (layer i
/// runs on layer_devices[i]), a Sequential of the same layers under the same names but with each
/// such later layer replaced by its clone (torch::nn::Module::clone), which holds copies (Note
/// [Tied parameters]). Throws c10::Error naming the layer when it cannot be cloned.
torch::nn::Sequential clone_across_devices(const torch::nn::Sequential& module,
                                           const std::vector<c10::Device>& layer_devices,
                                           const char* who);

/// Within one process: the owner and the copies of each tie over `partitions` (Sequentials
/// holding some of the tied layers under their names), kept equal and their gradients summed
/// (Note [Tied parameters]).
class TiedCopies {
 public:
  TiedCopies(const std::vector<Tie>& ties, const std::vector<torch::nn::Sequential>& partitions);

  /// Whether any tie has a copy here.
  bool has_copies() const { return copies_ > 0; }
  /// The owner here of each tie (its first place among the partitions), or an undefined tensor
  /// for a tie with no place here; one entry per tie.
  const std::vector<at::Tensor>& owners() const { return owners_; }
  /// Copies take their owners' values (before each forward and step); first, after a failed
  /// backward, settles the gradients it left on the copies (Note [Tied parameters]).
  void refresh();
  /// Adds each copy's gradient to its owner's (on the owner's device) and resets the copy's.
  void sum_gradients();
  /// Marks that a forward()'s backward failed, leaving its gradients on the copies until the next
  /// refresh(). Thread-safe: the engine may call it from a device thread.
  void mark_failed_backward() { failed_backward_.store(true); }
  /// Whether `t` is a copy.
  bool is_copy(const at::Tensor& t) const;

 private:
  std::vector<at::Tensor> owners_;
  std::vector<std::vector<at::Tensor>> copies_of_;
  size_t copies_ = 0;
  std::atomic<bool> failed_backward_{false};

  void sum_gradients_of(size_t k);
  void settle_failed_backward();
};

/// `all` (a module's named_parameters()) with each tensor once, under its first name, and
/// without the copies of `tied` (when given).
torch::OrderedDict<std::string, at::Tensor> unique_parameters(
    const torch::OrderedDict<std::string, at::Tensor>& all, const TiedCopies* tied = nullptr);

/// Queues `tied`'s sum_gradients at the end of the running backward, behind every end-of-backward
/// callback queued so far or by them (a stage-local backward's wait): from a hook on the
/// pipeline's output.
void sum_tied_gradients_after_backward(std::shared_ptr<TiedCopies> tied);

}  // namespace gpipe
