// Measuring the link between processes: messages and all-reduces on c10d's Gloo between two ranks
// of this process, and messages through rings in shared memory between two of its threads (Note
// [Costs between processes] in process_link.h). Built with gpipe::distributed (Gloo's headers):
// //balancing:gloo_link.
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

/// Measures messages through rings in shared memory of `ring_bytes` each (as
/// distributed::PipelineStageOptions::shared_memory makes them between stages on one machine),
/// one each way between two threads of this process, packed with their header and unpacked into a
/// tensor made for each, as the stages do (Note [Costs between processes]): 4 bytes and as large
/// an activation as a ring takes, the median of
/// `repeats` rounds each. Throws c10::Error when `ring_bytes` is under 256 KiB or `repeats` under
/// 1, or with the system's reason when the rings cannot be made.
///
///   gpipe::ProcessLinkStats link = gpipe::measure_gloo_link();
///   link.ring = gpipe::measure_shared_memory_link();
///   double us = link.message_us(int64_t{1} << 20);  // 1 MiB of activations: through a ring
RingLinkStats measure_shared_memory_link(int64_t ring_bytes = int64_t{8} << 20, int repeats = 5);

}  // namespace gpipe
