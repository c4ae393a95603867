// Saving a training run and resuming it; see Note [Saving and resuming] in saved_training.h.
#include "gpipe/saved_training.h"

#include <map>
#include <mutex>
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

#include "absl/strings/str_join.h"

namespace gpipe {
namespace {

// An exception's message, without the backtrace a c10::Error carries (a message quoted in
// another error is read by people, not debuggers).
const char* without_backtrace(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}


// Archive keys (letters and underscores only, as LibTorch's archives take them).
constexpr const char* kNames = "gpipe_names";
constexpr const char* kTensors = "gpipe_tensors";
constexpr const char* kRandom = "gpipe_random";
constexpr const char* kLayout = "gpipe_layout";
constexpr const char* kStep = "gpipe_step";
constexpr const char* kOptimizer = "gpipe_optimizer";
constexpr const char* kScaler = "gpipe_grad_scaler";

}  // namespace

namespace detail {
namespace {

// Every parameter and buffer of `module`, by name (buffers prefixed, so that the two never mix).
std::vector<std::pair<std::string, at::Tensor>> state_of(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers()) {
    out.emplace_back("buffer " + item.key(), item.value());
  }
  return out;
}

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

void write_module(torch::serialize::OutputArchive& archive, const torch::nn::Module& module) {
  c10::List<std::string> names;
  c10::List<at::Tensor> tensors;
  for (const auto& [name, t] : state_of(module)) {
    names.push_back(name);
    tensors.push_back(t.detach());
  }
  archive.write(kNames, c10::IValue(names));
  archive.write(kTensors, c10::IValue(tensors));
}

void read_module(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                 const std::string& what) {
  c10::IValue names, tensors;
  TORCH_CHECK(archive.try_read(kNames, names) && archive.try_read(kTensors, tensors),
              "gpipe::load_training: ", what, " holds no module state");
  std::map<std::string, at::Tensor> saved;
  const c10::List<at::Tensor> values = tensors.toTensorList();
  const auto keys = names.toListRef();
  TORCH_CHECK(keys.size() == values.size(), "gpipe::load_training: ", what, " is damaged");
  for (size_t k = 0; k < keys.size(); ++k) saved.emplace(keys[k].toStringRef(), values.get(k));
  at::NoGradGuard no_grad;
  const auto mine = state_of(module);
  for (const auto& [name, t] : mine) {
    auto it = saved.find(name);
    TORCH_CHECK(it != saved.end(), "gpipe::load_training: ", what, " has no '", name,
                "', which the module has; load a save of the same model");
    const at::Tensor& from = it->second;
    TORCH_CHECK(from.sizes() == t.sizes() && from.scalar_type() == t.scalar_type(),
                "gpipe::load_training: '", name, "' in ", what, " is ", from.sizes(), " ",
                from.scalar_type(), ", but the module's is ", t.sizes(), " ", t.scalar_type(),
                "; load a save of the same model (converted as it was when saved)");
    t.copy_(from);
  }
  if (saved.size() != mine.size()) {
    std::vector<std::string> extra;
    for (const auto& item : saved) {
      bool found = false;
      for (const auto& m : mine) found = found || m.first == item.first;
      if (!found) extra.push_back("'" + item.first + "'");
    }
    TORCH_CHECK(false, "gpipe::load_training: ", what, " holds ", absl::StrJoin(extra, ", "),
                ", which the module does not have; load a save of the same model");
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

void read_random(torch::serialize::InputArchive& archive, const std::string& what) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(kRandom, value), "gpipe::load_training: ", what,
              " holds no random generators");
  const c10::List<at::Tensor> states = value.toTensorList();
  std::vector<at::Generator> mine = generators();
  TORCH_CHECK(states.size() == mine.size(), "gpipe::load_training: ", what, " was saved with ",
              states.size() - 1, " CUDA device(s), but this process has ", mine.size() - 1,
              "; resume on the same devices");
  for (size_t k = 0; k < mine.size(); ++k) {
    std::lock_guard<std::mutex> lock(mine[k].mutex());
    mine[k].set_state(states.get(k));
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

void save_file(const std::string& path, const std::string& layout,
               const torch::nn::Module* module, const torch::optim::Optimizer* optimizer,
               int64_t step, bool random, const GradScaler* scaler) {
  torch::serialize::OutputArchive archive;
  write_layout(archive, layout);
  if (module != nullptr) write_module(archive, *module);
  if (optimizer != nullptr) {
    torch::serialize::OutputArchive state;
    optimizer->save(state);
    archive.write(kOptimizer, state);
  }
  archive.write(kStep, c10::IValue(step));
  if (random) write_random(archive);
  if (scaler != nullptr) {
    torch::serialize::OutputArchive state;
    scaler->save(state);
    archive.write(kScaler, state);
  }
  try {
    archive.save_to(path);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gpipe::save_training: cannot write '", path, "': ",
                without_backtrace(e));
  }
}

int64_t load_file(const std::string& path, const std::string& layout, torch::nn::Module* module,
                  torch::optim::Optimizer* optimizer, bool random, GradScaler* scaler) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gpipe::load_training: cannot read '", path, "': ",
                without_backtrace(e));
  }
  const std::string what = "'" + path + "'";
  check_layout(archive, layout, what);
  if (module != nullptr) read_module(archive, *module, what);
  if (optimizer != nullptr) {
    torch::serialize::InputArchive state;
    TORCH_CHECK(archive.try_read(kOptimizer, state), "gpipe::load_training: ", what,
                " was saved without an optimizer");
    try {
      optimizer->load(state);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "gpipe::load_training: the optimizer's state in ", what, " does not fit "
                  "this optimizer (", e.what_without_backtrace(), "); make the optimizer over "
                  "the same parameters as when saved");
    }
  }
  c10::IValue step;
  archive.read(kStep, step);
  if (random) read_random(archive, what);
  if (scaler != nullptr) {
    torch::serialize::InputArchive state;
    TORCH_CHECK(archive.try_read(kScaler, state), "gpipe::load_training: ", what,
                " was saved without a GradScaler");
    scaler->load(state);
  }
  return step.toInt();
}

}  // namespace detail

void save_training(const std::string& path, const torch::nn::Module& module,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler) {
  detail::save_file(path, "one process", &module, optimizer, step, /*random=*/true, scaler);
}

int64_t load_training(const std::string& path, torch::nn::Module& module,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler) {
  return detail::load_file(path, "one process", &module, optimizer, /*random=*/true, scaler);
}

}  // namespace gpipe
