// Thread state; see Note [Thread-local state in workers] in thread_state.h.
#include "gpipe/thread_state.h"

#include <array>
#include <vector>

#include <ATen/FuncTorchTLS.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PythonDispatcherTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>

namespace gpipe {
namespace {

// The autocast dtype accessors were renamed in PyTorch 2.4.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
c10::ScalarType cpu_dtype() { return at::autocast::get_autocast_dtype(at::kCPU); }
c10::ScalarType gpu_dtype() { return at::autocast::get_autocast_dtype(at::kCUDA); }
void set_cpu_dtype(c10::ScalarType t) { at::autocast::set_autocast_dtype(at::kCPU, t); }
void set_gpu_dtype(c10::ScalarType t) { at::autocast::set_autocast_dtype(at::kCUDA, t); }
bool autocast_on() {
  return at::autocast::is_autocast_enabled(at::kCPU) || at::autocast::is_autocast_enabled(at::kCUDA);
}
#else
c10::ScalarType cpu_dtype() { return at::autocast::get_autocast_cpu_dtype(); }
c10::ScalarType gpu_dtype() { return at::autocast::get_autocast_gpu_dtype(); }
void set_cpu_dtype(c10::ScalarType t) { at::autocast::set_autocast_cpu_dtype(t); }
void set_gpu_dtype(c10::ScalarType t) { at::autocast::set_autocast_gpu_dtype(t); }
bool autocast_on() { return at::autocast::is_cpu_enabled() || at::autocast::is_enabled(); }
#endif

// The versions whose at::ThreadLocalState the reading covers, field by field (Note [Installing a
// state that is already there]).
#if (TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR == 13) || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 6)
#define GPIPE_READS_THREAD_STATE 1
#endif

#ifdef GPIPE_READS_THREAD_STATE
// Whether the states only Python sets are all off on this thread: its dispatch and function
// modes, its dispatcher, saved-tensor hooks, and functorch's transforms.
bool python_states_are_off() {
  const auto& hooks = at::SavedTensorDefaultHooks::get_tls_state();
#if TORCH_VERSION_MAJOR >= 2
  const bool modes_off = !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
                         at::impl::PythonTorchFunctionTLS::stack_len() == 0 &&
                         at::impl::PythonTorchFunctionTLS::get_disabled_state() ==
                             at::impl::TorchFunctionDisabledState::ENABLED;
#else
  const bool modes_off = c10::impl::TorchDispatchModeTLS::stack_len() == 0 &&
                         !c10::impl::TorchDispatchModeTLS::get_mode() &&
                         at::impl::PythonTorchFunctionTLS::stack_len() == 0 &&
                         !at::impl::PythonTorchFunctionTLS::get_mode() &&
                         !at::impl::PythonTorchFunctionTLS::is_disabled();
#endif
#if TORCH_VERSION_MAJOR >= 2
  const bool hooks_off = hooks.stack.empty() && !hooks.disabled_error_message && !hooks.is_tracing;
#else
  const bool hooks_off = hooks.stack.empty() && !hooks.disabled_error_message;
#endif
  return modes_off && hooks_off && c10::impl::PythonDispatcherTLS::get_state() == nullptr &&
         at::functorch::getCopyOfFuncTorchTLS() == nullptr;
}
#endif

}  // namespace

#ifdef GPIPE_READS_THREAD_STATE

// What the C++ API can read and set of a thread's at::ThreadLocalState, field by field (Note
// [Installing a state that is already there]).
struct ThreadState::Reading {
  // Read off the calling thread.
  Reading()
      : keys(c10::impl::tls_local_dispatch_key_set()),
        autograd(c10::AutogradState::get_tls_state()),
        debug_info(c10::ThreadLocalDebugInfo::current()),
        record_function_enabled(at::get_record_function_tls_().tls_record_function_enabled_),
        python_states_off(python_states_are_off()) {
#if TORCH_VERSION_MAJOR >= 2
    reapply_views = at::functionalization::impl::getFunctionalizationReapplyViewsTLS();
    for (size_t k = 0; k < autocast_dtypes.size(); ++k) {
      autocast_dtypes[k] = at::autocast::get_autocast_dtype(static_cast<c10::DeviceType>(k));
    }
#endif
    for (const auto& entry : at::get_record_function_tls_().sorted_tls_callbacks_) {
      callbacks.emplace_back(entry.handle_, entry.enabled_);
    }
  }

  // The calling thread's reading; null where this LibTorch's state cannot be read completely.
  static std::shared_ptr<const Reading> of_this_thread() { return std::make_shared<const Reading>(); }

  // Whether `now` has this reading's record-function callbacks, with Python's states off in
  // both: what install() does not set.
  bool installs_over(const Reading& now) const {
    return python_states_off && now.python_states_off && callbacks == now.callbacks &&
           record_function_enabled == now.record_function_enabled;
  }

  // Sets the fields that are cheap to set, as at::ThreadLocalState::setThreadLocalState does.
  void install() const {
    c10::impl::_force_tls_local_dispatch_key_set(keys);
    c10::AutogradState::set_tls_state(autograd);
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(debug_info);
#if TORCH_VERSION_MAJOR >= 2
    at::functionalization::impl::setFunctionalizationReapplyViewsTLS(reapply_views);
    for (size_t k = 0; k < autocast_dtypes.size(); ++k) {
      at::autocast::set_autocast_dtype(static_cast<c10::DeviceType>(k), autocast_dtypes[k]);
    }
#endif
  }

  // Set by install(): the dispatch keys in and out (which carry autocast, names, inference mode
  // and the below-autograd guards), grad, inference and forward-grad mode, the debug info; on
  // LibTorch 2 also functionalization's reapplied views and autocast's dtype for every kind of
  // device.
  c10::impl::LocalDispatchKeySet keys;
  c10::AutogradState autograd;
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
#if TORCH_VERSION_MAJOR >= 2
  bool reapply_views = false;
  std::array<c10::ScalarType, c10::COMPILE_TIME_MAX_DEVICE_TYPES> autocast_dtypes{};
#endif
  // Compared: the record-function callbacks (handle, enabled) and whether record functions are
  // on, which only a whole install sets, and whether the states only Python sets are off.
  std::vector<std::pair<at::CallbackHandle, bool>> callbacks;
  bool record_function_enabled;
  bool python_states_off;
};
#else
// Another LibTorch: nothing is read, and every guard installs the whole state.
struct ThreadState::Reading {
  static std::shared_ptr<const Reading> of_this_thread() { return nullptr; }
  bool installs_over(const Reading&) const { return false; }
  void install() const {}
};
#endif

ThreadState::ThreadState()
    : reading_(Reading::of_this_thread()),
      autocast_cpu_dtype_(cpu_dtype()),
      autocast_gpu_dtype_(gpu_dtype()),
      autocast_cache_enabled_(at::autocast::is_autocast_cache_enabled()) {}

ThreadStateGuard::Previous::Previous()
    : cpu_dtype(gpipe::cpu_dtype()),
      gpu_dtype(gpipe::gpu_dtype()),
      cache_enabled(at::autocast::is_autocast_cache_enabled()) {}

ThreadStateGuard::ThreadStateGuard(const ThreadState& state) {
  std::shared_ptr<const ThreadState::Reading> now =
      state.reading_ ? ThreadState::Reading::of_this_thread() : nullptr;
  if (now && state.reading_->installs_over(*now)) {
    state.reading_->install();
    previous_reading_ = std::move(now);
  } else {
    tls_guard_.emplace(state.tls_);
  }
  set_cpu_dtype(state.autocast_cpu_dtype_);
  set_gpu_dtype(state.autocast_gpu_dtype_);
  at::autocast::set_autocast_cache_enabled(state.autocast_cache_enabled_);
  if (autocast_on()) {
    at::autocast::increment_nesting();
    region_ = true;
  }
}

ThreadStateGuard::~ThreadStateGuard() {
  if (region_ && at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  set_cpu_dtype(previous_.cpu_dtype);
  set_gpu_dtype(previous_.gpu_dtype);
  at::autocast::set_autocast_cache_enabled(previous_.cache_enabled);
  if (previous_reading_) previous_reading_->install();
}

AutocastCacheOff::AutocastCacheOff() : previous_(at::autocast::is_autocast_cache_enabled()) {
  at::autocast::set_autocast_cache_enabled(false);
}

AutocastCacheOff::~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(previous_); }

Autocast::Autocast(c10::DeviceType device_type, c10::ScalarType dtype)
    : device_type_(device_type) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  previous_enabled_ = at::autocast::is_autocast_enabled(device_type);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_type);
  at::autocast::set_autocast_enabled(device_type, true);
  at::autocast::set_autocast_dtype(device_type, dtype);
#else
  if (device_type == c10::kCPU) {
    previous_enabled_ = at::autocast::is_cpu_enabled();
    previous_dtype_ = at::autocast::get_autocast_cpu_dtype();
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    previous_enabled_ = at::autocast::is_enabled();
    previous_dtype_ = at::autocast::get_autocast_gpu_dtype();
    at::autocast::set_enabled(true);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
  at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
#else
  if (device_type_ == c10::kCPU) {
    at::autocast::set_cpu_enabled(previous_enabled_);
    at::autocast::set_autocast_cpu_dtype(previous_dtype_);
  } else {
    at::autocast::set_enabled(previous_enabled_);
    at::autocast::set_autocast_gpu_dtype(previous_dtype_);
  }
#endif
}

}  // namespace gpipe
