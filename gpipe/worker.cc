// Workers; see worker.h.
#include "gpipe/worker.h"

#include <dlfcn.h>

#include <ATen/Parallel.h>

#include <utility>

#ifdef __linux__
#include <pthread.h>
#endif

namespace gpipe {
namespace {
std::function<void()>& submit_hook() {
  static auto* hook = new std::function<void()>();
  return *hook;
}
}  // namespace

void internal::set_submit_hook(std::function<void()> hook) { submit_hook() = std::move(hook); }

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

void set_intra_op_threads(int threads) {
  TORCH_CHECK(threads >= 1, "set_intra_op_threads: threads must be at least 1, got ", threads);
  at::set_num_threads(threads);
  // OpenBLAS, when it is the BLAS LibTorch was linked with (Debian's LibTorch is): found at run
  // time, so that gpipe does not depend on it.
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(threads);
  }
}

}  // namespace gpipe
