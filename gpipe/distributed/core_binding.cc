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
#include <string>

#include <c10/util/Exception.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"

namespace gpipe {
namespace distributed {
namespace {

// The threads of this process (their ids in /proc/self/task).
std::vector<pid_t> threads() {
  std::vector<pid_t> ids;
  DIR* dir = opendir("/proc/self/task");
  TORCH_CHECK(dir != nullptr, "bind_to_cpus: cannot list this process's threads in "
              "/proc/self/task: ", std::strerror(errno));
  while (const dirent* entry = readdir(dir)) {
    int id = 0;
    if (absl::SimpleAtoi(entry->d_name, &id)) ids.push_back(static_cast<pid_t>(id));
  }
  closedir(dir);
  return ids;
}

// torchrun's variable `name` as an integer, or `otherwise` when it is not set.
int64_t env_or(const char* name, int64_t otherwise) {
  const char* value = std::getenv(name);
  if (value == nullptr) return otherwise;
  int64_t parsed = 0;
  TORCH_CHECK(absl::SimpleAtoi(value, &parsed), "bind_cores_to_rank: the environment variable ",
              name, "='", value, "' is not an integer");
  return parsed;
}

}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  TORCH_CHECK(sched_getaffinity(0, sizeof(set), &set) == 0,
              "allowed_cpus: sched_getaffinity failed: ", std::strerror(errno));
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
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
  TORCH_CHECK(sched_setaffinity(0, sizeof(set), &set) == 0, "bind_to_cpus: cannot bind to CPUs {",
              absl::StrJoin(cpus, ", "), "}: ", std::strerror(errno), "; this process may run on {",
              absl::StrJoin(allowed_cpus(), ", "), "}");
  for (pid_t thread : threads()) {
    // A thread that ended meanwhile (ESRCH) needs no binding.
    TORCH_CHECK(sched_setaffinity(thread, sizeof(set), &set) == 0 || errno == ESRCH,
                "bind_to_cpus: cannot bind thread ", thread, " to CPUs {",
                absl::StrJoin(cpus, ", "), "}: ", std::strerror(errno));
  }
}

std::vector<int> cores_of_rank(const std::vector<int>& cpus, int64_t local_rank,
                               int64_t local_world_size) {
  TORCH_CHECK(local_world_size >= 1 && local_rank >= 0 && local_rank < local_world_size,
              "cores_of_rank: local rank ", local_rank, " is not one of the ", local_world_size,
              " local ranks (0 to ", local_world_size - 1, ")");
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
  const std::vector<int> cpus = cores_of_rank(allowed_cpus(), env_or("LOCAL_RANK", 0),
                                              env_or("LOCAL_WORLD_SIZE", 1));
  bind_to_cpus(cpus);
  return cpus;
}

}  // namespace distributed
}  // namespace gpipe
