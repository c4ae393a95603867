// Messages and all-reduces between two ranks on Gloo, and messages through rings in shared memory,
// measured; see Note [Costs between processes] in process_link.h.
#include "balancing/gloo_link.h"
#include "balancing/internal/detail.h"
#include "balancing/internal/link_timing.h"

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
  internal::LinkTimes times(sizes.size(), std::vector<std::vector<double>>(2));
  internal::on_two_ranks([&](int rank) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    const Group group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
    internal::time_link_rank(group, rank, sizes, repeats, at::TensorOptions(), [] {}, times);
  });
  return internal::fit_link<ProcessLinkStats>(times, large_bytes);
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
