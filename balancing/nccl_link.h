// Measuring the link between GPUs on c10d's NCCL: messages and all-reduces between two ranks of
// this process, each a thread with a GPU of its own (Note [Costs between processes] in
// process_link.h). Built with gpipe::distributed (//balancing:gloo_link); it measures where gpipe
// was built with NCCL (distributed::built_with_nccl()), and says so where not.
#pragma once

#include <cstdint>

#include <c10/core/Device.h>

#include "balancing/process_link.h"

namespace gpipe {

/// Measures messages and all-reduces on NCCL between two ranks of this process, on GPUs `first`
/// and `second` (Note [Costs between processes]): 4 bytes and `large_bytes`, each the median of
/// `repeats` rounds after an untimed one (which makes NCCL's communicators), the host waiting for
/// each operation's stream. Throws c10::Error when gpipe was built without NCCL, when the devices
/// are not two different GPUs, when `large_bytes` is under 4096 or `repeats` under 1.
///
///   gpipe::ProcessLinkStats link = gpipe::measure_gloo_link();
///   link.nccl = gpipe::measure_nccl_link(c10::Device("cuda:0"), c10::Device("cuda:1"));
GpuLinkStats measure_nccl_link(c10::Device first, c10::Device second,
                               int64_t large_bytes = int64_t{64} << 20, int repeats = 5);

}  // namespace gpipe
