// Text for the language-model trainer (//examples:gpt): a corpus of bytes split into training and
// held-out validation text, windows of it as token ids, and the unigram and bigram entropies that
// say what a model of single bytes or pairs would reach.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace gpipe {
namespace training {

/// A byte corpus: the training and the validation text, each a 1-D int64 tensor of bytes.
struct TextCorpus {
  std::string name;
  at::Tensor train, validation;
};

/// Loads `spec`: "fortunes[:<folder>]" (the plain-text files of Debian's fortunes package, in
/// /usr/share/games/fortunes by default, each fortune once, '%' separators dropped) or
/// "text:<file>" (any file). Bytes other than printable ASCII, newlines and tabs are dropped (the
/// fortunes' overstriking). Every `holdout`-th fortune (for a file, every `holdout`-th block of 4
/// KiB) goes to validation. Throws c10::Error naming what is missing.
TextCorpus load_text(const std::string& spec, int64_t holdout = 10);

/// `batch` windows of `length` + 1 bytes of `text` starting at random offsets (`generator`'s):
/// the inputs [batch, length] and the next bytes, the targets [batch, length].
std::pair<at::Tensor, at::Tensor> random_windows(const at::Tensor& text, int64_t batch,
                                                 int64_t length, at::Generator generator);

/// The `rows` consecutive windows of `text` from window `first` on (window k starts at byte
/// k * length): the inputs [rows, length] and the next bytes [rows, length]; for validation.
std::pair<at::Tensor, at::Tensor> consecutive_windows(const at::Tensor& text, int64_t first,
                                                      int64_t rows, int64_t length);

/// The entropies of `text` in bits per byte: of single bytes (unigram), and of a byte given the
/// one before it (bigram, H(pair) - H(first)), both under `text`'s own frequencies: what a model
/// that knows only those counts would reach on it.
std::pair<double, double> unigram_bigram_entropy(const at::Tensor& text);

}  // namespace training
}  // namespace gpipe
