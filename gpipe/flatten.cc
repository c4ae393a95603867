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

void add_list(const torch::nn::ModuleList& list, const std::string& prefix,
              torch::nn::Sequential& out);

void add_sequential(const torch::nn::Sequential& seq, const std::string& prefix,
                    torch::nn::Sequential& out) {
  const auto children = seq->named_children();
  for (const auto i : c10::irange(seq->size())) {
    const std::string name = join(prefix, children[i].key());
    const std::shared_ptr<torch::nn::Module> child = seq->ptr(i);
    if (auto inner = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(child)) {
      add_sequential(torch::nn::Sequential(inner), name, out);
    } else if (auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(child)) {
      add_list(torch::nn::ModuleList(list), name, out);
    } else {
      out->push_back(absl::StrReplaceAll(name, {{".", "_"}}), *(seq->begin() + i));
    }
  }
}

void add_list(const torch::nn::ModuleList& list, const std::string& prefix,
              torch::nn::Sequential& out) {
  const auto children = list->named_children();
  for (const auto i : c10::irange(list->size())) {
    const std::string name = join(prefix, children[i].key());
    const std::shared_ptr<torch::nn::Module> child = list->ptr(i);
    if (auto inner = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(child)) {
      add_sequential(torch::nn::Sequential(inner), name, out);
    } else if (auto nested = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(child)) {
      add_list(torch::nn::ModuleList(nested), name, out);
    } else {
      TORCH_CHECK(false, "gpipe::flatten: element '", name,
                  "' (", child->name(), ") of a ModuleList is neither a Sequential nor a "
                  "ModuleList, so its forward cannot be called as a layer (a ModuleList keeps "
                  "modules without their forward's type); make each block a Sequential of its "
                  "layers, e.g. torch::nn::Sequential(ln, attention, ...)");
    }
  }
}

}  // namespace

torch::nn::Sequential flatten(const torch::nn::Sequential& module) {
  TORCH_CHECK(module, "gpipe::flatten: the Sequential is empty (null)");
  torch::nn::Sequential out;
  add_sequential(module, "", out);
  return out;
}

torch::nn::Sequential flatten(const torch::nn::ModuleList& module) {
  TORCH_CHECK(module, "gpipe::flatten: the ModuleList is empty (null)");
  torch::nn::Sequential out;
  add_list(module, "", out);
  return out;
}

}  // namespace gpipe
