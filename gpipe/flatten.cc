// Flattening nested models; see flatten.h.
#include "gpipe/flatten.h"

#include <memory>
#include <string>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace gpipe {
namespace {

// The path "blocks.3.attn" of a layer; its name in the flat Sequential is "blocks_3_attn".
std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// `child` (at `path`) into `out`: a Sequential's or a ModuleList's elements in order, or itself
// as the layer `leaf` (null: an element of a ModuleList, which cannot be called).
void add(const std::shared_ptr<torch::nn::Module>& child, const std::string& path,
         const torch::nn::AnyModule* leaf, torch::nn::Sequential& out) {
  if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(child)) {
    const auto children = seq->named_children();
    for (const auto i : c10::irange(seq->size())) {
      add(seq->ptr(i), join(path, children[i].key()), &*(seq->begin() + i), out);
    }
  } else if (auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(child)) {
    const auto children = list->named_children();
    for (const auto i : c10::irange(list->size())) {
      add(list->ptr(i), join(path, children[i].key()), nullptr, out);
    }
  } else {
    TORCH_CHECK(leaf != nullptr, "gpipe::flatten: element '", path, "' (", child->name(),
                ") of a ModuleList is neither a Sequential nor a ModuleList, so its forward "
                "cannot be called as a layer (a ModuleList keeps modules without their "
                "forward's type); make each block a Sequential of its layers, e.g. "
                "torch::nn::Sequential(ln, attention, ...)");
    out->push_back(absl::StrReplaceAll(path, {{".", "_"}}), *leaf);
  }
}

}  // namespace

torch::nn::Sequential flatten(const torch::nn::Sequential& module) {
  TORCH_CHECK(module, "gpipe::flatten: the Sequential is empty (null)");
  torch::nn::Sequential out;
  add(module.ptr(), "", nullptr, out);
  return out;
}

torch::nn::Sequential flatten(const torch::nn::ModuleList& module) {
  TORCH_CHECK(module, "gpipe::flatten: the ModuleList is empty (null)");
  torch::nn::Sequential out;
  add(module.ptr(), "", nullptr, out);
  return out;
}

}  // namespace gpipe
