// Streams: the queues a device runs work on, behind one small interface with the other device
// specifics the engine needs (random generator state, memory statistics). On CUDA a stream is a
// CUDA stream; on CPU every stream is the one CPU "stream" and every stream operation is a no-op,
// so the pipeline engine has a single code path for both.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

namespace at {
struct CPUGeneratorImpl;
}  // namespace at

namespace gpipe {
namespace internal {

/// Whether this build of gpipe was compiled against a CUDA-enabled LibTorch.
bool built_with_cuda();

/// Whether `device` uses real streams (CUDA), so that waits, records and copies matter.
inline bool has_streams(const c10::Device& device) { return device.is_cuda(); }

/// The stream that work on `device` is currently issued to (the CPU stream on CPU).
c10::Stream current_stream(c10::Device device);

/// A stream for copies and transfers on `device`, from the device's pool of high-priority
/// streams (Note [Streams apart from NCCL's] in stream.cc; the CPU stream on CPU).
c10::Stream new_stream(c10::Device device);

/// Makes `waiting` wait for all work issued to `source` so far. No-op when both are the same
/// stream or `waiting` is a CPU stream; a CPU `waiting` on a CUDA `source` is not needed because
/// CPU work does not read CUDA memory asynchronously. Thread-safe; the events it needs are
/// reused (Note [Event pool] in stream.cc).
///
///   gpipe::internal::wait_stream(compute, copy);  // compute runs after the copy has landed
void wait_stream(const c10::Stream& waiting, const c10::Stream& source);

/// Makes `waiting` wait for the calling thread's current stream on its device when one of
/// `tensors` is a GPU tensor on that device: a tensor this thread made there (a layer's output off
/// its partition's device) that `waiting`'s work is to use as it is, without a copy.
void wait_for_tensors_made_here(const c10::Stream& waiting,
                                const std::vector<at::Tensor>& tensors);

/// A point in a stream's work that another stream, or the host, can wait for: a CUDA event
/// recorded there, taken from the event pool and given back when the last holder drops it (Note
/// [Event pool] in stream.cc). Made by record_point; null on the CPU.
struct StreamPoint;

/// Records a point on `stream` now; null where `stream` is not a real stream (CPU).
std::shared_ptr<const StreamPoint> record_point(const c10::Stream& stream);

/// Makes `waiting` wait until its device has reached `point` (no host wait). No-op when `waiting`
/// is a CPU stream.
void wait_point(const c10::Stream& waiting, const StreamPoint& point);

/// Blocks the calling thread until the device has reached `point`: for the host's own work on
/// what the device wrote (a copy to the CPU).
void synchronize_point(const StreamPoint& point);

/// Tells the caching allocator that `tensor`'s whole storage is in use on `stream`, so its memory
/// is not reused before the work queued there finishes. Records the storage, not the tensor, so a
/// view with an offset protects all of its memory. No-op on CPU.
void record_stream(const at::Tensor& tensor, const c10::Stream& stream);

/// Blocks the calling thread until all work on `device`, on every one of its streams, has finished.
/// Only that device (the current one for a plain "cuda") is synchronised or made current, and only
/// for the call. No-op on CPU.
void synchronize(c10::Device device);

/// Bytes currently allocated on `device` by LibTorch's caching allocator (CUDA), or -1 where the
/// allocator does not track them (CPU).
int64_t memory_allocated(c10::Device device);

/// The most bytes allocated on `device` by LibTorch's caching allocator since the process started
/// (or since its peak statistics were reset), or -1 where the allocator does not track them (CPU).
int64_t peak_memory_allocated(c10::Device device);

/// What a CUDA device's memory holds, in bytes: all that is in use on it (the driver's count,
/// other processes included), what LibTorch's caching allocator reserves now, and the most it has
/// reserved and allocated since its peak statistics were reset. All -1 on the CPU.
struct DeviceMemoryUse {
  int64_t used = -1;
  int64_t reserved = -1;
  int64_t peak_reserved = -1;
  int64_t peak_allocated = -1;
};
DeviceMemoryUse device_memory_use(c10::Device device);

/// Resets the caching allocator's peak statistics of `device` (CUDA; no-op on CPU).
void reset_peak_memory(c10::Device device);

/// Returns the caching allocator's unused blocks to the driver, after `device`'s work (CUDA; no-op
/// on CPU): its reserve then starts from what is in use.
void release_cached_memory(c10::Device device);

/// A point in a CUDA stream's work whose time on the device can be read once the device has
/// reached it: a CUDA event with timing. Made by mark_stream; used by the timeline (timeline.h).
struct StreamMark;

/// Records a timing mark on `stream` now. Null on the CPU, where work runs when the host runs it.
std::shared_ptr<StreamMark> mark_stream(const c10::Stream& stream);

/// The device (with its index) on which `mark` was recorded.
c10::Device mark_device(const StreamMark& mark);

/// Microseconds of device time from mark `from` to mark `to`, both on one device; waits until the
/// device has reached `to`. Throws c10::Error if the marks are on different devices.
double elapsed_us(const StreamMark& from, const StreamMark& to);

/// The state of the random generator that work on a device draws from: the CPU generator for the
/// CPU, the device's own generator for a CUDA device. (Only that one: recomputations run on one
/// thread per device at once, and saving and restoring the process-wide CPU generator from
/// several of them would rewind it.)
struct RngState {
  /// A copy of the CPU generator's state (its engine and cached normal samples; no serialisation
  /// and no generator object, whose construction would seed an engine only to overwrite it).
  struct Cpu {
    at::mt19937 engine;
    c10::optional<float> next_float_normal;
    c10::optional<double> next_double_normal;
  };
  c10::optional<Cpu> cpu;
  at::Tensor cuda;
  c10::Device device = c10::Device(c10::kCPU);
  /// Whether nothing was saved (set_rng_state then does nothing).
  bool empty() const { return !cpu && !cuda.defined(); }
};

/// Saves the generator states that work on `device` uses. A CUDA device without an index is the
/// calling thread's current device, resolved here.
RngState get_rng_state(c10::Device device);

/// Restores generator states saved by get_rng_state.
void set_rng_state(const RngState& state);

/// Whether the CPU generator is still exactly as `state` saved it: nothing drew a random number
/// from it since. False for CUDA states (not compared).
bool rng_unchanged(const RngState& state);

}  // namespace internal
}  // namespace gpipe
