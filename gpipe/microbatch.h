// Micro-batches: a mini-batch is split along dimension 0 into micro-batches that flow through the
// pipeline one by one, and the outputs are concatenated back. A batch is one tensor ("atomic") or a
// vector of tensors (a "tuple" batch, for layers that take several inputs).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

namespace gpipe {

/// A micro-batch: the value that crosses partition boundaries.
///
///   gpipe::Batch b(x);                          // atomic
///   gpipe::Batch t(std::vector<at::Tensor>{x, mask});  // tuple
class Batch {
 public:
  /// An atomic batch holding one tensor.
  explicit Batch(at::Tensor tensor) : values_{std::move(tensor)}, atomic_(true) {}
  /// A tuple batch holding several tensors (possibly one).
  explicit Batch(std::vector<at::Tensor> tensors) : values_(std::move(tensors)), atomic_(false) {}

  /// Whether this batch is a single tensor rather than a vector of tensors.
  bool atomic() const { return atomic_; }
  /// The tensor of an atomic batch.
  const at::Tensor& tensor() const;
  /// The tensors: one for an atomic batch.
  std::vector<at::Tensor>& values() { return values_; }
  /// The tensors, read-only.
  const std::vector<at::Tensor>& values() const { return values_; }
  /// The number of tensors: 1 for an atomic batch.
  size_t size() const { return values_.size(); }
  /// Tensor `i` (unchecked, as std::vector's).
  at::Tensor& operator[](size_t i) { return values_[i]; }
  /// Tensor `i`, read-only.
  const at::Tensor& operator[](size_t i) const { return values_[i]; }

  /// The index of the tensor that carries the pipeline's autograd dependencies (the first defined
  /// floating-point tensor), or -1 when there is none.
  int64_t lane() const;

  /// The batch as the argument of a layer's forward: at::Tensor or std::vector<at::Tensor>.
  torch::nn::AnyValue to_any() const;

  /// The batch a layer returned. Throws c10::Error naming `producer` and the type when the value
  /// is neither a tensor nor a vector of tensors.
  static Batch from_any(torch::nn::AnyValue&& value, const std::string& producer);

 private:
  std::vector<at::Tensor> values_;
  bool atomic_;
};

/// Checks that `input` can be split: every tensor defined, at least one dimension, and all with
/// the same size in dimension 0. Throws c10::Error saying what is wrong.
void check_input(const Batch& input);

/// Splits `input` into at most `chunks` micro-batches along dimension 0, as at::Tensor::chunk
/// does: uneven splits are allowed (7 rows in 4 chunks gives 2, 2, 2, 1) and a batch smaller than
/// `chunks` gives fewer micro-batches.
///
///   auto micro = gpipe::scatter(gpipe::Batch(x), 4);
std::vector<Batch> scatter(const Batch& input, int64_t chunks);

/// Concatenates micro-batch outputs along dimension 0, position by position for tuple batches.
Batch gather(const std::vector<Batch>& outputs);

}  // namespace gpipe
