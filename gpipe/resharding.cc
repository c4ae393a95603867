// Loading a save into another layout; see gpipe/internal/resharding.h and Note [Saves that
// outlive their layout] in saved_training.h.
#include "gpipe/internal/resharding.h"

#include <set>
#include <sstream>
#include <type_traits>

#include <ATen/core/List.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/atomic_file.h"
#include "gpipe/internal/error_text.h"
#include "gpipe/internal/manifest.h"

namespace gpipe {
namespace internal {
namespace {

constexpr const char* kWho = "gpipe::load_training";

// The optimizer's state of `p` in `states` (keyed by a string of the TensorImpl's address in
// LibTorch 1.x, by the address itself in 2.x).
template <typename Map>
auto state_key(const Map&, const at::Tensor& p) {
  void* impl = p.unsafeGetTensorImpl();
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;
    key << impl;
    return key.str();
  } else {
    return impl;
  }
}

// The tensors a parameter's optimizer state of `kind` holds: every one has the parameter's shape
// and is moved to its device; the first is there whenever the state is.
std::vector<const char*> moments_of(const std::string& kind) {
  if (kind == "Adam" || kind == "AdamW") return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  if (kind == "SGD") return {"momentum_buffer"};
  if (kind == "Adagrad") return {"sum"};
  if (kind == "RMSprop") return {"square_avg", "momentum_buffer", "grad_avg"};
  return {};
}

std::unique_ptr<torch::optim::OptimizerParamState> new_state(const std::string& kind) {
  if (kind == "Adam") return std::make_unique<torch::optim::AdamParamState>();
  if (kind == "AdamW") return std::make_unique<torch::optim::AdamWParamState>();
  if (kind == "SGD") return std::make_unique<torch::optim::SGDParamState>();
  if (kind == "Adagrad") return std::make_unique<torch::optim::AdagradParamState>();
  return std::make_unique<torch::optim::RMSpropParamState>();
}

// The whole Sequential's name of a tie's place k ("<layer index>.<name in the layer>").
std::string place_name(const Tie& tie, size_t k) {
  const std::string& name = tie.names[k];
  return absl::StrCat(tie.layers[k], name.substr(name.find('.')));
}

// The layer of a name in the whole Sequential ("3.weight", "buffer 3.running_mean": 3); -1 when
// it has none.
int64_t layer_of(const std::string& name) {
  const size_t start = name.rfind(' ', name.find('.')) + 1;  // 0 without a "buffer " prefix
  int64_t layer = -1;
  return absl::SimpleAtoi(name.substr(start, name.find('.') - start), &layer) ? layer : -1;
}

// Each of `state`'s moments moved to `device` (through its typed setters).
void place_moments(torch::optim::OptimizerParamState& state, c10::Device device) {
  const auto to = [device](const at::Tensor& t) { return t.defined() ? t.to(device) : t; };
  if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    s->exp_avg(to(s->exp_avg())).exp_avg_sq(to(s->exp_avg_sq()));
    s->max_exp_avg_sq(to(s->max_exp_avg_sq()));
  } else if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    s->exp_avg(to(s->exp_avg())).exp_avg_sq(to(s->exp_avg_sq()));
    s->max_exp_avg_sq(to(s->max_exp_avg_sq()));
  } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    s->momentum_buffer(to(s->momentum_buffer()));
  } else if (auto* s = dynamic_cast<torch::optim::AdagradParamState*>(&state)) {
    s->sum(to(s->sum()));
  } else if (auto* s = dynamic_cast<torch::optim::RMSpropParamState*>(&state)) {
    s->square_avg(to(s->square_avg())).momentum_buffer(to(s->momentum_buffer()));
    s->grad_avg(to(s->grad_avg()));
  }
}

}  // namespace

void place_moments_on_parameters(torch::optim::Optimizer& optimizer) {
  auto& states = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      auto it = states.find(state_key(states, p));
      if (it != states.end()) place_moments(*it->second, p.device());
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> state_of(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers()) {
    out.emplace_back("buffer " + item.key(), item.value());
  }
  return out;
}

bool same_tensor_names(const c10::IValue& names, const torch::nn::Module& module) {
  std::set<std::string> saved, mine;
  for (const c10::IValue& name : names.toListRef()) saved.insert(name.toStringRef());
  for (const auto& item : state_of(module)) mine.insert(item.first);
  return saved == mine;
}

LayerNames layer_names(const std::vector<PlacedLayer>& layers) {
  LayerNames out;
  for (const PlacedLayer& l : layers) {
    const std::string index = absl::StrCat(l.index, ".");
    for (const auto& item : l.layer->named_parameters()) {
      out.emplace(l.prefix + item.key(), index + item.key());
    }
    for (const auto& item : l.layer->named_buffers()) {
      out.emplace("buffer " + l.prefix + item.key(), "buffer " + index + item.key());
    }
  }
  return out;
}

LayerNames layer_names(const torch::nn::Module& module) {
  std::vector<PlacedLayer> layers;
  if (const auto* gpipe = dynamic_cast<const GPipeImpl*>(&module)) {
    int64_t index = 0;
    for (size_t j = 0; j < gpipe->partitions().size(); ++j) {
      for (const auto& child : gpipe->partitions()[j]->named_children()) {
        layers.push_back(
            {absl::StrCat("partitions.", j, ".", child.key(), "."), index++, child.value()});
      }
    }
  } else if (const auto* sequential = dynamic_cast<const torch::nn::SequentialImpl*>(&module)) {
    int64_t index = 0;
    for (const auto& child : sequential->named_children()) {
      layers.push_back({child.key() + ".", index++, child.value()});
    }
  }
  return layer_names(layers);
}

std::unordered_map<std::string, std::vector<std::string>> tie_aliases(
    const std::vector<Tie>& ties) {
  std::unordered_map<std::string, std::vector<std::string>> out;
  for (const Tie& tie : ties) {
    for (size_t k = 0; k < tie.names.size(); ++k) {
      for (size_t m = 0; m < tie.names.size(); ++m) {
        if (m != k) out[place_name(tie, k)].push_back(place_name(tie, m));
      }
    }
  }
  return out;
}

std::vector<Tie> ties_of(const torch::nn::Module& module) {
  if (const auto* gpipe = dynamic_cast<const GPipeImpl*>(&module)) return gpipe->ties();
  if (const auto* sequential = dynamic_cast<const torch::nn::SequentialImpl*>(&module)) {
    // find_ties takes the Sequential's holder; this one shares the module without owning it.
    const torch::nn::Sequential holder(std::shared_ptr<torch::nn::SequentialImpl>(
        std::shared_ptr<torch::nn::SequentialImpl>(),
        const_cast<torch::nn::SequentialImpl*>(sequential)));
    return find_ties(holder, {}, kWho);
  }
  return {};
}

std::string optimizer_kind(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) return "Adam";
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr) return "SGD";
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr) return "Adagrad";
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr) return "RMSprop";
  return "";
}

ReshardedLoad::ReshardedLoad(torch::nn::Module& module, LayerNames names, std::vector<Tie> ties,
                             torch::optim::Optimizer* optimizer, GradScaler* scaler, bool whole,
                             int64_t layers)
    : module_(module),
      names_(std::move(names)),
      aliases_(tie_aliases(ties)),
      optimizer_(optimizer),
      scaler_(scaler),
      whole_(whole),
      layers_(layers) {
  TORCH_CHECK(!names_.empty() || state_of(module).empty(), kWho,
              ": a save of another layout "
              "loads only into a Sequential, a GPipe or a PipelineStage (whose tensors are named "
              "by their layer); load it into the layout it was saved from");
  TORCH_CHECK(optimizer == nullptr || !optimizer_kind(*optimizer).empty(), kWho,
              ": a save of "
              "another layout loads the optimizer's state into an Adam, AdamW, SGD, Adagrad or "
              "RMSprop only, not into this optimizer; load it into the layout it was saved from");
}

int64_t ReshardedLoad::read(const std::string& path) {
  if (is_file(path)) {
    add(path, read_whole_file(path, kWho));
    return 0;
  }
  const Manifest manifest = read_manifest(path);
  for (const ManifestFile& f : manifest.files) {
    if (absl::StartsWith(f.name, "random")) continue;
    const auto [file, bytes] =
        committed_file(path, manifest, f.name.substr(0, f.name.find(".step")));
    add(file, bytes);
  }
  manifest_step_ = manifest.step;
  return manifest.save;
}

void ReshardedLoad::add(const std::string& path, const std::string& bytes) {
  const std::string what = "'" + path + "'";
  torch::serialize::InputArchive archive;
  try {
    // On the CPU: a stage reads every stage's file, and copies only its own tensors to their
    // devices (which the saving run's devices need not be).
    archive.load_from(bytes.data(), bytes.size(), c10::Device(c10::kCPU));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kWho, ": cannot read ", what, ": ", without_backtrace(e));
  }
  c10::IValue step, names, layer_names, tensors;
  TORCH_CHECK(archive.try_read(kStep, step) && step.isInt(), kWho, ": ", what, " holds no step");
  steps_.emplace_back(step.toInt(), path);
  if (archive.try_read(kNames, names) && archive.try_read(kTensors, tensors)) {
    TORCH_CHECK(archive.try_read(kLayerNames, layer_names), kWho, ": ", what,
                " does not name "
                "its tensors by layer (an older gpipe wrote it); load it into the layout it was "
                "saved from");
    const auto keys = names.toListRef();
    const auto global = layer_names.toListRef();
    const c10::List<at::Tensor> values = tensors.toTensorList();
    TORCH_CHECK(keys.size() == values.size() && global.size() == keys.size(), kWho, ": ", what,
                " is damaged");
    for (size_t k = 0; k < keys.size(); ++k) {
      TORCH_CHECK(!global[k].toStringRef().empty(), kWho, ": ", what,
                  " was saved from a module "
                  "that is not a Sequential, a GPipe or a PipelineStage: its '",
                  keys[k].toStringRef(),
                  "' has no layer; load it into the layout it was saved "
                  "from");
      tensors_.emplace(global[k].toStringRef(), Saved{values.get(k), path});
    }
  }
  torch::serialize::InputArchive optimizer;
  if (optimizer_ != nullptr && archive.try_read(kOptimizer, optimizer)) {
    saved_optimizer_ = true;
    c10::IValue kind, optimizer_names;
    TORCH_CHECK(archive.try_read(kOptimizerKind, kind) &&
                    archive.try_read(kOptimizerNames, optimizer_names),
                kWho, ": ", what,
                " does not name its optimizer's state by layer (an older gpipe "
                "wrote it); load it into the layout it was saved from");
    torch::serialize::InputArchive groups, states;
    optimizer.read("param_groups", groups);
    optimizer.read("state", states);
    at::Tensor count;
    groups.read("param_groups/size", count);
    const auto global = optimizer_names.toListRef();
    size_t flat = 0;
    for (int64_t i = 0; i < count.item<int64_t>(); ++i) {
      torch::serialize::InputArchive group;
      groups.read("param_groups/" + std::to_string(i), group);
      at::Tensor size;
      group.read("params/size", size);
      for (int64_t j = 0; j < size.item<int64_t>(); ++j, ++flat) {
        TORCH_CHECK(flat < global.size(), kWho, ": ", what,
                    " is damaged (its optimizer has "
                    "more parameters than names)");
        c10::IValue key;
        group.read("params/" + std::to_string(j), key);
        auto state = std::make_shared<torch::serialize::InputArchive>();
        if (!states.try_read(key.toStringRef(), *state)) state.reset();
        const std::string& name = global[flat].toStringRef();
        if (!name.empty()) states_.emplace(name, SavedState{state, kind.toStringRef(), path});
      }
    }
    TORCH_CHECK(flat == global.size(), kWho, ": ", what,
                " is damaged (its optimizer has fewer "
                "parameters than names)");
  }
  torch::serialize::InputArchive scaler;
  if (scaler_ != nullptr && !scaler_state_ && archive.try_read(kScaler, scaler)) {
    scaler_state_.emplace(*scaler_);
    scaler_state_->load(scaler);
  }
}

std::unique_ptr<torch::optim::OptimizerParamState> ReshardedLoad::state_for(
    const at::Tensor& param, const std::string& name) {
  auto it = states_.find(name);
  for (const std::string& other : aliases_[name]) {
    if (it == states_.end()) it = states_.find(other);
  }
  TORCH_CHECK(it != states_.end(), kWho, ": no file of the save holds the optimizer's state of '",
              name,
              "' (the saved run's optimizer was not over it); make the optimizer over the "
              "parameters the saved run's was over");
  const std::string mine = optimizer_kind(*optimizer_);
  const SavedState& saved = it->second;
  TORCH_CHECK(saved.kind == mine, kWho, ": '", saved.path, "' holds the state of ",
              saved.kind.empty() ? "an optimizer of another kind" : "the optimizer " + saved.kind,
              ", but it is loaded into an ", mine,
              "; make the optimizer of the saved run's "
              "kind");
  if (!saved.state) return nullptr;
  for (const char* moment : moments_of(mine)) {
    c10::IValue value;
    if (!saved.state->try_read(moment, value) || !value.isTensor()) continue;
    const at::Tensor t = value.toTensor();
    TORCH_CHECK(!t.defined() || t.sizes() == param.sizes(), kWho, ": the optimizer's '", moment,
                "' of '", name, "' in '", saved.path, "' is ", t.sizes(),
                ", but the parameter "
                "is ",
                param.sizes(), "; load a save of the same model");
  }
  c10::IValue first;
  TORCH_CHECK(saved.state->try_read(moments_of(mine)[0], first), kWho,
              ": the optimizer's state "
              "of '",
              name, "' in '", saved.path, "' has no ", moments_of(mine)[0],
              "; load a save of the same model and optimizer");
  std::unique_ptr<torch::optim::OptimizerParamState> state = new_state(mine);
  try {
    state->serialize(*saved.state);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kWho, ": the optimizer's state of '", name, "' in '", saved.path,
                "' does not fit a ", mine, " (", e.what_without_backtrace(), ")");
  }
  place_moments(*state, param.device());
  return state;
}

int64_t ReshardedLoad::check() {
  TORCH_CHECK(!steps_.empty(), kWho, ": the save holds no file");
  for (const auto& [step, path] : steps_) {
    TORCH_CHECK(step == steps_[0].first, kWho, ": '", path, "' holds step ", step, ", but '",
                steps_[0].second, "' holds step ", steps_[0].first, ": the save mixes steps");
  }
  TORCH_CHECK(!manifest_step_ || *manifest_step_ == steps_[0].first, kWho, ": '", steps_[0].second,
              "' holds step ", steps_[0].first, ", but its folder's manifest commits step ",
              *manifest_step_, ": the folder mixes saves");
  std::set<std::string> used;
  for (const auto& [local, t] : state_of(module_)) {
    const auto name = names_.find(local);
    TORCH_CHECK(name != names_.end(), kWho, ": the module's '", local, "' has no layer");
    // A tie's places are one parameter: each takes the value saved under its first place (the
    // owner; a GPipe refreshes its copies before each step, so a copy's saved value is a step
    // behind: Note [Tied parameters]).
    std::string source = name->second;
    for (const std::string& other : aliases_[name->second]) {
      if (layer_of(other) < layer_of(source) && tensors_.count(other) > 0) source = other;
    }
    const auto it = tensors_.find(source);
    TORCH_CHECK(it != tensors_.end(), kWho, ": no file of the save holds '", name->second,
                "' (the module's '", local, "'); load a save of the same model");
    const at::Tensor& from = it->second.tensor;
    TORCH_CHECK(from.sizes() == t.sizes() && from.scalar_type() == t.scalar_type(), kWho, ": '",
                name->second, "' in '", it->second.path, "' is ", from.sizes(), " ",
                from.scalar_type(), ", but the module's '", local, "' is ", t.sizes(), " ",
                t.scalar_type(),
                "; load a save of the same model (converted as it was when saved)");
    copies_.emplace_back(t, from);
    used.insert(name->second);
  }
  if (layers_ >= 0) {  // a part of the model: the save must not hold layers past its end
    for (const auto& item : tensors_) {
      const int64_t layer = layer_of(item.first);
      TORCH_CHECK(layer < layers_, kWho, ": '", item.second.path, "' holds '", item.first,
                  "', of layer ", layer, ", but the model has ", layers_,
                  " layers; load a save "
                  "of the same model");
    }
  }
  if (whole_) {
    std::vector<std::string> extra;
    for (const auto& item : tensors_) {
      if (used.count(item.first) == 0) extra.push_back("'" + item.first + "'");
    }
    TORCH_CHECK(extra.empty(), kWho, ": the save holds ", absl::StrJoin(extra, ", "),
                ", which the module does not have; load a save of the same model");
  }
  TORCH_CHECK(optimizer_ == nullptr || saved_optimizer_, kWho,
              ": the save was made without an "
              "optimizer, but one is given to load into; give none, or load a save made with one");
  if (optimizer_ != nullptr) {
    std::unordered_map<const void*, std::string> local_names;
    for (const auto& item : module_.named_parameters()) {
      local_names.emplace(item.value().unsafeGetTensorImpl(), item.key());
    }
    for (const auto& group : optimizer_->param_groups()) {
      for (const at::Tensor& p : group.params()) {
        const auto local = local_names.find(p.unsafeGetTensorImpl());
        TORCH_CHECK(local != local_names.end(), kWho,
                    ": the optimizer is over a parameter that "
                    "the module does not hold; make it over the module's parameters");
        const auto name = names_.find(local->second);
        TORCH_CHECK(name != names_.end(), kWho, ": the module's '", local->second,
                    "' has no layer");
        states_to_set_.emplace_back(p, state_for(p, name->second));
      }
    }
  }
  TORCH_CHECK(scaler_ == nullptr || scaler_state_, kWho,
              ": the save was made without a "
              "GradScaler");
  return steps_[0].first;
}

void ReshardedLoad::apply() {
  {
    at::NoGradGuard no_grad;
    for (auto& [mine, saved] : copies_) mine.copy_(saved);
  }
  if (optimizer_ != nullptr) {
    auto& states = optimizer_->state();
    for (auto& [p, state] : states_to_set_) {
      const auto key = state_key(states, p);
      if (state) {
        states[key] = std::move(state);
      } else {
        states.erase(key);
      }
    }
  }
  if (scaler_ != nullptr) *scaler_ = *scaler_state_;
}

}  // namespace internal
}  // namespace gpipe
