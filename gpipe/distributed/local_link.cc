// Local links between the partitions of a stage; see local_link.h and Note [Partitions within a
// stage].
#include "gpipe/distributed/local_link.h"

#include <utility>

#include <c10/util/Exception.h>

namespace gpipe {
namespace distributed {

void LocalLink::send_activation(int64_t microbatches, const Batch& output) {
  std::vector<at::Tensor> values;
  values.reserve(output.size());
  for (const at::Tensor& t : output.values()) {
    at::Tensor v = t.detach().to(to_device_);
    if (t.requires_grad()) v.requires_grad_(true);
    values.push_back(std::move(v));
  }
  Activation a{microbatches,
               output.atomic() ? Batch(std::move(values[0])) : Batch(std::move(values))};
  absl::MutexLock lock(&mu_);
  activations_.push_back(std::move(a));
}

LocalLink::Activation LocalLink::next_activation() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](LocalLink* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return self->failed_ || !self->activations_.empty();
      },
      this));
  check_not_failed();
  Activation a = std::move(activations_.front());
  activations_.pop_front();
  return a;
}

void LocalLink::send_gradients(int64_t microbatch, const std::vector<at::Tensor>& gradients) {
  std::vector<at::Tensor> moved;
  moved.reserve(gradients.size());
  for (const at::Tensor& g : gradients) moved.push_back(g.to(from_device_));
  absl::MutexLock lock(&mu_);
  gradients_[microbatch] = std::move(moved);
}

std::vector<at::Tensor> LocalLink::gradients(int64_t microbatch) {
  absl::MutexLock lock(&mu_);
  struct Waiting {
    LocalLink* self;
    int64_t microbatch;
  } waiting{this, microbatch};
  mu_.Await(absl::Condition(
      +[](Waiting* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->self->mu_) {
        return w->self->failed_ || w->self->gradients_.count(w->microbatch) > 0;
      },
      &waiting));
  check_not_failed();
  auto it = gradients_.find(microbatch);
  std::vector<at::Tensor> out = std::move(it->second);
  gradients_.erase(it);
  return out;
}

void LocalLink::fail(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (!failed_) {
    failed_ = true;
    why_ = why;
  }
}

void LocalLink::check_not_failed() const {
  TORCH_CHECK(!failed_, "gpipe::distributed::PipelineStage: this stage's partitions ", from_,
              " and ", from_ + 1, " stopped passing micro-batches: ", why_);
}

}  // namespace distributed
}  // namespace gpipe
