// Gradient-norm clipping over parameters on several devices: the norm of all their gradients
// together, as torch::nn::utils::clip_grad_norm_ computes it on one device.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace gpipe {

// Note [Clipping by the global norm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Clipping by the gradients' norm must see the whole model's gradients, as the plain model's
// torch::nn::utils::clip_grad_norm_ does: clipping each partition or stage by its own norm scales
// them differently and changes the direction of the step (and splits a tied weight whose places
// lie in several stages). In one process a GPipe's parameters() lists every parameter once, ties
// once, on the partitions' devices; LibTorch's function stacks their norms on one device, which
// fails for partitions on several. clip_grad_norm computes each device's norm there, combines
// them on the first device and scales every gradient on its own device: between GPUs without
// the host waiting; a copy between a GPU and the CPU (partitions on both) makes it wait for the
// GPU's norm. Across processes (PipelineStage::clip_grad_norm) each stage computes the norm of its
// parameters (a tie only on the lowest stage holding it), the stages exchange them (one
// all-gather over the pipeline's group, on the CPU), and every stage scales its gradients alike;
// replicas need no exchange, since their gradients are averaged before step() returns.

/// Scales the gradients of `parameters` (on any devices; those without a gradient are skipped)
/// so that their norm of order `norm_type` (positive, or infinity) is at most `max_norm`, as
/// torch::nn::utils::clip_grad_norm_ does for parameters on one device. Returns the norm before
/// clipping, on the first gradient's device (zero on the CPU without any); with GPUs only, the
/// host does not wait for them (Note [Clipping by the global norm]). A parameter listed twice counts twice: give
/// a GPipe's parameters(), which lists each tie once.
///
///   model->step(x, y, loss);
///   gpipe::clip_grad_norm(model->parameters(), 1.0);
///   optimizer.step();
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm,
                          double norm_type = 2.0);

namespace internal {

/// The norm of order `norm_type` of the defined gradients of `parameters`, on the first one's
/// device; undefined when none has a gradient. Checks `norm_type`, naming `who`.
at::Tensor gradient_norm(const std::vector<at::Tensor>& parameters, double norm_type,
                         const char* who);
/// Multiplies every defined gradient of `parameters` by min(1, max_norm / (norm + 1e-6)).
void scale_gradients_to(const std::vector<at::Tensor>& parameters, const at::Tensor& norm,
                        double max_norm);

}  // namespace internal
}  // namespace gpipe
