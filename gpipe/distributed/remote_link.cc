// Remote links; see remote_link.h.
#include "gpipe/distributed/remote_link.h"

#include <utility>

#include <ATen/ops/empty.h>

namespace gpipe {
namespace distributed {

std::shared_ptr<Transfer> Wire::post(std::shared_ptr<Transfer> transfer,
                                     std::function<void(Transfer&)> operations) const {
  courier->submit([transfer, operations = std::move(operations)] {
    try {
      operations(*transfer);
      transfer->set_posted();
    } catch (...) {
      transfer->set_posted(std::current_exception());
    }
  });
  return transfer;
}

RemoteUpstream::RemoteUpstream(Wire wire, int peer, c10::Device device, bool grad_enabled)
    : wire_(std::move(wire)),
      peer_(peer),
      device_(device),
      grad_enabled_(grad_enabled),
      receiver_(wire_.group, peer, wire_.device, wire_.stream, wire_.cancellation) {}

detail::Activation RemoteUpstream::receive() {
  ActivationReceiver::Received r = receiver_.next();
  TORCH_CHECK(r.header.grad_enabled == grad_enabled_, "gpipe::distributed::PipelineStage::step: "
              "stage ", peer_, " runs ", r.header.grad_enabled ? "with" : "without", " grad but "
              "stage ", peer_ + 1, " ", grad_enabled_ ? "with" : "without", " it; call step() "
              "under the same grad mode (torch::NoGradGuard for inference) on every stage");
  std::vector<at::Tensor> values;
  for (size_t t = 0; t < r.tensors.size(); ++t) {
    at::Tensor v = r.tensors[t].to(device_);
    if (r.header.entries[t].requires_grad) v.requires_grad_(true);
    values.push_back(std::move(v));
  }
  return {r.header.microbatches,
          r.header.atomic ? Batch(std::move(values[0])) : Batch(std::move(values)),
          r.header.grad_enabled};
}

void RemoteUpstream::send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) {
  std::vector<at::Tensor> tensors = to_wire(gradients, wire_.device);
  sends_.push_back(wire_.post(
      std::make_shared<Transfer>(wire_.group, "sending gradients to the previous stage",
                                 wire_.stream, wire_.cancellation),
      [tensors = std::move(tensors), peer = peer_, microbatch](Transfer& t) {
        t.send(tensors, peer, Message::kGradient, microbatch);
      }));
}

void RemoteUpstream::finish() {
  for (const auto& send : sends_) send->wait();
  sends_.clear();
}

RemoteDownstream::RemoteDownstream(Wire wire, int peer, c10::Device device,
                                   GradientReceives when)
    : wire_(std::move(wire)), peer_(peer), device_(device), when_(when) {}

void RemoteDownstream::send(int64_t microbatches, int64_t microbatch, const Batch& output,
                            bool grad_enabled) {
  // (The tensors first: on a GPU the Transfer's sends follow the work queued before it.)
  at::Tensor header =
      BatchHeader::of(output, microbatches, grad_enabled).encode().to(wire_.device);
  std::vector<at::Tensor> tensors = to_wire(output.values(), wire_.device);
  sends_.push_back(wire_.post(
      std::make_shared<Transfer>(wire_.group, "sending activations to the next stage",
                                 wire_.stream, wire_.cancellation),
      [header = std::move(header), tensors = std::move(tensors), peer = peer_,
       microbatch](Transfer& t) {
        t.send({header}, peer, Message::kHeader, microbatch);
        t.send(tensors, peer, Message::kActivation, microbatch);
      }));
  if (!grad_enabled) return;
  std::vector<at::Tensor> buffers;
  for (const at::Tensor& t : detail::requiring_grad(output)) {
    buffers.push_back(at::empty(t.sizes(), t.options().device(wire_.device)));
  }
  buffers_[microbatch] = std::move(buffers);
  // Note [When gradients' receives are posted].
  if (when_ == GradientReceives::kWithSend) {
    post_receive(microbatch);
  } else if (microbatch + 1 == microbatches) {
    for (int64_t i = microbatches - 1; i >= 0; --i) post_receive(i);
  }
}

void RemoteDownstream::post_receive(int64_t microbatch) {
  auto it = buffers_.find(microbatch);
  if (it == buffers_.end()) return;
  receives_[microbatch] = wire_.post(
      std::make_shared<Transfer>(wire_.group, "receiving gradients from the next stage",
                                 wire_.stream, wire_.cancellation),
      [buffers = std::move(it->second), peer = peer_, microbatch](Transfer& t) {
        t.receive(buffers, peer, Message::kGradient, microbatch);
      });
  buffers_.erase(it);
}

std::vector<at::Tensor> RemoteDownstream::receive_gradients(int64_t microbatch) {
  if (receives_.count(microbatch) == 0) post_receive(microbatch);
  auto it = receives_.find(microbatch);
  if (it == receives_.end()) return {};  // nothing required grad
  std::shared_ptr<Transfer> transfer = std::move(it->second);
  receives_.erase(it);
  transfer->wait();
  std::vector<at::Tensor> out;
  for (const at::Tensor& g : transfer->tensors()) out.push_back(g.to(device_));
  return out;
}

void RemoteDownstream::finish() {
  for (const auto& send : sends_) send->wait();
  sends_.clear();
}

}  // namespace distributed
}  // namespace gpipe
