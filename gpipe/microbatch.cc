// Micro-batches; see microbatch.h.
#include "gpipe/microbatch.h"

#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <c10/util/Type.h>

namespace gpipe {

const at::Tensor& Batch::tensor() const {
  TORCH_CHECK(atomic_, "gpipe::Batch::tensor() called on a tuple batch of ", values_.size(),
              " tensors");
  return values_[0];
}

int64_t Batch::lane() const {
  for (const auto i : c10::irange(values_.size())) {
    if (values_[i].defined() && values_[i].is_floating_point()) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

torch::nn::AnyValue Batch::to_any() const {
  if (atomic_) {
    return torch::nn::AnyValue(values_[0]);
  }
  return torch::nn::AnyValue(values_);
}

Batch Batch::from_any(torch::nn::AnyValue&& value, const std::string& producer) {
  if (at::Tensor* tensor = value.try_get<at::Tensor>()) {
    return Batch(std::move(*tensor));
  }
  if (auto* tensors = value.try_get<std::vector<at::Tensor>>()) {
    return Batch(std::move(*tensors));
  }
  TORCH_CHECK(false, producer, " returned a value of type ", c10::demangle(value.type_info().name()),
              "; values passed between the layers of a GPipe must be at::Tensor or "
              "std::vector<at::Tensor>");
}

void check_input(const Batch& input) {
  TORCH_CHECK(input.size() > 0,
              "GPipe input is an empty vector of tensors; pass a tensor or a non-empty vector");
  const int64_t rows = input[0].defined() && input[0].dim() > 0 ? input[0].size(0) : -1;
  for (const auto i : c10::irange(input.size())) {
    const at::Tensor& t = input[i];
    TORCH_CHECK(t.defined(), "GPipe input tensor ", i, " is undefined; every input must be a "
                "defined tensor");
    TORCH_CHECK(t.dim() > 0, "GPipe input tensor ", i, " is a 0-dimensional tensor; inputs are "
                "split into micro-batches along dimension 0, so they need at least one dimension");
    TORCH_CHECK(t.size(0) == rows, "GPipe input tensors must all have the same size in "
                "dimension 0 (the batch dimension), but tensor 0 has ", rows, " and tensor ", i,
                " has ", t.size(0));
  }
}

namespace {

// `t` in `chunks` pieces along dimension 0, as Tensor::chunk splits it. A leaf that requires grad
// gets a node of its own in each piece (a narrow, not one split shared by every piece), so that
// each micro-batch's backward reaches it apart from the others' (Note [Where a backward may cut]
// in stage_backward.cc: a node that several micro-batches share keeps the one graph).
std::vector<at::Tensor> pieces_of(const at::Tensor& t, int64_t chunks) {
  const int64_t rows = t.dim() > 0 ? t.size(0) : 0;
  if (!t.requires_grad() || t.grad_fn() != nullptr || rows == 0) return t.chunk(chunks, 0);
  const int64_t size = (rows + chunks - 1) / chunks;
  std::vector<at::Tensor> pieces;
  for (int64_t start = 0; start < rows; start += size) {
    pieces.push_back(t.narrow(0, start, std::min(size, rows - start)));
  }
  return pieces;
}

}  // namespace

std::vector<Batch> scatter(const Batch& input, int64_t chunks) {
  TORCH_CHECK(chunks > 0, "scatter: chunks must be positive, got ", chunks);
  if (input.atomic()) {
    std::vector<Batch> out;
    for (at::Tensor& piece : pieces_of(input.tensor(), chunks)) {
      out.emplace_back(std::move(piece));
    }
    return out;
  }
  std::vector<std::vector<at::Tensor>> pieces;
  pieces.reserve(input.size());
  for (const at::Tensor& t : input.values()) {
    pieces.push_back(pieces_of(t, chunks));
  }
  // All tensors have the same size in dimension 0 (check_input), so they split alike.
  const size_t count = pieces[0].size();
  std::vector<Batch> out;
  out.reserve(count);
  for (const auto i : c10::irange(count)) {
    std::vector<at::Tensor> values;
    values.reserve(pieces.size());
    for (auto& p : pieces) {
      values.push_back(std::move(p[i]));
    }
    out.emplace_back(std::move(values));
  }
  return out;
}

Batch gather(const std::vector<Batch>& outputs) {
  TORCH_CHECK(!outputs.empty(), "gather: no micro-batches");
  if (outputs.size() == 1) {
    return outputs[0];
  }
  const Batch& first = outputs[0];
  std::vector<at::Tensor> gathered;
  gathered.reserve(first.size());
  for (const auto k : c10::irange(first.size())) {
    std::vector<at::Tensor> column;
    column.reserve(outputs.size());
    for (const Batch& b : outputs) {
      TORCH_CHECK(b.size() == first.size() && b.atomic() == first.atomic(),
                  "GPipe micro-batch outputs differ in structure: one has ", first.size(),
                  " tensors and another ", b.size(), "; every micro-batch must give the same kind "
                  "of output");
      column.push_back(b[k]);
    }
    gathered.push_back(at::cat(column, 0));
  }
  if (first.atomic()) {
    return Batch(std::move(gathered[0]));
  }
  return Batch(std::move(gathered));
}

}  // namespace gpipe
