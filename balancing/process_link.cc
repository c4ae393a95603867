// What messages and all-reduces between processes cost; see Note [Costs between processes] in
// process_link.h.
#include "balancing/process_link.h"

#include <c10/util/Exception.h>

namespace gpipe {

double ProcessLinkStats::message_us(int64_t bytes) const {
  if (bytes <= 0) return 0;
  if (ring.measured() && bytes <= ring.max_message) {
    return ring.latency_us + static_cast<double>(bytes) / ring.bytes_per_us;
  }
  // Past a ring: a record through it saying so, then the header and the data on Gloo.
  const double past_ring = ring.measured() ? ring.latency_us + latency_us : 0;
  TORCH_CHECK(bytes_per_us > 0, "gpipe::ProcessLinkStats: the link between processes was not "
              "measured (bytes_per_us ", bytes_per_us, "); measure it with "
              "gpipe::measure_gloo_link() or give its numbers");
  return past_ring + latency_us + static_cast<double>(bytes) / bytes_per_us;
}

namespace {

// A ring all-reduce over `replicas` ranks: 2(r - 1) steps of alpha, each moving bytes / r at beta
// (Note [Costs between processes]).
// `who` names the link's type, `measure` its measurement, in the errors.
double ring_allreduce_us(double alpha_us, double beta, int64_t bytes, int64_t replicas,
                         const char* who, const char* measure) {
  TORCH_CHECK(replicas >= 1, "gpipe::", who, ": ", replicas, " replicas; give 1 or more");
  if (replicas == 1 || bytes <= 0) return 0;
  TORCH_CHECK(beta > 0, "gpipe::", who, ": the all-reduce between processes was not measured "
              "(allreduce_bytes_per_us ", beta, "); measure it with gpipe::", measure,
              "() or give its numbers");
  const double steps = 2.0 * static_cast<double>(replicas - 1);
  return steps * alpha_us +
         steps / static_cast<double>(replicas) * static_cast<double>(bytes) / beta;
}

}  // namespace

double ProcessLinkStats::allreduce_us(int64_t bytes, int64_t replicas) const {
  return ring_allreduce_us(allreduce_step_us, allreduce_bytes_per_us, bytes, replicas,
                           "ProcessLinkStats", "measure_gloo_link");
}

double GpuLinkStats::message_us(int64_t bytes) const {
  if (bytes <= 0) return 0;
  TORCH_CHECK(bytes_per_us > 0, "gpipe::GpuLinkStats: the link between GPUs on NCCL was not "
              "measured (bytes_per_us ", bytes_per_us, "); measure it with "
              "gpipe::measure_nccl_link() or give its numbers");
  return 2 * latency_us + static_cast<double>(bytes) / bytes_per_us;
}

double GpuLinkStats::allreduce_us(int64_t bytes, int64_t replicas) const {
  return ring_allreduce_us(allreduce_step_us, allreduce_bytes_per_us, bytes, replicas,
                           "GpuLinkStats", "measure_nccl_link");
}

}  // namespace gpipe
