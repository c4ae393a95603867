// Links between a partition and its neighbours in this process; see link.h.
#include "gpipe/internal/link.h"

#include <limits>
#include <utility>

#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "gpipe/internal/copy.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace internal {

Batch cut_batch(const Batch& batch, c10::Device device) {
  std::vector<at::Tensor> values;
  values.reserve(batch.size());
  for (const at::Tensor& t : batch.values()) {
    if (!t.defined()) {
      values.push_back(t);
      continue;
    }
    at::Tensor v = t.detach().to(device);
    if (t.requires_grad()) v.requires_grad_(true);
    values.push_back(std::move(v));
  }
  return batch.atomic() ? Batch(std::move(values[0])) : Batch(std::move(values));
}

std::vector<at::Tensor> requiring_grad(const Batch& batch) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : batch.values()) {
    if (t.defined() && t.requires_grad()) out.push_back(t);
  }
  return out;
}

Moving move_tensors(const std::vector<at::Tensor>& values, c10::Device to,
                    const c10::Stream& compute, const c10::Stream& copy_from,
                    const c10::Stream& copy_to) {
  const c10::Device from = compute.device();
  Moving out;
  out.values.reserve(values.size());
  if (!has_streams(from) && !has_streams(to)) {
    for (const at::Tensor& t : values) out.values.push_back(t.defined() ? t.detach().to(to) : t);
    return out;
  }
  // Note [Links on copy streams].
  wait_stream(copy_from, compute);
  // A GPU tensor already on the receiver's device (a layer's output off its partition's device)
  // is not copied: the receiver's copy stream waits for the stream that made it.
  if (to != from) wait_for_tensors_made_here(copy_to, values);
  std::vector<c10::Stream> current;
  if (has_streams(from)) current.push_back(copy_from);
  if (has_streams(to) && to != from) current.push_back(copy_to);
  {
    const c10::MultiStreamGuard guard(current);
    for (const at::Tensor& t : values) {
      if (!t.defined()) {
        out.values.push_back(t);
        continue;
      }
      record_stream(t, copy_from);
      // A CUDA tensor on another device than the partition's is not ordered by the copy
      // streams: copied with non_blocking false (LibTorch orders a copy between GPUs after both
      // devices' current streams, here its maker's and the receiver's copy stream; to the CPU
      // the host waits).
      const bool ordered = !t.is_cuda() || t.device() == from;
      out.values.push_back(copy_to_device(t, to, /*non_blocking=*/ordered));
    }
  }
  // A copy between two GPUs ends on both copy streams (LibTorch orders the destination's after
  // it); one to the CPU, or within a device, on the source's.
  out.ready = record_point(has_streams(to) && to != from ? copy_to : copy_from);
  return out;
}

std::vector<at::Tensor> arrive(Moving moving, c10::Device device) {
  if (moving.ready == nullptr) return std::move(moving.values);
  if (has_streams(device)) {
    const c10::Stream compute = current_stream(device);
    wait_point(compute, *moving.ready);
    for (const at::Tensor& t : moving.values) record_stream(t, compute);
  } else {
    synchronize_point(*moving.ready);
  }
  return std::move(moving.values);
}

Moving LocalLink::move(const std::vector<at::Tensor>& values, int64_t microbatch,
                       int64_t source) {
  const bool forward = source == from_;
  const c10::Device here = forward ? from_device_ : to_device_;
  const c10::Device there = forward ? to_device_ : from_device_;
  if (copy_streams_ == nullptr || (!has_streams(here) && !has_streams(there))) {
    return move_tensors(values, there, current_stream(here), current_stream(here),
                        current_stream(there));
  }
  const int64_t target = forward ? from_ + 1 : from_;
  const c10::Stream& copy_from = (*copy_streams_)[source][microbatch];
  const c10::Stream& copy_to = (*copy_streams_)[target][microbatch];
  const c10::Stream& issuing = has_streams(here) ? copy_from : copy_to;
  // Activation copies on the timeline (TimelineEvent::Kind::kCopy), timed from when the copy
  // stream has waited for the sender's computation.
  const bool recorded = timeline_ != nullptr && forward && here != there;
  Timeline::Started started;
  if (recorded) {
    wait_stream(copy_from, current_stream(here));
    started = timeline_->start(issuing);
  }
  Moving moving = move_tensors(values, there, current_stream(here), copy_from, copy_to);
  if (recorded) {
    timeline_->finish({TimelineEvent::Kind::kCopy, microbatch, timeline_offset_ + target,
                       timeline_offset_ + source, static_cast<int64_t>(values.size())},
                      started, issuing);
  }
  return moving;
}

void LocalLink::send(int64_t microbatches, int64_t microbatch, const Batch& output,
                     bool grad_enabled) {
  Sent sent;
  sent.microbatches = microbatches;
  sent.atomic = output.atomic();
  sent.grad_enabled = grad_enabled;
  for (const at::Tensor& t : output.values()) {
    sent.requires_grad.push_back(t.defined() && t.requires_grad());
  }
  sent.moving = move(output.values(), microbatch, from_);
  absl::MutexLock lock(&mu_);
  activations_.push_back(std::move(sent));
}

void Link::await(const std::function<bool()>& ready) {
  struct Waiting {
    Link* self;
    const std::function<bool()>* ready;
  } waiting{this, &ready};
  mu_.Await(absl::Condition(
      +[](Waiting* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->self->mu_) {
        return w->self->failed_ || (*w->ready)();
      },
      &waiting));
  TORCH_CHECK(!failed_, who_, ": partitions ", from_, " and ", from_ + 1,
              " stopped passing micro-batches: ", why_);
}

void Link::fail(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (!failed_) {
    failed_ = true;
    why_ = why;
  }
}

Activation LocalLink::receive() {
  Sent sent = take_front(activations_);
  std::vector<at::Tensor> values = arrive(std::move(sent.moving), to_device_);
  for (size_t k = 0; k < values.size(); ++k) {
    if (sent.requires_grad[k]) values[k].requires_grad_(true);
  }
  Batch batch = sent.atomic ? Batch(std::move(values[0])) : Batch(std::move(values));
  return Activation{sent.microbatches, std::move(batch), sent.grad_enabled};
}

void LocalLink::send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) {
  Moving moving = move(gradients, microbatch, from_ + 1);
  absl::MutexLock lock(&mu_);
  gradients_[microbatch] = std::move(moving);
}

std::vector<at::Tensor> LocalLink::receive_gradients(int64_t microbatch) {
  Moving moving;
  {
    absl::MutexLock lock(&mu_);
    await([this, microbatch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return gradients_.count(microbatch) > 0;
    });
    auto it = gradients_.find(microbatch);
    moving = std::move(it->second);
    gradients_.erase(it);
  }
  return arrive(std::move(moving), from_device_);
}

void GraphLink::send(int64_t microbatches, int64_t microbatch, const Batch& output,
                     bool grad_enabled) {
  const c10::Stream& copy_from = (*copy_streams_)[from_][microbatch];
  const c10::Stream& copy_to = (*copy_streams_)[from_ + 1][microbatch];
  // The copy stream already waits for the sender's computation (Note [Links that keep the
  // graph]).
  std::vector<at::Tensor> values = output.values();
  // LibTorch runs a copy from a CUDA device on the source's current stream, else on the
  // destination's.
  const c10::Stream& issuing = has_streams(from_device_) ? copy_from : copy_to;
  const Timeline::Started started = timeline_ ? timeline_->start(issuing) : Timeline::Started{};
  // To the CPU the receiver waits for the copy, not this lane (Note [Copy streams] in copy.h).
  std::shared_ptr<const StreamPoint> landed;
  values = copy(std::move(values), copy_from, copy_to, &landed);
  if (timeline_) {
    timeline_->finish({TimelineEvent::Kind::kCopy, microbatch, timeline_offset_ + from_ + 1,
                       timeline_offset_ + from_, static_cast<int64_t>(values.size())},
                      started, issuing);
  }
  if (crosses_threads_ && from_device_ == to_device_ && !has_streams(from_device_)) {
    values = pass(std::move(values));  // Note [Links that keep the graph]
  }
  Sent sent;
  sent.microbatch = microbatch;
  sent.landed = std::move(landed);
  sent.activation.microbatches = microbatches;
  sent.activation.grad_enabled = grad_enabled;
  sent.activation.batch =
      output.atomic() ? Batch(std::move(values[0])) : Batch(std::move(values));
  absl::MutexLock lock(&mu_);
  activations_.push_back(std::move(sent));
}

Activation GraphLink::receive() {
  Sent sent = take_front(activations_);
  if (sent.landed != nullptr) synchronize_point(*sent.landed);
  Batch& batch = sent.activation.batch;
  batch.values() = wait(std::move(batch.values()), (*copy_streams_)[from_ + 1][sent.microbatch],
                        current_stream(to_device_));
  return std::move(sent.activation);
}

void GraphLink::send_gradients(int64_t /*microbatch*/, std::vector<at::Tensor> /*gradients*/) {
  TORCH_INTERNAL_ASSERT(false, "gpipe: a forward()'s link carries no gradients");
}

std::vector<at::Tensor> GraphLink::receive_gradients(int64_t /*microbatch*/) {
  TORCH_INTERNAL_ASSERT(false, "gpipe: a forward()'s link carries no gradients");
  return {};
}

void OutputSink::send(int64_t microbatches, int64_t microbatch, const Batch& output,
                      bool /*grad_enabled*/) {
  absl::MutexLock lock(&mu_);
  if (outputs_.empty()) outputs_.assign(microbatches, Batch(std::vector<at::Tensor>{}));
  outputs_[microbatch] = output;
}

std::vector<at::Tensor> OutputSink::receive_gradients(int64_t /*microbatch*/) {
  TORCH_INTERNAL_ASSERT(false, "gpipe: a forward()'s output takes no gradients by hand");
  return {};
}

std::vector<Batch> OutputSink::take() {
  absl::MutexLock lock(&mu_);
  return std::move(outputs_);
}

InputSource::InputSource(std::vector<Batch> microbatches, bool grad_enabled, bool keep_graph)
    : microbatches_(std::move(microbatches)), grad_enabled_(grad_enabled) {
  roots_.resize(microbatches_.size());
  if (!grad_enabled_ || keep_graph) return;
  // The micro-batches leave the input's graph (a layer before the pipeline, or the input's own
  // split): the first partition's backward of each stops at a leaf, and the input's graph runs
  // once, in finish().
  for (size_t i = 0; i < microbatches_.size(); ++i) {
    for (at::Tensor& t : microbatches_[i].values()) {
      if (!t.defined() || !t.requires_grad()) continue;
      roots_[i].push_back(t);
      t = t.detach().requires_grad_(true);
    }
  }
}

Activation InputSource::receive() {
  TORCH_INTERNAL_ASSERT(next_ < microbatches_.size(), "gpipe: no micro-batch ", next_);
  Activation a{static_cast<int64_t>(microbatches_.size()), std::move(microbatches_[next_]),
               grad_enabled_};
  microbatches_[next_] = Batch(std::vector<at::Tensor>{});
  ++next_;
  return a;
}

void InputSource::send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) {
  if (roots_[microbatch].empty()) return;
  absl::MutexLock lock(&mu_);
  gradients_[microbatch] = std::move(gradients);
}

void InputSource::finish() {
  std::vector<at::Tensor> roots, grads;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [i, g] : gradients_) {
      for (size_t k = 0; k < g.size() && k < roots_[i].size(); ++k) {
        if (!g[k].defined()) continue;  // no gradient reached it
        roots.push_back(roots_[i][k]);
        grads.push_back(std::move(g[k]));
      }
    }
    gradients_.clear();
  }
  if (!roots.empty()) torch::autograd::backward(roots, grads);
}

LossSink::LossSink(Loss loss, at::Tensor target, bool whole_batch, std::string who)
    : loss_fn_(std::move(loss)),
      target_(std::move(target)),
      whole_batch_(whole_batch),
      who_(std::move(who)) {}

at::Tensor LossSink::target_rows(int64_t microbatch, int64_t rows) {
  TORCH_CHECK(target_.defined() && target_.dim() > 0, who_, ": the target must have the "
              "mini-batch's samples along its first dimension, to be split like the input, but "
              "it has ", target_.defined() ? target_.dim() : 0, " dimensions");
  TORCH_CHECK(target_offset_ + rows <= target_.size(0), who_, ": the target has ",
              target_.size(0), " rows but the outputs up to micro-batch ", microbatch, " have ",
              target_offset_ + rows, "; give one target row per sample of the mini-batch");
  at::Tensor rows_of = target_.narrow(0, target_offset_, rows);
  target_offset_ += rows;
  if (microbatch + 1 == microbatches_) {
    TORCH_CHECK(target_offset_ == target_.size(0), who_, ": the target has ", target_.size(0),
                " rows but the mini-batch has ", target_offset_, " samples; give one target row "
                "per sample");
  }
  return rows_of;
}

namespace {

// The gradients the loss's backward left on `leaves`' tensors that require grad (undefined where
// none reached one).
std::vector<at::Tensor> leaf_gradients(const Batch& leaves) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& t : requiring_grad(leaves)) grads.push_back(t.grad());
  return grads;
}

}  // namespace

at::Tensor LossSink::apply_loss(const Batch& output, const at::Tensor& target) const {
  at::Tensor loss = loss_fn_.function()(output, target);
  TORCH_CHECK(loss.defined() && loss.numel() == 1, who_, ": the loss function must return a "
              "scalar, but it returned ", loss.defined() ? loss.sizes() : c10::IntArrayRef{});
  return loss;
}

at::Tensor LossSink::counted(const at::Tensor& rows) const {
  at::Tensor count = loss_fn_.count()(rows);
  TORCH_CHECK(count.defined() && count.numel() == 1, who_, ": the loss's count must return a "
              "scalar (how many terms the loss averages over in the given target rows), but it "
              "returned ", count.defined() ? count.sizes() : c10::IntArrayRef{});
  return count.reshape({}).to(at::kDouble);
}

LossSink::Share LossSink::share_of(const at::Tensor& rows) {
  Share share;
  if (!loss_fn_.count()) {
    share.host = static_cast<double>(rows.size(0)) / static_cast<double>(target_.size(0));
    return share;
  }
  if (!total_count_.defined()) total_count_ = counted(target_);
  const at::Tensor mine = counted(rows);
  if (mine.is_cpu() && total_count_.is_cpu()) {
    // Read on the host: no device to wait for.
    const double total = total_count_.item<double>();
    share.host = total > 0 ? mine.item<double>() / total : 0;
    return share;
  }
  // On the target's device, without waiting for it.
  share.device = at::where(total_count_.gt(0), mine / total_count_, at::zeros_like(mine));
  share.any = mine.gt(0);
  return share;
}

void LossSink::send(int64_t microbatches, int64_t microbatch, const Batch& output,
                    bool grad_enabled) {
  microbatches_ = microbatches;
  grad_enabled_ = grad_enabled;
  Batch leaf = grad_enabled ? cut_batch(output, output[0].device()) : output;
  if (static_cast<int64_t>(leaves_.size()) <= microbatch) leaves_.resize(microbatch + 1, Batch(
      std::vector<at::Tensor>{}));
  leaves_[microbatch] = leaf;
  if (!loss_fn_ || !target_.defined() || whole_batch_) return;
  // Note [Losses over micro-batches].
  const int64_t rows = leaf[0].dim() > 0 ? leaf[0].size(0) : 1;
  const at::Tensor rows_of = target_rows(microbatch, rows);
  const Share share = share_of(rows_of);
  if (!share.device.defined() && share.host == 0) {
    // No terms (only padding): it adds nothing and no gradient reaches the output, as in the
    // plain model; a mini-batch with no terms at all has the plain model's NaN loss.
    if (!loss_.defined() && microbatch + 1 == microbatches_) {
      loss_ = at::full({}, std::numeric_limits<double>::quiet_NaN(), at::kFloat);
    }
    return;
  }
  const at::Tensor unweighted = apply_loss(leaf, rows_of);
  at::Tensor loss;
  if (share.device.defined()) {
    // Weighted in float64 and rounded once; a micro-batch without terms adds 0 (its own mean is
    // NaN), and its gradients are zeroed below for a loss whose backward makes NaN of them.
    const at::Tensor any = share.any.to(unweighted.device());
    loss = (unweighted.to(at::kDouble) * share.device.to(unweighted.device()))
               .to(unweighted.scalar_type());
    loss = at::where(any, loss, at::zeros_like(loss));
  } else {
    loss = unweighted * share.host;
  }
  if (grad_enabled && loss.requires_grad()) {
    loss.backward();
    std::vector<at::Tensor> grads = leaf_gradients(leaf);
    if (share.device.defined()) {
      for (at::Tensor& g : grads) {
        if (g.defined()) g = at::where(share.any.to(g.device()), g, at::zeros_like(g));
      }
    }
    gradients_[microbatch] = std::move(grads);
  }
  loss_ = loss_.defined() ? loss_ + loss.detach() : loss.detach();
}

void LossSink::whole_batch_loss() {
  const Batch output = gather(leaves_);
  at::Tensor loss = apply_loss(output, target_);
  if (grad_enabled_ && loss.requires_grad()) loss.backward();
  for (size_t i = 0; i < leaves_.size(); ++i) {
    gradients_[static_cast<int64_t>(i)] = leaf_gradients(leaves_[i]);
  }
  loss_ = loss.detach();
}

std::vector<at::Tensor> LossSink::receive_gradients(int64_t microbatch) {
  TORCH_CHECK(loss_fn_, who_, ": a training step needs a loss function");
  TORCH_CHECK(target_.defined(), who_, ": a training step needs a target for the loss (under "
              "torch::NoGradGuard, a step without one runs the forward only)");
  if (whole_batch_ && !loss_.defined()) whole_batch_loss();
  auto it = gradients_.find(microbatch);
  if (it == gradients_.end()) {
    // The loss does not depend on this output: no gradient reaches it.
    return std::vector<at::Tensor>(requiring_grad(leaves_[microbatch]).size());
  }
  std::vector<at::Tensor> out = std::move(it->second);
  gradients_.erase(it);
  return out;
}

void LossSink::finish() {
  if (whole_batch_ && !loss_.defined() && loss_fn_ && target_.defined() && !leaves_.empty()) {
    whole_batch_loss();
  }
}

Batch LossSink::output() const {
  if (leaves_.empty()) return Batch(std::vector<at::Tensor>{});
  Batch out = gather(leaves_);
  for (at::Tensor& t : out.values()) t = t.detach();
  return out;
}

}  // namespace internal
}  // namespace gpipe
