// Thread state; see Note [Thread-local state in workers] in thread_state.h.
#include "gpipe/thread_state.h"

#include <ATen/autocast_mode.h>
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

}  // namespace

ThreadState::ThreadState()
    : autocast_cpu_dtype_(cpu_dtype()),
      autocast_gpu_dtype_(gpu_dtype()),
      autocast_cache_enabled_(at::autocast::is_autocast_cache_enabled()) {}

ThreadStateGuard::Previous::Previous()
    : cpu_dtype(gpipe::cpu_dtype()),
      gpu_dtype(gpipe::gpu_dtype()),
      cache_enabled(at::autocast::is_autocast_cache_enabled()) {}

ThreadStateGuard::ThreadStateGuard(const ThreadState& state) : tls_guard_(state.tls_) {
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
