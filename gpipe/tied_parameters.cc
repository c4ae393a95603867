// Tied parameters; see tied_parameters.h.
#include "gpipe/tied_parameters.h"

#include <algorithm>
#include <set>
#include <unordered_map>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/internal/end_of_backward.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace {

std::string shape_of(const at::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
}

// The root of `k` in a union-find forest.
size_t root(std::vector<size_t>& parent, size_t k) {
  while (parent[k] != k) k = parent[k] = parent[parent[k]];
  return k;
}

}  // namespace

std::vector<Tie> find_ties(const torch::nn::Sequential& module, const TiedNames& named,
                           const char* who) {
  std::unordered_map<std::string, int64_t> layer_index;
  const auto children = module->named_children();
  for (const auto i : c10::irange(children.size())) {
    layer_index.emplace(children[i].key(), static_cast<int64_t>(i));
  }
  // Every place of every parameter, in order; places of one tensor joined.
  const auto all = module->named_parameters();
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  std::unordered_map<std::string, size_t> place;
  std::vector<size_t> parent;
  std::unordered_map<const c10::TensorImpl*, size_t> first_place;
  for (const auto& item : all) {
    const size_t k = names.size();
    names.push_back(item.key());
    tensors.push_back(item.value());
    place.emplace(item.key(), k);
    parent.push_back(k);
    auto inserted = first_place.emplace(item.value().unsafeGetTensorImpl(), k);
    if (!inserted.second) parent[k] = inserted.first->second;
  }
  for (const auto& [a, b] : named) {
    for (const std::string* name : {&a, &b}) {
      if (place.count(*name) == 0) {
        std::vector<std::string> some(names.begin(),
                                      names.begin() + std::min<size_t>(names.size(), 6));
        TORCH_CHECK(false, who, ": the tied parameter '", *name, "' (of the pair '", a, "', '", b,
                    "') is not a parameter of the Sequential; name parameters as its "
                    "named_parameters() does, '<layer name>.<parameter>', e.g. ",
                    names.empty() ? std::string("'0.weight'")
                                  : absl::StrCat("'", absl::StrJoin(some, "', '"), "'"));
      }
    }
    const at::Tensor& ta = tensors[place[a]];
    const at::Tensor& tb = tensors[place[b]];
    TORCH_CHECK(ta.sizes() == tb.sizes(), who, ": the tied parameters '", a, "' ",
                shape_of(ta), " and '", b, "' ", shape_of(tb), " differ in shape; only "
                "parameters of one shape can be one parameter");
    TORCH_CHECK(ta.scalar_type() == tb.scalar_type(), who, ": the tied parameters '", a, "' (",
                ta.scalar_type(), ") and '", b, "' (", tb.scalar_type(), ") differ in dtype; "
                "convert the model to one dtype first");
    TORCH_CHECK(ta.requires_grad() == tb.requires_grad(), who, ": of the tied parameters '", a,
                "' and '", b, "', only '", ta.requires_grad() ? a : b, "' requires grad; freeze "
                "both or neither");
    parent[root(parent, place[a])] = root(parent, place[b]);
  }
  // One group per root, in the order of its first place; those of one place are no ties.
  std::unordered_map<size_t, size_t> group_of_root;
  std::vector<Tie> groups;
  for (size_t k = 0; k < names.size(); ++k) {
    const auto inserted = group_of_root.emplace(root(parent, k), groups.size());
    if (inserted.second) groups.emplace_back();
    Tie& tie = groups[inserted.first->second];
    tie.names.push_back(names[k]);
    tie.layers.push_back(layer_index.at(names[k].substr(0, names[k].find('.'))));
  }
  std::vector<Tie> ties;
  for (Tie& tie : groups) {
    if (tie.names.size() >= 2) ties.push_back(std::move(tie));
  }
  return ties;
}

torch::nn::Sequential clone_across_devices(const torch::nn::Sequential& module,
                                           const std::vector<c10::Device>& layer_devices,
                                           const char* who) {
  // A tensor stays on the device of the first layer that holds it; later layers holding it on
  // another device are cloned.
  std::unordered_map<const c10::TensorImpl*, size_t> home;
  std::vector<std::string> reason(module->size());
  std::vector<bool> clone(module->size(), false);
  const auto children = module->named_children();
  for (const auto i : c10::irange(module->size())) {
    for (const auto& item : module->ptr(i)->named_parameters()) {
      auto inserted = home.emplace(item.value().unsafeGetTensorImpl(), i);
      const size_t first = inserted.first->second;
      if (!inserted.second && layer_devices[first] != layer_devices[i] && !clone[i]) {
        clone[i] = true;
        reason[i] = absl::StrCat("its parameter '", item.key(), "' is also a parameter of layer ",
                                 first, " ('", children[first].key(), "') on ",
                                 layer_devices[first].str(), ", and it runs on ",
                                 layer_devices[i].str());
      }
    }
  }
  if (std::none_of(clone.begin(), clone.end(), [](bool c) { return c; })) return module;
  torch::nn::Sequential result;
  for (const auto i : c10::irange(module->size())) {
    const torch::nn::AnyModule& layer = *(module->begin() + i);
    if (!clone[i]) {
      result->push_back(children[i].key(), layer);
      continue;
    }
    try {
      result->push_back(children[i].key(), layer.clone());
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, who, ": layer ", i, " ('", children[i].key(), "', ",
                  children[i].value()->name(), ") needs a copy of a tied parameter: ", reason[i],
                  ". gpipe gives it one by cloning the layer, but it cannot be cloned (",
                  e.what_without_backtrace(), "). Derive the layer from torch::nn::Cloneable, put "
                  "the layers that share the parameter on one device, or give the layer a "
                  "parameter of its own and name the pair as tied (tied_parameters)");
    }
  }
  return result;
}

TiedCopies::TiedCopies(const std::vector<Tie>& ties,
                       const std::vector<torch::nn::Sequential>& partitions) {
  std::unordered_map<std::string, at::Tensor> here;
  for (const auto& partition : partitions) {
    for (const auto& item : partition->named_parameters()) here.emplace(item.key(), item.value());
  }
  for (const Tie& tie : ties) {
    at::Tensor owner;
    std::vector<at::Tensor> copies;
    std::set<const c10::TensorImpl*> seen;
    for (const std::string& name : tie.names) {
      auto found = here.find(name);
      if (found == here.end()) continue;
      const at::Tensor& t = found->second;
      if (!owner.defined()) owner = t;
      if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
      if (!t.is_same(owner)) copies.push_back(t);
    }
    copies_ += copies.size();
    owners_.push_back(owner);
    copies_of_.push_back(std::move(copies));
  }
  refresh();
}

void TiedCopies::refresh() {
  if (failed_backward_.exchange(false)) settle_failed_backward();
  // Every time: LibTorch's optimizers step parameters through Tensor::data(), which has a version
  // counter of its own, so a change of the owner cannot be told from its version. Through
  // variable_data() too, so that graphs of earlier forwards that saved a copy (unchanged
  // unless its owner was) stay valid for their backward.
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < owners_.size(); ++k) {
    for (at::Tensor& copy : copies_of_[k]) copy.variable_data().copy_(owners_[k]);
  }
}

void TiedCopies::sum_gradients() {
  for (size_t k = 0; k < owners_.size(); ++k) sum_gradients_of(k);
}

void TiedCopies::sum_gradients_of(size_t k) {
  at::NoGradGuard no_grad;
  at::Tensor& owner = owners_[k];
  for (at::Tensor& copy : copies_of_[k]) {
    at::Tensor& grad = copy.mutable_grad();
    if (!grad.defined()) continue;
    if (owner.grad().defined()) {
      owner.mutable_grad().add_(grad.to(owner.device()));
    } else {
      owner.mutable_grad() = grad.to(owner.device(), /*non_blocking=*/false, /*copy=*/true);
    }
    grad.reset();
  }
}

void TiedCopies::settle_failed_backward() {
  // The plain model's one parameter holds the failed backward's partial gradient until
  // zero_grad(): so does the owner, with its copies' parts added, unless it was cleared since.
  // The failed backward made those gradients on the partitions' streams, which the engine joins
  // to the caller's only after a backward that succeeds: every device holding a tie waits first.
  at::NoGradGuard no_grad;
  std::vector<c10::Device> devices;  // (c10::Device has no order)
  const auto add = [&devices](c10::Device d) {
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  };
  for (size_t k = 0; k < owners_.size(); ++k) {
    if (owners_[k].defined()) add(owners_[k].device());
    for (const at::Tensor& copy : copies_of_[k]) add(copy.device());
  }
  for (const c10::Device& device : devices) internal::synchronize(device);
  for (size_t k = 0; k < owners_.size(); ++k) {
    if (!owners_[k].defined()) continue;
    const at::Tensor& grad = owners_[k].grad();
    const bool cleared = !grad.defined() || !grad.count_nonzero().item<int64_t>();
    if (!cleared) {
      sum_gradients_of(k);
      continue;
    }
    for (at::Tensor& copy : copies_of_[k]) copy.mutable_grad().reset();
  }
}

bool TiedCopies::is_copy(const at::Tensor& t) const {
  for (const auto& copies : copies_of_) {
    for (const at::Tensor& copy : copies) {
      if (copy.is_same(t)) return true;
    }
  }
  return false;
}

torch::OrderedDict<std::string, at::Tensor> unique_parameters(
    const torch::OrderedDict<std::string, at::Tensor>& all, const TiedCopies* tied) {
  torch::OrderedDict<std::string, at::Tensor> result;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : all) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    if (tied != nullptr && tied->is_copy(item.value())) continue;
    result.insert(item.key(), item.value());
  }
  return result;
}

void sum_tied_gradients_after_backward(std::shared_ptr<TiedCopies> tied) {
  // Queued from the output's hook, the first callback would run before callbacks that nodes
  // queue later (a stage-local backward's wait for its handed-off backwards); queued again from
  // itself, it runs after them (Note [A callback the failed backward drops]).
  // A failed backward leaves the copies' gradients to the next refresh().
  internal::queue_end_of_backward(
      [tied] {
        internal::queue_end_of_backward([tied] { tied->sum_gradients(); },
                                        [tied] { tied->mark_failed_backward(); });
      },
      [tied] { tied->mark_failed_backward(); });
}

}  // namespace gpipe
