// Skip connections: a layer stashes a tensor under a name and a later layer pops it, per
// micro-batch, so that the tensor need not be passed through every layer in between. In a GPipe
// the tensor moves straight from the stashing partition's device to the popping one's.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

namespace gpipe {

/// An isolation scope for skip names. Each Namespace() is distinct from every other; copies
/// compare equal. Names of a layer not isolated live in the global namespace.
///
///   gpipe::Namespace level1, level2;
///   encoder1->isolate(level1); decoder1->isolate(level1);  // their "skip" pairs up
class Namespace {
 public:
  /// A new namespace, distinct from all others.
  Namespace();
  /// The namespace of names that were not isolated.
  static Namespace global() { return Namespace(0); }
  /// Its number: 0 for the global namespace, then 1, 2, ... in the order they were made.
  uint64_t id() const { return id_; }
  /// Whether both are the same namespace (one and its copies).
  bool operator==(const Namespace& o) const { return id_ == o.id_; }
  /// Whether they are different namespaces.
  bool operator!=(const Namespace& o) const { return id_ != o.id_; }
  /// An order of namespaces (by id), for maps.
  bool operator<(const Namespace& o) const { return id_ < o.id_; }

 private:
  explicit Namespace(uint64_t id) : id_(id) {}
  uint64_t id_;
};

/// A skip's identity: its name within a namespace.
struct SkipKey {
  /// The namespace the name lives in.
  Namespace ns;
  /// The name given to gpipe::stash and gpipe::pop.
  std::string name;
  /// An order of keys (by namespace, then name), for maps.
  bool operator<(const SkipKey& o) const {
    return ns < o.ns || (ns == o.ns && name < o.name);
  }
  /// Whether both name the same skip.
  bool operator==(const SkipKey& o) const { return ns == o.ns && name == o.name; }
  /// "skip", or "skip@3" in namespace 3.
  std::string str() const;
};

/// The names a skippable layer stashes and pops.
///
///   gpipe::SkippableOptions().stash({"skip"})
///   gpipe::SkippableOptions().pop({"skip"})
struct SkippableOptions {
  /// The names the layer's forward stashes (gpipe::stash), each once per forward.
  TORCH_ARG(std::vector<std::string>, stash) = {};
  /// The names the layer's forward pops (gpipe::pop), each once per forward.
  TORCH_ARG(std::vector<std::string>, pop) = {};
};

/// The part of every skippable layer that does not depend on the wrapped module's type: the
/// declarations, their namespaces, and the bookkeeping around the wrapped forward. Found in a
/// Sequential with dynamic_cast.
class SkippableBase : public torch::nn::Module {
 public:
  /// `name` is the module name, e.g. "gpipe::Skippable(DownImpl)".
  SkippableBase(SkippableOptions options, std::string name);

  /// The names declared as stashed.
  const std::vector<std::string>& stash_names() const { return options_.stash(); }
  /// The names declared as popped.
  const std::vector<std::string>& pop_names() const { return options_.pop(); }

  /// Puts this layer's names (or only those in `only`) into `ns`, so the same layer class can be
  /// used several times in one Sequential. Returns this layer.
  ///
  ///   gpipe::Namespace ns;
  ///   down->isolate(ns);
  ///   up->isolate(ns);
  SkippableBase& isolate(const Namespace& ns, const std::vector<std::string>& only = {});

  /// The key of one of this layer's names.
  SkipKey key(const std::string& name) const;

  /// The module this layer wraps.
  virtual std::shared_ptr<torch::nn::Module> wrapped() const = 0;

  /// Copies another layer's namespaces (for clone()).
  void copy_namespaces(const SkippableBase& other) { namespaces_ = other.namespaces_; }
  /// The declarations this layer was made with.
  const SkippableOptions& options() const { return options_; }

  /// Makes this layer the one gpipe::stash and gpipe::pop act for during a forward, and checks at
  /// finish() that every declared stash and pop happened.
  class ForwardScope {
   public:
    explicit ForwardScope(const SkippableBase& layer);
    ~ForwardScope();
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;
    void finish();

    const SkippableBase& layer;
    std::set<std::string> stashed;
    std::set<std::string> popped;

   private:
    ForwardScope* previous_;
  };

 private:
  SkippableOptions options_;
  std::map<std::string, Namespace> namespaces_;
};

template <typename ModuleType, typename Signature = decltype(&ModuleType::forward)>
class SkippableImpl;

/// A skippable layer wrapping a module whose forward is `Return forward(Args...)`: the wrapper has
/// the same forward, so it goes into a Sequential like the module itself.
template <typename ModuleType, typename Return, typename... Args>
class SkippableImpl<ModuleType, Return (ModuleType::*)(Args...)> : public SkippableBase {
 public:
  /// Wraps `module` (registered as the submodule "module") with the declarations of `options`.
  SkippableImpl(std::shared_ptr<ModuleType> module, SkippableOptions options)
      : SkippableBase(std::move(options),
                      "gpipe::Skippable(" + module->torch::nn::Module::name() + ")"),
        module_(register_module("module", std::move(module))) {}

  /// The wrapped module's forward, during which gpipe::stash and gpipe::pop act for this layer;
  /// throws c10::Error when it did not stash or pop every name this layer declares.
  Return forward(Args... args) {
    ForwardScope scope(*this);
    Return out = module_->forward(std::forward<Args>(args)...);
    scope.finish();
    return out;
  }

  std::shared_ptr<torch::nn::Module> wrapped() const override { return module_; }

  /// A deep copy (the wrapped module must implement clone(), e.g. through torch::nn::Cloneable),
  /// with the same declarations and namespaces.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<c10::Device>& device = c10::nullopt) const override {
    auto module = std::dynamic_pointer_cast<ModuleType>(module_->clone(device));
    TORCH_CHECK(module, "gpipe::Skippable: clone() of ", module_->torch::nn::Module::name(),
                " returned another type");
    auto copy = std::make_shared<SkippableImpl>(std::move(module), options());
    copy->copy_namespaces(*this);
    copy->train(this->is_training());
    return copy;
  }

 private:
  std::shared_ptr<ModuleType> module_;
};

/// The same for a const forward.
template <typename ModuleType, typename Return, typename... Args>
class SkippableImpl<ModuleType, Return (ModuleType::*)(Args...) const>
    : public SkippableImpl<ModuleType, Return (ModuleType::*)(Args...)> {
  using SkippableImpl<ModuleType, Return (ModuleType::*)(Args...)>::SkippableImpl;
};

/// A module holder of a skippable layer.
///
///   struct SaveImpl : torch::nn::Module {
///     at::Tensor forward(const at::Tensor& x) { gpipe::stash("skip", x); return x; }
///   };
///   TORCH_MODULE(Save);
///   gpipe::Skippable<SaveImpl> save(Save(), gpipe::SkippableOptions().stash({"skip"}));
template <typename ModuleType>
class Skippable : public torch::nn::ModuleHolder<SkippableImpl<ModuleType>> {
 public:
  using torch::nn::ModuleHolder<SkippableImpl<ModuleType>>::ModuleHolder;
  /// Wraps the module that `module` holds (not a copy) with the declarations of `options`.
  Skippable(const torch::nn::ModuleHolder<ModuleType>& module, SkippableOptions options)
      : torch::nn::ModuleHolder<SkippableImpl<ModuleType>>(module.ptr(), std::move(options)) {}
};

/// Wraps `module` (a module holder) as a skippable layer with the given declarations.
///
///   seq->push_back(gpipe::skippable(Save(), gpipe::SkippableOptions().stash({"skip"})));
template <typename ModuleType>
Skippable<ModuleType> skippable(const torch::nn::ModuleHolder<ModuleType>& module,
                                SkippableOptions options) {
  return Skippable<ModuleType>(module, std::move(options));
}

/// Stashes `tensor` (which may be undefined: an optional skip) under `name` for the current
/// micro-batch. Only inside the forward of a Skippable layer that declares `name` as a stash.
void stash(const std::string& name, at::Tensor tensor);

/// Takes the tensor stashed under `name` for the current micro-batch. Only inside the forward of a
/// Skippable layer that declares `name` as a pop.
at::Tensor pop(const std::string& name);

/// Identifies the micro-batch being computed, for layers that keep state per micro-batch in their
/// own maps. Outside a GPipe it is the same key for every call (the whole batch is one
/// micro-batch). See Note [current_microbatch and checkpointing] in internal/skip_tracker.h.
struct MicroBatch {
  /// Distinct for every GPipe forward (0 outside one).
  uint64_t run = 0;
  /// The micro-batch's index in its mini-batch.
  int64_t index = 0;
  /// Whether both are the same micro-batch of the same run.
  bool operator==(const MicroBatch& o) const { return run == o.run && index == o.index; }
  /// Whether they differ in run or index.
  bool operator!=(const MicroBatch& o) const { return !(*this == o); }
  /// An order (by run, then index), for maps.
  bool operator<(const MicroBatch& o) const {
    return run < o.run || (run == o.run && index < o.index);
  }
};

/// Prints "micro-batch 2 of run 7".
inline std::ostream& operator<<(std::ostream& os, const MicroBatch& mb) {
  return os << "micro-batch " << mb.index << " of run " << mb.run;
}

/// The micro-batch being computed on this thread.
///
///   std::map<gpipe::MicroBatch, at::Tensor> saved;
///   saved[gpipe::current_microbatch()] = x;  // in one layer
///   x = x + saved.at(gpipe::current_microbatch());  // in a later one
MicroBatch current_microbatch();

/// Checks the skip declarations of `module`'s layers and throws one c10::Error listing every
/// problem: a name both stashed and popped by one layer, a name stashed (or popped) again without
/// namespace isolation, a pop with no earlier stash, a stash never popped. Run by the GPipe
/// constructor too.
void verify_skippables(const torch::nn::Sequential& module);

/// The number of stashed tensors gpipe currently holds (for leak checks): zero after a training
/// step's backward, or after a forward without grad.
int64_t live_skip_tensors();

}  // namespace gpipe
