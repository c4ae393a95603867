// Workers: one thread per device runs that device's tasks, one after another, in the order the
// pipeline submits them, so partitions on different devices compute at the same time.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <c10/core/Device.h>

#include "absl/synchronization/mutex.h"

namespace gpipe {

/// A thread that runs submitted functions in order. Functions must not throw (the pipeline wraps
/// each task and carries its exception back to the caller). The destructor runs what is queued,
/// then joins the thread.
///
///   gpipe::Worker worker("cpu");
///   absl::Notification done;
///   worker.submit([&] { /* ... */ done.Notify(); });
///   done.WaitForNotification();
class Worker {
 public:
  explicit Worker(std::string name);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues `task` to run on this worker's thread.
  void submit(std::function<void()> task);

  /// The name given at construction (the device it serves).
  const std::string& name() const { return name_; }

 private:
  void loop();

  std::string name_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

/// The workers of a pipeline: one per distinct device, as in the Python reference, so that all
/// partitions on one device run on one thread in schedule order.
///
///   gpipe::WorkerPool pool({torch::kCPU, torch::kCPU});  // one thread
///   pool.for_partition(1).submit(task);
class WorkerPool {
 public:
  /// Starts one worker per distinct device among `devices` (the partitions' devices, in order).
  explicit WorkerPool(const std::vector<c10::Device>& devices);

  /// The worker that runs partition `partition`.
  Worker& for_partition(size_t partition) { return *workers_[worker_of_partition_[partition]]; }

  /// The number of threads.
  size_t size() const { return workers_.size(); }

 private:
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<size_t> worker_of_partition_;
};

}  // namespace gpipe
