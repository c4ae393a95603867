// The bundled example models by name; see registry.h.
#include "examples/models/registry.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_join.h"
#include "examples/models/mlp.h"
#include "examples/models/resnet.h"
#include "examples/models/unet.h"

namespace gpipe {
namespace models {

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const char* suffix : {"", "_cifar"}) {
    for (int depth : {18, 34, 50, 101, 152}) {
      names.push_back("resnet" + std::to_string(depth) + suffix);
    }
  }
  names.push_back("unet");
  names.push_back("mlp");
  return names;
}

NamedModel make_model(const std::string& name) {
  for (int depth : {18, 34, 50, 101, 152}) {
    if (name == "resnet" + std::to_string(depth)) {
      return {resnet(depth, 1000, /*imagenet=*/true), {3, 224, 224}};
    }
    if (name == "resnet" + std::to_string(depth) + "_cifar") {
      return {resnet(depth, 10, /*imagenet=*/false), {3, 32, 32}};
    }
  }
  if (name == "unet") return {unet(), {1, 16, 16}};
  if (name == "mlp") return {mlp(), {2}};
  TORCH_CHECK(false, "unknown model '", name, "'; the bundled models are ",
              absl::StrJoin(model_names(), ", "));
}

}  // namespace models
}  // namespace gpipe
