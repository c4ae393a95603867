// Remote links; see remote_link.h.
#include "gpipe/distributed/internal/remote_link.h"

#include <algorithm>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "gpipe/schedule_check.h"

namespace gpipe {
namespace distributed {
namespace internal {
namespace {

// Receives `tensors` (their sizes known) of `kind` for `microbatch` from `peer` over the group,
// on this thread.
void receive_over_group(const Wire& wire, const char* what, std::vector<at::Tensor> tensors,
                        int peer, Message kind, int64_t microbatch, int64_t channel) {
  Transfer transfer(wire.group, what, c10::nullopt, wire.cancellation);
  transfer.receive(std::move(tensors), peer, kind, microbatch, channel);
  transfer.set_posted();
  transfer.wait();
}

}  // namespace

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

std::vector<PairTurn> pair_turns(ScheduleKind kind, int64_t stages, int64_t m, int64_t stage,
                                 int64_t peer) {
  const Schedule schedule = with_communication(make_schedule(kind, stages, m));
  std::vector<PairTurn> turns;
  for (const Action& a : schedule.ranks[stage]) {
    const bool down = peer == stage + 1, up = peer == stage - 1;
    if ((down && a.type == ActionType::kSendForward) ||
        (up && a.type == ActionType::kRecvForward)) {
      turns.push_back({true, a.microbatch});
    }
    if ((down && a.type == ActionType::kRecvBackward) ||
        (up && a.type == ActionType::kSendBackward)) {
      turns.push_back({false, a.microbatch});
    }
  }
  return turns;
}

RemoteUpstream::RemoteUpstream(Wire wire, int peer, c10::Device device, bool grad_enabled,
                               TurnsOf turns, int64_t channel, int64_t* capacity,
                               SharedLink* shared)
    : wire_(std::move(wire)),
      peer_(peer),
      device_(device),
      grad_enabled_(grad_enabled),
      turns_of_(std::move(turns)),
      channel_(channel),
      shared_(shared) {
  TORCH_INTERNAL_ASSERT(shared_ == nullptr || (!turns_of_ && !wire_.device.is_cuda()));
  if (shared_) {
    const int rank = wire_.group->getRank();
    waiting_for_activations_ = absl::StrCat("activations from rank ", peer_, " on rank ", rank);
    waiting_for_room_ = absl::StrCat("room for gradients to rank ", peer_, " on rank ", rank);
    return;
  }
  receiver_ = std::make_unique<ActivationReceiver>(
      wire_.group, peer, wire_.device, wire_.stream, wire_.cancellation,
      turns_of_ ? std::function<bool(int64_t, int64_t)>([this](int64_t i, int64_t m) {
        return sends_before(i, m);
      })
                : nullptr,
      channel, capacity);
}

RemoteUpstream::~RemoteUpstream() {
  // Before the receiver's thread is joined: it may wait for a gradient in sends_before.
  fail("the step ended");
}

void RemoteUpstream::fail(const std::string& /*why*/) {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

bool RemoteUpstream::sends_before(int64_t next, int64_t m) {
  if (turns_.empty()) {
    turns_ = turns_of_(m);
    TORCH_INTERNAL_ASSERT(!turns_.empty() && turns_[0].forward && turns_[0].microbatch == 0);
    next_turn_ = 1;
  }
  while (next_turn_ < turns_.size()) {
    const PairTurn turn = turns_[next_turn_];
    if (turn.forward) {
      TORCH_INTERNAL_ASSERT(turn.microbatch == next, "activations ", next, " out of turn");
      ++next_turn_;
      return true;
    }
    ++next_turn_;
    if (!grad_enabled_) continue;  // no gradients go back in inference
    std::pair<std::shared_ptr<Transfer>, std::vector<at::Tensor>> computed;
    {
      absl::MutexLock lock(&mu_);
      const int64_t i = turn.microbatch;
      awaited_ = i;
      mu_.Await(absl::Condition(this, &RemoteUpstream::computed_or_stopping));
      if (stopping_) return false;
      auto it = computed_.find(i);
      computed = std::move(it->second);
      computed_.erase(it);
    }
    try {
      computed.first->send(computed.second, peer_, Message::kGradient, turn.microbatch,
                           channel_);
      computed.first->set_posted();
    } catch (...) {
      computed.first->set_posted(std::current_exception());
    }
  }
  return true;
}

void check_microbatch(const SharedLink::Record& record, int64_t expected, int rank, int peer) {
  TORCH_CHECK(record.microbatch == expected, "gpipe::distributed: on rank ", rank, ", from rank ",
              peer, ": activations of micro-batch ", record.microbatch, " arrived in shared "
              "memory where micro-batch ", expected, " was next; do all ranks run the same "
              "gpipe?");
}

ActivationReceiver::Received activations_of(const SharedLink::Record& record, int64_t expected,
                                            int rank, int peer) {
  check_microbatch(record, expected, rank, peer);
  TORCH_CHECK(record.bytes >= kHeaderBytes, "gpipe::distributed: on rank ", rank, ", from rank ",
              peer, ": a record of ", record.bytes, " bytes in shared memory, shorter than an "
              "activation header (", kHeaderBytes, "); do all ranks run the same gpipe?");
  ActivationReceiver::Received r;
  uint8_t* header = const_cast<uint8_t*>(record.data);  // read only
  r.header =
      BatchHeader::decode(at::from_blob(header, {BatchHeader::size()}, at::kLong), rank, peer);
  const int64_t expected_bytes = kHeaderBytes + packed_data_bytes(r.header);
  TORCH_CHECK(expected_bytes <= record.bytes, "gpipe::distributed: on rank ", rank, ", from rank ",
              peer, ": a record of ", record.bytes, " bytes in shared memory is shorter than its "
              "header says (", expected_bytes, "); do all ranks run the same gpipe?");
  r.tensors = r.header.empty_tensors(c10::Device(c10::kCPU));
  unpack_into(record.data + kHeaderBytes, r.tensors);
  return r;
}

gpipe::internal::Activation RemoteUpstream::receive() {
  c10::OptionalStreamGuard on_wire(wire_.stream);  // Note [The wire's stream]
  ActivationReceiver::Received r;
  if (shared_) {
    const int rank = wire_.group->getRank();
    const RingWait wait = shared_->wait(waiting_for_activations_, wire_.cancellation.get());
    const SharedLink::Record record = shared_->read(wait);
    if (!record.over_group) {
      r = activations_of(record, received_, rank, peer_);
      shared_->release();
    } else {
      check_microbatch(record, received_, rank, peer_);
      shared_->release();
      const char* what = "receiving activations from the previous stage";
      at::Tensor encoded = at::empty({BatchHeader::size()}, at::kLong);
      receive_over_group(wire_, what, {encoded}, peer_, Message::kHeader, received_, channel_);
      r.header = BatchHeader::decode(encoded, rank, peer_);
      at::Tensor data = at::empty({packed_data_bytes(r.header)}, at::kByte);
      receive_over_group(wire_, what, {data}, peer_, Message::kActivation, received_, channel_);
      r.tensors = unpack_activations(r.header, data);
    }
    ++received_;
  } else {
    r = receiver_->next();
  }
  TORCH_CHECK(r.header.grad_enabled == grad_enabled_, "gpipe::distributed::PipelineStage::step: "
              "stage ", peer_, " runs ", r.header.grad_enabled ? "with" : "without", " grad but "
              "stage ", wire_.group->getRank(), " ", grad_enabled_ ? "with" : "without", " it; "
              "call step() under the same grad mode (torch::NoGradGuard for inference) on every "
              "stage");
  TORCH_CHECK(r.header.training == wire_.training, "gpipe::distributed::PipelineStage::step: "
              "stage ", peer_, " is in ", r.header.training ? "train" : "eval", " mode but stage ",
              wire_.group->getRank(), " in ", wire_.training ? "train" : "eval", " mode; call "
              "train() or eval() on every stage alike");
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
  // (A GPU tensor on the wire's device made on another stream: to_wire passes it as it is.)
  if (wire_.stream) gpipe::internal::wait_for_tensors_made_here(*wire_.stream, gradients);
  c10::OptionalStreamGuard on_wire(wire_.stream);  // Note [The wire's stream]
  std::vector<at::Tensor> tensors = to_wire(gradients, wire_.device);
  if (shared_) {
    if (tensors.empty()) return;  // the receiver expects none
    const RingWait wait = shared_->wait(waiting_for_room_, wire_.cancellation.get());
    if (shared_->write(microbatch, at::Tensor(), tensors, wait)) return;
  }
  absl::MutexLock lock(&mu_);
  if (turns_of_) {
    // Posted by the receiving thread in its turn (sends_before).
    auto transfer = std::make_shared<Transfer>(wire_.group, "sending gradients to the previous "
                                               "stage", wire_.stream, wire_.cancellation);
    sends_.push_back(transfer);
    computed_[microbatch] = {std::move(transfer), std::move(tensors)};
    return;
  }
  sends_.push_back(wire_.post(
      std::make_shared<Transfer>(wire_.group, "sending gradients to the previous stage",
                                 wire_.stream, wire_.cancellation),
      [tensors = std::move(tensors), peer = peer_, microbatch, channel = channel_](Transfer& t) {
        t.send(tensors, peer, Message::kGradient, microbatch, channel);
      }));
}

void RemoteUpstream::finish() {
  if (turns_of_) receiver_->finish();  // every gradient posted in its turn
  std::vector<std::shared_ptr<Transfer>> sends;
  {
    absl::MutexLock lock(&mu_);
    sends.swap(sends_);
  }
  for (const auto& send : sends) send->wait();
}

RemoteDownstream::RemoteDownstream(Wire wire, int peer, c10::Device device,
                                   GradientReceives when, TurnsOf turns, int64_t channel,
                                   int64_t* capacity, SharedLink* shared)
    : wire_(std::move(wire)),
      peer_(peer),
      device_(device),
      when_(when),
      turns_of_(std::move(turns)),
      channel_(channel),
      capacity_(capacity),
      capacity_at_start_(capacity ? *capacity : 0),
      largest_sent_(capacity_at_start_),
      shared_(shared) {
  TORCH_INTERNAL_ASSERT(when_ != GradientReceives::kInTurn || turns_of_);
  TORCH_INTERNAL_ASSERT(shared_ == nullptr ||
                        (when_ != GradientReceives::kInTurn && !wire_.device.is_cuda()));
  TORCH_INTERNAL_ASSERT(capacity_ == nullptr ||
                        (when_ != GradientReceives::kInTurn && !wire_.device.is_cuda()));
  if (shared_) {
    const int rank = wire_.group->getRank();
    waiting_for_gradients_ = absl::StrCat("gradients from rank ", peer_, " on rank ", rank);
    waiting_for_room_ = absl::StrCat("room for activations to rank ", peer_, " on rank ", rank);
  }
}

RemoteDownstream::~RemoteDownstream() {
  if (capacity_ != nullptr) *capacity_ = largest_sent_;
}

void RemoteDownstream::post_packed(int64_t microbatch, at::Tensor header,
                                   std::vector<at::Tensor> tensors, int64_t bytes) {
  largest_sent_ = std::max(largest_sent_, bytes);
  // post_send's two messages: the header's (here with the data), then the tensors (none, or the
  // data).
  if (bytes <= capacity_at_start_) {
    post_send(microbatch, pack_activations(tensors, header), {});
  } else {
    post_send(microbatch, std::move(header), {pack_activations(tensors)});
  }
}

void RemoteDownstream::post_send(int64_t microbatch, at::Tensor header,
                                 std::vector<at::Tensor> tensors) {
  sends_.push_back(wire_.post(
      std::make_shared<Transfer>(wire_.group, "sending activations to the next stage",
                                 wire_.stream, wire_.cancellation),
      [header = std::move(header), tensors = std::move(tensors), peer = peer_, microbatch,
       channel = channel_](Transfer& t) {
        t.send({header}, peer, Message::kHeader, microbatch, channel);
        t.send(tensors, peer, Message::kActivation, microbatch, channel);
      }));
}

void RemoteDownstream::post_in_turn() {
  while (next_turn_ < turns_.size()) {
    const PairTurn turn = turns_[next_turn_];
    if (turn.forward) {
      auto it = ready_.find(turn.microbatch);
      if (it == ready_.end()) return;
      post_send(turn.microbatch, std::move(it->second.first), std::move(it->second.second));
      ready_.erase(it);
    } else if (grad_enabled_) {
      // Its buffers exist once its activations were sent, which comes first in any order.
      if (buffers_.count(turn.microbatch) == 0) return;
      post_receive(turn.microbatch);
    }
    ++next_turn_;
  }
}

void RemoteDownstream::send(int64_t microbatches, int64_t microbatch, const Batch& output,
                            bool grad_enabled) {
  // (A GPU tensor on the wire's device made on another stream: to_wire passes it as it is.)
  if (wire_.stream) gpipe::internal::wait_for_tensors_made_here(*wire_.stream, output.values());
  c10::OptionalStreamGuard on_wire(wire_.stream);  // Note [The wire's stream]
  // (The tensors first: on a GPU the Transfer's sends follow the work queued before it.)
  at::Tensor header;
  int64_t bytes = 0;
  try {
    BatchHeader of = BatchHeader::of(output, microbatches, grad_enabled);
    of.training = wire_.training;
    // (Not a blocking to(): that would wait here for the wire's stream, holding the lane back
    // from queueing the next micro-batch.)
    header = to_wire({of.encode()}, wire_.device)[0];
    bytes = packed_data_bytes(of);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "on rank ", wire_.group->getRank(), ", to rank ", peer_, ": ",
                e.what_without_backtrace());
  }
  std::vector<at::Tensor> tensors = to_wire(output.values(), wire_.device);
  if (shared_) {
    const RingWait wait = shared_->wait(waiting_for_room_, wire_.cancellation.get());
    if (!shared_->write(microbatch, header, tensors, wait)) {
      post_send(microbatch, std::move(header), {pack_activations(tensors)});
    }
  } else if (when_ == GradientReceives::kInTurn) {
    if (turns_.empty()) turns_ = turns_of_(microbatches);
    ready_[microbatch] = {std::move(header), std::move(tensors)};
  } else if (capacity_ != nullptr) {
    post_packed(microbatch, std::move(header), std::move(tensors), bytes);
  } else {
    post_send(microbatch, std::move(header), std::move(tensors));
  }
  grad_enabled_ = grad_enabled;
  if (grad_enabled) {
    std::vector<at::Tensor> buffers;
    for (const at::Tensor& t : gpipe::internal::requiring_grad(output)) {
      buffers.push_back(at::empty(t.sizes(), t.options().device(wire_.device)));
    }
    buffers_[microbatch] = std::move(buffers);
  }
  // Note [When gradients' receives are posted]; over shared memory, none.
  if (shared_) {
    return;
  } else if (when_ == GradientReceives::kInTurn) {
    post_in_turn();
  } else if (!grad_enabled) {
    return;
  } else if (when_ == GradientReceives::kWithSend) {
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
      [buffers = std::move(it->second), peer = peer_, microbatch, channel = channel_](Transfer& t) {
        t.receive(buffers, peer, Message::kGradient, microbatch, channel);
      });
  buffers_.erase(it);
}

std::vector<at::Tensor> RemoteDownstream::receive_gradients(int64_t microbatch) {
  c10::OptionalStreamGuard on_wire(wire_.stream);  // Note [The wire's stream]
  if (shared_) {
    // Records come in the order the next stage's backwards send them: any taken before their
    // turn wait in arrived_.
    while (arrived_.count(microbatch) == 0) {
      auto mine = buffers_.find(microbatch);
      if (mine == buffers_.end() || mine->second.empty()) {  // nothing required grad
        if (mine != buffers_.end()) buffers_.erase(mine);
        return {};
      }
      const RingWait wait = shared_->wait(waiting_for_gradients_, wire_.cancellation.get());
      const SharedLink::Record record = shared_->read(wait);
      auto it = buffers_.find(record.microbatch);
      TORCH_CHECK(it != buffers_.end(), "gpipe::distributed: on rank ", wire_.group->getRank(),
                  ", from rank ", peer_, ": gradients of micro-batch ", record.microbatch,
                  " arrived in shared memory, which this stage did not send or has them already; "
                  "do all ranks run the same gpipe?");
      if (!record.over_group) {
        TORCH_CHECK(packed_bytes(it->second) <= record.bytes, "gpipe::distributed: on rank ",
                    wire_.group->getRank(), ", from rank ", peer_, ": gradients of ",
                    record.bytes, " bytes in shared memory where ", packed_bytes(it->second),
                    " were expected; do all ranks run the same gpipe?");
        unpack_into(record.data, it->second);
        shared_->release();
      } else {
        shared_->release();
        receive_over_group(wire_, "receiving gradients from the next stage", it->second, peer_,
                           Message::kGradient, record.microbatch, channel_);
      }
      arrived_[record.microbatch] = std::move(it->second);
      buffers_.erase(it);
    }
    std::vector<at::Tensor> out;
    for (const at::Tensor& g : arrived_[microbatch]) out.push_back(g.to(device_));
    arrived_.erase(microbatch);
    return out;
  }
  if (when_ == GradientReceives::kInTurn) {
    post_in_turn();
    TORCH_INTERNAL_ASSERT(receives_.count(microbatch) > 0 || buffers_.count(microbatch) == 0,
                          "the gradients of micro-batch ", microbatch, " are wanted before "
                          "their turn");
  } else if (receives_.count(microbatch) == 0) {
    post_receive(microbatch);
  }
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

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
