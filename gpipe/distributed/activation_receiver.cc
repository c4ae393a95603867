// Receiving a step's activations on a thread of their own; see ActivationReceiver in transfer.h.
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include "gpipe/distributed/internal/fault.h"
#include "gpipe/distributed/internal/transfer.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace distributed {
namespace internal {
namespace {

constexpr const char* kReceiving = "receiving activations from the previous stage";

}  // namespace

ActivationReceiver::ActivationReceiver(ProcessGroup group, int peer, c10::Device device,
                                       c10::optional<c10::Stream> stream,
                                       std::shared_ptr<Cancellation> cancellation,
                                       std::function<bool(int64_t, int64_t)> between,
                                       int64_t channel, int64_t* capacity)
    : group_(std::move(group)),
      peer_(peer),
      device_(device),
      stream_(device.is_cuda() ? stream : c10::nullopt),
      cancellation_(std::move(cancellation)),
      between_(std::move(between)),
      channel_(channel),
      capacity_(capacity),
      thread_([this] { run(); }) {
  TORCH_INTERNAL_ASSERT(capacity_ == nullptr || !device_.is_cuda());
}

ActivationReceiver::~ActivationReceiver() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (in_flight_) abort_quietly(in_flight_);
    if (data_in_flight_) abort_quietly(data_in_flight_);
    for (auto& entry : posted_) abort_quietly(entry.second.work);
    for (const Received& r : ready_) {
      for (const auto& work : r.works) abort_quietly(work);
    }
  }
  thread_.join();
}

c10::intrusive_ptr<c10d::Work> ActivationReceiver::post(at::Tensor tensor, Message kind,
                                                        int64_t i, int64_t t) {
  c10::intrusive_ptr<c10d::Work> work;
  check_collective(group_, kReceiving, [&] {
    work = post_receive(group_, std::move(tensor), peer_, transfer_tag(kind, i, t, channel_));
  });
  // Kept by the cancellation: Gloo wedges the connection when a message comes for a receive
  // whose buffer is gone (Note [Failing fast across processes]).
  if (cancellation_) cancellation_->add(work);
  return work;
}

void ActivationReceiver::run() {
  pthread_setname_np(pthread_self(), "gpipe receive");
  const std::string what = kReceiving;
  // On a GPU (NCCL) a receive's wait only makes the current stream wait for NCCL's; the host
  // learns of the header's arrival by polling its work, which also ends when stopping (a failed
  // sender never sends it, and LibTorch 1.x cannot abort NCCL's work); false then.
  const auto arrived = [&](const c10::intrusive_ptr<c10d::Work>& work) {
    while (!work->isCompleted()) {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    return true;
  };
  // Posts one receive and waits for it (on a GPU, once it arrived); or, given `later`, adds its
  // work there for next() to wait on (Note [Streams apart from NCCL's] in gpipe/stream.cc: no
  // stream of this thread's waits on a transfer before the stream that needs it does). False when
  // the receiver is stopping.
  const auto receive = [&](at::Tensor tensor, Message kind, int64_t i, int64_t t,
                           std::vector<c10::intrusive_ptr<c10d::Work>>* later = nullptr) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return false;
    }
    c10::intrusive_ptr<c10d::Work> work = post(std::move(tensor), kind, i, t);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) {
        abort_quietly(work);
        return false;
      }
      if (later != nullptr) {
        later->push_back(std::move(work));
        return true;
      }
      in_flight_ = work;
    }
    if (device_.is_cuda() && !arrived(work)) return false;
    wait_unless_cancelled(group_, work, what, cancellation_.get());
    absl::MutexLock lock(&mu_);
    in_flight_.reset();
    return !stopping_;
  };
  // Receives the step's micro-batches; returns early when stopping.
  const auto receive_all = [&] {
    int64_t m = 1;  // known from the first header
    for (int64_t i = 0; i < m; ++i) {
      if (i > 0 && between_ && !between_(i, m)) return;
      // On a GPU, each micro-batch on a stream of its own (see the constructor's doc).
      const c10::optional<c10::Stream> stream =
          device_.is_cuda() ? c10::make_optional(gpipe::internal::new_stream(device_))
                            : c10::nullopt;
      c10::OptionalStreamGuard guard(stream);
      at::Tensor encoded = at::empty({BatchHeader::size()}, at::dtype(at::kLong).device(device_));
      if (!receive(encoded, Message::kHeader, i, 0)) return;
      Received r;
      r.header = BatchHeader::decode(encoded.to(at::kCPU), group_->getRank(), peer_);
      m = r.header.microbatches;
      r.tensors = r.header.empty_tensors(device_);
      r.stream = stream;
      for (size_t t = 0; t < r.tensors.size(); ++t) {
        if (!receive(r.tensors[t], Message::kActivation, i, static_cast<int64_t>(t),
                     stream ? &r.works : nullptr)) {
          for (const auto& work : r.works) abort_quietly(work);  // (in no list the stop sees)
          return;
        }
      }
      absl::MutexLock lock(&mu_);
      ready_.push_back(std::move(r));
    }
    if (between_) between_(m, m);
  };
  try {
    if (capacity_ != nullptr) {
      post_packed();
    } else {
      receive_all();
    }
  } catch (...) {
    absl::MutexLock lock(&mu_);
    if (!stopping_) error_ = std::current_exception();
  }
  absl::MutexLock lock(&mu_);
  finished_ = true;
}

// Note [One message per micro-batch]: this thread only posts each micro-batch's receive, a few
// ahead of the one taken (kPostedAhead), each as large as the header and the link's capacity;
// next() waits for it on the consuming thread, which Gloo's own thread then wakes directly.
void ActivationReceiver::post_packed() {
  const auto may_post = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Micro-batch 0 first; the rest once its header told how many (m), kPostedAhead beyond the
    // one next() takes.
    const int64_t limit = microbatches_ < 0 ? 1 : std::min(microbatches_, taken_ + kPostedAhead);
    return stopping_ || next_post_ < limit || next_post_ == microbatches_;
  };
  for (;;) {
    int64_t i;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&may_post));
      if (stopping_ || next_post_ == microbatches_) return;
      i = next_post_++;
    }
    at::Tensor message = at::empty({kHeaderBytes + *capacity_}, at::kByte);
    c10::intrusive_ptr<c10d::Work> work = post(message, Message::kHeader, i, 0);
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      abort_quietly(work);
      return;
    }
    posted_[i] = {std::move(message), std::move(work)};
  }
}

ActivationReceiver::Received ActivationReceiver::next_packed() {
  int64_t i;
  Posted posted;
  {
    absl::MutexLock lock(&mu_);
    i = taken_;
    mu_.Await(absl::Condition(
        +[](ActivationReceiver* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
          return self->posted_.count(self->taken_) > 0 || self->finished_;
        },
        this));
    auto it = posted_.find(i);
    if (it == posted_.end()) {
      if (error_) std::rethrow_exception(error_);
      // (The thread posts every micro-batch the header announced: only a caller that takes more
      // gets here.)
      TORCH_CHECK(false, "gpipe::distributed: rank ", group_->getRank(), " took micro-batch ", i,
                  " from the previous stage (rank ", peer_, "), whose header announced ",
                  microbatches_, "; this is a bug in gpipe");
    }
    posted = std::move(it->second);
    posted_.erase(it);
    ++taken_;
  }
  wait_unless_cancelled(group_, posted.work, kReceiving, cancellation_.get());
  Received r;
  r.header = BatchHeader::decode(posted.message.narrow(0, 0, kHeaderBytes).view(at::kLong),
                                 group_->getRank(), peer_);
  int64_t m;
  {
    absl::MutexLock lock(&mu_);
    if (microbatches_ < 0) microbatches_ = r.header.microbatches;
    m = microbatches_;
  }
  const int64_t bytes = packed_data_bytes(r.header);
  at::Tensor data;
  if (bytes <= *capacity_) {
    data = posted.message.narrow(0, kHeaderBytes, bytes);
  } else {
    // Larger than any before: the data follows as a message of its own.
    data = at::empty({bytes}, at::kByte);
    c10::intrusive_ptr<c10d::Work> work = post(data, Message::kActivation, i, 0);
    {
      absl::MutexLock lock(&mu_);
      data_in_flight_ = work;
    }
    wait_unless_cancelled(group_, work, kReceiving, cancellation_.get());
    absl::MutexLock lock(&mu_);
    data_in_flight_.reset();
  }
  largest_ = std::max(largest_, bytes);
  // The link's capacity for the next step, once every micro-batch of this one is here.
  if (i + 1 == m) *capacity_ = std::max(*capacity_, largest_);
  r.tensors = unpack_activations(r.header, data);
  return r;
}

ActivationReceiver::Received ActivationReceiver::next() {
  if (capacity_ != nullptr) return next_packed();
  absl::ReleasableMutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](ActivationReceiver* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return !self->ready_.empty() || self->finished_;
      },
      this));
  if (ready_.empty()) {
    if (error_) std::rethrow_exception(error_);
    TORCH_CHECK(false, "gpipe::distributed: the previous stage (rank ", peer_, ") sent rank ",
                group_->getRank(), " fewer micro-batches than its header announced");
  }
  Received r = std::move(ready_.front());
  ready_.pop_front();
  lock.Release();
  // On a GPU, the stream that computes with the activations waits for their receives.
  c10::OptionalStreamGuard guard(stream_);
  for (const c10::intrusive_ptr<c10d::Work>& work : r.works) {
    wait_unless_cancelled(group_, work, kReceiving, cancellation_.get());
  }
  r.works.clear();
  if (r.stream && stream_) {
    gpipe::internal::wait_stream(*stream_, *r.stream);
    for (const at::Tensor& t : r.tensors) gpipe::internal::record_stream(t, *stream_);
  }
  return r;
}

void ActivationReceiver::finish() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&finished_));
  if (error_) std::rethrow_exception(error_);
}

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
