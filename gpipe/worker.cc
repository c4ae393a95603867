// Workers; see worker.h.
#include "gpipe/worker.h"

#include <utility>

namespace gpipe {

Worker::Worker(std::string name) : name_(std::move(name)), thread_([this] { loop(); }) {}

Worker::~Worker() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void Worker::submit(std::function<void()> task) {
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

WorkerPool::WorkerPool(const std::vector<c10::Device>& devices) {
  std::vector<c10::Device> seen;
  for (const c10::Device& device : devices) {
    size_t index = 0;
    while (index < seen.size() && seen[index] != device) {
      ++index;
    }
    if (index == seen.size()) {
      seen.push_back(device);
      workers_.push_back(std::make_unique<Worker>(device.str()));
    }
    worker_of_partition_.push_back(index);
  }
}

}  // namespace gpipe
