// Transfers between stages; see transfer.h.
#include "gpipe/distributed/internal/transfer.h"

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
#include <c10/util/safe_numerics.h>
#include <c10/util/accumulate.h>

#include "absl/strings/str_cat.h"
#include "gpipe/distributed/internal/fault.h"
#include "gpipe/internal/copy.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace distributed {
namespace internal {
namespace {

constexpr int64_t kHeaderSize = kHeaderBytes / 8;   // int64 values: 4 KiB
constexpr int64_t kMaxTensors = 64;    // per batch: tags leave room for this many

absl::Mutex& posting_mutex() {
  static absl::Mutex mu(absl::kConstInit);
  return mu;
}

}  // namespace

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
    post_stream_ = gpipe::internal::new_stream(stream_->device());
    gpipe::internal::wait_stream(*post_stream_, *stream_);
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

namespace {

// The dtypes a stage sends to the next: those every LibTorch allocates and copies as plain bytes
// (not quantized or bit-packed ones, whose tensors carry more than their bytes).
bool carried(at::ScalarType dtype) {
  switch (dtype) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
    case at::kHalf: case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kBool:
    case at::kComplexHalf: case at::kComplexFloat: case at::kComplexDouble:
      return true;
    default:
      return false;
  }
}

}  // namespace

BatchHeader BatchHeader::of(const Batch& batch, int64_t microbatches, bool grad_enabled) {
  BatchHeader header;
  header.microbatches = microbatches;
  header.atomic = batch.atomic();
  header.grad_enabled = grad_enabled;
  TORCH_CHECK(static_cast<int64_t>(batch.size()) <= kMaxTensors, "gpipe::distributed: a stage's "
              "output has ", batch.size(), " tensors; at most ", kMaxTensors, " can go to the "
              "next stage");
  // encode() writes five values before the entries: micro-batches, atomic, grad_enabled,
  // training and the number of entries; each entry 3 + its dimensions.
  int64_t used = 5;
  for (const at::Tensor& t : batch.values()) {
    TORCH_CHECK(t.defined(), "gpipe::distributed: a stage's output holds an undefined tensor; "
                "only defined tensors can go to the next stage");
    TORCH_CHECK(carried(t.scalar_type()), "gpipe::distributed: a stage's output holds a tensor of "
                "dtype ", t.scalar_type(), ", which does not go to the next stage; convert it to "
                "a floating-point, integer, complex or bool dtype");
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
  TORCH_CHECK(count >= 0 && count <= kMaxTensors && header.microbatches > 0 &&
                  (!header.atomic || count == 1),
              "gpipe::distributed: a malformed activation header arrived (", count,
              " tensors, ", header.microbatches, " micro-batches", header.atomic ? ", atomic" : "",
              "); do all ranks run the same gpipe?");
  for (int64_t k = 0; k < count; ++k) {
    TORCH_CHECK(end - p >= 3, "gpipe::distributed: a malformed activation header arrived");
    Entry e;
    const int64_t dtype = *p++;
    TORCH_CHECK(dtype >= 0 && dtype < static_cast<int64_t>(at::ScalarType::NumOptions) &&
                    carried(static_cast<at::ScalarType>(dtype)),
                "gpipe::distributed: a malformed activation header arrived (tensor ", k,
                " has dtype number ", dtype, ")");
    e.dtype = static_cast<at::ScalarType>(dtype);
    e.requires_grad = *p++ != 0;
    const int64_t dim = *p++;
    TORCH_CHECK(dim >= 0 && end - p >= dim,
                "gpipe::distributed: a malformed activation header arrived");
    e.sizes.assign(p, p + dim);
    p += dim;
    // Its bytes, the packed message's (packed_data_bytes) and its contiguous strides must fit in
    // an int64, whatever order they are multiplied in: so the sizes, with a zero counted as one,
    // multiply to under a petabyte (a shape like {2^62, 3, 0} holds nothing, yet overflows).
    uint64_t bound = 1;
    bool overflows = false;
    for (int64_t size : e.sizes) {
      TORCH_CHECK(size >= 0, "gpipe::distributed: a malformed activation header arrived (tensor ",
                  k, " has a size of ", size, ")");
      overflows |= c10::mul_overflows(bound, static_cast<uint64_t>(std::max<int64_t>(size, 1)),
                                      &bound);
    }
    overflows |= bound > (uint64_t{1} << 50) / c10::elementSize(e.dtype);
    TORCH_CHECK(!overflows, "gpipe::distributed: a malformed activation header arrived (tensor ",
                k, " has sizes ", c10::IntArrayRef(e.sizes),
                ", whose non-zero sizes multiply to over a petabyte)");
    header.entries.push_back(std::move(e));
  }
  return header;
}

BatchHeader BatchHeader::decode(const at::Tensor& encoded, int rank, int peer) {
  try {
    return decode(encoded);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "on rank ", rank, ", from rank ", peer, ": ", e.what_without_backtrace());
  }
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

std::vector<at::Tensor> to_wire(const std::vector<at::Tensor>& tensors, c10::Device device) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    // To a GPU wire without blocking the host (from the CPU staged in pinned memory): the sends
    // follow the copies on the wire's stream. To a CPU wire blocking: Gloo reads host memory.
    out.push_back(device.is_cuda() ? gpipe::internal::copy_to_device(t.contiguous(), device,
                                                                     /*non_blocking=*/true)
                                   : t.detach().to(device).contiguous());
  }
  return out;
}

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
