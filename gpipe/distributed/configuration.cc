// Configurations compared across ranks; see configuration.h.
#include "gpipe/distributed/internal/configuration.h"

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gpipe {
namespace distributed {
namespace internal {

uint64_t fingerprint(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) {
    h = (h ^ c) * 1099511628211ULL;
  }
  return h;
}

void check_same_fields(const ProcessGroup& group,
                       const std::vector<std::pair<std::string, int64_t>>& fields,
                       const std::string& who, const std::string& noun,
                       const std::string& advice, c10::Device local) {
  std::vector<int64_t> values;
  for (const auto& f : fields) values.push_back(f.second);
  const std::vector<at::Tensor> all =
      all_gather(group, at::tensor(values, at::kLong), local,
                 absl::StrCat("the comparison of the ", noun, "s' configurations"));
  for (int r = 1; r < group->getSize(); ++r) {
    std::vector<std::string> differences;
    for (size_t k = 0; k < fields.size(); ++k) {
      const int64_t theirs = all[r][static_cast<int64_t>(k)].item<int64_t>();
      const int64_t first = all[0][static_cast<int64_t>(k)].item<int64_t>();
      if (theirs != first) {
        differences.push_back(absl::StrCat(fields[k].first, ": ", theirs, " (rank 0: ", first,
                                           ")"));
      }
    }
    TORCH_CHECK(differences.empty(), who, ": rank ", r, "'s ", noun, " differs from rank 0's: ",
                absl::StrJoin(differences, "; "), ". ", advice);
  }
}

std::vector<std::pair<std::string, int64_t>> module_fields(const torch::nn::Module& module) {
  std::string shapes;
  int64_t numel = 0;
  const auto params = module.named_parameters();
  for (const auto& item : params) {
    absl::StrAppend(&shapes, item.key(), ":", item.value().sizes().vec().size(), ":",
                    absl::StrJoin(item.value().sizes(), "x"), ":",
                    c10::toString(item.value().scalar_type()), ";");
    numel += item.value().numel();
  }
  const auto buffers = module.named_buffers();
  for (const auto& item : buffers) {
    absl::StrAppend(&shapes, item.key(), ":", absl::StrJoin(item.value().sizes(), "x"), ";");
  }
  return {{"parameters", static_cast<int64_t>(params.size())},
          {"parameter elements", numel},
          {"buffers", static_cast<int64_t>(buffers.size())},
          {"names, shapes and dtypes (hash)", static_cast<int64_t>(fingerprint(shapes))}};
}

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
