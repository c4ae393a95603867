// What the example trainers share, in one process or several: the data as the flags say, the
// balance and checkpoint flags, and the progress bar.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>

#include "absl/strings/str_format.h"
#include "examples/training/choices.h"
#include "examples/training/data.h"
#include "examples/training/saves.h"
#include "gpipe/gpipe.h"

namespace gpipe {
namespace training {

/// The data of --data (and --data_cache, --synthetic_samples).
Data load_data_from_flags();

/// Sets Adam's learning rate for step `step` of `total`: `lr` following a cosine down to zero.
inline void set_cosine_lr(torch::optim::Adam& optimizer, double lr, int64_t step,
                          int64_t total) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamOptions&>(group.options())
        .lr(lr * 0.5 * (1 + std::cos(M_PI * static_cast<double>(step) / total)));
  }
}

/// The save to resume from, given --save and --resume (save_to_resume in saves.h). A save of
/// either trainer, of any layout.
std::string save_to_resume();

inline std::string duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

// A progress bar on one line (a terminal), or a line every tenth of the epoch (a log).
class Progress {
 public:
  Progress(int64_t epoch, int64_t total) : epoch_(epoch), total_(total), tty_(isatty(1)) {}
  void update(int64_t done, double loss) {
    const double elapsed = seconds();
    const double rate = done / std::max(elapsed, 1e-9);
    const double eta = (total_ - done) / std::max(rate, 1e-9);
    const int64_t tenth = std::max<int64_t>(total_ / 10, 1);
    if (!tty_ && done / tenth == last_tenth_ && done < total_) return;
    last_tenth_ = done / tenth;
    const int width = 30;
    const int filled = static_cast<int>(width * done / std::max<int64_t>(total_, 1));
    std::printf("%sepoch %lld [%s%s] %6lld/%lld  %7.1f samples/s  loss %.4f  ETA %s%s",
                tty_ ? "\r" : "", static_cast<long long>(epoch_),
                std::string(filled, '=').c_str(), std::string(width - filled, ' ').c_str(),
                static_cast<long long>(done), static_cast<long long>(total_), rate, loss,
                duration(eta).c_str(), tty_ ? "" : "\n");
    std::fflush(stdout);
  }
  void finish() {
    if (tty_) std::printf("\n");
  }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  int64_t epoch_, total_;
  bool tty_;
  int64_t last_tenth_ = -1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace training
}  // namespace gpipe
