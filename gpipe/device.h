// Which devices this process can use: a device that this LibTorch or this machine does not have is
// refused before anything is copied to it, naming the device and what is available.
#pragma once

#include <string>

#include <c10/core/Device.h>

namespace gpipe {

/// Throws c10::Error, starting with `who`, when `device` cannot be used here: a CUDA device in a
/// LibTorch built without CUDA, with no GPU visible (no driver, CUDA_VISIBLE_DEVICES empty), or
/// with an index past the last GPU; another kind of device this LibTorch has no backend for. The
/// error says what is available. CPU devices always pass.
///
///   gpipe::check_device_available(c10::Device("cuda:3"), "GPipe: partition 1");
///   // GPipe: partition 1 is on cuda:3, but this machine has 2 CUDA devices (cuda:0 to cuda:1)
void check_device_available(const c10::Device& device, const std::string& who);

/// The CUDA devices this process sees (0 in a CPU-only LibTorch).
int64_t cuda_device_count();

}  // namespace gpipe
