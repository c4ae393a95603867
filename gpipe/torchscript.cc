// Models written in Python as the layers of a Sequential; see Note [Layers from TorchScript] in
// torchscript.h.
#include "gpipe/torchscript.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gpipe/internal/error_text.h"

namespace gpipe {
namespace {

// A scripted tensor's name as LibTorch's registers take it: "bn1.running_mean" as
// "bn1_running_mean".
std::string flat_name(std::string name) {
  std::replace(name.begin(), name.end(), '.', '_');
  return name;
}

std::vector<std::string> child_names(const torch::jit::Module& module) {
  std::vector<std::string> out;
  for (const auto& child : module.named_children()) out.push_back(child.name);
  return out;
}

}  // namespace

ScriptedLayerImpl::ScriptedLayerImpl(const torch::jit::Module& child,
                                     const torch::jit::Module& root, std::string name)
    : child_(std::make_shared<torch::jit::Module>(child)),
      root_(std::make_shared<torch::jit::Module>(root)),
      name_(std::move(name)) {
  reset();
}

void ScriptedLayerImpl::reset() {
  if (registered_) {
    // Module::clone() clears the tensors and calls reset(): a clone holds a deep copy of its
    // child, and no root (the scripted model is not copied with it).
    TORCH_CHECK(named_parameters(false).is_empty() && named_buffers(false).is_empty(),
                "gpipe::ScriptedLayer::reset: layer '", name_,
                "' holds its scripted child's "
                "own tensors, which reset() would detach from the scripted model; initialise "
                "them in Python, or assign to them under torch::NoGradGuard");
    child_ = std::make_shared<torch::jit::Module>(child_->deepcopy());
    root_.reset();
  }
  registered_ = true;
  const auto check = [this](const std::string& name, const std::string& flat) {
    TORCH_CHECK(
        named_parameters(false).find(flat) == nullptr && named_buffers(false).find(flat) == nullptr,
        "gpipe::from_torchscript: layer '", name_, "' has two tensors named '", flat,
        "' once its dots are written '_' (one of them '", name,
        "'); rename one in the Python model");
  };
  for (const auto& p : child_->named_parameters(/*recurse=*/true)) {
    const std::string flat = flat_name(p.name);
    check(p.name, flat);
    register_parameter(flat, p.value, p.value.requires_grad());
  }
  for (const auto& b : child_->named_buffers(/*recurse=*/true)) {
    const std::string flat = flat_name(b.name);
    check(b.name, flat);
    register_buffer(flat, b.value);
  }
  child_->train(is_training());
}

at::Tensor ScriptedLayerImpl::forward(const at::Tensor& input) {
  const c10::IValue out = child_->forward({input});
  TORCH_CHECK(out.isTensor(), "gpipe::from_torchscript: layer '", name_, "' returned a ",
              out.tagKind(),
              ", but a scripted layer gives the next one tensor (whose first "
              "dimension is the batch); return one tensor from its forward()");
  return out.toTensor();
}

void ScriptedLayerImpl::train(bool on) {
  torch::nn::Module::train(on);
  child_->train(on);
}

torch::nn::Sequential from_torchscript(const torch::jit::Module& module, const std::string& child) {
  torch::jit::Module parent = module;
  if (!child.empty()) {
    // "blocks", or "encoder.blocks" for a submodule's submodule.
    for (const std::string& part : std::vector<std::string>(absl::StrSplit(child, '.'))) {
      std::optional<torch::jit::Module> found;
      for (const auto& c : parent.named_children()) {
        if (c.name == part) found = c.value;
      }
      const std::vector<std::string> names = child_names(parent);
      TORCH_CHECK(found.has_value(),
                  "gpipe::from_torchscript: the scripted module has no "
                  "submodule '",
                  child, "' ('", part,
                  "' is not there; the submodules there "
                  "are: ",
                  names.empty() ? std::string("none") : absl::StrJoin(names, ", "), ")");
      parent = *found;
    }
  }
  torch::nn::Sequential layers;
  for (const auto& c : parent.named_children()) {
    layers->push_back(std::string(c.name), ScriptedLayer(c.value, module, c.name));
  }
  TORCH_CHECK(!layers->is_empty(), "gpipe::from_torchscript: the scripted ",
              child.empty() ? std::string("module") : "submodule '" + child + "'",
              " has no children to make layers of; give a scripted nn.Sequential, or name the "
              "submodule that holds the layers (e.g. 'blocks')");
  return layers;
}

torch::nn::Sequential from_torchscript(const std::string& path, const std::string& child) {
  torch::jit::Module module;
  try {
    module = torch::jit::load(path, c10::Device(c10::kCPU));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gpipe::from_torchscript: cannot load '", path,
                "': ", internal::without_backtrace(e));
  }
  return from_torchscript(module, child);
}

const torch::jit::Module& scripted_module(const torch::nn::Sequential& layers) {
  const ScriptedLayerImpl* first =
      layers->is_empty() ? nullptr : layers->ptr(0)->as<ScriptedLayerImpl>();
  TORCH_CHECK(first != nullptr,
              "gpipe::scripted_module: the Sequential's first layer is not a "
              "gpipe::ScriptedLayer; give the Sequential that from_torchscript made");
  return first->root();
}

const torch::jit::Module& ScriptedLayerImpl::root() const {
  TORCH_CHECK(root_ != nullptr, "gpipe::ScriptedLayer: layer '", name_,
              "' is a clone, which "
              "holds a deep copy of its child only, not the scripted model; save the model "
              "from_torchscript was given (or the Sequential it made)");
  return *root_;
}

}  // namespace gpipe
