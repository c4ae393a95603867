// Measuring the link between processes: messages and all-reduces on c10d's Gloo between two ranks
// of this process (Note [Costs between processes] in process_link.h). Built with
// gpipe::distributed (Gloo's headers): //balancing:gloo_link.
#pragma once

#include <cstdint>

#include "balancing/process_link.h"

namespace gpipe {

/// Measures messages and all-reduces on Gloo between two ranks of this process on the loopback
/// interface (Note [Costs between processes]): 4 bytes and `large_bytes`, the median of `repeats`
/// rounds each. Throws c10::Error when `large_bytes` is under 4096 or `repeats` under 1.
///
///   gpipe::ProcessLinkStats link = gpipe::measure_gloo_link();
///   double us = link.allreduce_us(int64_t{100} << 20, 8);  // 100 MiB of gradients, 8 replicas
ProcessLinkStats measure_gloo_link(int64_t large_bytes = int64_t{16} << 20, int repeats = 5);

}  // namespace gpipe
