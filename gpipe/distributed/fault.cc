// Failing fast across processes; see fault.h and Note [Failing fast across processes].
#include "gpipe/distributed/internal/fault.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/internal/transfer.h"

namespace gpipe {
namespace distributed {
namespace internal {
namespace {

constexpr int64_t kMessageBytes = 4096;
// How long a failing rank waits for the others to take its message: they have a receive posted
// for it, so only a rank that is gone or heard another failure first makes it wait this long.
constexpr std::chrono::seconds kRaiseWait(5);
// Longer than any step: Gloo's wait that times out closes the group's connections.
constexpr std::chrono::hours kForever(24 * 365);

}  // namespace

void abort_quietly(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->abort();
  } catch (const std::exception&) {
  }
}

void Cancellation::add(const c10::intrusive_ptr<c10d::Work>& work) {
  absl::MutexLock lock(&mu_);
  if (message_) {
    abort_quietly(work);
  } else {
    // Those waited for are done with: a step keeps only what is in flight.
    works_.erase(std::remove_if(works_.begin(), works_.end(),
                                [](const auto& w) { return w->isCompleted(); }),
                 works_.end());
  }
  works_.push_back(work);
}

void Cancellation::cancel(const std::string& message) {
  absl::MutexLock lock(&mu_);
  if (message_) return;
  message_ = message;
  for (const auto& work : works_) abort_quietly(work);
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return message_.has_value();
}

void Cancellation::check() const {
  absl::MutexLock lock(&mu_);
  TORCH_CHECK(!message_, *message_);
}

bool FaultChannel::can_hear_any(const ProcessGroup& group) {
  return group && group->getSize() > 1 && matches_by_tag(group);
}

FaultChannel::FaultChannel(ProcessGroup group, std::string who)
    : group_(std::move(group)), who_(std::move(who)) {
  TORCH_CHECK(can_hear_any(group_), who_, ": a fault channel needs a Gloo group of two or more "
              "ranks");
  // One tag per channel, agreed with rank 0: a channel made later on the same group (another
  // stage) never takes this one's messages.
  // (Any of the tags of kFault: kMaxMicrobatches "micro-batches" on each of kMaxChannels.)
  at::Tensor tag = at::tensor(
      {static_cast<int64_t>(std::random_device()() % (kMaxChannels * kMaxMicrobatches))});
  broadcast_from_rank0(group_, {tag}, "the stages' fault tag");
  const int64_t k = tag.item<int64_t>();
  tag_ = transfer_tag(Message::kFault, k % kMaxMicrobatches, 0, k / kMaxMicrobatches);
  inbox_ = at::zeros({kMessageBytes}, at::kByte);
  check_collective(group_, "posting the receive of other stages' failures",
                   [&] { receive_ = post_receive_from_any(group_, inbox_, tag_); });
  listener_ = std::thread([this] { listen(); });
}

FaultChannel::~FaultChannel() {
  abort_quietly(receive_);
  listener_.join();
}

void FaultChannel::listen() {
  pthread_setname_np(pthread_self(), "gpipe faults");
  bool arrived = false;
  try {
    arrived = receive_->wait(kForever);
  } catch (const std::exception&) {
    // The group broke (a peer died, a wait timed out): the step's own transfers say why.
    return;
  }
  if (!arrived) return;  // aborted: the stage is going away
  // The failed step's index, then the text.
  const char* bytes = static_cast<const char*>(inbox_.data_ptr());
  int64_t index = 0;
  std::memcpy(&index, bytes, sizeof(index));
  const char* text = bytes + sizeof(index);
  const std::string failure(text, strnlen(text, kMessageBytes - sizeof(index)));
  const std::string error =
      absl::StrCat(who_, ": ", failure, "; rank ", group_->getRank(), " stops its step too. ",
                   "After a failure the pipeline's transfers are unmatched: make new process "
                   "groups and stages to go on");
  absl::MutexLock lock(&mu_);
  heard_ = error;
  heard_index_ = index;
  if (step_ && step_index_ >= index) step_->cancel(error);
}

void FaultChannel::raise(const std::string& failure, int64_t index) {
  at::Tensor outbox = at::zeros({kMessageBytes}, at::kByte);
  char* bytes = static_cast<char*>(outbox.data_ptr());
  std::memcpy(bytes, &index, sizeof(index));
  std::memcpy(bytes + sizeof(index), failure.data(),
              std::min<size_t>(failure.size(), kMessageBytes - sizeof(index) - 1));
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  for (int r = 0; r < group_->getSize(); ++r) {
    if (r == group_->getRank()) continue;
    try {
      sends.push_back(post_send(group_, outbox, r, tag_));
    } catch (const std::exception&) {
      // That rank is gone; tell the others.
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + kRaiseWait;
  for (const auto& send : sends) {
    try {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !send->wait(left)) abort_quietly(send);
    } catch (const std::exception&) {
    }
  }
}

void FaultChannel::attach(std::shared_ptr<Cancellation> step, int64_t index) {
  absl::MutexLock lock(&mu_);
  step_ = std::move(step);
  step_index_ = index;
  if (heard_ && heard_index_ <= index) step_->cancel(*heard_);
}

void FaultChannel::detach() {
  absl::MutexLock lock(&mu_);
  step_.reset();
}

std::optional<std::string> FaultChannel::heard(int64_t index) const {
  absl::MutexLock lock(&mu_);
  if (heard_ && heard_index_ <= index) return heard_;
  return std::nullopt;
}

void FaultChannel::throw_if_heard(const FaultChannel* channel, int64_t index) {
  if (channel == nullptr) return;
  if (std::optional<std::string> heard = channel->heard(index)) TORCH_CHECK(false, *heard);
}

namespace {
std::function<void(int64_t)>& step_end_hook() {
  static std::function<void(int64_t)> hook;
  return hook;
}
}  // namespace

void set_step_end_hook(std::function<void(int64_t)> hook) { step_end_hook() = std::move(hook); }

void run_step_end_hook(int64_t index) {
  if (step_end_hook()) step_end_hook()(index);
}

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
