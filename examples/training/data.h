// The trainers' data: Fashion-MNIST (Debian's dataset-fashion-mnist package, gzipped IDX files,
// read by LibTorch's own MNIST reader), CIFAR-10's binary batches, or synthetic images for timing;
// as torch::data datasets for LibTorch's data loader.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

namespace gpipe {
namespace training {

/// Images (float, N x C x H x W, normalised per channel with the training set's mean and
/// standard deviation) and their labels (int64), in memory.
class ImageDataset : public torch::data::datasets::Dataset<ImageDataset> {
 public:
  ImageDataset(at::Tensor images, at::Tensor labels);
  torch::data::Example<> get(size_t index) override;
  c10::optional<size_t> size() const override;
  const at::Tensor& images() const { return images_; }
  const at::Tensor& labels() const { return labels_; }

 private:
  at::Tensor images_;
  at::Tensor labels_;
};

/// A training set and a test set of one kind of image.
struct Data {
  std::string name;
  ImageDataset train;
  ImageDataset test;
  int64_t channels;
  int64_t size;     // images are size x size
  int64_t classes;
};

/// The data named by `spec`:
/// - "fashion-mnist" or "fashion-mnist:<folder>": the four gzipped IDX files of Fashion-MNIST
///   (default folder /usr/share/datasets/fashion-mnist, from Debian's dataset-fashion-mnist),
///   uncompressed once into `cache` and read with torch::data::datasets::MNIST;
/// - "cifar10:<folder>": CIFAR-10's binary version (data_batch_1.bin ... data_batch_5.bin,
///   test_batch.bin; the training batches present are used);
/// - "synthetic" or "synthetic:<channels>x<size>": random images (3 x 32 x 32 by default) with
///   random labels among 10, `synthetic_samples` for training and a tenth of that for testing.
/// Throws c10::Error naming the missing file or the malformed spec.
Data load_data(const std::string& spec, const std::string& cache,
               int64_t synthetic_samples = 2048);

/// Reads CIFAR-10 binary batch files (records of one label byte and 3 x 32 x 32 pixel bytes):
/// images as uint8 N x 3 x 32 x 32, labels as int64.
std::pair<at::Tensor, at::Tensor> read_cifar10(const std::vector<std::string>& files);

}  // namespace training
}  // namespace gpipe
