// Text for the language-model trainer; see text.h.
#include "examples/training/text.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace gpipe {
namespace training {
namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "load_text: cannot read ", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Printable ASCII, newlines and tabs; an overstruck character ("_\bx") keeps its last form.
std::string clean(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\b') {
      if (!out.empty()) out.pop_back();
    } else if (c == '\n' || c == '\t' || (c >= 32 && c < 127)) {
      out.push_back(c);
    }
  }
  return out;
}

at::Tensor as_tensor(const std::string& text) {
  std::vector<int64_t> bytes(text.begin(), text.end());
  return at::tensor(bytes, at::kLong);
}

double entropy_bits(const at::Tensor& counts) {
  const at::Tensor p = counts.to(at::kDouble) / counts.sum().item<double>();
  const at::Tensor nz = p.masked_select(p > 0);
  return -(nz * nz.log2()).sum().item<double>();
}

}  // namespace

TextCorpus load_text(const std::string& spec, int64_t holdout) {
  TORCH_CHECK(holdout >= 2, "load_text: holdout must be at least 2, got ", holdout);
  absl::string_view rest = spec;
  std::vector<std::string> pieces;  // fortunes, or 4 KiB blocks of a file
  std::string name;
  if (absl::ConsumePrefix(&rest, "fortunes")) {
    std::string folder = "/usr/share/games/fortunes";
    if (absl::ConsumePrefix(&rest, ":")) folder = std::string(rest);
    TORCH_CHECK(std::filesystem::is_directory(folder), "--data=fortunes: ", folder, " is not a "
                "folder; install Debian's fortunes package (apt-get install fortunes; "
                "tools/setup.sh does) or give --data=text:<file>");
    std::vector<std::filesystem::path> files;
    for (const auto& entry : std::filesystem::directory_iterator(folder)) {
      const std::string file = entry.path().filename().string();
      // The plain-text files: not the indices (.dat) nor their UTF-8 links (.u8).
      if (!entry.is_regular_file() || entry.is_symlink() || absl::EndsWith(file, ".dat") ||
          absl::EndsWith(file, ".u8")) {
        continue;
      }
      files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    TORCH_CHECK(!files.empty(), "--data=fortunes: no text files in ", folder);
    for (const auto& file : files) {
      for (absl::string_view fortune : absl::StrSplit(read_file(file), "\n%\n")) {
        std::string text = clean(std::string(absl::StripPrefix(fortune, "%\n")));
        if (!text.empty()) pieces.push_back(text + "\n\n");
      }
    }
    name = absl::StrCat("fortunes (", files.size(), " files of ", folder, ")");
  } else if (absl::ConsumePrefix(&rest, "text:")) {
    const std::string all = clean(read_file(std::string(rest)));
    for (size_t at = 0; at < all.size(); at += 4096) pieces.push_back(all.substr(at, 4096));
    name = std::string(rest);
  } else {
    TORCH_CHECK(false, "--data must be fortunes[:<folder>] or text:<file>, got '", spec, "'");
  }
  std::string train, validation;
  for (size_t k = 0; k < pieces.size(); ++k) {
    (k % static_cast<size_t>(holdout) == static_cast<size_t>(holdout) - 1 ? validation : train) +=
        pieces[k];
  }
  TORCH_CHECK(train.size() > 1024 && validation.size() > 1024, "load_text: ", name, " has ",
              train.size(), " bytes of training and ", validation.size(), " of validation text; "
              "give at least ", 1024 * holdout, " bytes");
  return {name, as_tensor(train), as_tensor(validation)};
}

std::pair<at::Tensor, at::Tensor> random_windows(const at::Tensor& text, int64_t batch,
                                                 int64_t length, at::Generator generator) {
  TORCH_CHECK(text.numel() > length + 1, "random_windows: a text of ", text.numel(),
              " bytes has no window of ", length + 1);
  const at::Tensor starts =
      at::randint(text.numel() - length - 1, {batch}, generator, at::TensorOptions(at::kLong));
  const at::Tensor offsets = at::arange(length + 1, at::kLong);
  const at::Tensor windows = text.index_select(0, (starts.unsqueeze(1) + offsets).reshape(-1))
                                 .view({batch, length + 1});
  return {windows.narrow(1, 0, length).contiguous(), windows.narrow(1, 1, length).contiguous()};
}

std::pair<at::Tensor, at::Tensor> consecutive_windows(const at::Tensor& text, int64_t first,
                                                      int64_t rows, int64_t length) {
  const at::Tensor span = text.narrow(0, first * length, rows * length + 1);
  return {span.narrow(0, 0, rows * length).view({rows, length}),
          span.narrow(0, 1, rows * length).view({rows, length})};
}

std::pair<double, double> unigram_bigram_entropy(const at::Tensor& text) {
  const at::Tensor unigrams = at::bincount(text, {}, 256);
  const at::Tensor pairs =
      at::bincount(text.narrow(0, 0, text.numel() - 1) * 256 + text.narrow(0, 1, text.numel() - 1),
                   {}, 256 * 256);
  const at::Tensor firsts = at::bincount(text.narrow(0, 0, text.numel() - 1), {}, 256);
  return {entropy_bits(unigrams), entropy_bits(pairs) - entropy_bits(firsts)};
}

}  // namespace training
}  // namespace gpipe
