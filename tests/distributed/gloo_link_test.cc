// Measuring the link between processes on Gloo (balancing/gloo_link.h): two ranks of this process
// on the loopback, and rings in shared memory between two of its threads; the planner's arithmetic
// on what they measured.
#include "tests/gpipe/test_util.h"

#include <chrono>
#include <cmath>
#include <exception>
#include <thread>
#include <vector>

#include <ATen/ops/ones.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "balancing/gloo_link.h"
#include "balancing/nccl_link.h"
#include "gpipe/distributed/process_group.h"

namespace gpipe {
namespace testing {
namespace {

// A measured link (ProcessLinkStats, GpuLinkStats): positive latencies, finite bandwidths of more
// than `least` bytes per microsecond, and an all-reduce of `large` bytes dearer than one of 4.
template <typename Link>
void check_measured(const Link& link, double least, int64_t large) {
  CATCH_REQUIRE(link.measured());
  CATCH_CHECK(link.latency_us > 0);
  CATCH_CHECK(link.allreduce_step_us > 0);
  for (double bandwidth : {link.bytes_per_us, link.allreduce_bytes_per_us}) {
    CATCH_CHECK(std::isfinite(bandwidth));
    CATCH_CHECK(bandwidth > least);
  }
  CATCH_CHECK(link.allreduce_us(large, 2) > link.allreduce_us(4, 2));
}

CATCH_TEST_CASE("measure_gloo_link measures messages and all-reduces between two ranks",
                "[distributed][balancing][replicas]") {
  // A loopback moves more than 10 MB/s, whatever else the machine runs.
  check_measured(measure_gloo_link(int64_t{4} << 20, 3), 10, int64_t{4} << 20);
  CATCH_CHECK_THROWS_WITH(measure_gloo_link(100), gpipe_test::contains("large_bytes 100"));
  CATCH_CHECK_THROWS_WITH(measure_gloo_link(4096, 0), gpipe_test::contains("repeats 0"));
}

CATCH_TEST_CASE("measure_nccl_link refuses what is not two GPUs, and a build without NCCL",
                "[distributed][balancing][nccl]") {
  const c10::Device gpu0(c10::kCUDA, 0), gpu1(c10::kCUDA, 1);
  CATCH_CHECK_THROWS_WITH(measure_nccl_link(gpu0, gpu0),
                          gpipe_test::contains("between two different GPUs, such as cuda:0 and "
                                               "cuda:1; got cuda:0 and cuda:0"));
  CATCH_CHECK_THROWS_WITH(measure_nccl_link(c10::Device(c10::kCPU), gpu1),
                          gpipe_test::contains("got cpu and cuda:1"));
  CATCH_CHECK_THROWS_WITH(measure_nccl_link(gpu0, gpu1, 100),
                          gpipe_test::contains("large_bytes 100"));
  CATCH_CHECK_THROWS_WITH(measure_nccl_link(gpu0, gpu1, 4096, 0),
                          gpipe_test::contains("repeats 0"));
  if (!distributed::built_with_nccl()) {
    CATCH_CHECK_THROWS_WITH(measure_nccl_link(gpu0, gpu1),
                            gpipe_test::contains("built without NCCL") &&
                                gpipe_test::contains("--nccl_link"));
  }
}

CATCH_TEST_CASE("measure_nccl_link measures messages and all-reduces between two GPUs",
                "[distributed][balancing][nccl][cuda][gpus2]") {
  CATCH_REQUIRE(distributed::built_with_nccl());
  const int64_t large = int64_t{64} << 20;
  // Two GPUs of one machine move more than 1 GB/s (PCIe 3's x16 link: about 12).
  const GpuLinkStats link =
      measure_nccl_link(c10::Device(c10::kCUDA, 0), c10::Device(c10::kCUDA, 1), large, 3);
  check_measured(link, 1000, large);
}

CATCH_TEST_CASE("measure_shared_memory_link measures messages through rings between two threads",
                "[distributed][balancing][shared_memory]") {
  const int64_t ring_bytes = int64_t{1} << 20;
  const RingLinkStats ring = measure_shared_memory_link(ring_bytes, 3);
  CATCH_REQUIRE(ring.measured());
  CATCH_CHECK(ring.latency_us > 0);
  CATCH_CHECK(std::isfinite(ring.bytes_per_us));
  CATCH_CHECK(ring.bytes_per_us > 10);  // a memory copy, whatever else the machine runs
  // The largest activations an empty ring always takes: 7/16 of it, less the records' headers.
  CATCH_CHECK(ring.max_message < ring_bytes * 7 / 16);
  CATCH_CHECK(ring.max_message > ring_bytes * 7 / 16 - 8192);
  CATCH_CHECK_THROWS_WITH(measure_shared_memory_link(4096), gpipe_test::contains("ring_bytes 4096"));
  CATCH_CHECK_THROWS_WITH(measure_shared_memory_link(ring_bytes, 0),
                          gpipe_test::contains("repeats 0"));
}

CATCH_TEST_CASE("An all-reduce of two ranks sums what both gave, as the measurement assumes",
                "[distributed][balancing][replicas]") {
  // The measurement times group->allreduce on the tensors of both ranks; check that it is the
  // collective the planner models (every rank ends with the sum), not a no-op.
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<at::Tensor> results(2);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
        std::vector<at::Tensor> t{at::ones({1024}) * (rank + 1)};
        group->allreduce(t)->wait();
        results[rank] = t[0];
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (const at::Tensor& r : results) CATCH_CHECK(r.eq(3).all().item<bool>());
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
