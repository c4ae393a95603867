// Binding each process of a host to cores of its own; see Note [Binding cores to ranks] in
// core_binding.h.
#include "gpipe/distributed/core_binding.h"

#include <dirent.h>
#include <sched.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "gpipe/distributed/process_group.h"

namespace gpipe {
namespace distributed {
namespace {

// The threads of this process (their ids in /proc/self/task).
std::vector<pid_t> threads() {
  std::vector<pid_t> ids;
  DIR* dir = opendir("/proc/self/task");
  TORCH_CHECK(dir != nullptr, "bind_to_cpus: cannot list this process's threads in "
              "/proc/self/task: ", std::strerror(errno));
  while (true) {
    errno = 0;
    const dirent* entry = readdir(dir);
    if (entry == nullptr) {
      const int error = errno;
      closedir(dir);
      TORCH_CHECK(error == 0, "bind_to_cpus: cannot list this process's threads in "
                  "/proc/self/task: ", std::strerror(error));
      return ids;
    }
    int id = 0;
    if (absl::SimpleAtoi(entry->d_name, &id)) ids.push_back(static_cast<pid_t>(id));
  }
}

// The CPUs in `set`, ascending.
std::vector<int> cpus_in(const cpu_set_t& set) {
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

// The first CPU of a list such as "0,8" or "0-1" (thread_siblings_list), or -1.
int first_of_list(const std::string& list) {
  int first = -1;
  const size_t end = list.find_first_of(",-\n");
  return absl::SimpleAtoi(list.substr(0, end), &first) ? first : -1;
}

}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  TORCH_CHECK(sched_getaffinity(0, sizeof(set), &set) == 0,
              "allowed_cpus: sched_getaffinity failed: ", std::strerror(errno));
  return cpus_in(set);
}

void bind_to_cpus(const std::vector<int>& cpus) {
  TORCH_CHECK(!cpus.empty(), "bind_to_cpus: no CPUs given; give at least one of this process's "
              "(allowed_cpus(): ", absl::StrJoin(allowed_cpus(), ", "), ")");
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_to_cpus: CPU ", cpu, " is not a CPU number "
                "(0 to ", CPU_SETSIZE - 1, ")");
    CPU_SET(cpu, &set);
  }
  // The calling thread first: the threads it starts from now on inherit its mask.
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    const int error = errno;
    TORCH_CHECK(false, "bind_to_cpus: cannot bind to CPUs {", absl::StrJoin(cpus, ", "), "}: ",
                std::strerror(error), "; none of them is a CPU this process may run on (its "
                "cgroup's cpuset, online CPUs)");
  }
  // The kernel binds to the CPUs it allows of those asked for: what it gave must be all of them.
  const std::vector<int> asked = cpus_in(set), given = allowed_cpus();
  if (given != asked) {
    std::vector<int> missing;
    for (int cpu : asked) {
      if (std::find(given.begin(), given.end(), cpu) == given.end()) missing.push_back(cpu);
    }
    TORCH_CHECK(false, "bind_to_cpus: this process may not run on CPU",
                missing.size() > 1 ? "s " : " ", absl::StrJoin(missing, ", "), " of {",
                absl::StrJoin(cpus, ", "), "} (its cgroup's cpuset or offline); it is now bound "
                "to {", absl::StrJoin(given, ", "), "} on this thread: give CPUs of those it "
                "may use");
  }
  for (pid_t thread : threads()) {
    // A thread that ended meanwhile (ESRCH) needs no binding.
    if (sched_setaffinity(thread, sizeof(set), &set) != 0 && errno != ESRCH) {
      const int error = errno;
      TORCH_CHECK(false, "bind_to_cpus: cannot bind thread ", thread, " to CPUs {",
                  absl::StrJoin(cpus, ", "), "}: ", std::strerror(error));
    }
  }
}

std::vector<int> order_by_core(const std::vector<int>& cpus,
                               const std::function<int(int cpu)>& core_of) {
  // (core, cpu) pairs sorted: a core's threads together, cores by their first thread.
  std::vector<std::pair<int, int>> keyed;
  for (int cpu : cpus) {
    const int core = core_of(cpu);
    keyed.emplace_back(core >= 0 ? core : cpu, cpu);
  }
  std::sort(keyed.begin(), keyed.end());
  std::vector<int> ordered;
  for (const auto& [core, cpu] : keyed) ordered.push_back(cpu);
  return ordered;
}

std::vector<int> order_by_core(const std::vector<int>& cpus) {
  return order_by_core(cpus, [](int cpu) {
    std::ifstream in("/sys/devices/system/cpu/cpu" + std::to_string(cpu) +
                     "/topology/thread_siblings_list");
    std::string list;
    return in && std::getline(in, list) ? first_of_list(list) : -1;
  });
}

std::vector<int> cores_of_rank(const std::vector<int>& cpus, int64_t local_rank,
                               int64_t local_world_size) {
  TORCH_CHECK(local_world_size >= 1, "cores_of_rank: the local world size must be at least 1, "
              "got ", local_world_size);
  TORCH_CHECK(local_rank >= 0 && local_rank < local_world_size, "cores_of_rank: local rank ",
              local_rank, " is not one of the ", local_world_size, " local ranks (0 to ",
              local_world_size - 1, ")");
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n >= local_world_size, "cores_of_rank: ", n, " CPUs {", absl::StrJoin(cpus, ", "),
              "} cannot give each of ", local_world_size, " local ranks one of its own; run at "
              "most ", n, " processes on this host, or leave them unbound");
  const int64_t share = n / local_world_size, extra = n % local_world_size;
  const int64_t begin = local_rank * share + std::min(local_rank, extra);
  const int64_t end = begin + share + (local_rank < extra ? 1 : 0);
  return std::vector<int>(cpus.begin() + begin, cpus.begin() + end);
}

std::vector<int> bind_cores_to_rank() {
  constexpr int64_t kMost = 1 << 20;
  const c10::optional<int64_t> ranks = env_int("LOCAL_WORLD_SIZE", 1, kMost, "bind_cores_to_rank");
  const c10::optional<int64_t> rank = env_int("LOCAL_RANK", 0, kMost, "bind_cores_to_rank");
  const c10::optional<int64_t> world = env_int("WORLD_SIZE", 1, kMost, "bind_cores_to_rank");
  TORCH_CHECK(rank.has_value() == ranks.has_value(), "bind_cores_to_rank: ",
              rank ? "LOCAL_RANK" : "LOCAL_WORLD_SIZE", " is set but ",
              rank ? "LOCAL_WORLD_SIZE" : "LOCAL_RANK", " is not; set both (torchrun does): "
              "this process's rank among the processes on its host, and their number");
  TORCH_CHECK(ranks || !world || *world <= 1, "bind_cores_to_rank: WORLD_SIZE=", world.value_or(0),
              " but LOCAL_RANK and LOCAL_WORLD_SIZE are not set, so which cores are this "
              "process's is not known; start it with torchrun, or set them: this process's rank "
              "among the processes on its host, and their number");
  const int64_t local_rank = rank.value_or(0), local_ranks = ranks.value_or(1);
  std::vector<int> cpus;
  try {
    cpus = cores_of_rank(order_by_core(allowed_cpus()), local_rank, local_ranks);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "bind_cores_to_rank (LOCAL_RANK=", local_rank, ", LOCAL_WORLD_SIZE=",
                local_ranks, "): ", e.what_without_backtrace());
  }
  bind_to_cpus(cpus);
  return cpus;
}

}  // namespace distributed
}  // namespace gpipe
