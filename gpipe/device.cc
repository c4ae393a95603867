// Which devices this process can use; see device.h.
#include "gpipe/device.h"

#include <c10/core/DeviceType.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace gpipe {

int64_t cuda_device_count() {
  // LibTorch's CUDA library registers its device guard when it is loaded: without one, this is a
  // CPU-only LibTorch (or its CUDA library was dropped at link time).
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return 0;
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount();
}

void check_device_available(const c10::Device& device, const std::string& who) {
  if (device.is_cpu()) return;
  if (device.is_cuda()) {
    TORCH_CHECK(c10::impl::hasDeviceGuardImpl(c10::kCUDA), who, " is on ", device,
                ", but this LibTorch was built without CUDA (CPU only); use the CPU, or build gpipe "
                "against a CUDA LibTorch (docs/building.md)");
    const int64_t count = cuda_device_count();
    TORCH_CHECK(count > 0, who, " is on ", device, ", but no CUDA device is visible to this "
                "process (no GPU or no driver, or CUDA_VISIBLE_DEVICES hides them); use the CPU");
    TORCH_CHECK(!device.has_index() || device.index() < count, who, " is on ", device,
                ", but this machine has ", count, " CUDA device", count == 1 ? "" : "s",
                " (cuda:0", count == 1 ? "" : " to cuda:" + std::to_string(count - 1), ")");
    return;
  }
  TORCH_CHECK(c10::impl::hasDeviceGuardImpl(device.type()), who, " is on ", device,
              ", but this LibTorch has no ", c10::DeviceTypeName(device.type(), true),
              " backend; use the CPU or a CUDA device");
}

}  // namespace gpipe
