// The trainers' data; see data.h.
#include "examples/training/data.h"

#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <string>
#include <fstream>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/data/datasets/mnist.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace gpipe {
namespace training {
namespace {

namespace fs = std::filesystem;

// Uncompresses `from` (gzip) into `to`, unless `to` is already there; safe for processes at once.
void gunzip(const fs::path& from, const fs::path& to) {
  if (fs::exists(to) && fs::file_size(to) > 0) {
    return;
  }
  TORCH_CHECK(fs::exists(from), "data: '", from.string(), "' is missing; install Debian's "
              "dataset-fashion-mnist package (tools/setup.sh does) or pass --data=fashion-mnist:"
              "<folder with the four .gz files>");
  gzFile in = gzopen(from.c_str(), "rb");
  TORCH_CHECK(in != nullptr, "data: cannot open '", from.string(), "'");
  // A file of this process's own: ranks started at once on a fresh machine uncompress side by
  // side, and each renames a whole file into place (one rename replacing another's is fine).
  const fs::path partial = to.string() + ".partial." + std::to_string(getpid());
  std::ofstream out(partial, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out.good(), "data: cannot write '", partial.string(), "'");
  std::vector<char> buffer(1 << 20);
  int n = 0;
  while ((n = gzread(in, buffer.data(), static_cast<unsigned>(buffer.size()))) > 0) {
    out.write(buffer.data(), n);
  }
  const bool failed = n < 0;
  gzclose(in);
  out.close();
  TORCH_CHECK(!failed && out.good(), "data: cannot uncompress '", from.string(), "'");
  fs::rename(partial, to);
}

// Normalises `images` (float in [0, 1]) per channel with `mean` and `std` (per channel).
at::Tensor normalise(const at::Tensor& images, const at::Tensor& mean, const at::Tensor& std) {
  return (images - mean.view({1, -1, 1, 1})) / std.view({1, -1, 1, 1});
}

Data make_data(std::string name, at::Tensor train_images, at::Tensor train_labels,
               at::Tensor test_images, at::Tensor test_labels, int64_t classes) {
  const at::Tensor mean = train_images.mean({0, 2, 3});
  const at::Tensor std = train_images.std({0, 2, 3}).clamp_min(1e-6);
  const int64_t channels = train_images.size(1);
  const int64_t size = train_images.size(2);
  return Data{std::move(name),
              ImageDataset(normalise(train_images, mean, std), std::move(train_labels)),
              ImageDataset(normalise(test_images, mean, std), std::move(test_labels)), channels,
              size, classes};
}

}  // namespace

ImageDataset::ImageDataset(at::Tensor images, at::Tensor labels)
    : images_(std::move(images)), labels_(std::move(labels)) {
  TORCH_CHECK(images_.dim() == 4 && labels_.dim() == 1 && images_.size(0) == labels_.size(0),
              "ImageDataset: expected N x C x H x W images and N labels, got ", images_.sizes(),
              " and ", labels_.sizes());
}

torch::data::Example<> ImageDataset::get(size_t index) {
  return {images_[static_cast<int64_t>(index)], labels_[static_cast<int64_t>(index)]};
}

c10::optional<size_t> ImageDataset::size() const { return static_cast<size_t>(images_.size(0)); }

std::pair<at::Tensor, at::Tensor> read_cifar10(const std::vector<std::string>& files) {
  constexpr int64_t kPixels = 3 * 32 * 32;
  constexpr int64_t kRecord = 1 + kPixels;
  std::vector<uint8_t> bytes;
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    TORCH_CHECK(in.good(), "data: cannot open CIFAR-10 file '", file, "'");
    std::vector<uint8_t> content((std::istreambuf_iterator<char>(in)),
                                 std::istreambuf_iterator<char>());
    TORCH_CHECK(!content.empty() && content.size() % kRecord == 0, "data: '", file,
                "' is not a CIFAR-10 binary batch: its size, ", content.size(),
                " bytes, is not a positive multiple of ", kRecord,
                " (a label byte and 3 x 32 x 32 pixel bytes per image)");
    bytes.insert(bytes.end(), content.begin(), content.end());
  }
  const int64_t n = static_cast<int64_t>(bytes.size()) / kRecord;
  at::Tensor records = at::from_blob(bytes.data(), {n, kRecord}, at::kByte);
  at::Tensor labels = records.select(1, 0).to(at::kLong);
  TORCH_CHECK(labels.max().item<int64_t>() < 10, "data: a CIFAR-10 label is ",
              labels.max().item<int64_t>(), "; they are 0 to 9");
  at::Tensor images = records.slice(1, 1).reshape({n, 3, 32, 32}).clone();
  return {images, labels};
}

Data load_data(const std::string& spec, const std::string& cache, int64_t synthetic_samples) {
  absl::string_view rest = spec;
  if (rest == "fashion-mnist" || absl::ConsumePrefix(&rest, "fashion-mnist:")) {
    const fs::path folder = rest == "fashion-mnist" ? fs::path("/usr/share/datasets/fashion-mnist")
                                                    : fs::path(std::string(rest));
    const fs::path unpacked = fs::path(cache) / "fashion-mnist";
    fs::create_directories(unpacked);
    for (const char* file : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
      gunzip(folder / (std::string(file) + ".gz"), unpacked / file);
    }
    using torch::data::datasets::MNIST;
    MNIST train(unpacked.string(), MNIST::Mode::kTrain);
    MNIST test(unpacked.string(), MNIST::Mode::kTest);
    return make_data("Fashion-MNIST", train.images(), train.targets(), test.images(),
                     test.targets(), 10);
  }
  if (absl::ConsumePrefix(&rest, "cifar10:")) {
    const fs::path folder{std::string(rest)};
    std::vector<std::string> train_files;
    for (int k = 1; k <= 5; ++k) {
      const fs::path file = folder / absl::StrCat("data_batch_", k, ".bin");
      if (fs::exists(file)) train_files.push_back(file.string());
    }
    TORCH_CHECK(!train_files.empty(), "data: no data_batch_<k>.bin in '", folder.string(),
                "'; --data=cifar10:<folder> wants CIFAR-10's binary version "
                "(cifar-10-batches-bin)");
    auto [train_images, train_labels] = read_cifar10(train_files);
    auto [test_images, test_labels] = read_cifar10({(folder / "test_batch.bin").string()});
    return make_data("CIFAR-10", train_images.to(at::kFloat) / 255, train_labels,
                     test_images.to(at::kFloat) / 255, test_labels, 10);
  }
  if (rest == "synthetic" || absl::ConsumePrefix(&rest, "synthetic:")) {
    int64_t channels = 3;
    int64_t size = 32;
    if (rest != "synthetic") {
      std::vector<absl::string_view> parts = absl::StrSplit(rest, 'x');
      TORCH_CHECK(parts.size() == 2 && absl::SimpleAtoi(parts[0], &channels) &&
                      absl::SimpleAtoi(parts[1], &size) && channels >= 1 && size >= 1,
                  "data: '", spec, "' is not synthetic:<channels>x<size>, e.g. synthetic:1x28");
    }
    TORCH_CHECK(synthetic_samples >= 10, "data: synthetic samples must be at least 10, got ",
                synthetic_samples);
    const int64_t test_samples = std::max<int64_t>(synthetic_samples / 10, 1);
    return make_data(absl::StrCat("synthetic ", channels, "x", size, "x", size),
                     at::rand({synthetic_samples, channels, size, size}),
                     at::randint(10, {synthetic_samples}, at::kLong),
                     at::rand({test_samples, channels, size, size}),
                     at::randint(10, {test_samples}, at::kLong), 10);
  }
  TORCH_CHECK(false, "data: unknown --data '", spec, "'; use fashion-mnist[:<folder>], "
              "cifar10:<folder> or synthetic[:<channels>x<size>]");
}

}  // namespace training
}  // namespace gpipe
