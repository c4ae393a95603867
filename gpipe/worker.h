// Workers: one thread per device (or per partition: Note [Threads of forward()]) runs its tasks,
// one after another, in the order the pipeline submits them, so partitions on different devices
// compute at the same time.
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
  /// Whether the calling thread is this worker's.
  bool is_current() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void loop();

  std::string name_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Note [Workers and the calling thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// As in the Python reference, forward() runs the tasks of all partitions on one device on one
// thread — a lane of the executor (Note [forward() on the executor] in internal/executor.h) — in
// schedule order: a device's work is issued in order, and several devices' work is issued at the
// same time. Unlike the reference, the calling thread is itself the first lane: it would otherwise
// only wait. With one thread per device and a single device (everything on cuda:0, one CPU
// partition, or CPU partitions that draw random numbers) no thread is started and no task crosses
// threads, which is what keeps gpipe's cost per task low.
// When the engine gives every partition a lane of its own (Note [Threads of forward()]), the first
// runs on the caller and partitions on one device run concurrently. A WorkerPool holds those
// threads; stage-local backward (Note [Stage-local backward in one process] in
// internal/stage_backward.h) runs each partition's backward on its partition's. step()'s lanes
// are its schedule's ranks, on threads of their own.
//
// Note [Threads of forward()]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Whether forward() runs each partition on a thread of its own is the engine's decision, made once
// when the GPipe is built (GPipe::partitions_on_own_threads()). A thread per partition where two
// or more partitions are all on the CPU and none holds a layer that draws random numbers (a
// dropout, RReLU; Note [Random numbers in concurrent partitions] in internal/partition.h): there
// one CPU's partitions compute at the same time, each with its share of the cores (Note [Dividing
// the cores]), and no result depends on which thread ran first. Elsewhere a thread per device, as
// in the reference: a GPU's work is issued in order by one thread, and CPU partitions that draw
// random numbers draw them in one order, the same in every run with the same seed and the same
// in a checkpoint's recomputation. Stage-local backward needs a thread per partition and so
// takes one. A test-only override lives in internal/partition_threads.h (GPipeOptions'
// deprecated worker_per_partition sets it for one more release).

/// Sets how many threads each CPU operator may use: LibTorch's intra-op threads and, where
/// LibTorch's CPU kernels call OpenBLAS, OpenBLAS's own thread pool (which LibTorch 1.13 leaves at
/// one thread per core, so that two pipeline workers each running a matrix product start twice
/// as many BLAS threads as there are cores, and spin against each other). With
/// CPU partitions on threads of their own (Note [Threads of forward()]), cores / partitions is the
/// usual choice; the engine divides the cores itself unless this was called (Note [Dividing the
/// cores]).
///
///   gpipe::set_intra_op_threads(std::thread::hardware_concurrency() / partitions);
void set_intra_op_threads(int threads);

// Note [Dividing the cores]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch starts every CPU operator with one thread per physical core, and OpenBLAS, which
// Debian's LibTorch calls for matrix products, with one per logical CPU, process-wide. A step whose
// CPU partitions run on several threads at once (GPipe::step's lanes, forward()'s CPU partitions
// on threads of their own, a PipelineStage's partitions, stage-local backwards) would then start
// lanes × cores threads, which spin against each other: measured on two vCPUs, two lanes of
// Linear layers trained at 0.29x the plain model's speed. So the executor
// divides the cores for the step: each CPU lane's intra-op threads become cores / CPU lanes (at
// least one; set on the lane's thread, which is where OpenMP keeps the count) and OpenBLAS's
// threads CPUs / CPU lanes; both are put back when the step ends (process-wide: by the last of
// the steps running at once).
//
// A lane whose partitions are all on GPUs computes little on the host, but must issue its
// kernels and copies the moment their inputs are ready; so each such lane keeps one CPU: the CPU
// lanes share the CPUs of the process's affinity mask less one per GPU lane (their intra-op
// threads never more than LibTorch's count), divided also for a single CPU lane beside a GPU's.
// Why: on an H100 machine with 16 cores (benchmarks/copy_overlap, 2026-11-28), the GPU partition
// of a {cpu, cuda:0} pipeline began its first forward on the host only after the CPU lane had
// sent all eight micro-batches, so hardly any copy overlapped computation, except where the CPU
// lane blocked in the driver on copies from pageable memory (up to 38%). A CPU lane with a full
// team of OpenMP threads, which spin between parallel regions, leaves no core free to wake the
// GPU's lane on; that this is the cause is read from the timeline and is yet to be measured on a
// GPU (copy_overlap --cores=engine,libtorch prints each lane's lag both ways).
//
// A user's own choice wins: nothing is divided once set_intra_op_threads was called (its count is
// set on every CPU lane's thread instead: OpenMP keeps a count per thread, and a worker started
// earlier would not see it), when LibTorch's intra-op threads differ from its default, or when
// OMP_NUM_THREADS (or, for OpenBLAS, OPENBLAS_NUM_THREADS) is set. A lane's count is set and put back for its thread alone
// (omp_set_num_threads), not process-wide. Not divided: OpenBLAS's threads that are already
// spinning. Debian's OpenBLAS (the pthread build) keeps its threads spinning for about 0.1 s after
// a product that used them, so a step that starts right after a product of the user's own with
// OpenBLAS's full count shares the cores with them until they sleep: up to twice the step's time,
// measured on two vCPUs (benchmarks/default_threads, Note [Rounds against a noisy machine]).
// OPENBLAS_THREAD_TIMEOUT=4, set before the program starts, shortens the spin to nothing.

namespace internal {

/// The cores divided among `cpu_lanes` CPU lanes for a step's lifetime, less one for each of
/// `gpu_lanes` lanes that only issue a GPU's work (Note [Dividing the cores]); nothing is divided
/// with one CPU lane alone, none, or where the user chose thread counts (but
/// set_intra_op_threads's count reaches every CPU lane, and stays there).
class CoreShare {
 public:
  explicit CoreShare(int64_t cpu_lanes, int64_t gpu_lanes = 0);
  ~CoreShare();
  CoreShare(const CoreShare&) = delete;
  CoreShare& operator=(const CoreShare&) = delete;

  /// Sets the calling thread's intra-op threads to its share while alive (a CPU lane's thread).
  class Lane {
   public:
    explicit Lane(const CoreShare& share);
    ~Lane();
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;

   private:
    int before_ = 0;  // 0: unchanged
  };

  /// The intra-op threads of each CPU lane; 0 when the engine leaves them alone.
  int lane_threads() const { return lane_threads_; }
  /// Whether a lane keeps its count after the step (the user's set_intra_op_threads).
  bool keeps() const { return keep_; }

 private:
  int lane_threads_ = 0;
  bool keep_ = false;
  bool blas_ = false;  // whether this share holds OpenBLAS's count
};

/// For tests and benchmarks: whether the executor divides the cores (Note [Dividing the cores];
/// default true); false leaves every thread count as LibTorch and OpenBLAS have it, and forgets
/// that set_intra_op_threads was called. Not for use while steps run.
void set_core_share(bool enabled);
/// Fault injection for tests: `hook` (or nothing, when empty) runs at the start of every
/// Worker::submit, before the task is queued; a hook that throws stands for a submit that fails
/// (out of memory). Not for concurrent use with running pipelines.
void set_submit_hook(std::function<void()> hook);
/// For tests: how many Worker threads are running (counted from the start of a worker's loop to
/// its end; a Worker's destructor returns after its thread's end). Threads that a worker starts
/// (OpenMP's, which take its name) are not counted.
int running_worker_threads();
}  // namespace internal

/// The workers of a pipeline (see Note [Workers and the calling thread]).
///
///   gpipe::WorkerPool pool({torch::kCPU, torch::kCUDA}, /*worker_per_partition=*/false);
///   if (!pool.runs_inline(1)) pool.for_partition(1).submit(task);
class WorkerPool {
 public:
  /// Plans the workers for partitions on `devices` (in order) and starts their threads.
  WorkerPool(const std::vector<c10::Device>& devices, bool worker_per_partition);

  /// Whether partition `partition`'s tasks run on the calling thread.
  bool runs_inline(size_t partition) const { return worker_of_partition_[partition] < 0; }

  /// The worker thread that runs partition `partition` (which must not run inline).
  Worker& for_partition(size_t partition) { return *workers_[worker_of_partition_[partition]]; }

  /// The number of threads started.
  size_t size() const { return workers_.size(); }

  /// A pool shared by its owners (a GPipe; a stage-local backward while it hands a job to a
  /// worker) whose last owner may let go of it on one of its own threads (a GPipe destroyed
  /// during its backward): it is then destroyed on a new thread, since a worker cannot join
  /// itself.
  static std::shared_ptr<WorkerPool> make_shared(const std::vector<c10::Device>& devices,
                                                 bool worker_per_partition);

 private:
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<int64_t> worker_of_partition_;  // -1: the calling thread
};

}  // namespace gpipe
