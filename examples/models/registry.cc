// The bundled example models by name; see registry.h.
#include "examples/models/registry.h"

#include <algorithm>

#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "examples/models/amoebanet.h"
#include "examples/models/gpt.h"
#include "examples/models/mlp.h"
#include "examples/models/resnet.h"
#include "examples/models/unet.h"
#include "examples/models/unet_reference.h"

namespace gpipe {
namespace models {

namespace {

// "<a>_<b>" as two numbers; else an error saying that `name` is not `pattern`.
std::pair<int64_t, int64_t> two_numbers(absl::string_view text, const std::string& name,
                                        const char* pattern) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, '_');
  int64_t a = 0;
  int64_t b = 0;
  TORCH_CHECK(parts.size() == 2 && absl::SimpleAtoi(parts[0], &a) && absl::SimpleAtoi(parts[1], &b),
              "make_model: '", name, "' is not ", pattern);
  return {a, b};
}

}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const char* suffix : {"", "_cifar", "_fine"}) {
    for (int depth : {18, 34, 50, 101, 152}) {
      names.push_back("resnet" + std::to_string(depth) + suffix);
    }
  }
  for (int depth : {8, 20, 32, 44, 56, 110}) {
    names.push_back("resnet" + std::to_string(depth) + "_cifar");
  }
  names.push_back("amoebanet_d_<L>_<D> (e.g. amoebanet_d_18_256)");
  names.push_back("unet_<B>_<C> (e.g. unet_5_64)");
  names.push_back("unet");
  names.push_back("mlp");
  names.push_back("gpt_<L>_<D> (e.g. gpt_4_128)");
  names.push_back("gpt2_small");
  names.push_back("gpt2_medium");
  return names;
}

at::Tensor sample_batch(const NamedModel& named, int64_t batch) {
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), named.sample_shape.begin(), named.sample_shape.end());
  return named.vocabulary > 0 ? at::randint(named.vocabulary, shape, at::kLong) : at::randn(shape);
}

NamedModel make_model(const std::string& name, const ModelInput& input) {
  TORCH_CHECK(input.channels >= 1, "make_model: channels must be positive, got ", input.channels);
  auto shape = [&](int64_t size) {
    const int64_t s = input.size > 0 ? input.size : size;
    return std::vector<int64_t>{input.channels, s, s};
  };
  auto classes = [&](int64_t own) { return input.classes > 0 ? input.classes : own; };
  for (int depth : {18, 34, 50, 101, 152}) {
    const std::string base = "resnet" + std::to_string(depth);
    if (name == base) {
      return {resnet(depth, classes(1000), /*imagenet=*/true, input.channels), shape(224)};
    }
    if (name == base + "_cifar") {
      return {resnet(depth, classes(10), /*imagenet=*/false, input.channels), shape(32)};
    }
    if (name == base + "_fine") {
      return {resnet_fine(depth, classes(1000), /*imagenet=*/true, input.channels), shape(224)};
    }
  }
  for (int depth : {8, 20, 32, 44, 56, 110}) {
    if (name == "resnet" + std::to_string(depth) + "_cifar") {
      return {resnet_cifar(depth, classes(10), input.channels), shape(32)};
    }
  }
  absl::string_view rest = name;
  if (name == "gpt2_small" || name == "gpt2_medium") {
    const GptOptions o = name == "gpt2_small" ? gpt2_small() : gpt2_medium();
    return {gpt(o), {o.context()}, o.vocabulary()};
  }
  if (absl::ConsumePrefix(&rest, "gpt_")) {
    const auto [layers, width] = two_numbers(
        rest, name, "gpt_<L>_<D> with numbers L (blocks) and D (width), e.g. gpt_4_128");
    const GptOptions o =
        GptOptions(256, 256).layers(layers).width(width).heads(std::max<int64_t>(1, width / 64));
    return {gpt(o), {o.context()}, o.vocabulary()};
  }
  if (absl::ConsumePrefix(&rest, "amoebanet_d_")) {
    const auto [layers, filters] = two_numbers(
        rest, name, "amoebanet_d_<L>_<D> with numbers L (normal cells, a multiple of 3) and D "
                    "(filters), e.g. amoebanet_d_18_256");
    return {amoebanet_d(layers, filters, classes(1000), input.channels), shape(224)};
  }
  if (absl::ConsumePrefix(&rest, "unet_")) {
    const auto [convs, channels] = two_numbers(
        rest, name, "unet_<B>_<C> with numbers B (convolutions per level) and C (base channels), "
                    "e.g. unet_5_64");
    return {unet_reference(5, convs, channels, input.channels, 1), shape(192)};
  }
  if (name == "unet") return {unet(), {1, 16, 16}};
  if (name == "mlp") return {mlp(), {2}};
  TORCH_CHECK(false, "unknown model '", name, "'; the bundled models are ",
              absl::StrJoin(model_names(), ", "));
}

}  // namespace models
}  // namespace gpipe
