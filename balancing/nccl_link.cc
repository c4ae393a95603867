// Messages and all-reduces between two GPUs on NCCL, measured; see Note [Costs between processes]
// in process_link.h.
#include "balancing/nccl_link.h"
#include "balancing/internal/link_timing.h"

#include <chrono>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#ifdef GPIPE_WITH_NCCL
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace gpipe {

GpuLinkStats measure_nccl_link(c10::Device first, c10::Device second, int64_t large_bytes,
                               int repeats) {
  const char* who = "gpipe::measure_nccl_link";
  TORCH_CHECK(first.is_cuda() && second.is_cuda() && first.has_index() && second.has_index() &&
                  first != second,
              who, ": NCCL's link is between two different GPUs, such as cuda:0 and cuda:1; got ",
              first, " and ", second);
  TORCH_CHECK(large_bytes >= 4096, who, ": large_bytes ", large_bytes,
              " is too small to tell bandwidth from latency; give 4096 or more");
  TORCH_CHECK(repeats >= 1, who, ": repeats ", repeats, "; give 1 or more");
#ifdef GPIPE_WITH_NCCL
  const std::vector<int64_t> sizes{4, large_bytes};
  auto store = c10::make_intrusive<c10d::HashStore>();
  // (A rank that failed leaves the other waiting at most this long: in the store, and for its
  // operations' streams, which `landed` polls rather than blocks on, since an NCCL operation
  // whose peer is gone never completes and c10d's timeout acts only with blocking waits or its
  // watchdog.)
  const std::chrono::seconds timeout(60);
  store->setTimeout(timeout);
  internal::LinkTimes times(sizes.size(), std::vector<std::vector<double>>(2));
  const c10::Device devices[2] = {first, second};
  internal::on_two_ranks([&](int rank) {
    const c10::Device device = devices[rank];
    const c10::cuda::CUDAGuard guard(device);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    const auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, 2, options);
    // (A work's wait() orders the current stream after NCCL's; this, the host after both.)
    const auto landed = [&] {
      const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!stream.query()) {
        TORCH_CHECK(std::chrono::steady_clock::now() < deadline, who, ": an operation on ", device,
                    " did not finish within ", timeout.count(), " s (did the other rank fail?)");
        std::this_thread::yield();
      }
    };
    internal::time_link_rank(group, rank, sizes, repeats, at::TensorOptions().device(device),
                             landed, times);
  });
  return internal::fit_link<GpuLinkStats>(times, large_bytes);
#else
  TORCH_CHECK(false, who, ": this gpipe was built without NCCL (it needs a CUDA LibTorch with "
              "c10d's NCCL backend and NCCL's headers); give the link's numbers instead "
              "(balance --nccl_link)");
#endif
}

}  // namespace gpipe
