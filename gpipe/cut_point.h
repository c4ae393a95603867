// Cut points: places a user marks inside any module's forward() where a pipeline may cut it, and
// the sections between them as the layers of a Sequential that a GPipe or a PipelineStage trains.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

namespace gpipe {

// Note [Cut points]
// ~~~~~~~~~~~~~~~~~
// A model as C++ users write it — a Module whose forward() mixes submodules, residual additions,
// views and loops — is pipelined by marking places in its forward() where a stage may begin:
// `x = cut1(x);`, cut1 a registered CutPoint (Varuna's CutPoints). Outside a pipeline a cut
// point returns its input. cut(model, sample) makes one layer, a Section, per stretch of forward()
// between two cut points (or the start or the end), so that every GPipe and PipelineStage feature
// — schedules, checkpointing, deferred batch norm, ties, saves, balancers — works on them as on
// any Sequential.
//
// Which tensors a section owns. cut() runs the model once on the sample (the dry run), with every
// floating parameter requiring grad, each cut point's output a new leaf; section s owns the
// parameters its result's autograd graph reaches back to its own input leaf, and every tensor of
// a submodule whose parameters are all its (buffers, frozen weights). A parameter reached by two
// sections — a weight used in both, or a value of an earlier section reaching a later one other
// than through the cut point — is refused, naming it: only the tensor at a cut point crosses
// sections (and skips, stash/pop, inside a section); register a copy of a shared weight and tie
// it (GPipeOptions::tied_parameters). A buffer of a module without parameters directly under a
// module that spans sections (a BatchNorm without affine weights under the root) is held by every
// section as a constant: moved with it, not saved, and not seen by deferred batch norm (the
// section that calls such a BatchNorm in training updates its own copy's statistics: give it
// affine weights, or put it in a submodule with the layer before it, to make it a section's).
//
// How a section computes only its own part. C++ cannot enter forward() in its middle, so a
// section runs the whole forward() of its own copy of the model (Cloneable's clone()), in which
// the tensors of other sections are stride-0 expansions of one zero: no memory, any shape.
// Before its first cut point it runs on a placeholder — an empty batch (zero samples), in eval
// mode, without autograd — and at that cut point it swaps the placeholder's activation for its
// real input and the model's own mode; at its last cut point it stops (an exception that the
// section catches). On an empty batch ops do no work (about 1 to 8 us each on the CPU); code that
// cannot run on one (a view(b, -1), ambiguous for 0 elements) makes the section fall back, for
// good, to a batch of one zero sample, which costs the code before the section at batch 1 (ops
// that need a contiguous weight copy an expanded one, briefly). benchmarks/cut_points measures
// both. A section's forwards run one at a time (a mutex): its copy's modes change during a
// forward. Modes are the modules' own: cut() and a section's forward() leave every module's
// mode as they found it (a BatchNorm in eval mode inside a training model stays frozen), and a
// section's train() sets its copy's every module's, as Module::train does.
//
// What a forward() may not do (each refused with an error naming the cut point or the section):
// call a cut point twice, pass one a tensor whose first dimension is not the batch, read a
// tensor's values (item(), a branch on data) before a section's start — there it sees zeros —,
// or let a value computed before a cut point reach the code after it other than through the cut
// point. The last is checked when cut() is made: the sections, run one after another on the
// sample, must give the model's own output (eval mode, no autograd), or cut() refuses the model
// (a crossing value from an empty placeholder fails to broadcast; from a batch of one, it
// differs).

/// A place in a module's forward() where a pipeline may cut (Note [Cut points]): register one
/// per place, call each at most once per forward() on one tensor whose first dimension is the
/// batch. Outside a section it returns its input.
///
///   struct NetImpl : torch::nn::Cloneable<NetImpl> {
///     void reset() override { ... cut = register_module("cut", gpipe::CutPoint()); }
///     at::Tensor forward(at::Tensor x) { x = cut(first(x)); return second(x) + x; }
///     ...
///   };
class CutPointImpl : public torch::nn::Cloneable<CutPointImpl> {
 public:
  CutPointImpl() = default;
  /// A cut point holds nothing.
  void reset() override {}
  /// `input`, or inside a section what the section makes of this place (Note [Cut points]).
  at::Tensor forward(const at::Tensor& input);
};

/// A CutPointImpl's holder (TORCH_MODULE).
TORCH_MODULE(CutPoint);

/// Calls a model's forward() on one tensor (cut() makes it from the model's type).
using ModelForward = std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)>;

/// How cut() cut a model, shared by its sections.
struct CutPlan {
  /// The model, of the user's type, while cut() runs (sections hold copies of it); null after,
  /// so that no process keeps the whole model.
  std::shared_ptr<torch::nn::Module> model;
  /// Its forward().
  ModelForward forward;
  /// A sample's shape without the batch, and its dtype (the placeholder's).
  std::vector<int64_t> sample_shape;
  /// The sample's dtype.
  c10::ScalarType sample_dtype = c10::kFloat;
  /// The number of cut points forward() calls.
  int64_t cut_points = 0;
  /// Per interval between cut points (cut_points + 1 of them), each tensor it owns, by its path
  /// in the model ("blocks.2.weight"; buffers "buffer " + path).
  std::vector<std::vector<std::string>> owned;
  /// The tensors no interval owns (Note [Cut points]: held by every section as constants).
  std::vector<std::string> constants;
};

/// One stretch of a model's forward() between two cut points (Note [Cut points]): intervals
/// [first, last] of a CutPlan. Its parameters and buffers are the ones its intervals own,
/// registered as its own: the submodules they make up under their paths ('_' for '.'), lone
/// tensors likewise.
class SectionImpl : public torch::nn::Cloneable<SectionImpl> {
 public:
  /// Section of intervals [first, last] of `plan` (whose model it copies).
  SectionImpl(std::shared_ptr<const CutPlan> plan, int64_t first, int64_t last);
  /// The same, copying `source` (a section's copy of the model) instead of the plan's model.
  SectionImpl(std::shared_ptr<const CutPlan> plan, int64_t first, int64_t last,
              std::shared_ptr<torch::nn::Module> source);
  /// Makes its copy of the model (of the section it is cloned from, for a clone) and registers
  /// the tensors it owns; the others become placeholders.
  void reset() override;
  /// Its stretch of forward() on `input` (the model's input for the first section, else the
  /// tensor at its first cut point).
  at::Tensor forward(const at::Tensor& input);
  /// Moves or casts its tensors, and makes its placeholders of the same device and dtype.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  /// Casts its tensors and placeholders.
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// Moves its tensors and placeholders.
  void to(torch::Device device, bool non_blocking = false) override;
  /// Sets the mode of its copy's every module (as Module::train sets a module's submodules').
  void train(bool on = true) override;
  /// A section over a copy of this one's copy of the model (values, modes, requires_grad flags),
  /// moved to `device` if given.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<c10::Device>& device = c10::nullopt) const override;
  /// The first interval (0: the model's start).
  int64_t first() const { return first_; }
  /// The last interval (the plan's cut_points: the model's end).
  int64_t last() const { return last_; }
  /// This section's copy of the model (its other sections' tensors are placeholders).
  const std::shared_ptr<torch::nn::Module>& model() const { return model_; }
  /// The tensors its intervals own, by their keys in the plan (paths; buffers "buffer " + path).
  std::vector<std::pair<std::string, at::Tensor>> owned_tensors() const;

 private:
  struct PrefixFailed;
  // Its stretch with a placeholder batch of `placeholder_batch` zero samples before its start;
  // throws PrefixFailed when forward() fails there.
  at::Tensor run(const at::Tensor& input, int64_t placeholder_batch);
  std::string who() const;  // "gpipe::Section 2" (or "2-3"), for errors
  std::set<std::string> owned_keys() const;  // the plan's keys of its intervals' tensors

  struct Placeholder {
    at::Tensor tensor;  // the copy's tensor whose data is a placeholder
    std::vector<int64_t> shape;
  };
  // Makes each placeholder of `move`(its zero) and moves each constant with `move`.
  void place_others(const std::function<at::Tensor(const at::Tensor&)>& move);

  std::shared_ptr<const CutPlan> plan_;
  int64_t first_ = 0, last_ = 0;
  std::shared_ptr<torch::nn::Module> model_;  // its copy
  std::vector<Placeholder> placeholders_;
  std::vector<at::Tensor> constants_;
  std::shared_ptr<std::mutex> running_ = std::make_shared<std::mutex>();
  int64_t placeholder_batch_ = 0;  // 1 once forward() failed on an empty batch
  c10::ScalarType input_dtype_ = c10::kFloat;  // the placeholder's: the sample's, cast by to()
};

/// A SectionImpl's holder (TORCH_MODULE).
TORCH_MODULE(Section);

namespace internal {
// cut()'s work, for any model type.
torch::nn::Sequential cut_model(const std::shared_ptr<torch::nn::Module>& model,
                                ModelForward forward, const at::Tensor& sample,
                                const std::vector<int64_t>& balance);
}  // namespace internal

/// `model`'s sections as the layers of a Sequential (Note [Cut points]): one per interval
/// between its cut points, or, given `balance` (intervals per section, summing to the number of
/// intervals), one per entry, each spanning that many intervals (the cut points inside a section
/// cost nothing). `model` must be Cloneable (torch::nn::Cloneable) with a forward() taking one
/// tensor; `sample` is a batch of at least 2 samples of its input (on the model's device). Throws
/// c10::Error naming what is wrong with the model (Note [Cut points]).
///
///   Net net;                                                     // 4 cut points: 5 intervals
///   auto fine = gpipe::cut(net, sample);                         // 5 sections
///   auto balance = gpipe::balance_by_time(2, fine, sample);      // e.g. {3, 2}
///   gpipe::GPipe pipe(gpipe::cut(net, sample, balance), gpipe::GPipeOptions({1, 1}));
template <typename ModuleType>
torch::nn::Sequential cut(const torch::nn::ModuleHolder<ModuleType>& model,
                          const at::Tensor& sample, const std::vector<int64_t>& balance = {}) {
  return internal::cut_model(
      model.ptr(),
      [](torch::nn::Module& m, const at::Tensor& x) -> at::Tensor {
        return dynamic_cast<ModuleType&>(m).forward(x);
      },
      sample, balance);
}

/// Copies the trained tensors of `sections` (cut() of `model`) into `model`, by their paths:
/// the model then computes what the pipeline learned.
void uncut(const torch::nn::Sequential& sections, torch::nn::Module& model);

}  // namespace gpipe
