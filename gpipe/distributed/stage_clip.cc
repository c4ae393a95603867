// PipelineStage::clip_grad_norm: clipping by the gradient norm of the whole model, whose
// parameters lie in several processes (Note [Clipping by the global norm] in gpipe/clip_grad.h).
#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "gpipe/clip_grad.h"
#include "gpipe/distributed/internal/fault.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/internal/tied_stages.h"

namespace gpipe {
namespace distributed {

at::Tensor PipelineStageImpl::clip_grad_norm(double max_norm, double norm_type) {
  const char* who = "gpipe::distributed::PipelineStage::clip_grad_norm";
  TORCH_CHECK(max_norm >= 0 && !std::isnan(max_norm), who, ": max_norm must be at least 0, got ",
              max_norm);
  {
    absl::MutexLock lock(&step_mu_);
    TORCH_CHECK(!failed_, who, ": an earlier step failed on this stage, which leaves the "
                "pipeline's collectives unmatched; make new process groups and stages to go on");
  }
  const std::vector<at::Tensor> mine = parameters();
  // A tie across stages counts on the lowest stage holding it.
  const std::vector<at::Tensor> below = tied_stages_->held_below(stage());
  std::vector<at::Tensor> counted;
  for (const at::Tensor& p : mine) {
    bool elsewhere = false;
    for (const at::Tensor& t : below) elsewhere |= t.is_same(p);
    if (!elsewhere) counted.push_back(p);
  }
  const at::Tensor local = gpipe::internal::gradient_norm(counted, norm_type, who);
  const at::Tensor sent =
      local.defined() ? local.to(c10::kCPU, c10::kDouble).reshape({1}) : at::zeros({1}, c10::kDouble);
  const std::vector<at::Tensor> norms =
      stages() > 1
          ? all_gather(group_, sent, local_, "the all-gather of the stages' gradient norms",
                       // A failure heard from another stage ends the wait at once.
                       [this] { internal::FaultChannel::throw_if_heard(faults_.get()); })
          : std::vector<at::Tensor>{sent};
  const at::Tensor all = at::stack(norms).reshape(-1);
  const at::Tensor norm =
      norm_type == std::numeric_limits<double>::infinity() ? all.max() : all.norm(norm_type);
  gpipe::internal::scale_gradients_to(mine, norm, max_norm);
  return norm;
}

}  // namespace distributed
}  // namespace gpipe
