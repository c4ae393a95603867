// Streams; see stream.h. CUDA specifics are compiled only against a CUDA-enabled LibTorch
// (GPIPE_WITH_CUDA); elsewhere CUDA devices are refused with a clear error.
#include "gpipe/stream.h"

#include <c10/util/Exception.h>

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>

#ifdef GPIPE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gpipe {
namespace {

[[noreturn]] void no_cuda(const c10::Device& device) {
  TORCH_CHECK(false, "gpipe was built without CUDA, so it cannot use device ", device,
              "; build against a CUDA-enabled LibTorch (see docs/building.md)");
}

c10::Stream cpu_stream(const c10::Device& device) {
  return c10::Stream(c10::Stream::DEFAULT, c10::Device(device.type(), device.index()));
}

}  // namespace

bool built_with_cuda() {
#ifdef GPIPE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

c10::Stream current_stream(c10::Device device) {
  if (!device.is_cuda()) {
    return cpu_stream(device);
  }
#ifdef GPIPE_WITH_CUDA
  return c10::cuda::getCurrentCUDAStream(device.has_index() ? device.index() : -1);
#else
  no_cuda(device);
#endif
}

c10::Stream new_stream(c10::Device device) {
  if (!device.is_cuda()) {
    return cpu_stream(device);
  }
#ifdef GPIPE_WITH_CUDA
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/false,
                                      device.has_index() ? device.index() : -1);
#else
  no_cuda(device);
#endif
}

void wait_stream(const c10::Stream& waiting, const c10::Stream& source) {
  if (waiting == source || !has_streams(waiting.device()) || !has_streams(source.device())) {
    return;
  }
#ifdef GPIPE_WITH_CUDA
  at::cuda::CUDAEvent event;
  event.record(c10::cuda::CUDAStream(source));
  event.block(c10::cuda::CUDAStream(waiting));
#endif
}

void record_stream(const at::Tensor& tensor, const c10::Stream& stream) {
  if (!tensor.defined() || !has_streams(stream.device()) || !tensor.is_cuda()) {
    return;
  }
#ifdef GPIPE_WITH_CUDA
  // Record the storage's base pointer, not the tensor's: a view with a storage offset would
  // otherwise protect only part of the block (the reference's workaround for PyTorch issue 27366).
  const c10::Storage& storage = tensor.storage();
  if (storage.data_ptr().get() != nullptr) {
    c10::cuda::CUDACachingAllocator::recordStream(storage.data_ptr(),
                                                  c10::cuda::CUDAStream(stream));
  }
#endif
}

void synchronize(c10::Device device) {
  if (!device.is_cuda()) {
    return;
  }
#ifdef GPIPE_WITH_CUDA
  c10::cuda::CUDAStream(current_stream(device)).synchronize();
  c10::cuda::device_synchronize();
#else
  no_cuda(device);
#endif
}

int64_t memory_allocated(c10::Device device) {
  if (!device.is_cuda()) {
    return -1;
  }
#ifdef GPIPE_WITH_CUDA
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  // Entry 0 of the statistics arrays is the aggregate over all pools (StatType::AGGREGATE), in
  // every LibTorch version; the enum itself moved between namespaces in 2.x.
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current;
#else
  no_cuda(device);
#endif
}

RngState get_rng_state(c10::Device device) {
  RngState state;
  state.device = device;
  if (!device.is_cuda()) {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    state.cpu = cpu.get_state();
    return state;
  }
#ifdef GPIPE_WITH_CUDA
  at::Generator gen =
      at::cuda::detail::getDefaultCUDAGenerator(device.has_index() ? device.index() : -1);
  std::lock_guard<std::mutex> lock(gen.mutex());
  state.cuda = gen.get_state();
#else
  no_cuda(device);
#endif
  return state;
}

void set_rng_state(const RngState& state) {
  if (state.cpu.defined()) {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(state.cpu);
  }
  if (state.cuda.defined()) {
#ifdef GPIPE_WITH_CUDA
    at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(
        state.device.has_index() ? state.device.index() : -1);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.cuda);
#endif
  }
}

}  // namespace gpipe
