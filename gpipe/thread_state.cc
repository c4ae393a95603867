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
#else
c10::ScalarType cpu_dtype() { return at::autocast::get_autocast_cpu_dtype(); }
c10::ScalarType gpu_dtype() { return at::autocast::get_autocast_gpu_dtype(); }
void set_cpu_dtype(c10::ScalarType t) { at::autocast::set_autocast_cpu_dtype(t); }
void set_gpu_dtype(c10::ScalarType t) { at::autocast::set_autocast_gpu_dtype(t); }
#endif

}  // namespace

ThreadState::ThreadState() : autocast_cpu_dtype_(cpu_dtype()), autocast_gpu_dtype_(gpu_dtype()) {}

ThreadStateGuard::ThreadStateGuard(const ThreadState& state)
    : tls_guard_(state.tls_), previous_cpu_dtype_(cpu_dtype()), previous_gpu_dtype_(gpu_dtype()) {
  set_cpu_dtype(state.autocast_cpu_dtype_);
  set_gpu_dtype(state.autocast_gpu_dtype_);
}

ThreadStateGuard::~ThreadStateGuard() {
  set_cpu_dtype(previous_cpu_dtype_);
  set_gpu_dtype(previous_gpu_dtype_);
}

}  // namespace gpipe
