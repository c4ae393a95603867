// PipelineStage::evaluate: inference across the stages whose output, and loss, every stage gets
// (for logging and accuracy on any rank); see pipeline_stage.h.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/internal/transfer.h"

namespace gpipe {
namespace distributed {
namespace {

// Broadcasts `tensor` (the same size and dtype on every rank) from `root` over `group`, on the
// group's wire (a GPU's for NCCL: `local`, this rank's device); returns it on `local`.
at::Tensor broadcast(const ProcessGroup& group, at::Tensor tensor, int root, c10::Device local,
                     const std::string& what) {
  std::vector<at::Tensor> one{tensor.to(wire_device(group, local))};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  check_collective(group, what, [&] { group->broadcast(one, options)->wait(); });
  return one[0].to(local);
}

}  // namespace

PipelineStageImpl::Evaluation PipelineStageImpl::evaluate(const Batch& input,
                                                          const at::Tensor& target,
                                                          Loss loss) {
  at::Tensor last_loss;
  {
    at::NoGradGuard no_grad;
    last_loss = step(input, target, std::move(loss));
  }
  // The stage that holds the last partition: the last, or stage 0 under a V-shaped schedule.
  const int last = static_cast<int>(stage_ranks_.back());
  const std::string what = "the broadcast of the last stage's output";
  // The last stage's output (its header first: the others learn the sizes from it), then its
  // loss, if it computed one.
  at::Tensor header = is_last() ? internal::BatchHeader::of(output_, 1, false).encode()
                                : at::empty({internal::BatchHeader::size()}, at::kLong);
  const internal::BatchHeader shape =
      internal::BatchHeader::decode(broadcast(group_, header, last, local_, what).to(at::kCPU));
  std::vector<at::Tensor> values = is_last() ? output_.values()
                                             : shape.empty_tensors(local_);
  for (at::Tensor& v : values) v = broadcast(group_, v, last, local_, what);
  Evaluation result{shape.atomic ? Batch(std::move(values[0])) : Batch(std::move(values)),
                    at::Tensor()};
  const bool has_loss = is_last() && last_loss.defined();
  at::Tensor sent = at::tensor({has_loss ? 1.0 : 0.0, has_loss ? last_loss.item<double>() : 0.0},
                               at::kDouble);
  sent = broadcast(group_, sent, last, local_, "the broadcast of the loss").to(at::kCPU);
  if (sent[0].item<double>() > 0) result.loss = sent[1];
  return result;
}

}  // namespace distributed
}  // namespace gpipe
