// Thread state: the caller's thread-local settings (grad mode, inference mode, autocast and its
// dtypes, dispatch keys, saved-tensor hooks, profiler callbacks, ...), carried to the worker threads
// that run the caller's layers and to the backward-time recomputation.
#pragma once

#include <ATen/ThreadLocalState.h>
#include <c10/core/ScalarType.h>

namespace gpipe {

// Note [Thread-local state in workers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch keeps many settings per thread. A layer run by a worker thread must see the settings of
// the thread that called GPipe::forward, or it would compute something else: under autocast a
// Linear would run in float32 instead of bfloat16, under InferenceMode it would record autograd
// history. The Python reference passes only grad mode to its workers and loses autocast. gpipe
// captures the whole at::ThreadLocalState plus the autocast dtypes (plain thread-locals outside
// ThreadLocalState) once per forward and installs them around every task.

/// A snapshot of the calling thread's thread-local state.
///
///   gpipe::ThreadState state;  // on the caller
///   // later, on a worker thread:
///   gpipe::ThreadStateGuard guard(state);
class ThreadState {
 public:
  ThreadState();

 private:
  friend class ThreadStateGuard;
  at::ThreadLocalState tls_;
  c10::ScalarType autocast_cpu_dtype_;
  c10::ScalarType autocast_gpu_dtype_;
};

/// Installs a ThreadState on the current thread for its lifetime, then restores the previous one.
class ThreadStateGuard {
 public:
  explicit ThreadStateGuard(const ThreadState& state);
  ~ThreadStateGuard();
  ThreadStateGuard(const ThreadStateGuard&) = delete;
  ThreadStateGuard& operator=(const ThreadStateGuard&) = delete;

 private:
  at::ThreadLocalStateGuard tls_guard_;
  c10::ScalarType previous_cpu_dtype_;
  c10::ScalarType previous_gpu_dtype_;
};

}  // namespace gpipe
