// What a token-level loss averages over (loss.h).
#include "gpipe/loss.h"

#include <ATen/Functions.h>

namespace gpipe {

LossCount count_targets_except(int64_t ignore_index) {
  return [ignore_index](const at::Tensor& target) { return target.ne(ignore_index).sum(); };
}

}  // namespace gpipe
