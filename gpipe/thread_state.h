// Thread state: the caller's thread-local settings (grad mode, inference mode, autocast and its
// dtypes, dispatch keys, saved-tensor hooks, profiler callbacks, ...), carried to the worker threads
// that run the caller's layers and to the backward-time recomputation.
#pragma once

#include <memory>
#include <optional>

#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace gpipe {

// Note [Thread-local state in workers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch keeps many settings per thread. A layer run by a worker thread must see the settings of
// the thread that called GPipe::forward, or it would compute something else: under autocast a
// Linear would run in float32 instead of bfloat16, under InferenceMode it would record autograd
// history. The Python reference passes only grad mode to its workers and loses autocast. gpipe
// captures the whole at::ThreadLocalState plus the autocast settings that live in plain
// thread-locals outside it (the dtypes and whether casts are cached) once per forward, and
// installs them around every task.
//
// Note [Autocast regions in workers and recomputation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Autocast caches the low-precision copy of each weight it casts, in a thread-local cache that is
// cleared when the outermost autocast region of the thread ends (torch.autocast's exit,
// at::autocast::decrement_nesting() reaching 0). A worker thread or a backward-time recomputation
// runs under the caller's autocast, but no region of the caller ever ends on that thread: its cache
// would keep the casts of the weights from before the optimizer's update, and every later step
// would compute with stale weights. So ThreadStateGuard opens a region of its own when the state
// it installs has autocast on (increment_nesting), and closes it when it ends: the cache is
// cleared when the thread's outermost region closes, as torch.utils.checkpoint does around its
// recomputation. The caller's cache-enabled flag is carried along. A checkpointed micro-batch's
// first forward runs without grad; a cast cached there would have no autograd history and, reused
// by a later micro-batch with grad in the same region, would cut the weights off their gradients.
// That forward therefore runs with the cast cache off (AutocastCacheOff).
//
// Note [Installing a state that is already there]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Installing an at::ThreadLocalState and putting the previous one back costs about 5,000
// instructions, nearly all of it LibTorch rebuilding its record-function callbacks for every
// scope, each time: a tenth of what checkpointing adds to a micro-batch. The callbacks seldom
// differ: a recomputation usually runs in the caller's backward, on the caller's thread, with the
// callbacks its forward had (the dispatch keys and grad mode do differ there: the autograd engine
// runs without grad and without names). So a ThreadState also keeps a reading of the state it
// took (ThreadState::Reading), and ThreadStateGuard reads the current thread: where the two have
// the same record-function callbacks (and record functions are on in both or off in both) and the
// states only Python sets (its dispatch and function modes, dispatcher, saved-tensor hooks,
// functorch's transforms) are off in both, the guard sets the rest itself, as
// at::ThreadLocalState does (the dispatch keys included and excluded, which carry autocast, names,
// inference mode and the below-autograd guards; grad, inference and forward-grad mode; the debug
// info; on LibTorch 2 also functionalization's reapplied views and autocast's dtype per kind of
// device), and puts the thread's own back after; elsewhere it installs the whole state. (LibTorch
// 2's thread-local Python objects cannot be read from C++; they hold Python objects, which only
// Python makes.) The reading was written from LibTorch 1.13's and
// 2.6's at::ThreadLocalState, whose fields it covers; on any other version it reads nothing, and
// the guard always installs the whole state.

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
  // What can be read of a thread's at::ThreadLocalState (Note [Installing a state that is
  // already there]); defined in thread_state.cc.
  struct Reading;
  at::ThreadLocalState tls_;
  // Of tls_, when it was taken; null where this LibTorch's state cannot be read completely.
  std::shared_ptr<const Reading> reading_;
  c10::ScalarType autocast_cpu_dtype_;
  c10::ScalarType autocast_gpu_dtype_;
  bool autocast_cache_enabled_;
};

/// Installs a ThreadState on the current thread for its lifetime, then restores the previous one.
/// Opens and closes an autocast region when the state has autocast on (see Note [Autocast regions
/// in workers and recomputation]). Where the thread's record-function callbacks already are the
/// ThreadState's, sets the rest of the state alone, at a tenth of the cost (Note [Installing a
/// state that is already there]).
class ThreadStateGuard {
 public:
  explicit ThreadStateGuard(const ThreadState& state);
  ~ThreadStateGuard();
  ThreadStateGuard(const ThreadStateGuard&) = delete;
  ThreadStateGuard& operator=(const ThreadStateGuard&) = delete;

  /// Whether the guard installed the whole state, rather than finding the record-function
  /// callbacks in place and setting the rest alone.
  bool installed() const { return tls_guard_.has_value(); }

 private:
  // Read before the new state is installed, restored after it is removed.
  struct Previous {
    Previous();
    c10::ScalarType cpu_dtype;
    c10::ScalarType gpu_dtype;
    bool cache_enabled;
  };
  Previous previous_;
  std::optional<at::ThreadLocalStateGuard> tls_guard_;
  // Where tls_guard_ is empty: what the guard set of the thread's state, as it was before.
  std::shared_ptr<const ThreadState::Reading> previous_reading_;
  bool region_ = false;
};

/// Turns autocast's weight-cast cache off for a scope (see Note [Autocast regions in workers and
/// recomputation]).
class AutocastCacheOff {
 public:
  AutocastCacheOff();
  ~AutocastCacheOff();
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool previous_;
};

/// An autocast region, as Python's `torch.autocast(device_type, dtype)` opens one (LibTorch's C++
/// API has none): autocast on for `device_type` (kCPU or kCUDA) with `dtype`, one level of
/// nesting, and the weight-cast cache cleared when the outermost region ends, so that the next
/// region casts the weights as the optimizer left them.
///
///   {
///     gpipe::Autocast autocast(torch::kCPU, torch::kBFloat16);
///     loss = criterion(model->forward(x), y);
///   }
///   loss.backward();
class Autocast {
 public:
  /// Turns autocast on for `device_type` with `dtype` until the destructor, which restores the
  /// previous setting.
  explicit Autocast(c10::DeviceType device_type = c10::kCPU,
                    c10::ScalarType dtype = c10::kBFloat16);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
};

}  // namespace gpipe
