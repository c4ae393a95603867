// Skippable layers, namespaces, stash and pop; see skippable.h. Where the tensors go is the
// tracker's business (skip_tracker.h).
#include "gpipe/skippable.h"

#include <algorithm>
#include <atomic>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/internal/skip_tracker.h"

namespace gpipe {
namespace {

std::atomic<uint64_t> next_namespace{1};

thread_local const void* current_scope = nullptr;

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string quoted(const std::vector<std::string>& names) {
  return names.empty() ? "none" : absl::StrCat("'", absl::StrJoin(names, "', '"), "'");
}

// "the skippable layer around SaveImpl", for messages.
std::string describe(const SkippableBase& layer) {
  return absl::StrCat("the skippable layer around ", layer.wrapped()->name());
}

}  // namespace

Namespace::Namespace() : id_(next_namespace.fetch_add(1)) {}

std::string SkipKey::str() const {
  return ns == Namespace::global() ? name : absl::StrCat(name, "@", ns.id());
}

SkippableBase::SkippableBase(SkippableOptions options, std::string name)
    : torch::nn::Module(std::move(name)), options_(std::move(options)) {
  for (const auto& name : options_.stash()) {
    TORCH_CHECK(!name.empty(), "gpipe::SkippableOptions: a stash name is empty");
  }
  for (const auto& name : options_.pop()) {
    TORCH_CHECK(!name.empty(), "gpipe::SkippableOptions: a pop name is empty");
  }
}

SkippableBase& SkippableBase::isolate(const Namespace& ns, const std::vector<std::string>& only) {
  const std::vector<std::string>* names[] = {&options_.stash(), &options_.pop()};
  for (const std::string& name : only) {
    TORCH_CHECK(contains(options_.stash(), name) || contains(options_.pop(), name),
                "isolate: '", name, "' is not one of this layer's skips (stash: ",
                quoted(options_.stash()), "; pop: ", quoted(options_.pop()), ")");
  }
  for (const auto* list : names) {
    for (const std::string& name : *list) {
      if (only.empty() || contains(only, name)) {
        namespaces_[name] = ns;
      }
    }
  }
  return *this;
}

SkipKey SkippableBase::key(const std::string& name) const {
  auto it = namespaces_.find(name);
  return SkipKey{it == namespaces_.end() ? Namespace::global() : it->second, name};
}

SkippableBase::ForwardScope::ForwardScope(const SkippableBase& layer)
    : layer(layer), previous_(static_cast<ForwardScope*>(const_cast<void*>(current_scope))) {
  current_scope = this;
}

SkippableBase::ForwardScope::~ForwardScope() { current_scope = previous_; }

void SkippableBase::ForwardScope::finish() {
  for (const std::string& name : layer.stash_names()) {
    TORCH_CHECK(stashed.count(name) > 0, describe(layer), " declares '", name,
                "' as a stash, but its forward did not call gpipe::stash(\"", name, "\", ...)");
  }
  for (const std::string& name : layer.pop_names()) {
    TORCH_CHECK(popped.count(name) > 0, describe(layer), " declares '", name,
                "' as a pop, but its forward did not call gpipe::pop(\"", name, "\")");
  }
}

namespace {

SkippableBase::ForwardScope* scope_for(const char* what, const std::string& name) {
  auto* scope = static_cast<SkippableBase::ForwardScope*>(const_cast<void*>(current_scope));
  TORCH_CHECK(scope != nullptr, "gpipe::", what, "(\"", name, "\") was called outside the forward "
              "of a skippable layer; wrap the layer with gpipe::skippable(...) and declare the "
              "name in its SkippableOptions");
  return scope;
}

}  // namespace

void stash(const std::string& name, at::Tensor tensor) {
  auto* scope = scope_for("stash", name);
  TORCH_CHECK(contains(scope->layer.stash_names(), name), describe(scope->layer), " stashed '",
              name, "', which it does not declare as a stash (declared stashes: ",
              quoted(scope->layer.stash_names()), ")");
  TORCH_CHECK(scope->stashed.insert(name).second, describe(scope->layer), " stashed '", name,
              "' twice in one forward");
  internal::current_skip_tracker().stash(scope->layer.key(name), std::move(tensor));
}

at::Tensor pop(const std::string& name) {
  auto* scope = scope_for("pop", name);
  TORCH_CHECK(contains(scope->layer.pop_names(), name), describe(scope->layer), " popped '", name,
              "', which it does not declare as a pop (declared pops: ",
              quoted(scope->layer.pop_names()), ")");
  TORCH_CHECK(scope->popped.insert(name).second, describe(scope->layer), " popped '", name,
              "' twice in one forward");
  return internal::current_skip_tracker().pop(scope->layer.key(name));
}

}  // namespace gpipe
