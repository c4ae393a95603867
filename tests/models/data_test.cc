// The trainers' data: CIFAR-10 binary batches read back exactly, Fashion-MNIST from Debian's
// package through LibTorch's MNIST reader, synthetic images, and clear errors for bad specs.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <torch/data/dataloader.h>
#include <torch/data/datasets/map.h>
#include <torch/data/samplers/sequential.h>
#include <torch/data/transforms/stack.h>

#include "examples/training/data.h"
#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace testing {
namespace {

namespace fs = std::filesystem;
using training::load_data;

// Writes `n` CIFAR-10 records with labels k % 10 and pixels (k + p) % 256 to `path`.
void write_cifar(const fs::path& path, int64_t n, int64_t first) {
  std::ofstream out(path, std::ios::binary);
  for (int64_t k = first; k < first + n; ++k) {
    out.put(static_cast<char>(k % 10));
    for (int64_t p = 0; p < 3 * 32 * 32; ++p) out.put(static_cast<char>((k + p) % 256));
  }
}

CATCH_TEST_CASE("CIFAR-10 binary batches are read back exactly and normalised per channel",
                "[data]") {
  const fs::path dir = fs::temp_directory_path() / "gpipe_data_test_cifar";
  fs::remove_all(dir);
  fs::create_directories(dir);
  write_cifar(dir / "data_batch_1.bin", 5, 0);
  write_cifar(dir / "data_batch_2.bin", 3, 5);
  write_cifar(dir / "test_batch.bin", 4, 100);

  auto [images, labels] = training::read_cifar10({(dir / "data_batch_1.bin").string()});
  CATCH_REQUIRE(images.sizes() == at::IntArrayRef({5, 3, 32, 32}));
  for (int64_t k = 0; k < 5; ++k) {
    CATCH_CHECK(labels[k].item<int64_t>() == k % 10);
    // Pixel p of record k is (k + p) % 256, in channel-major order.
    const at::Tensor flat = images[k].flatten().to(at::kLong);
    const at::Tensor expected = (at::arange(3 * 32 * 32, at::kLong) + k).remainder(256);
    CATCH_CHECK(flat.equal(expected));
  }

  training::Data data = load_data("cifar10:" + dir.string(), dir.string());
  CATCH_CHECK(data.train.images().size(0) == 8);  // both training batches
  CATCH_CHECK(data.test.images().size(0) == 4);
  CATCH_CHECK(data.channels == 3);
  CATCH_CHECK(data.size == 32);
  // Normalised with the training set's statistics: mean 0 and standard deviation 1 per channel.
  const at::Tensor mean = data.train.images().mean({0, 2, 3});
  const at::Tensor std = data.train.images().std({0, 2, 3});
  CATCH_CHECK(mean.abs().max().item<double>() < 1e-5);
  CATCH_CHECK((std - 1).abs().max().item<double>() < 1e-4);
  CATCH_CHECK(data.test.labels().equal(at::arange(100, 104, at::kLong).remainder(10)));

  // A truncated file is refused with its size.
  std::ofstream(dir / "bad.bin", std::ios::binary) << "abc";
  CATCH_CHECK_THROWS_WITH(training::read_cifar10({(dir / "bad.bin").string()}),
                          gpipe_test::contains("3 bytes, is not a positive multiple of 3073"));
  fs::remove_all(dir);
  CATCH_CHECK_THROWS_WITH(load_data("cifar10:" + dir.string(), dir.string()),
                          gpipe_test::contains("no data_batch_<k>.bin"));
}

CATCH_TEST_CASE("Fashion-MNIST comes from Debian's package through LibTorch's MNIST reader "
                "and its data loader",
                "[data]") {
  const fs::path cache = fs::temp_directory_path() / "gpipe_data_test_cache";
  training::Data data = load_data("fashion-mnist", cache.string());
  CATCH_CHECK(data.train.images().sizes() == at::IntArrayRef({60000, 1, 28, 28}));
  CATCH_CHECK(data.test.images().sizes() == at::IntArrayRef({10000, 1, 28, 28}));
  // Ten classes, 6,000 training images each (the dataset's published balance).
  CATCH_CHECK(at::bincount(data.train.labels()).equal(at::full({10}, 6000, at::kLong)));
  CATCH_CHECK(at::bincount(data.test.labels()).equal(at::full({10}, 1000, at::kLong)));
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      data.test.map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(4096));
  int64_t seen = 0;
  for (auto& batch : *loader) {
    CATCH_CHECK(batch.data.size(1) == 1);
    seen += batch.target.size(0);
  }
  CATCH_CHECK(seen == 10000);
  CATCH_CHECK_THROWS_WITH(load_data("fashion-mnist:/nonexistent", cache.string() + "2"),
                          gpipe_test::contains("'/nonexistent/train-images-idx3-ubyte.gz' is "
                                               "missing"));
  fs::remove_all(cache.string() + "2");
}

CATCH_TEST_CASE("synthetic data has the asked shape, and bad specs say what is allowed",
                "[data]") {
  training::Data data = load_data("synthetic:1x20", "", 100);
  CATCH_CHECK(data.train.images().sizes() == at::IntArrayRef({100, 1, 20, 20}));
  CATCH_CHECK(data.test.images().size(0) == 10);
  CATCH_CHECK_THROWS_WITH(load_data("synthetic:1y20", ""), gpipe_test::contains("synthetic:<channels>x<size>"));
  CATCH_CHECK_THROWS_WITH(load_data("imagenet", ""), gpipe_test::contains("unknown --data 'imagenet'"));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
