// Saving a training run and resuming it; see Note [Saving and resuming] in saved_training.h.
#include "gpipe/saved_training.h"

#include <filesystem>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/List.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/internal/atomic_file.h"
#include "gpipe/internal/error_text.h"
#include "gpipe/internal/manifest.h"
#include "gpipe/internal/resharding.h"

namespace gpipe {
namespace internal {
namespace {

// The generators this process draws from: the CPU's, then each CUDA device's.
std::vector<at::Generator> generators() {
  std::vector<at::Generator> out{at::detail::getDefaultCPUGenerator()};
  if (torch::cuda::is_available()) {
    for (size_t i = 0; i < torch::cuda::device_count(); ++i) {
      out.push_back(at::globalContext().defaultGenerator(
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))));
    }
  }
  return out;
}

// The module's tensors by name, and by their names in the whole Sequential (Note [Saves that
// outlive their layout]; "" where `names` has none).
void write_module(torch::serialize::OutputArchive& archive, const torch::nn::Module& module,
                  const LayerNames& names) {
  c10::List<std::string> keys, global;
  c10::List<at::Tensor> tensors;
  for (const auto& [name, t] : state_of(module)) {
    keys.push_back(name);
    const auto it = names.find(name);
    global.push_back(it != names.end() ? it->second : std::string());
    tensors.push_back(t.detach());
  }
  archive.write(kNames, c10::IValue(keys));
  archive.write(kLayerNames, c10::IValue(global));
  archive.write(kTensors, c10::IValue(tensors));
}

// The names of `module`'s parameters (if any) by tensor, for errors about the optimizer's state.
std::unordered_map<const void*, std::string> parameter_names(const torch::nn::Module* module) {
  std::unordered_map<const void*, std::string> out;
  if (module == nullptr) return out;
  for (const auto& item : module->named_parameters()) {
    out.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  return out;
}

// The optimizer's state, its kind, and its parameters' names in the whole Sequential.
void write_optimizer(torch::serialize::OutputArchive& archive,
                     const torch::optim::Optimizer& optimizer, const torch::nn::Module* module,
                     const LayerNames& names) {
  torch::serialize::OutputArchive state;
  optimizer.save(state);
  archive.write(kOptimizer, state);
  const std::unordered_map<const void*, std::string> local = parameter_names(module);
  c10::List<std::string> global;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      const auto l = local.find(p.unsafeGetTensorImpl());
      const auto g = l != local.end() ? names.find(l->second) : names.end();
      global.push_back(g != names.end() ? g->second : std::string());
    }
  }
  archive.write(kOptimizerKind, c10::IValue(optimizer_kind(optimizer)));
  archive.write(kOptimizerNames, c10::IValue(global));
}

// The module's tensors, each with the saved one of its name, after checking every name, shape
// and dtype: nothing is copied until all match (Note [Saving and resuming]).
std::vector<std::pair<at::Tensor, at::Tensor>> module_copies(
    torch::serialize::InputArchive& archive, const torch::nn::Module& module,
    const std::string& what) {
  c10::IValue names, tensors;
  TORCH_CHECK(archive.try_read(kNames, names) && archive.try_read(kTensors, tensors),
              "gpipe::load_training: ", what, " holds no module state");
  std::map<std::string, at::Tensor> saved;
  const c10::List<at::Tensor> values = tensors.toTensorList();
  const auto keys = names.toListRef();
  TORCH_CHECK(keys.size() == values.size(), "gpipe::load_training: ", what, " is damaged");
  for (size_t k = 0; k < keys.size(); ++k) saved.emplace(keys[k].toStringRef(), values.get(k));
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  for (const auto& [name, t] : state_of(module)) {
    auto it = saved.find(name);
    TORCH_CHECK(it != saved.end(), "gpipe::load_training: ", what, " has no '", name,
                "', which the module has; load a save of the same model");
    const at::Tensor& from = it->second;
    TORCH_CHECK(from.sizes() == t.sizes() && from.scalar_type() == t.scalar_type(),
                "gpipe::load_training: '", name, "' in ", what, " is ", from.sizes(), " ",
                from.scalar_type(), ", but the module's is ", t.sizes(), " ", t.scalar_type(),
                "; load a save of the same model (converted as it was when saved)");
    copies.emplace_back(t, from);
    saved.erase(it);
  }
  std::vector<std::string> extra;
  for (const auto& item : saved) extra.push_back("'" + item.first + "'");
  TORCH_CHECK(extra.empty(), "gpipe::load_training: ", what, " holds ", absl::StrJoin(extra, ", "),
              ", which the module does not have; load a save of the same model");
  return copies;
}

// A parameter's moments, as LibTorch's optimizers keep them (Adam and AdamW, SGD, Adagrad,
// RMSprop): each has its parameter's shape.
constexpr const char* kMoments[] = {"exp_avg",         "exp_avg_sq", "max_exp_avg_sq",
                                    "momentum_buffer", "sum",        "square_avg",
                                    "grad_avg"};

// `state`'s moments (a parameter's saved optimizer state) against `param`'s shape.
void check_moments(torch::serialize::InputArchive& state, const at::Tensor& param,
                   const std::string& param_name, const std::string& what) {
  for (const char* moment : kMoments) {
    c10::IValue value;
    if (!state.try_read(moment, value) || !value.isTensor() || !value.toTensor().defined()) {
      continue;
    }
    const at::Tensor saved = value.toTensor();
    TORCH_CHECK(saved.sizes() == param.sizes(), "gpipe::load_training: the optimizer's '", moment,
                "' of ", param_name, " in ", what, " is ", saved.sizes(), ", but the parameter "
                "is ", param.sizes(), "; make the optimizer over the same parameters as when "
                "saved");
  }
}

// Parameter group `i` of a saved optimizer's state (`group`, and the parameters' states in
// `states`) against `params`, the optimizer's group `i`: as many parameters, each parameter's
// moments of its shape.
void check_group(torch::serialize::InputArchive& group, torch::serialize::InputArchive& states,
                 size_t i, const std::vector<at::Tensor>& params,
                 const std::unordered_map<const void*, std::string>& names,
                 const std::string& what) {
  at::Tensor size;
  group.read("params/size", size);
  TORCH_CHECK(size.item<int64_t>() == static_cast<int64_t>(params.size()),
              "gpipe::load_training: the optimizer's parameter group ", i, " in ", what, " has ",
              size.item<int64_t>(), " parameter(s), but this optimizer's has ", params.size(),
              "; make the optimizer over the same parameters as when saved");
  for (size_t j = 0; j < params.size(); ++j) {
    c10::IValue key;
    group.read("params/" + std::to_string(j), key);
    torch::serialize::InputArchive state;
    if (!states.try_read(key.toStringRef(), state)) continue;
    const auto name = names.find(params[j].unsafeGetTensorImpl());
    check_moments(state, params[j],
                  name != names.end() ? "'" + name->second + "'"
                                      : absl::StrCat("parameter ", j, " of group ", i),
                  what);
  }
}

// The optimizer's state in `saved` against `optimizer`: as many parameter groups, of as many
// parameters, and each parameter's moments of its shape (LibTorch's load() checks the groups,
// but not the moments, and only while it loads). An optimizer whose state has another format is
// left to its load().
void check_optimizer(torch::serialize::InputArchive& saved,
                     const torch::optim::Optimizer& optimizer, const torch::nn::Module* module,
                     const std::string& what) {
  c10::IValue version;
  torch::serialize::InputArchive groups, states;
  if (!saved.try_read("pytorch_version", version) || !saved.try_read("param_groups", groups) ||
      !saved.try_read("state", states)) {
    return;
  }
  const auto& mine = optimizer.param_groups();
  at::Tensor count;
  groups.read("param_groups/size", count);
  TORCH_CHECK(count.item<int64_t>() == static_cast<int64_t>(mine.size()),
              "gpipe::load_training: the optimizer's state in ", what, " has ",
              count.item<int64_t>(), " parameter group(s), but this optimizer has ", mine.size(),
              "; make the optimizer over the same parameters as when saved");
  const auto names = parameter_names(module);
  for (size_t i = 0; i < mine.size(); ++i) {
    torch::serialize::InputArchive group;
    groups.read("param_groups/" + std::to_string(i), group);
    check_group(group, states, i, mine[i].params(), names, what);
  }
}

void write_random(torch::serialize::OutputArchive& archive) {
  c10::List<at::Tensor> states;
  for (at::Generator& g : generators()) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
  }
  archive.write(kRandom, c10::IValue(states));
}

// The saved generators' states, checked against this process's generators.
std::vector<at::Tensor> random_states(torch::serialize::InputArchive& archive,
                                      const std::string& what) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(kRandom, value), "gpipe::load_training: ", what,
              " holds no random generators");
  const c10::List<at::Tensor> states = value.toTensorList();
  std::vector<at::Generator> mine = generators();
  TORCH_CHECK(!states.empty(), "gpipe::load_training: ", what, " holds an empty list of random "
              "generators (a save holds the CPU's, then each CUDA device's)");
  TORCH_CHECK(states.size() == mine.size(), "gpipe::load_training: ", what, " was saved with ",
              states.size() - 1, " CUDA device(s), but this process has ", mine.size() - 1,
              "; resume on the same devices");
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < mine.size(); ++k) {
    at::Tensor current;
    {
      std::lock_guard<std::mutex> lock(mine[k].mutex());
      current = mine[k].get_state();
    }
    const at::Tensor saved = states.get(k);
    TORCH_CHECK(saved.numel() == current.numel() && saved.scalar_type() == current.scalar_type(),
                "gpipe::load_training: the state of random generator ", k, " in ", what, " is ",
                saved.numel(), " ", saved.scalar_type(), ", but this process's is ",
                current.numel(), " ", current.scalar_type(), "; resume with the same LibTorch");
    out.push_back(saved);
  }
  return out;
}

void restore_random(const std::vector<at::Tensor>& states) {
  std::vector<at::Generator> mine = generators();
  for (size_t k = 0; k < states.size(); ++k) {
    std::lock_guard<std::mutex> lock(mine[k].mutex());
    mine[k].set_state(states[k]);
  }
}

void write_layout(torch::serialize::OutputArchive& archive, const std::string& layout) {
  archive.write(kLayout, c10::IValue(layout));
}

void check_layout(torch::serialize::InputArchive& archive, const std::string& layout,
                  const std::string& what) {
  c10::IValue saved;
  TORCH_CHECK(archive.try_read(kLayout, saved), "gpipe::load_training: ", what,
              " was not written by gpipe::save_training");
  TORCH_CHECK(saved.toStringRef() == layout, "gpipe::load_training: ", what, " was saved by ",
              saved.toStringRef(), ", but is loaded into ", layout,
              "; resume with the layout it was saved from");
}

}  // namespace

FileDigest save_file(const std::string& path, const std::string& layout,
                     const torch::nn::Module* module, const torch::optim::Optimizer* optimizer,
                     int64_t step, bool random, const GradScaler* scaler,
                     const LayerNames* layer_names) {
  torch::serialize::OutputArchive archive;
  write_layout(archive, layout);
  const LayerNames names = layer_names != nullptr ? *layer_names
                           : module != nullptr    ? internal::layer_names(*module)
                                                  : LayerNames();
  if (module != nullptr) write_module(archive, *module, names);
  if (optimizer != nullptr) write_optimizer(archive, *optimizer, module, names);
  archive.write(kStep, c10::IValue(step));
  if (random) write_random(archive);
  if (scaler != nullptr) {
    torch::serialize::OutputArchive state;
    scaler->save(state);
    archive.write(kScaler, state);
  }
  AtomicFile file(path, "gpipe::save_training");
  try {
    archive.save_to([&file](const void* data, size_t size) {
      file.append(data, size);
      return size;
    });
  } catch (const std::exception& e) {
    const std::string reason = file.error().empty() ? without_backtrace(e) : file.error();
    TORCH_CHECK(false, "gpipe::save_training: cannot write '", path, "': ", reason);
  }
  return file.commit();
}

LoadedFile::LoadedFile(const std::string& path, const std::string& bytes,
                       const std::string& layout, torch::nn::Module* module,
                       torch::optim::Optimizer* optimizer, bool random, GradScaler* scaler)
    : what_("'" + path + "'"), optimizer_(optimizer), scaler_(scaler) {
  try {
    archive_.load_from(bytes.data(), bytes.size());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gpipe::load_training: cannot read '", path, "': ",
                without_backtrace(e));
  }
  check_layout(archive_, layout, what_);
  if (module != nullptr) copies_ = module_copies(archive_, *module, what_);
  if (optimizer != nullptr) {
    TORCH_CHECK(archive_.try_read(kOptimizer, optimizer_state_), "gpipe::load_training: ", what_,
                " was saved without an optimizer");
    // The kind first: another kind's moments would fail the checks below less clearly. (A save
    // by an older gpipe records none.)
    c10::IValue kind;
    const std::string mine = optimizer_kind(*optimizer);
    const auto name = [](const std::string& k) { return k.empty() ? "another kind" : k; };
    TORCH_CHECK(!archive_.try_read(kOptimizerKind, kind) || !kind.isString() ||
                    kind.toStringRef() == mine,
                "gpipe::load_training: ", what_, " holds the state of the optimizer ",
                name(kind.toStringRef()), ", but it is loaded into an optimizer of ",
                name(mine), "; make the optimizer of the saved run's kind");
    check_optimizer(optimizer_state_, *optimizer, module, what_);
  }
  c10::IValue step;
  TORCH_CHECK(archive_.try_read(kStep, step) && step.isInt(), "gpipe::load_training: ", what_,
              " holds no step");
  step_ = step.toInt();
  if (random) random_ = random_states(archive_, what_);
  if (scaler != nullptr) {
    torch::serialize::InputArchive state;
    TORCH_CHECK(archive_.try_read(kScaler, state), "gpipe::load_training: ", what_,
                " was saved without a GradScaler");
    scaler_state_.emplace(*scaler);
    scaler_state_->load(state);
  }
}

void LoadedFile::apply() {
  if (optimizer_ != nullptr) {
    // As saved, also for parameters the saved run had no state of yet (LibTorch's load keeps
    // an existing state there), and on each parameter's device (the load keeps the saved one).
    auto before = std::move(optimizer_->state());
    optimizer_->state().clear();
    try {
      optimizer_->load(optimizer_state_);
      place_moments_on_parameters(*optimizer_);
    } catch (const c10::Error& e) {
      optimizer_->state() = std::move(before);  // a refused load changes nothing
      TORCH_CHECK(false, "gpipe::load_training: the optimizer's state in ", what_, " does not "
                  "fit this optimizer (", e.what_without_backtrace(), "); make the optimizer "
                  "over the same parameters as when saved");
    }
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [mine, saved] : copies_) mine.copy_(saved);
  }
  restore_random(random_);
  if (scaler_ != nullptr) *scaler_ = *scaler_state_;
}

}  // namespace internal

void save_training(const std::string& path, const torch::nn::Module& module,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler) {
  internal::save_file(path, "one process", &module, optimizer, step, /*random=*/true, scaler);
}

namespace {

// Whether the file `bytes` was saved by one process from a module with the
// same tensor names as `module`: then it loads exactly, generators too; otherwise it is a save of
// another layout (Note [Saves that outlive their layout]).
bool same_layout(const std::string& bytes, const torch::nn::Module& module) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(bytes.data(), bytes.size(), c10::Device(c10::kCPU));
  } catch (const std::exception&) {
    return true;  // LoadedFile says why it cannot be read
  }
  c10::IValue layout, names;
  if (!archive.try_read(internal::kLayout, layout) || !layout.isString() ||
      layout.toStringRef() != "one process" || !archive.try_read(internal::kNames, names)) {
    return !archive.try_read(internal::kLayerNames, names);
  }
  return internal::same_tensor_names(names, module) || internal::layer_names(module).empty();
}

// Loads a save of another layout: the file at `path`, or the files of the save committed in the
// folder `path` (its manifest's, but for the random generators').
int64_t load_resharded(const std::string& path, torch::nn::Module& module,
                       torch::optim::Optimizer* optimizer, GradScaler* scaler) {
  internal::ReshardedLoad load(module, internal::layer_names(module), internal::ties_of(module),
                               optimizer, scaler, /*whole=*/true);
  load.read(path);
  const int64_t step = load.check();
  load.apply();
  return step;
}

}  // namespace

int64_t load_training(const std::string& path, torch::nn::Module& module,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler) {
  if (internal::is_folder(path)) return load_resharded(path, module, optimizer, scaler);
  const std::string bytes = internal::read_whole_file(path, "gpipe::load_training");
  if (!same_layout(bytes, module)) {
    return load_resharded(path, module, optimizer, scaler);
  }
  internal::LoadedFile file(path, bytes, "one process", &module, optimizer, /*random=*/true,
                            scaler);
  file.apply();
  return file.step();
}

int64_t saved_step(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return -1;
  if (internal::is_folder(path)) {
    if (!std::filesystem::exists(path + "/" + internal::kManifest, error)) return -1;
    return internal::read_manifest(path).step;
  }
  return internal::LoadedFile(path, internal::read_whole_file(path, "gpipe::saved_step"),
                              "one process", nullptr, nullptr, /*random=*/false, nullptr)
      .step();
}

}  // namespace gpipe
