// Binding processes to cores (Note [Binding cores to ranks] in
// gpipe/distributed/core_binding.h): a rank's share of the CPUs, and binding every thread of the
// process, read back from the kernel.
#include <sched.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "absl/synchronization/notification.h"
#include "gpipe/distributed/core_binding.h"
#include "tests/catch.h"

namespace gpipe {
namespace distributed {
namespace {

// The CPUs `thread` (0: the calling one) may run on, as the kernel says.
std::vector<int> mask_of(pid_t thread) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CATCH_REQUIRE(sched_getaffinity(thread, sizeof(set), &set) == 0);
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

CATCH_TEST_CASE("the local ranks' shares of the CPUs are contiguous, disjoint and cover them all",
                "[distributed][core_binding]") {
  const int64_t n = GENERATE(1, 2, 3, 5, 8, 13);
  const int64_t ranks = GENERATE(1, 2, 3, 4, 8);
  if (ranks > n) return;
  std::vector<int> cpus;  // not 0..n-1: every other CPU, as a mask may leave some out
  for (int64_t k = 0; k < n; ++k) cpus.push_back(static_cast<int>(2 * k + 1));
  std::vector<int> joined;
  size_t smallest = cpus.size(), largest = 0;
  for (int64_t rank = 0; rank < ranks; ++rank) {
    const std::vector<int> share = cores_of_rank(cpus, rank, ranks);
    CATCH_CHECK(!share.empty());
    smallest = std::min(smallest, share.size());
    largest = std::max(largest, share.size());
    joined.insert(joined.end(), share.begin(), share.end());
  }
  CATCH_CHECK(joined == cpus);  // in order, each once
  CATCH_CHECK(largest - smallest <= 1);
}

CATCH_TEST_CASE("a rank outside the local ranks or more ranks than CPUs is refused by name",
                "[distributed][core_binding]") {
  CATCH_CHECK_THROWS_WITH(cores_of_rank({0, 1}, 2, 2),
                          gpipe_test::contains("local rank 2 is not one of the 2 local ranks (0 to 1)"));
  CATCH_CHECK_THROWS_WITH(cores_of_rank({0, 1}, -1, 2), gpipe_test::contains("local rank -1"));
  CATCH_CHECK_THROWS_WITH(cores_of_rank({4, 5}, 0, 3),
                          gpipe_test::contains("2 CPUs {4, 5} cannot give each of 3 local ranks"));
  CATCH_CHECK_THROWS_WITH(bind_to_cpus({}), gpipe_test::contains("no CPUs given"));
  CATCH_CHECK_THROWS_WITH(bind_to_cpus({CPU_SETSIZE}), gpipe_test::contains("is not a CPU number"));
}

CATCH_TEST_CASE("binding moves the threads already running and those started later",
                "[distributed][core_binding]") {
  const std::vector<int> all = allowed_cpus();
  CATCH_REQUIRE(!all.empty());
  CATCH_CHECK(mask_of(0) == all);
  if (all.size() < 2) {
    CATCH_WARN("one CPU only: binding cannot be told from not binding");
    return;
  }
  // A thread started before the binding reports its mask when told to.
  absl::Notification bound, reported;
  std::vector<int> before_thread_mask;
  std::thread before([&] {
    bound.WaitForNotification();
    before_thread_mask = mask_of(0);
    reported.Notify();
  });
  const std::vector<int> last = {all.back()};
  bind_to_cpus(last);
  bound.Notify();
  reported.WaitForNotification();
  before.join();
  std::vector<int> after_thread_mask;
  std::thread after([&] { after_thread_mask = mask_of(0); });
  after.join();
  const std::vector<int> main_mask = mask_of(0);
  bind_to_cpus(all);  // as it was, for the test cases after this one
  CATCH_CHECK(main_mask == last);
  CATCH_CHECK(before_thread_mask == last);
  CATCH_CHECK(after_thread_mask == last);
  CATCH_CHECK(mask_of(0) == all);
}

CATCH_TEST_CASE("bind_cores_to_rank binds to torchrun's local rank's share",
                "[distributed][core_binding]") {
  const std::vector<int> all = allowed_cpus();
  if (all.size() < 2) {
    CATCH_WARN("one CPU only: a share of two ranks needs two");
    return;
  }
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  const std::vector<int> share = bind_cores_to_rank();
  const std::vector<int> mask = mask_of(0);
  ::setenv("LOCAL_RANK", "2", 1);
  std::string refusal;
  try {
    bind_cores_to_rank();
  } catch (const c10::Error& e) {
    refusal = e.what_without_backtrace();
  }
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  bind_to_cpus(all);
  CATCH_CHECK(share == cores_of_rank(all, 1, 2));
  CATCH_CHECK(share.back() == all.back());
  CATCH_CHECK(mask == share);
  CATCH_CHECK(refusal.find("local rank 2 is not one of the 2 local ranks") != std::string::npos);
  // Without torchrun's variables: rank 0 of 1, every allowed CPU.
  CATCH_CHECK(bind_cores_to_rank() == all);
  CATCH_CHECK(mask_of(0) == all);
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
