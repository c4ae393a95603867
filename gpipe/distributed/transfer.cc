// Transfers between stages; see transfer.h.
#include "gpipe/distributed/transfer.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include "absl/strings/str_cat.h"
#include "gpipe/distributed/fault.h"
#include "gpipe/stream.h"

namespace gpipe {
namespace distributed {
namespace {

constexpr int64_t kHeaderSize = kHeaderBytes / 8;   // int64 values: 4 KiB
constexpr const char* kReceiving = "receiving activations from the previous stage";
constexpr int64_t kMaxTensors = 64;    // per batch: tags leave room for this many

// Waits for `work`. When it was aborted (its wait returns false, without its tensors) or failed
// and `cancellation` (may be null) was cancelled, throws the cancellation's error, another
// stage's failure, rather than what that failure did to the work; a work that completed is not
// undone by a failure heard later.
void wait_unless_cancelled(const ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work,
                           const std::string& what, const Cancellation* cancellation) {
  bool completed = true;
  try {
    check_collective(group, what, [&] { completed = work->wait(); });
  } catch (const c10::Error&) {
    if (cancellation) cancellation->check();
    throw;
  }
  if (!completed && cancellation) cancellation->check();
}

absl::Mutex& posting_mutex() {
  static absl::Mutex mu(absl::kConstInit);
  return mu;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> post_send(const ProcessGroup& group, at::Tensor tensor, int peer,
                                         int tag) {
  std::vector<at::Tensor> one{std::move(tensor)};
  absl::MutexLock lock(&posting_mutex());
  return group->send(one, peer, tag);
}

c10::intrusive_ptr<c10d::Work> post_receive(const ProcessGroup& group, at::Tensor tensor,
                                            int peer, int tag) {
  std::vector<at::Tensor> one{std::move(tensor)};
  absl::MutexLock lock(&posting_mutex());
  return group->recv(one, peer, tag);
}

c10::intrusive_ptr<c10d::Work> post_receive_from_any(const ProcessGroup& group, at::Tensor tensor,
                                                     int tag) {
  std::vector<at::Tensor> one{std::move(tensor)};
  absl::MutexLock lock(&posting_mutex());
  return group->recvAnysource(one, tag);
}

int transfer_tag(Message kind, int64_t microbatch, int64_t index, int64_t channel) {
  TORCH_INTERNAL_ASSERT(channel >= 0 && channel < kMaxChannels && microbatch >= 0 &&
                        microbatch < kMaxMicrobatches);
  return static_cast<int>(static_cast<int64_t>(kind) +
                          4 * (index + kMaxTensors * (channel + kMaxChannels * microbatch)));
}

Transfer::Transfer(ProcessGroup group, std::string what, c10::optional<c10::Stream> stream,
                   std::shared_ptr<Cancellation> cancellation)
    : group_(std::move(group)),
      what_(std::move(what)),
      stream_(stream),
      cancellation_(std::move(cancellation)) {
  if (stream_) {
    post_stream_ = new_stream(stream_->device());
    wait_stream(*post_stream_, *stream_);
  }
}

void Transfer::send(std::vector<at::Tensor> tensors, int peer, Message kind, int64_t microbatch,
                    int64_t channel) {
  c10::OptionalStreamGuard guard(post_stream_);
  for (size_t t = 0; t < tensors.size(); ++t) {
    check_collective(group_, what_, [&] {
      works_.push_back(post_send(group_, tensors[t], peer,
                                           transfer_tag(kind, microbatch, t, channel)));
    });
    if (cancellation_) cancellation_->add(works_.back());
    tensors_.push_back(std::move(tensors[t]));
  }
}

void Transfer::receive(std::vector<at::Tensor> tensors, int peer, Message kind,
                       int64_t microbatch, int64_t channel) {
  c10::OptionalStreamGuard guard(post_stream_);
  for (size_t t = 0; t < tensors.size(); ++t) {
    check_collective(group_, what_, [&] {
      works_.push_back(post_receive(group_, tensors[t], peer,
                                              transfer_tag(kind, microbatch, t, channel)));
    });
    if (cancellation_) cancellation_->add(works_.back());
    tensors_.push_back(std::move(tensors[t]));
  }
}

void Transfer::set_posted(std::exception_ptr error) {
  error_ = std::move(error);
  posted_.Notify();
}

void Transfer::wait() {
  posted_.WaitForNotification();
  if (error_) std::rethrow_exception(error_);
  c10::OptionalStreamGuard guard(stream_);
  for (auto& work : works_) wait_unless_cancelled(group_, work, what_, cancellation_.get());
  works_.clear();
}

BatchHeader BatchHeader::of(const Batch& batch, int64_t microbatches, bool grad_enabled) {
  BatchHeader header;
  header.microbatches = microbatches;
  header.atomic = batch.atomic();
  header.grad_enabled = grad_enabled;
  TORCH_CHECK(static_cast<int64_t>(batch.size()) <= kMaxTensors, "gpipe::distributed: a stage's "
              "output has ", batch.size(), " tensors; at most ", kMaxTensors, " can go to the "
              "next stage");
  int64_t used = 4;
  for (const at::Tensor& t : batch.values()) {
    TORCH_CHECK(t.defined(), "gpipe::distributed: a stage's output holds an undefined tensor; "
                "only defined tensors can go to the next stage");
    Entry e;
    e.dtype = t.scalar_type();
    e.requires_grad = t.requires_grad();
    e.sizes = t.sizes().vec();
    used += 3 + t.dim();
    header.entries.push_back(std::move(e));
  }
  TORCH_CHECK(used <= kHeaderSize, "gpipe::distributed: a stage's output has too many tensors or "
              "dimensions to describe in one header (", used, " values, at most ", kHeaderSize,
              ")");
  return header;
}

at::Tensor BatchHeader::encode() const {
  at::Tensor out = at::zeros({kHeaderSize}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  *p++ = microbatches;
  *p++ = atomic ? 1 : 0;
  *p++ = grad_enabled ? 1 : 0;
  *p++ = training ? 1 : 0;
  *p++ = static_cast<int64_t>(entries.size());
  for (const Entry& e : entries) {
    *p++ = static_cast<int64_t>(e.dtype);
    *p++ = e.requires_grad ? 1 : 0;
    *p++ = static_cast<int64_t>(e.sizes.size());
    for (int64_t s : e.sizes) *p++ = s;
  }
  return out;
}

BatchHeader BatchHeader::decode(const at::Tensor& encoded) {
  const int64_t* p = encoded.data_ptr<int64_t>();
  const int64_t* end = p + encoded.numel();
  BatchHeader header;
  header.microbatches = *p++;
  header.atomic = *p++ != 0;
  header.grad_enabled = *p++ != 0;
  header.training = *p++ != 0;
  const int64_t count = *p++;
  TORCH_CHECK(count >= 0 && count <= kMaxTensors && header.microbatches > 0,
              "gpipe::distributed: a malformed activation header arrived (", count,
              " tensors, ", header.microbatches, " micro-batches); do all ranks run the same "
              "gpipe?");
  for (int64_t k = 0; k < count; ++k) {
    TORCH_CHECK(end - p >= 3, "gpipe::distributed: a malformed activation header arrived");
    Entry e;
    e.dtype = static_cast<at::ScalarType>(*p++);
    e.requires_grad = *p++ != 0;
    const int64_t dim = *p++;
    TORCH_CHECK(dim >= 0 && end - p >= dim,
                "gpipe::distributed: a malformed activation header arrived");
    e.sizes.assign(p, p + dim);
    p += dim;
    header.entries.push_back(std::move(e));
  }
  return header;
}

int64_t BatchHeader::size() { return kHeaderSize; }

std::vector<at::Tensor> BatchHeader::empty_tensors(c10::Device device) const {
  std::vector<at::Tensor> out;
  for (const Entry& e : entries) {
    out.push_back(at::empty(e.sizes, at::TensorOptions().dtype(e.dtype).device(device)));
  }
  return out;
}

bool packs_activations(const ProcessGroup& group) {
  return matches_by_tag(group) && !carries_device_tensors(group);
}

namespace {

constexpr int64_t kPackAlignment = 64;

int64_t aligned(int64_t bytes) {
  return (bytes + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
}

int64_t bytes_of(const BatchHeader::Entry& e) {
  return c10::multiply_integers(e.sizes) * static_cast<int64_t>(c10::elementSize(e.dtype));
}

}  // namespace

int64_t packed_data_bytes(const BatchHeader& header) {
  int64_t bytes = 0;
  for (const BatchHeader::Entry& e : header.entries) bytes += aligned(bytes_of(e));
  return bytes;
}

int64_t packed_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += aligned(t.numel() * t.element_size());
  return bytes;
}

void pack_into(const std::vector<at::Tensor>& tensors, uint8_t* out) {
  for (const at::Tensor& t : tensors) {
    TORCH_INTERNAL_ASSERT(t.device().is_cpu() && t.is_contiguous());
    const int64_t n = t.numel() * t.element_size();
    if (n > 0) std::memcpy(out, t.data_ptr(), n);
    out += aligned(n);
  }
}

void unpack_into(const uint8_t* data, const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    TORCH_INTERNAL_ASSERT(t.device().is_cpu() && t.is_contiguous());
    const int64_t n = t.numel() * t.element_size();
    if (n > 0) std::memcpy(t.data_ptr(), data, n);
    data += aligned(n);
  }
}

at::Tensor pack_activations(const std::vector<at::Tensor>& tensors,
                            const at::Tensor& encoded_header) {
  const int64_t header_bytes = encoded_header.defined() ? kHeaderBytes : 0;
  at::Tensor message = at::empty({header_bytes + packed_bytes(tensors)}, at::kByte);
  uint8_t* out = message.data_ptr<uint8_t>();
  if (encoded_header.defined()) {
    std::memcpy(out, encoded_header.contiguous().data_ptr(), header_bytes);
  }
  pack_into(tensors, out + header_bytes);
  return message;
}

std::vector<at::Tensor> unpack_activations(const BatchHeader& header, const at::Tensor& data) {
  std::vector<at::Tensor> out = header.empty_tensors(c10::Device(c10::kCPU));
  TORCH_INTERNAL_ASSERT(data.is_contiguous() && data.numel() >= packed_data_bytes(header));
  unpack_into(data.data_ptr<uint8_t>(), out);
  return out;
}

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
  // Posts one receive and waits for it; false when the receiver is stopping.
  const auto receive = [&](at::Tensor tensor, Message kind, int64_t i, int64_t t) {
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
      in_flight_ = work;
    }
    wait_unless_cancelled(group_, work, what, cancellation_.get());
    absl::MutexLock lock(&mu_);
    in_flight_.reset();
    return !stopping_;
  };
  // On a GPU (NCCL), a receive's wait only orders `stream` after it: copying the header to the CPU
  // would block this thread until the header arrives, which it never does when the sender
  // failed, and a stopping stage (Note [Failing fast across processes]) could not end the wait
  // (LibTorch 1.x cannot abort NCCL's work). So the thread polls an event recorded after the
  // receive, and gives up when stopping; false then.
  const auto arrived = [&](const c10::Stream& on) {
    c10::Event done(on.device_type());
    done.record(on);
    while (!done.query()) {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    return true;
  };
  // Receives the step's micro-batches; returns early when stopping.
  const auto receive_all = [&] {
    int64_t m = 1;  // known from the first header
    for (int64_t i = 0; i < m; ++i) {
      if (i > 0 && between_ && !between_(i, m)) return;
      // On a GPU, each micro-batch on a stream of its own (see the constructor's doc).
      const c10::optional<c10::Stream> stream =
          device_.is_cuda() ? c10::make_optional(new_stream(device_)) : c10::nullopt;
      c10::OptionalStreamGuard guard(stream);
      at::Tensor encoded = at::empty({BatchHeader::size()}, at::dtype(at::kLong).device(device_));
      if (!receive(encoded, Message::kHeader, i, 0)) return;
      if (stream && !arrived(*stream)) return;
      Received r;
      try {
        r.header = BatchHeader::decode(encoded.to(at::kCPU));
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "on rank ", group_->getRank(), ", from rank ", peer_, ": ",
                    e.what_without_backtrace());
      }
      m = r.header.microbatches;
      r.tensors = r.header.empty_tensors(device_);
      r.stream = stream;
      for (size_t t = 0; t < r.tensors.size(); ++t) {
        if (!receive(r.tensors[t], Message::kActivation, i, static_cast<int64_t>(t))) return;
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
  try {
    r.header = BatchHeader::decode(posted.message.narrow(0, 0, kHeaderBytes).view(at::kLong));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "on rank ", group_->getRank(), ", from rank ", peer_, ": ",
                e.what_without_backtrace());
  }
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
  absl::MutexLock lock(&mu_);
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
  if (r.stream && stream_) {
    wait_stream(*stream_, *r.stream);
    for (const at::Tensor& t : r.tensors) record_stream(t, *stream_);
  }
  return r;
}

void ActivationReceiver::finish() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&finished_));
  if (error_) std::rethrow_exception(error_);
}

std::vector<at::Tensor> to_wire(const std::vector<at::Tensor>& tensors, c10::Device device) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    out.push_back(t.detach().to(device).contiguous());
  }
  return out;
}

}  // namespace distributed
}  // namespace gpipe
