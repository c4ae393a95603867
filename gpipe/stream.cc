// Streams; see stream.h. CUDA specifics are compiled only against a CUDA-enabled LibTorch
// (GPIPE_WITH_CUDA); elsewhere CUDA devices are refused with a clear error.
#include "gpipe/internal/stream.h"

#include <c10/core/Event.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#ifdef GPIPE_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gpipe {
namespace internal {
namespace {

#ifndef GPIPE_WITH_CUDA
[[noreturn]] void no_cuda(const c10::Device& device) {
  TORCH_CHECK(false, "gpipe was built without CUDA, so it cannot use device ", device,
              "; build against a CUDA-enabled LibTorch (see docs/building.md)");
}
#endif

c10::Stream cpu_stream(const c10::Device& device) {
  return c10::Stream(c10::Stream::DEFAULT, c10::Device(device.type(), device.index()));
}

#ifdef GPIPE_WITH_CUDA
// The device index LibTorch's CUDA functions take for `device`: -1, which they read as the
// calling thread's current device, when `device` names none (plain "cuda").
c10::DeviceIndex cuda_index(const c10::Device& device) {
  return device.has_index() ? device.index() : static_cast<c10::DeviceIndex>(-1);
}

// The index of `device`, the calling thread's current device for a plain "cuda": for the
// functions that take no -1 (the allocator's statistics) and for a state kept across threads.
c10::DeviceIndex resolved_index(const c10::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}
#endif

// Note [Event pool]
// ~~~~~~~~~~~~~~~~~
// wait_stream records an event on the source stream and makes the waiting stream wait for it.
// Creating and destroying an event for every wait would cost more than the wait itself, so events
// are reused. That is safe as soon as the wait has been issued: the waiting stream waits for the
// event as it was recorded when the wait was issued (cudaStreamWaitEvent), and a later record
// makes a new version of the event that this wait does not see, even if the waiting stream has
// not reached its wait yet. An event belongs to the device of its first record, so free events are
// kept per device. A c10::Event is not thread-safe: worker threads and the autograd engine's
// device threads all call wait_stream, so each event is taken out of the pool under the lock and
// used by one thread only until it is given back. The pool holds as many events per device as
// waits were ever issued at the same time, and is never destroyed: events destroyed at exit could
// outlive the CUDA runtime. c10::Event goes through the device guard interface
// (c10::impl::VirtualGuardImpl), so no CUDA-specific header is needed here.
class EventPool {
 public:
  c10::Event take(const c10::Device& device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<c10::Event>& free = free_list(device);
      if (!free.empty()) {
        c10::Event event = std::move(free.back());
        free.pop_back();
        return event;
      }
    }
    return c10::Event(device.type());  // made on its first record
  }

  void give(const c10::Device& device, c10::Event event) {
    std::lock_guard<std::mutex> lock(mu_);
    free_list(device).push_back(std::move(event));
  }

 private:
  std::vector<c10::Event>& free_list(const c10::Device& device) {
    for (auto& entry : free_) {
      if (entry.first == device) {
        return entry.second;
      }
    }
    free_.emplace_back(device, std::vector<c10::Event>());
    return free_.back().second;
  }

  std::mutex mu_;
  // A few devices at most: a list is enough.
  std::vector<std::pair<c10::Device, std::vector<c10::Event>>> free_;
};

EventPool& event_pool() {
  static EventPool* pool = new EventPool();  // never destroyed (Note [Event pool])
  return *pool;
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
  return c10::cuda::getCurrentCUDAStream(cuda_index(device));
#else
  no_cuda(device);
#endif
}

// Note [Streams apart from NCCL's]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch hands out each device's pool streams round-robin, 32 of each priority, and c10d's NCCL
// group takes each communicator's stream from the same low-priority pool (unless its options ask
// for high priority). gpipe draws a stream for every copy stream, every transfer and every
// received micro-batch, dozens a step, so drawn from that pool some would be a communicator's
// stream: a send posted there would queue behind that communicator's pending receives (the
// gradients that a 1F1B stage posts ahead from the next stage), which can wait on the very send
// (the previous stage's next forward needs it): a deadlock across processes, or at best transfers
// serialised. gpipe's streams come from the high-priority pool instead, which NCCL's default
// groups never use; and no gpipe stream is made to wait on a remote transfer that is not yet
// needed (ActivationReceiver leaves the wait for each micro-batch's activations to the stream
// that computes with them). Within one process the priority changes little: it orders kernels,
// and the links' copies run on the copy engines either way.
c10::Stream new_stream(c10::Device device) {
  if (!device.is_cuda()) {
    return cpu_stream(device);
  }
#ifdef GPIPE_WITH_CUDA
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/true, cuda_index(device));
#else
  no_cuda(device);
#endif
}

void wait_stream(const c10::Stream& waiting, const c10::Stream& source) {
  if (waiting == source || !has_streams(waiting.device()) || !has_streams(source.device())) {
    return;
  }
  // Streams always carry their device's index, so the event's device is fully named.
  const c10::Device device = source.device();
  EventPool& pool = event_pool();
  c10::Event event = pool.take(device);
  event.record(source);
  event.block(waiting);
  pool.give(device, std::move(event));  // reusable at once (Note [Event pool])
}

void wait_for_tensors_made_here(const c10::Stream& waiting,
                                const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda() && t.device() == waiting.device()) {
      wait_stream(waiting, current_stream(waiting.device()));
      return;
    }
  }
}

#ifdef GPIPE_WITH_CUDA
// A CUDA event without timing, made on its stream's device. The host waits for it too
// (synchronize_point), which c10::Event does not offer in every LibTorch gpipe builds with, so
// these are CUDA events of their own, kept in a free list like the event pool's (Note [Event
// pool]: a point goes back once its waits are issued, or its host wait is over).
struct StreamPoint {
  c10::DeviceIndex device;
  cudaEvent_t event = nullptr;
};

namespace {

std::mutex& free_points_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::vector<StreamPoint>& free_points() {
  static auto* points = new std::vector<StreamPoint>();  // never destroyed (Note [Event pool])
  return *points;
}

StreamPoint take_point(c10::DeviceIndex device) {
  {
    std::lock_guard<std::mutex> lock(free_points_mu());
    std::vector<StreamPoint>& points = free_points();
    for (size_t k = 0; k < points.size(); ++k) {
      if (points[k].device == device) {
        StreamPoint point = points[k];
        points[k] = points.back();
        points.pop_back();
        return point;
      }
    }
  }
  StreamPoint point{device};
  const c10::cuda::CUDAGuard guard(device);
  // A host that waits for a point sleeps instead of spinning: the CPU lanes beside it need the
  // cores (Note [Dividing the cores] in worker.h).
  C10_CUDA_CHECK(
      cudaEventCreateWithFlags(&point.event, cudaEventDisableTiming | cudaEventBlockingSync));
  return point;
}

}  // namespace
#else
struct StreamPoint {};
#endif

std::shared_ptr<const StreamPoint> record_point(const c10::Stream& stream) {
  if (!has_streams(stream.device())) {
    return nullptr;
  }
#ifdef GPIPE_WITH_CUDA
  auto* point = new StreamPoint(take_point(stream.device_index()));
  std::shared_ptr<const StreamPoint> held(point, [](const StreamPoint* p) {
    std::lock_guard<std::mutex> lock(free_points_mu());
    free_points().push_back(*p);
    delete p;
  });
  const c10::cuda::CUDAGuard guard(point->device);
  C10_CUDA_CHECK(cudaEventRecord(point->event, c10::cuda::CUDAStream(stream).stream()));
  return held;
#else
  no_cuda(stream.device());
#endif
}

void wait_point(const c10::Stream& waiting, const StreamPoint& point) {
  if (!has_streams(waiting.device())) {
    return;
  }
#ifdef GPIPE_WITH_CUDA
  const c10::cuda::CUDAGuard guard(waiting.device_index());
  C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::CUDAStream(waiting).stream(), point.event, 0));
#else
  (void)point;
  no_cuda(waiting.device());
#endif
}

void synchronize_point(const StreamPoint& point) {
#ifdef GPIPE_WITH_CUDA
  const c10::cuda::CUDAGuard guard(point.device);
  C10_CUDA_CHECK(cudaEventSynchronize(point.event));
#else
  (void)point;
  TORCH_CHECK(false, "gpipe: stream points exist only in a CUDA build");
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
  // That device only: the guard makes it current for the call (a device without an index stays
  // the current one) and puts the previous one back, so no other device is touched or gets a
  // context. cudaDeviceSynchronize waits for every stream of the device, pool streams included.
  const c10::cuda::CUDAGuard guard(device);
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
  const int index = resolved_index(device);
  // Entry 0 of the statistics arrays is the aggregate over all pools (StatType::AGGREGATE), in
  // every LibTorch version; the enum itself moved between namespaces in 2.x.
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current;
#else
  no_cuda(device);
#endif
}

int64_t peak_memory_allocated(c10::Device device) {
  if (!device.is_cuda()) {
    return -1;
  }
#ifdef GPIPE_WITH_CUDA
  const int index = resolved_index(device);
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].peak;
#else
  no_cuda(device);
#endif
}

DeviceMemoryUse device_memory_use(c10::Device device) {
  DeviceMemoryUse use;
  if (!device.is_cuda()) {
    return use;
  }
#ifdef GPIPE_WITH_CUDA
  const int index = resolved_index(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  use.used = static_cast<int64_t>(total - free);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  use.reserved = stats.reserved_bytes[0].current;  // entry 0: every pool (see memory_allocated)
  use.peak_reserved = stats.reserved_bytes[0].peak;
  use.peak_allocated = stats.allocated_bytes[0].peak;
#else
  no_cuda(device);
#endif
  return use;
}

void reset_peak_memory(c10::Device device) {
  if (!device.is_cuda()) {
    return;
  }
#ifdef GPIPE_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(resolved_index(device));
#else
  no_cuda(device);
#endif
}

void release_cached_memory(c10::Device device) {
  if (!device.is_cuda()) {
    return;
  }
#ifdef GPIPE_WITH_CUDA
  synchronize(device);
  c10::cuda::CUDACachingAllocator::emptyCache();
#else
  no_cuda(device);
#endif
}

#ifdef GPIPE_WITH_CUDA
// A CUDA event with timing enabled (the event pool's are made without: cheaper to record and
// wait for). Made on the device of its stream and destroyed there.
struct StreamMark {
  explicit StreamMark(c10::DeviceIndex device) : device(device) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaEventCreate(&event));
  }
  ~StreamMark() {
    // No throw from a destructor: setting the device fails once the CUDA runtime is unloading (a
    // timeline destroyed at exit), and then the event is gone with it.
    try {
      const c10::cuda::CUDAGuard guard(device);
      (void)cudaEventDestroy(event);
    } catch (...) {
    }
  }
  StreamMark(const StreamMark&) = delete;
  StreamMark& operator=(const StreamMark&) = delete;
  c10::DeviceIndex device;
  cudaEvent_t event = nullptr;
};
#else
struct StreamMark {};
#endif

std::shared_ptr<StreamMark> mark_stream(const c10::Stream& stream) {
  if (!has_streams(stream.device())) {
    return nullptr;
  }
#ifdef GPIPE_WITH_CUDA
  auto mark = std::make_shared<StreamMark>(stream.device_index());
  const c10::cuda::CUDAGuard guard(mark->device);
  C10_CUDA_CHECK(cudaEventRecord(mark->event, c10::cuda::CUDAStream(stream).stream()));
  return mark;
#else
  no_cuda(stream.device());
#endif
}

c10::Device mark_device(const StreamMark& mark) {
#ifdef GPIPE_WITH_CUDA
  return c10::Device(c10::kCUDA, mark.device);
#else
  (void)mark;
  TORCH_CHECK(false, "gpipe: device marks exist only in a CUDA build");
#endif
}

double elapsed_us(const StreamMark& from, const StreamMark& to) {
#ifdef GPIPE_WITH_CUDA
  TORCH_CHECK(from.device == to.device, "gpipe: elapsed time between marks on cuda:",
              static_cast<int>(from.device), " and cuda:", static_cast<int>(to.device),
              "; device times can only be compared on one device");
  const c10::cuda::CUDAGuard guard(to.device);
  C10_CUDA_CHECK(cudaEventSynchronize(from.event));
  C10_CUDA_CHECK(cudaEventSynchronize(to.event));
  float ms = 0;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, from.event, to.event));
  return 1000.0 * static_cast<double>(ms);
#else
  (void)from;
  (void)to;
  TORCH_CHECK(false, "gpipe: device marks exist only in a CUDA build");
#endif
}

RngState get_rng_state(c10::Device device) {
  RngState state;
  state.device = device;
  if (!device.is_cuda()) {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(cpu);
    state.cpu.emplace(RngState::Cpu{impl->engine(), impl->next_float_normal_sample(),
                                    impl->next_double_normal_sample()});
    return state;
  }
#ifdef GPIPE_WITH_CUDA
  // "cuda" is resolved to the current device now, so that set_rng_state restores the same
  // generator even on a thread whose current device is another one (a recomputation runs on the
  // autograd engine's thread).
  state.device = c10::Device(c10::kCUDA, resolved_index(device));
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(state.device.index());
  std::lock_guard<std::mutex> lock(gen.mutex());
  state.cuda = gen.get_state();
#else
  no_cuda(device);
#endif
  return state;
}

void set_rng_state(const RngState& state) {
  if (state.cpu) {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(cpu);
    impl->set_engine(state.cpu->engine);
    impl->set_next_float_normal_sample(state.cpu->next_float_normal);
    impl->set_next_double_normal_sample(state.cpu->next_double_normal);
  }
  if (state.cuda.defined()) {
#ifdef GPIPE_WITH_CUDA
    at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(cuda_index(state.device));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.cuda);
#endif
  }
}

bool rng_unchanged(const RngState& state) {
  if (!state.cpu) {
    return false;
  }
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(cpu);
  const at::mt19937_data_pod now = impl->engine().data();
  const at::mt19937_data_pod then = state.cpu->engine.data();
  return now.seed_ == then.seed_ && now.left_ == then.left_ && now.seeded_ == then.seeded_ &&
         now.next_ == then.next_ && now.state_ == then.state_ &&
         impl->next_float_normal_sample() == state.cpu->next_float_normal &&
         impl->next_double_normal_sample() == state.cpu->next_double_normal;
}

}  // namespace internal
}  // namespace gpipe
