// The process group: how a process joins the others of a distributed run, on c10d (a TCPStore to
// meet; Gloo to communicate between CPUs, or NCCL between GPUs), from torchrun's environment or
// from options.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/version.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace gpipe {
namespace distributed {

/// c10d's process group interface, whichever class carries it in this LibTorch: c10d::ProcessGroup
/// in 1.x, c10d::Backend (the per-backend half of a ProcessGroup) in 2.x. Collectives and
/// point-to-point operations are called on it directly.
#if TORCH_VERSION_MAJOR >= 2
using ProcessGroupBase = c10d::Backend;
#else
using ProcessGroupBase = c10d::ProcessGroup;
#endif
/// A process group, as gpipe's functions and classes take one.
using ProcessGroup = c10::intrusive_ptr<ProcessGroupBase>;

/// Where a process is in a distributed run and how to reach the others.
///
///   auto group = gpipe::distributed::new_gloo_group(gpipe::distributed::options_from_env());
struct GroupOptions {
  /// This process's rank, 0 .. world_size - 1.
  TORCH_ARG(int, rank) = 0;
  /// The number of processes.
  TORCH_ARG(int, world_size) = 1;
  /// The host of rank 0, where the TCPStore that the processes meet at listens.
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// The port of that TCPStore.
  TORCH_ARG(int, master_port) = 29500;
  /// Whether the launcher already serves the TCPStore at master_addr:master_port (torchrun does,
  /// and says so with TORCHELASTIC_USE_AGENT_STORE=True): then rank 0 connects to it like the
  /// others instead of serving one.
  TORCH_ARG(bool, launcher_store) = false;
  /// How long to wait for the others: to meet, and in every collective or transfer (with Gloo, a
  /// process that died or hangs makes the others fail with a c10::Error after at most this long;
  /// with NCCL, c10d's watchdog acts after it: docs/distributed.md, "GPUs: Gloo or NCCL").
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// The c10d backend of the groups made from these options: "gloo" (tensors cross between
  /// processes through the CPU, wherever they live) or "nccl" (GPU tensors go from GPU to GPU;
  /// every process must use a GPU of its own, and gpipe must be built with NCCL:
  /// built_with_nccl()).
  /// Note [Point-to-point order].
  TORCH_ARG(std::string, backend) = "gloo";
  /// The group's name, under which its processes meet in the store (Note [One store per
  /// process]): every process must give the same one, and no other group of this run may have it.
  /// Empty (the default): the k-th unnamed group this process makes on this store, so every
  /// process must make its unnamed groups in the same order.
  TORCH_ARG(std::string, name) = "";
};

// Note [One store per process]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The processes of a run meet in one TCPStore (served by rank 0, or by torchrun), and each group
// they make has keys of its own there: "gpipe/<k>" for the k-th unnamed group, "gpipe/named/<name>"
// for a named one. A process connects to a store once and keeps the connection for its life, for
// every group it makes there: so rank 0 serves the store once, and a group made after others (a
// pipeline made anew after a failed step, Note [Failing fast across processes]) meets in the same
// store instead of starting a second server on a port the first still holds. The k of an unnamed
// group counts this process's unnamed groups on that store; a group made by some processes only
// would shift the k of every later one on them, so such a group needs a name (named groups do not
// count). A name is refused when this process used it on that store already: the earlier group's
// keys are still there.

/// Whether this build of gpipe can make NCCL groups (a CUDA LibTorch with c10d's NCCL backend,
/// and NCCL's headers, found when gpipe was built).
bool built_with_nccl();

// Note [Point-to-point order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Gloo matches a send with the receive of the same tag, whatever order the two processes posted
// them in. NCCL ignores tags: the operations between two ranks run in the order each posted them,
// one after the other on one stream, and each may wait until the other side reaches its match. So
// every pair of neighbouring stages posts its point-to-point operations in one order both sides
// agree on, whatever the backend: the sender sends each micro-batch's header and activations, in
// micro-batch order, and only after the last of them posts the receives of their gradients, in the
// order the next stage sends them (GPipe's backward order, the micro-batches in reverse); the
// receiver receives the activations in order and sends the gradients after its forwards. Posting a
// gradient's receive right after its activations (as a tag-matched backend allows) would, on NCCL,
// queue the next activations behind a gradient that needs them first: a deadlock. The tests hold
// the stages to this order on Gloo through a group that matches by order, as NCCL does
// (tests/distributed/in_order_group.h).

/// Whether `group` matches point-to-point operations by their tags (c10d's Gloo group), rather
/// than in posting order (NCCL, or any other group gpipe does not know).
bool matches_by_tag(const ProcessGroup& group);

/// Whether `group` carries GPU tensors between processes itself (NCCL) instead of through the CPU.
bool carries_device_tensors(const ProcessGroup& group);

/// The device on which a transfer or collective on `group` takes its tensors: for NCCL, `local`
/// (a GPU; with no index, the current one); the CPU for every other backend. Throws c10::Error
/// when NCCL is given a `local` that is not a GPU.
c10::Device wire_device(const ProcessGroup& group, c10::Device local);

/// The environment variable `name` as an integer from `low` to `high`, or nullopt when it is not
/// set. Throws c10::Error for any other value, naming `who` (the caller), the variable, its value
/// and the range.
///
///   const int64_t local_rank = env_int("LOCAL_RANK", 0, 1 << 20, "my_trainer").value_or(0);
c10::optional<int64_t> env_int(const char* name, int64_t low, int64_t high,
                               const char* who = "gpipe::distributed");

/// The options torchrun (and torch.distributed's other launchers) give a process in its
/// environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE;
/// GPIPE_TIMEOUT_S (seconds) if set.
/// Throws c10::Error naming a variable that is missing or malformed.
GroupOptions options_from_env();

/// Joins the process group of `options` with the backend it names (new_gloo_group for "gloo"; for
/// "nccl", c10d's NCCL group over the same TCPStore). Throws c10::Error for any other backend, and
/// for "nccl" in a build without NCCL.
ProcessGroup new_process_group(const GroupOptions& options);

/// Joins the process group of `options` with c10d's Gloo backend: rank 0 serves a TCPStore at
/// master_addr:master_port (unless the launcher does), every rank connects to it and then to every
/// other rank (on loopback when master_addr is a loopback address; else on the interface named by
/// GLOO_SOCKET_IFNAME, or the one this host's name resolves to). Blocks until all world_size
/// processes have joined or the timeout passes (c10::Error).
ProcessGroup new_gloo_group(const GroupOptions& options);

/// The groups of this process in a pipeline of `stages` stages, replicated world_size / stages
/// times (data parallelism): rank r is stage r % stages of replica r / stages, so each pipeline
/// is `stages` consecutive ranks.
///
///   auto groups = gpipe::distributed::new_pipeline_groups(options_from_env(), 2);  // 4 processes
///   // rank 3: stage 1 of replica 1; pipeline {2, 3}, replica group {1, 3}
struct PipelineGroups {
  /// This replica's stages, in stage order.
  ProcessGroup pipeline;
  /// This stage in every replica, in replica order.
  ProcessGroup replica_group;
  /// The stages of a pipeline.
  int stages = 1, replicas = 1;  ///< The replicas of the pipeline.
  /// This process's stage.
  int stage = 0, replica = 0;  ///< This process's replica.
};

/// Joins the run of `options` (one TCPStore, as new_gloo_group) and makes this process's
/// pipeline and replica groups (with options' backend). Throws c10::Error when world_size is not
/// a multiple of `stages`.
PipelineGroups new_pipeline_groups(const GroupOptions& options, int stages);

/// Runs `fn` and turns any exception from c10d or Gloo into a c10::Error that says `what` failed
/// on this rank, why, and what usually causes it (a process that died or timed out).
void check_collective(const ProcessGroup& group, const std::string& what,
                      const std::function<void()>& fn);

/// Every rank's `mine` (a CPU tensor of the same size and dtype on every rank), in rank order, on
/// the CPU: one all-gather on wire_device(group, local), with check_collective's errors naming
/// `what`. `check` (if given) is called while it waits and may throw to stop waiting (another
/// rank's failure heard: the all-gather is then left to the broken group). `posted` (if given) is
/// called once the all-gather is posted: from then on the other ranks' all-gathers pair with it.
std::vector<at::Tensor> all_gather(const ProcessGroup& group, const at::Tensor& mine,
                                   c10::Device local, const std::string& what,
                                   const std::function<void()>& check = nullptr,
                                   const std::function<void()>& posted = nullptr);

namespace internal {
/// Fault injection for tests: `hook` (or nothing, when empty) runs in every all_gather before it
/// posts; a hook that throws stands for a local failure before the collective (out of memory).
/// Not for concurrent use with running collectives.
void set_all_gather_hook(std::function<void()> hook);
}  // namespace internal

/// Waits for `work`, with check_collective's errors.
void wait(const ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work,
          const std::string& what);

}  // namespace distributed
}  // namespace gpipe
