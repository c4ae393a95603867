// Workers; see worker.h.
#include "gpipe/worker.h"

#include <dlfcn.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

namespace gpipe {
namespace {
std::function<void()>& submit_hook() {
  static auto* hook = new std::function<void()>();
  return *hook;
}
}  // namespace

void internal::set_submit_hook(std::function<void()> hook) { submit_hook() = std::move(hook); }

namespace {
std::atomic<int> running_workers{0};
}  // namespace

int internal::running_worker_threads() { return running_workers.load(); }

Worker::Worker(std::string name) : name_(std::move(name)), thread_([this] { loop(); }) {
#ifdef __linux__
  // Named "gpipe <device>" (Linux allows 15 characters) for debuggers, `top -H`, and tests that
  // count gpipe's own threads among those of OpenMP, CUDA and the autograd engine.
  pthread_setname_np(thread_.native_handle(), ("gpipe " + name_).substr(0, 15).c_str());
#endif
}

Worker::~Worker() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void Worker::submit(std::function<void()> task) {
  if (submit_hook()) {
    submit_hook()();
  }
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

void Worker::loop() {
  ++running_workers;
  struct Ended {
    ~Ended() { --running_workers; }
  } ended;
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Worker* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
            return w->stopping_ || !w->queue_.empty();
          },
          this));
      if (queue_.empty()) {
        return;  // stopping, and nothing left to run
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

std::shared_ptr<WorkerPool> WorkerPool::make_shared(const std::vector<c10::Device>& devices,
                                                    bool worker_per_partition) {
  return std::shared_ptr<WorkerPool>(
      new WorkerPool(devices, worker_per_partition), [](WorkerPool* pool) {
        for (const auto& worker : pool->workers_) {
          if (worker->is_current()) {
            std::thread([pool] { delete pool; }).detach();
            return;
          }
        }
        delete pool;
      });
}

WorkerPool::WorkerPool(const std::vector<c10::Device>& devices, bool worker_per_partition) {
  std::vector<c10::Device> keys;  // the device of each worker; keys[0] is the caller's
  for (size_t j = 0; j < devices.size(); ++j) {
    // One CPU, however it is written ("cpu", "cpu:0"): partitions on it share a worker.
    const c10::Device device = devices[j].is_cpu() ? c10::Device(c10::kCPU) : devices[j];
    size_t index = 0;
    if (worker_per_partition) {
      index = j;
      keys.push_back(device);
    } else {
      while (index < keys.size() && keys[index] != device) {
        ++index;
      }
      if (index == keys.size()) {
        keys.push_back(device);
      }
    }
    if (index == 0) {
      worker_of_partition_.push_back(-1);
      continue;
    }
    if (index > workers_.size()) {
      workers_.push_back(std::make_unique<Worker>(device.str()));
    }
    worker_of_partition_.push_back(static_cast<int64_t>(index) - 1);
  }
}

namespace {

// OpenBLAS's thread count, when it is the BLAS LibTorch was linked with (Debian's LibTorch is):
// found at run time, so that gpipe does not depend on it. -1 without OpenBLAS.
int blas_threads() {
  using GetThreads = int (*)();
  static const auto get =
      reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : -1;
}

void set_blas_threads(int threads) {
  using SetThreads = void (*)(int);
  static const auto set =
      reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set != nullptr) set(threads);
}

// The count set_intra_op_threads was given last; 0: never called.
std::atomic<int>& user_threads() {
  static std::atomic<int> threads{0};
  return threads;
}

std::atomic<bool>& core_share_enabled() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

// The steps dividing OpenBLAS's threads at once, and the count to put back after the last.
struct BlasShare {
  std::mutex mu;
  int holders = 0;
  int before = 0;
};
BlasShare& blas_share() {
  static auto* share = new BlasShare();  // never destroyed: steps may end during exit
  return *share;
}

// The CPUs this process may run on: those of its affinity mask (taskset, a launcher's binding),
// else every one the system has.
int available_cpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

bool env_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0';
}

}  // namespace

void set_intra_op_threads(int threads) {
  TORCH_CHECK(threads >= 1, "set_intra_op_threads: threads must be at least 1, got ", threads);
  user_threads() = threads;  // Note [Dividing the cores]: the user's choice wins
  at::set_num_threads(threads);
  set_blas_threads(threads);
}

namespace internal {

namespace {

// The calling thread's intra-op threads, for it alone: OpenMP keeps a count per thread, while
// at::set_num_threads also sets the process-wide count that threads started later take (and
// clears oneDNN's caches). LibTorch's own setup of the thread comes first, or its first parallel
// region would overwrite the count.
void set_thread_threads(int threads) {
  using Set = void (*)(int);
  static const auto omp = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  at::internal::lazy_init_num_threads();
  if (omp != nullptr) {
    omp(threads);
  } else {
    at::set_num_threads(threads);  // not OpenMP: LibTorch's count is its pool's
  }
}

}  // namespace

CoreShare::CoreShare(int64_t cpu_lanes, int64_t gpu_lanes) {
  if (cpu_lanes < 1 || !core_share_enabled()) return;
  if (user_threads() > 0) {
    // The user's count, on every CPU lane's thread, kept there: OpenMP keeps a count per thread,
    // so a worker started before set_intra_op_threads would not see it otherwise.
    lane_threads_ = user_threads();
    keep_ = true;
    return;
  }
  if (cpu_lanes < 2 && gpu_lanes < 1) return;
  const int lanes = static_cast<int>(cpu_lanes);
  // The CPUs left to the CPU lanes: one each is the GPU lanes' (Note [Dividing the cores]).
  const int gpus = static_cast<int>(std::max<int64_t>(gpu_lanes, 0));
  const int cpus = std::max(1, available_cpus() - gpus);
  const int intra = at::get_num_threads();
  if (intra == at::intraop_default_num_threads() && intra > 1 && !env_set("OMP_NUM_THREADS")) {
    lane_threads_ = std::max(1, std::min(intra, cpus) / lanes);
  }
  if (env_set("OPENBLAS_NUM_THREADS") || env_set("OMP_NUM_THREADS")) return;
  BlasShare& share = blas_share();
  std::lock_guard<std::mutex> lock(share.mu);
  if (share.holders == 0) {
    share.before = blas_threads();
    if (share.before <= 1) return;  // no OpenBLAS, or one thread already
    set_blas_threads(std::max(1, std::min(share.before, cpus / lanes)));
  }
  ++share.holders;
  blas_ = true;
}

CoreShare::~CoreShare() {
  if (!blas_) return;
  BlasShare& share = blas_share();
  std::lock_guard<std::mutex> lock(share.mu);
  if (--share.holders == 0) set_blas_threads(share.before);
}

CoreShare::Lane::Lane(const CoreShare& share) {
  if (share.lane_threads() == 0) return;
  at::internal::lazy_init_num_threads();
  const int before = at::get_num_threads();
  if (before == share.lane_threads()) return;
  set_thread_threads(share.lane_threads());
  if (!share.keeps()) before_ = before;
}

CoreShare::Lane::~Lane() {
  if (before_ != 0) set_thread_threads(before_);
}

}  // namespace internal

void internal::set_core_share(bool enabled) {
  core_share_enabled() = enabled;
  user_threads() = 0;
}

}  // namespace gpipe
