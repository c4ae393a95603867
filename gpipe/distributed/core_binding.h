// Binding each process of a host to cores of its own (DeepSpeed's --bind_cores_to_rank): the
// CPUs a process may run on, a rank's share of them, and binding every thread of the process.
#pragma once

#include <cstdint>
#include <vector>

namespace gpipe {
namespace distributed {

// Note [Binding cores to ranks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage computes on one thread and moves its micro-batches on others: the courier that posts
// its sends, the thread that receives its activations ahead, Gloo's thread that reads and writes
// the socket (Note [Receiving ahead] in transfer.h), and LibTorch's intra-op threads. When a host
// runs several computing processes, each left free, their threads meet on any core: a helper
// woken for a hop may take a core from another process's computing thread, and intra-op pools
// sized for the whole host oversubscribe it. Bound to a share of the cores of its own (as
// DeepSpeed's launcher does with --bind_cores_to_rank, and as Intel's guides for CPU training
// advise), a process competes only with itself, and its intra-op threads are as many as its
// cores. It is the launcher's business, so it is a function for programs to call first thing
// (or `taskset` around each rank), not an option of the stage: the trainers' and benchmarks'
// --bind_cores_to_rank. What it is worth depends on the host: on the project's 2-vCPU VM, two
// interleaved stages measured the same bound and unbound, within the machine's noise
// (docs/benchmarks.md).

/// The CPUs this process's calling thread may run on (its affinity mask), ascending.
std::vector<int> allowed_cpus();

/// Binds every thread of this process, and those it starts later, to `cpus` (each a CPU it may
/// run on now: allowed_cpus()). Threads started while it runs may keep their earlier mask: call
/// it before starting any. Throws c10::Error naming the CPU when `cpus` is empty or one cannot
/// be bound.
void bind_to_cpus(const std::vector<int>& cpus);

/// The `local_rank`-th of `local_world_size` contiguous shares of `cpus` (in order): each
/// cpus.size() / local_world_size of them, the first cpus.size() % local_world_size ranks one
/// more. Throws c10::Error when `local_rank` is not in [0, local_world_size) or `cpus` has
/// fewer CPUs than there are ranks.
///
///   cores_of_rank({0, 1, 2, 3, 4}, 1, 2)  // {3, 4}
std::vector<int> cores_of_rank(const std::vector<int>& cpus, int64_t local_rank,
                               int64_t local_world_size);

/// Binds this process to its share of allowed_cpus() (cores_of_rank) by torchrun's LOCAL_RANK
/// and LOCAL_WORLD_SIZE (a process without them: rank 0 of 1, all of them); returns the share.
///
///   int main(int argc, char** argv) {
///     gpipe::distributed::bind_cores_to_rank();  // before any thread starts
///     ...
std::vector<int> bind_cores_to_rank();

}  // namespace distributed
}  // namespace gpipe
