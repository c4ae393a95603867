// Skip layout and the static check of skip declarations; see skip_layout.h and skippable.h.
#include "gpipe/skip_layout.h"

#include <algorithm>
#include <string>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gpipe {
namespace {

const SkippableBase* as_skippable(const std::shared_ptr<torch::nn::Module>& module) {
  return dynamic_cast<const SkippableBase*>(module.get());
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

void verify_skippables(const torch::nn::Sequential& module) {
  std::set<SkipKey> stashed;
  std::set<SkipKey> popped;
  std::map<SkipKey, std::string> stashed_by;
  std::vector<std::string> problems;
  for (const auto& child : module->named_children()) {
    const SkippableBase* layer = as_skippable(child.value());
    if (layer == nullptr) {
      continue;
    }
    const std::string who = absl::StrCat("layer '", child.key(), "'");
    for (const std::string& name : layer->stash_names()) {
      if (contains(layer->pop_names(), name)) {
        problems.push_back(absl::StrCat(who, " declares '", name,
                                        "' both as a stash and as a pop; a layer cannot pass a "
                                        "skip to itself"));
        continue;
      }
      const SkipKey key = layer->key(name);
      if (!stashed.insert(key).second) {
        problems.push_back(absl::StrCat(who, " stashes '", name, "', which ",
                                        stashed_by[key], " already stashes; isolate one of them "
                                        "with its own gpipe::Namespace"));
        continue;
      }
      stashed_by[key] = who;
    }
    for (const std::string& name : layer->pop_names()) {
      if (contains(layer->stash_names(), name)) {
        continue;  // reported above
      }
      const SkipKey key = layer->key(name);
      if (popped.count(key) > 0) {
        problems.push_back(absl::StrCat(who, " pops '", name, "', which an earlier layer already "
                                        "pops; isolate one of them with its own gpipe::Namespace"));
        continue;
      }
      if (stashed.count(key) == 0) {
        problems.push_back(absl::StrCat(who, " pops '", name, "', but no earlier layer stashes it",
                                        key.ns == Namespace::global() ? ""
                                                                      : " in its namespace"));
        continue;
      }
      popped.insert(key);
    }
  }
  for (const SkipKey& key : stashed) {
    if (popped.count(key) == 0) {
      problems.push_back(absl::StrCat(stashed_by[key], " stashes '", key.name,
                                      "', but no later layer pops it"));
    }
  }
  TORCH_CHECK(problems.empty(), "the skip connections of this Sequential do not match:\n  * ",
              absl::StrJoin(problems, "\n  * "));
}

SkipLayout::SkipLayout(const std::vector<torch::nn::Sequential>& partitions)
    : routes_into_(partitions.size()) {
  for (size_t j = 0; j < partitions.size(); ++j) {
    for (const auto& child : partitions[j]->named_children()) {
      const SkippableBase* layer = as_skippable(child.value());
      if (layer == nullptr) {
        continue;
      }
      for (const std::string& name : layer->stash_names()) {
        stash_partition_[layer->key(name)] = static_cast<int64_t>(j);
      }
      for (const std::string& name : layer->pop_names()) {
        const SkipKey key = layer->key(name);
        pop_partition_[key] = static_cast<int64_t>(j);
        auto from = stash_partition_.find(key);
        if (from != stash_partition_.end() && from->second != static_cast<int64_t>(j)) {
          routes_into_[j].emplace_back(key, from->second);
        }
      }
    }
  }
  for (auto& routes : routes_into_) {
    std::sort(routes.begin(), routes.end(), [](const auto& a, const auto& b) {
      return a.second < b.second || (a.second == b.second && a.first < b.first);
    });
  }
}

const std::vector<std::pair<SkipKey, int64_t>>& SkipLayout::routes_into(int64_t partition) const {
  return routes_into_[partition];
}

std::vector<SkipKey> SkipLayout::crossing() const {
  std::vector<SkipKey> keys;
  for (const auto& routes : routes_into_) {
    for (const auto& route : routes) {
      keys.push_back(route.first);
    }
  }
  return keys;
}

bool SkipLayout::crosses(const SkipKey& key) const {
  auto s = stash_partition_.find(key);
  auto p = pop_partition_.find(key);
  return s != stash_partition_.end() && p != pop_partition_.end() && s->second != p->second;
}

}  // namespace gpipe
