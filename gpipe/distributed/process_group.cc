// The process group; see process_group.h.
#include "gpipe/distributed/process_group.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>

#include <ATen/ops/empty_like.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "gpipe/internal/error_text.h"

#ifdef GPIPE_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace gpipe {
namespace distributed {
namespace {


std::string env(const char* name, bool required) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr || !required, "gpipe::distributed: the environment variable ",
              name, " is not set; start the program with torchrun (torchrun --no_python "
              "--nproc_per_node=N program ...), which sets RANK, WORLD_SIZE, MASTER_ADDR and "
              "MASTER_PORT, or set them yourself");
  return value != nullptr ? value : "";
}

// A variable that must be set, as an integer from low to high (env_int).
int required_int(const char* name, int low, int high) {
  env(name, true);
  return static_cast<int>(*env_int(name, low, high));
}

bool loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace

c10::optional<int64_t> env_int(const char* name, int64_t low, int64_t high, const char* who) {
  const char* text = std::getenv(name);
  if (text == nullptr) return c10::nullopt;
  int64_t value = 0;
  TORCH_CHECK(absl::SimpleAtoi(text, &value) && value >= low && value <= high, who, ": ", name,
              "='", text, "' is not an integer from ", low, " to ", high);
  return value;
}

GroupOptions options_from_env() {
  GroupOptions options;
  options.world_size(required_int("WORLD_SIZE", 1, 1 << 20));
  options.rank(required_int("RANK", 0, options.world_size() - 1));
  options.master_addr(env("MASTER_ADDR", true));
  options.master_port(required_int("MASTER_PORT", 1, 65535));
  options.launcher_store(env("TORCHELASTIC_USE_AGENT_STORE", false) == "True");
  const std::string timeout = env("GPIPE_TIMEOUT_S", false);
  if (!timeout.empty()) {
    double seconds = 0;
    TORCH_CHECK(absl::SimpleAtod(timeout, &seconds) && seconds > 0,
                "gpipe::distributed: GPIPE_TIMEOUT_S='", timeout,
                "' is not a positive number of seconds");
    options.timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  }
  return options;
}

namespace {

// Note [Waiting for the store's port]
// LibTorch's TCPStore client that finds nothing listening yet sleeps a whole second before it
// tries again (LibTorch 1.13; measured: a client started 0.1 s before its server connects after
// 1.0 s). Rank 0 serves the store and is seldom first to listen, so nearly every group of
// processes paid that second at its start: a program started once does not notice, but a test
// suite that starts hundreds of groups, or a job restarted after a failure, does. So a client first
// polls the port itself, every 10 ms, until something accepts a connection there, and only then
// lets TCPStore connect (at its first try). At the timeout it gives up with the error TCPStore
// would have given (the rank could not meet the others there). A probe connection that closes at
// once is nothing to the server: it counts its workers by a key they add, not by connections.

// Whether something accepts TCP connections at host:port within `timeout`, tried every 10 ms;
// true also when the host does not resolve (TCPStore then names the address).
bool wait_for_listener(const std::string& host, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return true;
  }
  using Clock = std::chrono::steady_clock;
  // (A timeout of years means none; capped so that the deadline does not overflow.)
  const Clock::time_point deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
  bool open = false;
  while (!open) {
    for (addrinfo* a = found; a != nullptr && !open; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                              a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        open = true;
      } else if (errno == EINPROGRESS) {
        // A remote host that drops the attempt would hold a blocking connect for minutes.
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - Clock::now());
        pollfd p{fd, POLLOUT, 0};
        int error = 0;
        socklen_t length = sizeof(error);
        open = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1000))) == 1 &&
               ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
      }
      ::close(fd);
    }
    if (open || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::freeaddrinfo(found);
  return open;
}

// Meets the others at options' TCPStore (rank 0 serves it unless the launcher does); called once
// per store (store_and_name).
c10::intrusive_ptr<c10d::Store> connect_store(const GroupOptions& options) {
  TORCH_CHECK(options.world_size() >= 1 && options.rank() >= 0 &&
                  options.rank() < options.world_size(),
              "gpipe::distributed: rank ", options.rank(), " is not in 0 .. world_size - 1 = ",
              options.world_size() - 1);
  TORCH_CHECK(options.master_port() >= 1 && options.master_port() <= 65535,
              "gpipe::distributed: master_port ", options.master_port(),
              " is not a TCP port (1 .. 65535)");
  TORCH_CHECK(options.timeout().count() > 0, "gpipe::distributed: the timeout must be positive, "
              "got ", options.timeout().count(), " ms");
  const std::string where =
      absl::StrFormat("%s:%d", options.master_addr(), options.master_port());
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(options.master_port());
    store_options.isServer = options.rank() == 0 && !options.launcher_store();
    if (!store_options.isServer &&  // Note [Waiting for the store's port]
        !wait_for_listener(options.master_addr(), options.master_port(), options.timeout())) {
      throw std::runtime_error("nothing accepted a connection there within the timeout");
    }
    store_options.numWorkers = static_cast<size_t>(options.world_size());
    store_options.waitWorkers = !options.launcher_store();
    store_options.timeout = options.timeout();
#if TORCH_VERSION_MAJOR >= 2
    store_options.useLibUV = false;  // Debian's LibTorch is built without libuv
#endif
    c10::intrusive_ptr<c10d::Store> store =
        c10::make_intrusive<c10d::TCPStore>(options.master_addr(), store_options);
    // torchrun's store outlives a restart of the processes: each attempt keeps its own keys.
    const std::string attempt = env("TORCHELASTIC_RESTART_COUNT", false);
    if (options.launcher_store() && !attempt.empty()) {
      store = c10::make_intrusive<c10d::PrefixStore>("gpipe/attempt_" + attempt, store);
    }
    return store;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gpipe::distributed: rank ", options.rank(), " of ", options.world_size(),
                " could not meet the others at ", where, " (TCPStore, timeout ",
                options.timeout().count(), " ms): ", gpipe::internal::without_backtrace(e),
                (options.rank() == 0 ? "; is the port already in use?"
                                     : "; is rank 0 running, and MASTER_ADDR/MASTER_PORT right?"));
  }
}

// This process's connection to a store and the names of the groups it made there (Note [One store
// per process]).
struct StoreEntry {
  c10::intrusive_ptr<c10d::Store> store;
  int unnamed = 0;
  std::set<std::string> names;
};

// The store of `options` (connected at the first call for its address, rank and world) and the
// key prefix of the group being made there.
std::pair<c10::intrusive_ptr<c10d::Store>, std::string> store_and_name(
    const GroupOptions& options) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* stores = new std::map<std::string, StoreEntry>();  // for the process's life
  const std::string key = absl::StrFormat(
      "%s:%d rank %d of %d%s attempt %s", options.master_addr(), options.master_port(),
      options.rank(), options.world_size(), options.launcher_store() ? " (launcher's)" : "",
      env("TORCHELASTIC_RESTART_COUNT", false));
  absl::MutexLock lock(&mu);
  auto it = stores->find(key);
  if (it == stores->end()) {
    StoreEntry entry;
    entry.store = connect_store(options);
    it = stores->emplace(key, std::move(entry)).first;
  }
  StoreEntry& entry = it->second;
  entry.store->setTimeout(options.timeout());
  if (options.name().empty()) {
    return {entry.store, absl::StrCat("gpipe/", entry.unnamed++)};
  }
  TORCH_CHECK(entry.names.insert(options.name()).second, "gpipe::distributed: rank ",
              options.rank(), " made a group named '", options.name(), "' at ",
              options.master_addr(), ":", options.master_port(), " already; its keys are still "
              "in the store, so each group needs a name of its own (e.g. with a number that "
              "counts the attempts)");
  return {entry.store, absl::StrCat("gpipe/named/", options.name())};
}

// The Gloo group of `size` processes that meet in `store`; this one is `rank`.
ProcessGroup gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        const GroupOptions& options) {
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout());
  const std::string ifname = env("GLOO_SOCKET_IFNAME", false);
  if (!ifname.empty()) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (loopback(options.master_addr())) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
}

// The NCCL group of `size` processes that meet in `store`; this one is `rank` (check_backend
// refuses "nccl" first in a build without it).
ProcessGroup nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        const GroupOptions& options) {
#ifdef GPIPE_WITH_NCCL
#if TORCH_VERSION_MAJOR < 2
  // LibTorch 1.x leaves NCCL's asynchronous error handling off, so a wait on a peer that died
  // could last forever (docs/distributed.md, Failures); on, as LibTorch 2.x has it by default,
  // the watchdog ends this process after the group's timeout. A user's own choice of either
  // variable stands. (Read when the group is made.)
  if (std::getenv("NCCL_ASYNC_ERROR_HANDLING") == nullptr &&
      std::getenv("NCCL_BLOCKING_WAIT") == nullptr) {
    ::setenv("NCCL_ASYNC_ERROR_HANDLING", "1", /*overwrite=*/0);
  }
#endif
  auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
  nccl_options->timeout = options.timeout();
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl_options);
#else
  (void)store, (void)rank, (void)size, (void)options;
  TORCH_CHECK(false, "gpipe was built without NCCL");
#endif
}

// The group of options' backend, of `size` processes that meet under `prefix` in `store`; this
// one is `rank`.
ProcessGroup backend_group(const c10::intrusive_ptr<c10d::Store>& store,
                           const std::string& prefix, int rank, int size,
                           const GroupOptions& options) {
  c10::intrusive_ptr<c10d::Store> scoped = store;
  if (!prefix.empty()) scoped = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  const bool nccl = options.backend() == "nccl";
  try {
    return nccl ? nccl_group(scoped, rank, size, options)
                : gloo_group(scoped, rank, size, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gpipe::distributed: rank ", options.rank(), " of ", options.world_size(),
                " met the others at ", options.master_addr(), ":", options.master_port(),
                " but could not connect to the others of its group ('", prefix, "') with ",
                nccl ? "NCCL" : "Gloo", " (timeout ", options.timeout().count(),
                " ms): ", gpipe::internal::without_backtrace(e),
                "; every process must make the same groups, its "
                "unnamed ones in the same order (a group that only some processes make needs "
                "GroupOptions::name)");
  }
}

void check_backend(const GroupOptions& options) {
  TORCH_CHECK(options.backend() == "gloo" || options.backend() == "nccl",
              "gpipe::distributed: unknown backend '", options.backend(),
              "'; gpipe's groups use \"gloo\" (CPUs, or GPUs through the CPU) or \"nccl\" (GPUs)");
  TORCH_CHECK(options.backend() != "nccl" || built_with_nccl(), "gpipe::distributed: the NCCL "
              "backend was asked for, but this gpipe was built without NCCL (it needs a CUDA "
              "LibTorch with c10d's NCCL backend and NCCL's headers); use backend \"gloo\", which "
              "carries GPU tensors through the CPU");
}

}  // namespace

bool built_with_nccl() {
#ifdef GPIPE_WITH_NCCL
  return true;
#else
  return false;
#endif
}

bool matches_by_tag(const ProcessGroup& group) {
  return dynamic_cast<const c10d::ProcessGroupGloo*>(group.get()) != nullptr;
}

bool carries_device_tensors(const ProcessGroup& group) {
  return group->getBackendName() == "nccl";
}

c10::Device wire_device(const ProcessGroup& group, c10::Device local) {
  if (!carries_device_tensors(group)) return c10::Device(c10::kCPU);
  TORCH_CHECK(local.is_cuda(), "gpipe::distributed: rank ", group->getRank(), "'s ",
              group->getBackendName(), " group carries only GPU tensors, but this process's "
              "tensors for it are on ", local, "; put the module or stage on this process's GPU "
              "(one per process), or use a Gloo group");
  if (local.has_index()) return local;
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice();
}

ProcessGroup new_gloo_group(const GroupOptions& options) {
  const auto [store, prefix] = store_and_name(options);
  return backend_group(store, prefix, options.rank(), options.world_size(),
                       GroupOptions(options).backend("gloo"));
}

ProcessGroup new_process_group(const GroupOptions& options) {
  check_backend(options);
  const auto [store, prefix] = store_and_name(options);
  return backend_group(store, prefix, options.rank(), options.world_size(), options);
}

PipelineGroups new_pipeline_groups(const GroupOptions& options, int stages) {
  TORCH_CHECK(stages >= 1 && options.world_size() % stages == 0,
              "gpipe::distributed: ", options.world_size(), " processes cannot form pipelines of ",
              stages, " stages; the number of processes must be a multiple of the stages");
  check_backend(options);
  const auto [store, prefix] = store_and_name(options);
  PipelineGroups groups;
  groups.stages = stages;
  groups.replicas = options.world_size() / stages;
  groups.stage = options.rank() % stages;
  groups.replica = options.rank() / stages;
  groups.pipeline = backend_group(store, absl::StrCat(prefix, "/pipeline/", groups.replica),
                                  groups.stage, stages, options);
  groups.replica_group = backend_group(store, absl::StrCat(prefix, "/replicas/", groups.stage),
                                       groups.replica, groups.replicas, options);
  return groups;
}

void check_collective(const ProcessGroup& group, const std::string& what,
                      const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    if (e.msg().rfind("gpipe", 0) == 0) throw;  // already ours
    TORCH_CHECK(false, "gpipe::distributed: ", what, " failed on rank ", group->getRank(), " of ",
                group->getSize(), ": ", e.what_without_backtrace(),
                " (another process may have died, stopped or timed out)");
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gpipe::distributed: ", what, " failed on rank ", group->getRank(), " of ",
                group->getSize(), ": ", gpipe::internal::without_backtrace(e),
                " (another process may have died, stopped or timed out)");
  }
}

namespace {
std::function<void()>& all_gather_hook() {
  static std::function<void()> hook;
  return hook;
}
}  // namespace

void internal::set_all_gather_hook(std::function<void()> hook) {
  all_gather_hook() = std::move(hook);
}

std::vector<at::Tensor> all_gather(const ProcessGroup& group, const at::Tensor& mine,
                                   c10::Device local, const std::string& what,
                                   const std::function<void()>& check,
                                   const std::function<void()>& posted) {
  if (all_gather_hook()) all_gather_hook()();
  std::vector<at::Tensor> input{mine.to(wire_device(group, local))};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < group->getSize(); ++r) all[0].push_back(at::empty_like(input[0]));
  check_collective(group, what, [&] {
    const c10::intrusive_ptr<c10d::Work> work = group->allgather(all, input);
    if (posted) posted();
    while (check && !work->isCompleted()) {
      check();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    work->wait();
  });
  for (at::Tensor& theirs : all[0]) theirs = theirs.to(at::kCPU);
  return all[0];
}

void wait(const ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work,
          const std::string& what) {
  check_collective(group, what, [&] { work->wait(); });
}

}  // namespace distributed
}  // namespace gpipe
