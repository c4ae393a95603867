// Binding processes to cores (Note [Binding cores to ranks] in
// gpipe/distributed/core_binding.h): a rank's share of the CPUs, and binding every thread of the
// process, read back from the kernel.
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include "absl/synchronization/notification.h"
#include "gpipe/distributed/core_binding.h"
#include "tests/catch.h"

namespace gpipe {
namespace distributed {
namespace {

// Sets (or, given null, unsets) environment variables for its life, then puts back what was there.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::vector<std::pair<std::string, const char*>> values) {
    for (const auto& [name, value] : values) {
      const char* before = std::getenv(name.c_str());
      saved_.emplace_back(name, before ? c10::optional<std::string>(before) : c10::nullopt);
      value ? ::setenv(name.c_str(), value, 1) : ::unsetenv(name.c_str());
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      value ? ::setenv(name.c_str(), value->c_str(), 1) : ::unsetenv(name.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, c10::optional<std::string>>> saved_;
};

// Binds back to `cpus` at the end of its scope, whatever happened in it.
struct RestoreBinding {
  ~RestoreBinding() {
    try {
      bind_to_cpus(cpus);
    } catch (const c10::Error& e) {
      CATCH_FAIL_CHECK("could not bind back: " << e.what_without_backtrace());
    }
  }
  std::vector<int> cpus;
};

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
  CATCH_CHECK_THROWS_WITH(cores_of_rank({0, 1}, 0, 0),
                          gpipe_test::contains("local world size must be at least 1, got 0"));
  CATCH_CHECK_THROWS_WITH(bind_to_cpus({}), gpipe_test::contains("no CPUs given"));
  CATCH_CHECK_THROWS_WITH(bind_to_cpus({CPU_SETSIZE}), gpipe_test::contains("is not a CPU number"));
}

CATCH_TEST_CASE("cores' hardware threads stay together so that shares take whole cores",
                "[distributed][core_binding]") {
  // Eight CPUs of four cores, numbered as Linux numbers them: CPU c and c + 4 share a core.
  const auto core_of = [](int cpu) { return cpu % 4; };
  const std::vector<int> ordered = order_by_core({0, 1, 2, 3, 4, 5, 6, 7}, core_of);
  CATCH_CHECK(ordered == std::vector<int>{0, 4, 1, 5, 2, 6, 3, 7});
  CATCH_CHECK(cores_of_rank(ordered, 0, 2) == std::vector<int>{0, 4, 1, 5});
  CATCH_CHECK(cores_of_rank(ordered, 1, 2) == std::vector<int>{2, 6, 3, 7});
  // A CPU of unknown core (-1) is a core of its own; a mask may leave a core's sibling out.
  CATCH_CHECK(order_by_core({1, 2, 5, 9}, [](int cpu) { return cpu == 9 ? -1 : cpu % 4; }) ==
              std::vector<int>{1, 5, 2, 9});
  // This machine's own topology: a permutation of the CPUs.
  std::vector<int> mine = order_by_core(allowed_cpus());
  std::sort(mine.begin(), mine.end());
  CATCH_CHECK(mine == allowed_cpus());
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
  // A CPU this process may not run on is refused by number, not left out silently.
  const int absent = CPU_SETSIZE - 1;
  if (std::find(all.begin(), all.end(), absent) == all.end()) {
    RestoreBinding restore{all};
    CATCH_CHECK_THROWS_WITH(bind_to_cpus({all.front(), absent}),
                            gpipe_test::contains("may not run on CPU " + std::to_string(absent)));
  }
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
  RestoreBinding restore{all};
  std::vector<int> share, mask;
  {
    ScopedEnv env({{"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"WORLD_SIZE", "2"}});
    share = bind_cores_to_rank();
    mask = mask_of(0);
  }
  bind_to_cpus(all);
  CATCH_CHECK(share == cores_of_rank(order_by_core(all), 1, 2));
  std::vector<int> sorted_share = share;
  std::sort(sorted_share.begin(), sorted_share.end());
  CATCH_CHECK(mask == sorted_share);  // the kernel's mask, ascending
  {
    ScopedEnv env({{"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}});
    CATCH_CHECK_THROWS_WITH(bind_cores_to_rank(),
                            gpipe_test::contains("(LOCAL_RANK=2, LOCAL_WORLD_SIZE=2)") &&
                                gpipe_test::contains("local rank 2 is not one of the 2"));
  }
  {
    ScopedEnv env({{"LOCAL_RANK", "one"}, {"LOCAL_WORLD_SIZE", "2"}});
    CATCH_CHECK_THROWS_WITH(bind_cores_to_rank(),
                            gpipe_test::contains("bind_cores_to_rank: LOCAL_RANK='one' is not an "
                                                 "integer from 0 to"));
  }
  {
    ScopedEnv env({{"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", nullptr}});
    CATCH_CHECK_THROWS_WITH(bind_cores_to_rank(),
                            gpipe_test::contains("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not"));
  }
  {
    // Ranks started by hand (RANK, WORLD_SIZE) without the local ones: which share is unknown.
    ScopedEnv env({{"LOCAL_RANK", nullptr}, {"LOCAL_WORLD_SIZE", nullptr}, {"WORLD_SIZE", "2"}});
    CATCH_CHECK_THROWS_WITH(bind_cores_to_rank(),
                            gpipe_test::contains("WORLD_SIZE=2 but LOCAL_RANK and "
                                                 "LOCAL_WORLD_SIZE are not set"));
  }
  // A process alone: rank 0 of 1, every allowed CPU.
  ScopedEnv alone({{"LOCAL_RANK", nullptr}, {"LOCAL_WORLD_SIZE", nullptr}, {"WORLD_SIZE", nullptr}});
  CATCH_CHECK(bind_cores_to_rank() == order_by_core(all));
  CATCH_CHECK(mask_of(0) == all);
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
