// Partitions; see partition.h.
#include "gpipe/internal/partition.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace gpipe {
namespace internal {
namespace {

const char* const kBalanceAdvice =
    "\n\nHow to choose a balance: each number is how many consecutive layers one partition (one "
    "device) holds, and they must add up to the number of layers. gpipe::balance_by_time and "
    "gpipe::balance_by_size (balancing/balance.h) compute a balance from measurements, e.g.\n"
    "  auto balance = gpipe::balance_by_time(/*partitions=*/4, model, sample);\n";

// "layer 'conv' (torch::nn::Conv2dImpl)" for a layer of a partition: partitions keep the
// user's layer names, while their indices restart at 0.
std::string describe_in_partition(const torch::nn::Sequential& partition, size_t index) {
  const auto& children = partition->named_children();
  return absl::StrFormat("layer '%s' (%s)", children[index].key(),
                         children[index].value()->name());
}

}  // namespace

namespace {

// "'<path>' (<type>)" of the first module of `partition` that draws random numbers in training,
// or "" (Note [Random numbers in concurrent partitions]).
std::string random_layer(const torch::nn::Sequential& partition) {
  for (const auto& item : partition->named_modules("", /*include_self=*/false)) {
    const std::string type = item.value()->name();
    if (type.find("Dropout") != std::string::npos || type.find("RReLU") != std::string::npos) {
      return absl::StrCat("'", item.key(), "' (", type, ")");
    }
  }
  return "";
}

}  // namespace

namespace {

// Whether partitions on `a` and `b` may draw from one generator: every CPU device is the one CPU
// generator, and a CUDA device without an index is the current one.
bool same_generator(const c10::Device& a, const c10::Device& b) {
  if (a.type() != b.type()) return false;
  if (!a.is_cuda()) return true;
  // (An unindexed one is taken to be any: the current device may be either.)
  return !a.has_index() || !b.has_index() || a.index() == b.index();
}

}  // namespace

void check_concurrent_generators(const std::string& who,
                                 const std::vector<torch::nn::Sequential>& partitions,
                                 const std::vector<c10::Device>& devices,
                                 const std::vector<int64_t>& threads, bool checkpointing) {
  if (!checkpointing) return;
  std::string warning;
  for (size_t j = 0; j < partitions.size(); ++j) {
    const std::string layer = random_layer(partitions[j]);
    if (layer.empty()) continue;
    for (size_t k = 0; k < partitions.size(); ++k) {
      if (k == j || threads[k] == threads[j] || !same_generator(devices[k], devices[j])) continue;
      TORCH_CHECK(!devices[j].is_cuda(), who, ": partition ", j, " holds ", layer, ", which "
                  "draws random numbers, and runs on ", devices[j], " at the same time as "
                  "partition ", k, ", on another thread: they share the device's random "
                  "generator, so a checkpointed micro-batch could recompute different numbers "
                  "than its forward drew. Give each partition its own GPU, or use "
                  "Checkpoint::kNever");
      if (warning.empty()) {
        warning = absl::StrCat(
            who, ": partition ", j, " holds ", layer, ", which draws random numbers, and runs at "
            "the same time as partition ", k, " on the CPU: they draw from the one CPU generator "
            "in an order that depends on thread timing, so a checkpointed micro-batch may "
            "recompute different numbers than its forward drew. Use Checkpoint::kNever, or "
            "partitions on one thread.");
      }
    }
  }
  // Every GPU pair checked first: a refusal is not hidden behind a warning.
  if (!warning.empty()) TORCH_WARN(warning);
}

bool own_threads_for_forward(const std::vector<torch::nn::Sequential>& partitions,
                             const std::vector<c10::Device>& devices, std::optional<bool> chosen,
                             bool stage_local) {
  if (chosen) return *chosen;
  if (stage_local) return true;
  if (partitions.size() < 2) return false;
  for (size_t j = 0; j < partitions.size(); ++j) {
    if (!devices[j].is_cpu() || !random_layer(partitions[j]).empty()) return false;
  }
  return true;
}

std::string describe_layer(const torch::nn::Sequential& module, size_t index) {
  const auto children = module->named_children();
  return absl::StrFormat("layer %d ('%s', %s)", index, children[index].key(),
                         children[index].value()->name());
}

void verify_module(const torch::nn::Sequential& module) {
  std::unordered_map<const torch::nn::Module*, size_t> first_index;
  for (const auto i : c10::irange(module->size())) {
    const torch::nn::Module* layer = module->ptr(i).get();
    auto inserted = first_index.emplace(layer, i);
    TORCH_CHECK(inserted.second, "GPipe cannot partition a Sequential that holds the same module "
                "object twice: ", describe_layer(module, inserted.first->second), " and ",
                describe_layer(module, i), " are one object; use two separate modules");
  }
  // Layers may share parameters: Note [Tied parameters] in tied_parameters.h.
}

void verify_balance(const std::vector<int64_t>& balance, int64_t layers, size_t devices) {
  const std::string shown = absl::StrCat("{", absl::StrJoin(balance, ", "), "}");
  TORCH_CHECK(!balance.empty() || layers == 0, "GPipe balance is empty, but the Sequential has ",
              layers, " layers; give at least one partition", kBalanceAdvice);
  for (int64_t b : balance) {
    TORCH_CHECK(b > 0, "GPipe balance ", shown, " has a non-positive entry ", b,
                "; every partition needs at least one layer", kBalanceAdvice);
  }
  const int64_t sum = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  TORCH_CHECK(sum == layers, "GPipe balance ", shown, " adds up to ", sum,
              " layers, but the Sequential has ", layers, kBalanceAdvice);
  TORCH_CHECK(balance.size() <= devices, "GPipe balance ", shown, " has ", balance.size(),
              " partitions, but only ", devices, " devices; give at least one device per "
              "partition with GPipeOptions::devices (a device may be repeated, e.g. "
              "{torch::kCPU, torch::kCPU})");
}

std::vector<torch::nn::Sequential> split_module(const torch::nn::Sequential& module,
                                                const std::vector<int64_t>& balance,
                                                const std::vector<c10::Device>& devices) {
  verify_balance(balance, static_cast<int64_t>(module->size()), devices.size());
  const auto& children = module->named_children();
  std::vector<torch::nn::Sequential> partitions;
  size_t next = 0;
  for (const auto j : c10::irange(balance.size())) {
    torch::nn::Sequential partition;
    for (int64_t k = 0; k < balance[j]; ++k, ++next) {
      partition->push_back(children[next].key(), *(module->begin() + next));
    }
    partition->to(devices[j]);
    partitions.push_back(std::move(partition));
  }
  return partitions;
}

std::vector<c10::Device> layer_devices(const std::vector<int64_t>& balance,
                                       const std::vector<c10::Device>& devices) {
  std::vector<c10::Device> out;
  for (size_t j = 0; j < balance.size(); ++j) out.insert(out.end(), balance[j], devices[j]);
  return out;
}

uint64_t requires_grad_key(const torch::nn::Sequential& partition) {
  uint64_t key = 1469598103934665603ull;
  for (const at::Tensor& p : partition->parameters()) {
    key = (key ^ (p.requires_grad() ? 2u : 1u)) * 1099511628211ull;
  }
  return key;
}

Batch run_partition(const torch::nn::Sequential& partition, const Batch& input,
                    std::vector<std::vector<at::Tensor>>* layer_outputs) {
  torch::nn::AnyValue value = input.to_any();
  size_t index = 0;
  for (auto& layer : *partition.ptr()) {
    try {
      value = layer.any_forward(std::move(value));
    } catch (c10::Error& e) {
      e.add_context(
          absl::StrCat("(raised by ", describe_in_partition(partition, index), " inside a GPipe)"));
      throw;
    }
    const at::Tensor* one = value.try_get<at::Tensor>();
    const std::vector<at::Tensor>* many = value.try_get<std::vector<at::Tensor>>();
    if (one == nullptr && many == nullptr) {
      break;
    }
    if (layer_outputs != nullptr) {
      std::vector<at::Tensor> out;
      for (const at::Tensor& t : one != nullptr ? std::vector<at::Tensor>{*one} : *many) {
        if (t.defined() && t.requires_grad()) out.push_back(t);
      }
      layer_outputs->push_back(std::move(out));
    }
    ++index;
  }
  if (index == partition->size()) {
    return Batch::from_any(std::move(value), "");
  }
  return Batch::from_any(std::move(value), describe_in_partition(partition, index));
}

}  // namespace internal
}  // namespace gpipe
