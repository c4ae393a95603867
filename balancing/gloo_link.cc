// Messages and all-reduces between two ranks on Gloo, and messages through rings in shared memory,
// measured; see Note [Costs between processes] in process_link.h.
#include "balancing/gloo_link.h"
#include "balancing/internal/detail.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <absl/strings/str_cat.h>
#include <absl/synchronization/mutex.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "gpipe/distributed/internal/fault.h"
#include "gpipe/distributed/internal/shared_memory.h"
#include "gpipe/distributed/internal/transfer.h"

namespace gpipe {

namespace {

using Group = c10::intrusive_ptr<c10d::ProcessGroupGloo>;
using Clock = std::chrono::steady_clock;

// Rank `rank`'s half of the measurement: for each size, ping-pongs (rank 0 sends, rank 1 sends
// back; half the round trip is one message) and all-reduces, `repeats` timed rounds after an
// untimed one. Rank 0's times go to `times`: [size][0] messages, [size][1] all-reduces.
void measure_rank(const Group& group, int rank, const std::vector<int64_t>& sizes, int repeats,
                  std::vector<std::vector<std::vector<double>>>& times) {
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<at::Tensor> t{at::zeros({sizes[s] / 4}, at::kFloat)};
    for (int r = 0; r <= repeats; ++r) {
      const auto start = Clock::now();
      if (rank == 0) {
        group->send(t, 1, 0)->wait();
        group->recv(t, 1, 0)->wait();
      } else {
        group->recv(t, 0, 0)->wait();
        group->send(t, 0, 0)->wait();
      }
      const auto pinged = Clock::now();
      group->allreduce(t)->wait();
      const auto reduced = Clock::now();
      if (rank != 0 || r == 0) continue;
      times[s][0].push_back(std::chrono::duration<double, std::micro>(pinged - start).count() / 2);
      times[s][1].push_back(std::chrono::duration<double, std::micro>(reduced - pinged).count());
    }
  }
}

}  // namespace

ProcessLinkStats measure_gloo_link(int64_t large_bytes, int repeats) {
  TORCH_CHECK(large_bytes >= 4096, "gpipe::measure_gloo_link: large_bytes ", large_bytes,
              " is too small to tell bandwidth from latency; give 4096 or more");
  TORCH_CHECK(repeats >= 1, "gpipe::measure_gloo_link: repeats ", repeats, "; give 1 or more");
  const std::vector<int64_t> sizes{4, large_bytes};
  auto store = c10::make_intrusive<c10d::HashStore>();
  // (A rank that failed leaves the other waiting at most this long: in the store, or in Gloo.)
  const std::chrono::seconds timeout(60);
  store->setTimeout(timeout);
  std::vector<std::vector<std::vector<double>>> times(sizes.size(),
                                                      std::vector<std::vector<double>>(2));
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        auto options = c10d::ProcessGroupGloo::Options::create(timeout);
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        const Group group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
        measure_rank(group, rank, sizes, repeats, times);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  const double message_small = internal::median(times[0][0]);
  const double message_large = internal::median(times[1][0]);
  const double reduce_small = internal::median(times[0][1]);
  const double reduce_large = internal::median(times[1][1]);
  const double bytes = static_cast<double>(large_bytes - 4);
  ProcessLinkStats link;
  link.latency_us = message_small;
  link.bytes_per_us = bytes / std::max(message_large - message_small, 1e-3);
  // Two ranks: 2 alpha + bytes / beta (Note [Costs between processes]).
  link.allreduce_step_us = reduce_small / 2;
  link.allreduce_bytes_per_us = bytes / std::max(reduce_large - reduce_small, 1e-3);
  return link;
}

namespace {

using distributed::internal::Cancellation;
using distributed::internal::kHeaderBytes;
using distributed::internal::kMinSharedRing;
using distributed::internal::PeerProcess;
using distributed::internal::RingWait;
using distributed::internal::SharedLink;
using distributed::internal::SharedRing;
using distributed::internal::unpack_into;

// One side of the ring measurement: for each size, a ping-pong through `link` (side 0 writes
// first, side 1 writes back; half the round trip is one message), each message an activation's
// record (its header and one tensor) packed by its writer and unpacked by its reader into a tensor
// made for it, `repeats` timed rounds after an untimed one. Side 0's times go to `times[size]`.
// A wait gives up when `cancellation` is cancelled (the other side failed).
void ping_pong(SharedLink& link, int side, const std::vector<int64_t>& sizes, int repeats,
               const Cancellation& cancellation, std::vector<std::vector<double>>& times) {
  const RingWait wait{"a message of the ring measurement", link.peer_process.get(),
                      std::chrono::seconds(60), &cancellation};
  const at::Tensor header = at::zeros({kHeaderBytes}, at::kByte);
  for (size_t s = 0; s < sizes.size(); ++s) {
    const at::Tensor sent = at::zeros({sizes[s]}, at::kByte);
    auto send = [&] {
      TORCH_CHECK(link.write(0, header, {sent}, wait), "gpipe::measure_shared_memory_link: a "
                  "message of ", sizes[s], " bytes found no room in its ring");
    };
    auto receive = [&] {
      const SharedLink::Record record = link.read(wait);
      TORCH_CHECK(!record.over_group && record.bytes >= kHeaderBytes + sizes[s],
                  "gpipe::measure_shared_memory_link: a record of ", record.bytes, " bytes",
                  record.over_group ? " sent over the group" : "", " where ", sizes[s],
                  " bytes and their header were sent");
      at::Tensor received = at::empty({sizes[s]}, at::kByte);
      unpack_into(record.data + kHeaderBytes, {received});
      link.release();
    };
    for (int r = 0; r <= repeats; ++r) {
      const auto start = Clock::now();
      if (side == 0) {
        send();
        receive();
      } else {
        receive();
        send();
      }
      if (side != 0 || r == 0) continue;
      times[s].push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() /
                         2);
    }
  }
}

}  // namespace

RingLinkStats measure_shared_memory_link(int64_t ring_bytes, int repeats) {
  TORCH_CHECK(ring_bytes >= kMinSharedRing, "gpipe::measure_shared_memory_link: ring_bytes ",
              ring_bytes, " is under the smallest ring, ", kMinSharedRing, " bytes (256 KiB)");
  TORCH_CHECK(repeats >= 1, "gpipe::measure_shared_memory_link: repeats ", repeats,
              "; give 1 or more");
  // Two rings, one each way, made and opened by this process, as two stages' processes do.
  const std::string label = absl::StrCat("gpipe-ring-measure-", getpid(), "-");
  std::unique_ptr<SharedRing> there = SharedRing::create(label + "0", ring_bytes);
  std::unique_ptr<SharedRing> back = SharedRing::create(label + "1", ring_bytes);
  const auto self = std::make_shared<const PeerProcess>(getpid());
  std::unique_ptr<SharedRing> there_in = SharedRing::open(*self, label + "0");
  std::unique_ptr<SharedRing> back_in = SharedRing::open(*self, label + "1");
  SharedLink sides[2];
  sides[0].out = there.get();
  sides[0].in = back_in.get();
  sides[1].out = back.get();
  sides[1].in = there_in.get();
  for (SharedLink& side : sides) side.peer_process = self;
  // The largest activations an empty ring always takes (a record's payload less their header),
  // and as large a message as that (less a tensor's alignment).
  const int64_t max_message = sides[0].max_sure_payload() - kHeaderBytes;
  const int64_t large = std::min<int64_t>(max_message - 64, int64_t{16} << 20);
  const std::vector<int64_t> sizes{4, large};
  std::vector<std::vector<double>> times(sizes.size());
  std::vector<std::vector<double>> unused(sizes.size());
  // The side that fails first cancels the other's waits; its error is the one reported.
  Cancellation cancellation;
  absl::Mutex mu;
  std::exception_ptr error;
  auto run = [&](int side, std::vector<std::vector<double>>& into) {
    try {
      ping_pong(sides[side], side, sizes, repeats, cancellation, into);
    } catch (...) {
      absl::MutexLock lock(&mu);
      if (!error) {
        error = std::current_exception();
        cancellation.cancel("gpipe::measure_shared_memory_link: the other side failed");
      }
    }
  };
  std::thread other([&] { run(1, unused); });
  run(0, times);
  other.join();
  if (error) std::rethrow_exception(error);
  const double small_us = internal::median(times[0]);
  const double large_us = internal::median(times[1]);
  RingLinkStats ring;
  ring.latency_us = small_us;
  ring.bytes_per_us = static_cast<double>(large - 4) / std::max(large_us - small_us, 1e-3);
  ring.max_message = max_message;
  return ring;
}

}  // namespace gpipe
