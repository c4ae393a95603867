// A meter of the CPU tensors' memory: a CPU allocator for LibTorch that counts the bytes it has
// given out, now and at the peak, across every thread (the pipeline's workers included).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace gpipe_benchmarks {

// Note [Counting CPU memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A process's resident memory mixes tensors with the allocator's caches, libraries and freed
// pages glibc keeps (Note [Keeping freed memory]); the planner predicts tensors. So the benchmark
// that checks its predictions installs this allocator (c10::SetCPUAllocator, above the default's
// priority) before any tensor is made: each allocation goes through c10::alloc_cpu as before and
// is counted, each free through its deleter, which looks its size up. Memory that kernels get past
// LibTorch's allocator (oneDNN's scratch pads) is not counted.
class MemoryMeter final : public c10::Allocator {
 public:
  /// The meter, installed as the CPU allocator on first use.
  static MemoryMeter& install() {
    static MemoryMeter* meter = [] {
      auto* m = new MemoryMeter();  // never destroyed: tensors may outlive main's statics
      c10::SetCPUAllocator(m, /*priority=*/100);
      return m;
    }();
    return *meter;
  }

  // allocate is const in LibTorch 1.13's Allocator and not in 2.x's: the one that matches
  // overrides (no `override` on either).
  c10::DataPtr allocate(size_t bytes) const { return counted(bytes); }
  c10::DataPtr allocate(size_t bytes) { return counted(bytes); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // (Pure in LibTorch 2.x's Allocator, absent from 1.13's: no `override`.)
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count > 0) std::memcpy(dest, src, count);
  }

  /// Bytes of CPU tensors alive now.
  int64_t current() const { return current_.load(); }
  /// The most alive at once since the last reset_peak().
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

 private:
  c10::DataPtr counted(size_t bytes) const {
    void* data = c10::alloc_cpu(std::max<size_t>(bytes, 1));
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[data] = bytes;
    }
    const int64_t now = add(static_cast<int64_t>(bytes));
    // As LibTorch's own CPU allocator does, for the profiler's memory reports (the layer
    // profiler's held bytes among them).
    c10::reportMemoryUsageToProfiler(data, static_cast<int64_t>(bytes), now, now,
                                     c10::Device(c10::kCPU));
    // The context is the data (some callers of raw_allocate assert so); sizes_ knows the size.
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  static void release(void* data) {
    MemoryMeter& meter = install();
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(meter.mu_);
      auto it = meter.sizes_.find(data);
      if (it != meter.sizes_.end()) {
        bytes = it->second;
        meter.sizes_.erase(it);
      }
    }
    const int64_t now = meter.add(-static_cast<int64_t>(bytes));
    c10::reportMemoryUsageToProfiler(data, -static_cast<int64_t>(bytes), now, now,
                                     c10::Device(c10::kCPU));
    c10::free_cpu(data);
  }
  int64_t add(int64_t bytes) const {
    const int64_t now = current_.fetch_add(bytes) + bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return now;
  }
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, size_t> sizes_;
  mutable std::atomic<int64_t> current_{0};
  mutable std::atomic<int64_t> peak_{0};
};

}  // namespace gpipe_benchmarks
