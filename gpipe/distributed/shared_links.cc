// The rings of a stage's links and the records in them; see SharedLinks in shared_memory.h.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gpipe/distributed/internal/shared_memory.h"
#include "gpipe/distributed/internal/transfer.h"

namespace gpipe {
namespace distributed {
namespace internal {
namespace {

using Clock = std::chrono::steady_clock;

// Note [Shared memory between stages on one host]: a record in a ring starts with its
// micro-batch and whether its tensors come over the group instead, in 64 bytes; then the header
// (activations) and the tensors, packed.
struct RecordPrefix {
  int64_t microbatch;
  int64_t over_group;
};
constexpr int64_t kPrefixBytes = 64;

}  // namespace

bool SharedLink::write(int64_t microbatch, const at::Tensor& header,
                       const std::vector<at::Tensor>& tensors, const RingWait& wait) {
  const int64_t header_bytes = header.defined() ? kHeaderBytes : 0;
  uint8_t* record = out->reserve(kPrefixBytes + header_bytes + packed_bytes(tensors),
                                 /*block=*/false, wait);
  const bool fits = record != nullptr;
  if (!fits) record = out->reserve(kPrefixBytes, /*block=*/true, wait);
  const RecordPrefix prefix{microbatch, fits ? 0 : 1};
  std::memcpy(record, &prefix, sizeof(prefix));
  if (fits) {
    if (header_bytes > 0) std::memcpy(record + kPrefixBytes, header.data_ptr(), header_bytes);
    pack_into(tensors, record + kPrefixBytes + header_bytes);
  }
  out->commit();
  return fits;
}

int64_t SharedLink::max_sure_payload() const { return out->max_sure_message() - kPrefixBytes; }

SharedLink::Record SharedLink::read(const RingWait& wait) {
  int64_t bytes = 0;
  const uint8_t* record = in->next(&bytes, wait);
  TORCH_CHECK(bytes >= kPrefixBytes, "gpipe::distributed: a record of ", bytes, " bytes in "
              "shared memory (", wait.what, "), without its ", kPrefixBytes, "-byte prefix; do "
              "both processes run the same gpipe?");
  RecordPrefix prefix;
  std::memcpy(&prefix, record, sizeof(prefix));
  return {prefix.microbatch, prefix.over_group != 0, record + kPrefixBytes, bytes - kPrefixBytes};
}

namespace {

// This host, as a number: its name, boot id and PID namespace. Processes in two containers of
// one host differ in name, or, sharing the host's name and /dev/shm (--ipc=host --network=host),
// in PID namespace, where a ring's waits could not tell whether the other process is alive.
int64_t host_key() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat pid_namespace = {};
  stat("/proc/self/ns/pid", &pid_namespace);
  return static_cast<int64_t>(
      std::hash<std::string>()(absl::StrCat(name, "/", boot, "/", pid_namespace.st_ino)) >> 1);
}

std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error ? error->what_without_backtrace() : e.what();
}

std::chrono::milliseconds timeout_of(const ProcessGroup& group) {
  if (auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(group.get())) {
    return gloo->getOptions()->timeout;
  }
  return std::chrono::minutes(5);
}

}  // namespace

SharedLinks::SharedLinks(const ProcessGroup& group, c10::Device local,
                         const std::vector<Spec>& links, int64_t ring_bytes, const char* who) {
  const int rank = group->getRank();
  const int size = group->getSize();
  // Who is where, and a name for this stage's rings (rank 0's draw).
  int64_t token = 0;
  if (rank == 0) {
    try {
      std::random_device random;
      token = static_cast<int64_t>(((uint64_t{random()} << 32) ^ random()) >> 1);
    } catch (const std::exception&) {  // no random device: the clock and the pid
      token = (Clock::now().time_since_epoch().count() ^ (int64_t{getpid()} << 40)) & INT64_MAX;
    }
  }
  const std::vector<at::Tensor> where =
      all_gather(group, at::tensor({host_key(), int64_t{getpid()}, token}, at::kLong), local,
                 "agreeing on shared memory between stages");
  token = where[0][2].item<int64_t>();
  const auto name = [&](char kind, int from, int to, int64_t channel) {
    return absl::StrFormat("gpipe-%x-%c%d-%d-%d", token, kind, from, to, channel);
  };
  // Whether every rank succeeded so far: an all-gather of each one's answer.
  const auto every_rank = [&](bool mine, const char* what) {
    std::vector<int> failed;
    const std::vector<at::Tensor> all =
        all_gather(group, at::tensor({int64_t{mine}}, at::kLong), local, what);
    for (int r = 0; r < size; ++r) {
      if (all[r].item<int64_t>() == 0) failed.push_back(r);
    }
    return failed;
  };
  std::string error;
  int64_t local_links = 0;
  for (const Spec& spec : links) {
    if (where[spec.peer][0].item<int64_t>() == where[rank][0].item<int64_t>()) ++local_links;
  }
  try {
    SharedRing::check_room(local_links, ring_bytes);
  } catch (const std::exception& e) {  // every rank goes on to the next collective
    error = message_of(e);
  }
  // Watched from before its rings are looked up (Note [Rings without names]), one per peer.
  std::map<int, std::shared_ptr<const PeerProcess>> peers;
  for (const Spec& spec : links) {
    if (where[spec.peer][0].item<int64_t>() != where[rank][0].item<int64_t>()) continue;
    SharedLink& link = links_[{spec.downstream, spec.channel}];
    link.peer = spec.peer;
    std::shared_ptr<const PeerProcess>& peer = peers[spec.peer];
    if (!peer) {
      peer = std::make_shared<PeerProcess>(static_cast<pid_t>(where[spec.peer][1].item<int64_t>()));
    }
    link.peer_process = peer;
    link.timeout = timeout_of(group);
    if (!error.empty()) continue;
    try {
      rings_.push_back(SharedRing::create(
          name(spec.downstream ? 'a' : 'g', rank, spec.peer, spec.channel), ring_bytes));
      link.out = rings_.back().get();
    } catch (const std::exception& e) {  // every rank goes on to the next collective
      error = message_of(e);
    }
  }
  std::vector<int> failed = every_rank(error.empty(), "making shared memory between stages");
  if (failed.empty()) {
    for (auto& [key, link] : links_) {
      const bool downstream = key.first;
      try {
        rings_.push_back(SharedRing::open(
            *link.peer_process, name(downstream ? 'g' : 'a', link.peer, rank, key.second)));
        link.in = rings_.back().get();
      } catch (const std::exception& e) {
        error = message_of(e);
        break;
      }
    }
    failed = every_rank(error.empty(), "opening shared memory between stages");
  } else {
    every_rank(false, "opening shared memory between stages");
  }
  if (failed.empty()) return;
  if (!error.empty()) {
    TORCH_WARN(who, ": rank ", rank, " could not set up shared memory with the stages on its "
               "host, so the stages' links go over the process group: ", error);
  } else {
    TORCH_WARN(who, ": rank(s) ", absl::StrJoin(failed, ", "), " could not set up shared "
               "memory with the stages on their host (their warning says why), so the stages' "
               "links go over the process group");
  }
  links_.clear();
  rings_.clear();
}

SharedLinks::~SharedLinks() = default;

SharedLink* SharedLinks::find(bool downstream, int64_t channel) {
  auto it = links_.find({downstream, channel});
  return it == links_.end() ? nullptr : &it->second;
}

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
