// Binding each process of a host to cores of its own (DeepSpeed's --bind_cores_to_rank): the
// CPUs a process may run on, a rank's share of them, and binding every thread of the process.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace gpipe {
namespace distributed {

// Note [Binding cores to ranks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage computes on one thread and moves its micro-batches on others: the courier that posts
// its sends, the thread that receives its activations ahead, Gloo's thread that reads and writes
// the socket (Note [Receiving ahead] in internal/transfer.h), and LibTorch's intra-op threads. When
// a host runs several computing processes, each left free, their threads meet on any core: a helper
// woken for a hop may take a core from another process's computing thread, and intra-op pools
// sized for the whole host oversubscribe it. Bound to a share of the cores of its own (as
// DeepSpeed's launcher does with --bind_cores_to_rank, and as Intel's guides for CPU training
// advise), a process competes only with itself, and its intra-op threads are as many as its
// cores. It is the launcher's business, so it is a function for programs to call first thing
// (or `taskset` around each rank), not an option of the stage: the trainers' and benchmarks'
// --bind_cores_to_rank. What it is worth depends on the host: on the project's 2-vCPU VM, two
// interleaved stages measured the same bound and unbound, within the machine's noise
// (docs/journal/2026-11-27-benchmarks.md, "each process bound to a core of its own").

/// The CPUs this process's calling thread may run on (its affinity mask), ascending.
std::vector<int> allowed_cpus();

/// Binds every thread of this process, and those it starts later, to `cpus`. Threads started
/// while it runs may keep their earlier mask: call it before starting any. Throws c10::Error
/// naming the CPUs when `cpus` is empty, has a number that is not a CPU's, or has CPUs this
/// process cannot run on (outside its cgroup's cpuset, or offline): the mask read back must be
/// `cpus`.
void bind_to_cpus(const std::vector<int>& cpus);

/// `cpus` with the hardware threads of each core next to each other, cores in the order of their
/// first thread (Linux numbers a core's threads far apart: CPUs 0 and 8 of an 8-core host), so
/// that contiguous shares (cores_of_rank) take whole cores. `core_of(cpu)` names cpu's core (the
/// first of its siblings); the overload without it reads
/// `/sys/devices/system/cpu/cpu<N>/topology/thread_siblings_list` (a CPU without one is a core
/// of its own).
///
///   order_by_core({0, 1, 2, 3}, [](int cpu) { return cpu % 2; })  // {0, 2, 1, 3}
std::vector<int> order_by_core(const std::vector<int>& cpus,
                               const std::function<int(int cpu)>& core_of);
/// The same, each CPU's core read from /sys (see above).
std::vector<int> order_by_core(const std::vector<int>& cpus);

/// The `local_rank`-th of `local_world_size` contiguous shares of `cpus` (in order): each
/// cpus.size() / local_world_size of them, the first cpus.size() % local_world_size ranks one
/// more. Throws c10::Error when `local_rank` is not in [0, local_world_size) or `cpus` has
/// fewer CPUs than there are ranks.
///
///   cores_of_rank({0, 1, 2, 3, 4}, 1, 2)  // {3, 4}
std::vector<int> cores_of_rank(const std::vector<int>& cpus, int64_t local_rank,
                               int64_t local_world_size);

/// Binds this process to its share of allowed_cpus(), ordered by core (order_by_core, then
/// cores_of_rank), by torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE; returns the share. A process
/// without them is rank 0 of 1 (all of its CPUs) unless WORLD_SIZE says there are others: then,
/// and when only one of the two is set, it throws c10::Error saying which to set.
///
///   int main(int argc, char** argv) {
///     gpipe::distributed::bind_cores_to_rank();  // before any thread starts
///     ...
std::vector<int> bind_cores_to_rank();

}  // namespace distributed
}  // namespace gpipe
