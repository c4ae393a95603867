// The link between processes: what a message and an all-reduce cost on c10d's Gloo (measured
// between two ranks on this machine) and a message through a ring in shared memory (between two
// threads), and the arithmetic the planner uses for stages in processes of
// their own (distributed::PipelineStage) and for data-parallel replicas.
#pragma once

#include <cstdint>

namespace gpipe {

// Note [Costs between processes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Two things cross between processes in a step: a stage's activations and their gradients, as
// messages between neighbouring stages, and, with data-parallel replicas, every stage's gradients,
// which PipelineStage averages over its replicas after its step (one flat all-reduce per dtype and
// a small one of who has which gradient: distributed/replication.h). measure_gloo_link() measures
// both on Gloo between two ranks of one process that meet on its loopback interface (each rank a
// thread: the same sockets and copies as two processes on one machine): a message of 4 bytes and
// one of `large_bytes` sent one way (half a ping-pong), and an all-reduce of each size; medians of
// `repeats` rounds after an untimed one.
//   A message costs latency_us + bytes / bytes_per_us.
//   An all-reduce over r replicas is Gloo's ring: 2(r-1) steps, each moving bytes / r to the next
//   rank, so 2(r-1) alpha + 2(r-1)/r bytes / beta; two ranks measure 2 alpha + bytes / beta, which
//   gives alpha (half the small all-reduce) and beta.
// The loopback is a machine's best case: between machines the network's own numbers belong in
// the profile instead (balance --process_link=LATENCY,BYTES_PER_US,STEP_US,BYTES_PER_US).
// Stages in processes on one machine send their activations and gradients through rings in
// shared memory instead of Gloo (PipelineStageOptions::shared_memory, on by default: Note [Shared
// memory between stages on one host] in gpipe/distributed/internal/shared_memory.h), a message
// that an empty ring always takes at once and, past that, over Gloo. measure_shared_memory_link()
// measures such a ring between two threads of this process, as the stages use it (packed by the
// writer with its header, unpacked by the reader into a tensor made for it): a message costs
// ring.latency_us + bytes / ring.bytes_per_us up to ring.max_message bytes (the largest
// activations an empty ring always takes: 7/16 of a ring of 512 KiB or more, less a record's
// prefix and the activations' header), and beyond it a record through the ring that says so plus
// the header and the data on Gloo. The planner assumes the reader keeps up, so that a message
// never finds its ring too full, and counts gradients (which have no header) as activations.
// Stages whose processes all hold a GPU may instead send on NCCL (GroupOptions::backend("nccl"),
// the trainers' --backend=nccl): GPU memory to GPU memory, without the copies through the CPU and
// without rings, and the replicas' all-reduces on NCCL's ring. measure_nccl_link() (nccl_link.h)
// measures it between two GPUs of this machine as measure_gloo_link() measures Gloo (two ranks,
// each a thread with its own GPU; the host waits for each operation's stream), and a profile that
// has those numbers (ProcessLinkStats::nccl) plans every plan of a process per worker whose
// stages are all on GPUs, each worker's its own, on NCCL (one pipeline per process, replicated,
// stays on Gloo): an activation costs its header's and its data's messages, 2 latency_us + bytes
// / bytes_per_us; an all-reduce the same ring as Gloo's on NCCL's alpha and beta. Plans with a
// stage on the CPU stay on Gloo (an NCCL group carries GPU tensors only).

/// What a message through a ring in shared memory costs between processes on one machine (Note
/// [Costs between processes]).
struct RingLinkStats {
  /// A message's fixed cost, microseconds (a 4-byte message sent one way).
  double latency_us = 0;
  /// A message's bytes per microsecond beyond its latency; 0: no rings (every message on Gloo).
  double bytes_per_us = 0;
  /// The largest activations an empty ring always takes: 7/16 of the ring
  /// (PipelineStageOptions::shared_memory; 512 KiB or more) less a record's prefix and the
  /// activations' header.
  int64_t max_message = 0;

  /// Whether the rings were measured (or given).
  bool measured() const { return bytes_per_us > 0 && max_message > 0; }
};

/// What messages and all-reduces cost between GPUs of two processes on NCCL (Note [Costs
/// between processes]).
struct GpuLinkStats {
  /// A message's fixed cost, microseconds (4 bytes sent one way).
  double latency_us = 0;
  /// A message's bytes per microsecond beyond its latency; 0: not measured.
  double bytes_per_us = 0;
  /// An all-reduce's fixed cost per ring step, microseconds (alpha).
  double allreduce_step_us = 0;
  /// An all-reduce's bytes per microsecond on each ring step (beta).
  double allreduce_bytes_per_us = 0;

  /// Whether the link was measured (or given).
  bool measured() const { return bytes_per_us > 0 && allreduce_bytes_per_us > 0; }
  /// Whether its numbers make a link: measured, and no latency negative.
  bool valid() const { return latency_us >= 0 && allreduce_step_us >= 0 && measured(); }
  /// The time of an activation of `bytes` (0 for none): its header's message and its data's.
  double message_us(int64_t bytes) const;
  /// The time of an all-reduce of `bytes` over `replicas` ranks (NCCL's ring; 0 for one rank).
  double allreduce_us(int64_t bytes, int64_t replicas) const;
};

/// What messages and all-reduces cost between processes (Note [Costs between processes]).
struct ProcessLinkStats {
  /// A message's fixed cost, microseconds (a 4-byte message sent one way).
  double latency_us = 0;
  /// A message's bytes per microsecond beyond its latency (= MB/s); 0: not measured.
  double bytes_per_us = 0;
  /// An all-reduce's fixed cost per ring step, microseconds (alpha).
  double allreduce_step_us = 0;
  /// An all-reduce's bytes per microsecond on each ring step (beta).
  double allreduce_bytes_per_us = 0;

  /// Messages through rings in shared memory, where the processes are on one machine; none (not
  /// measured): every message on Gloo.
  RingLinkStats ring;

  /// Messages and all-reduces between GPUs on NCCL, for plans whose stages are all on GPUs; none
  /// (not measured): those too on Gloo, through the CPU.
  GpuLinkStats nccl;

  /// Whether the link was measured (or given).
  bool measured() const { return bytes_per_us > 0 && allreduce_bytes_per_us > 0; }
  /// Whether its Gloo numbers make a link: measured, and no latency negative.
  bool valid() const { return latency_us >= 0 && allreduce_step_us >= 0 && measured(); }
  /// The time of a message of `bytes` (0 for none): through a ring when it fits in one, else on
  /// Gloo (after a record through the ring that says so, where there are rings).
  double message_us(int64_t bytes) const;
  /// The time of an all-reduce of `bytes` over `replicas` ranks (Gloo's ring; 0 for one rank).
  double allreduce_us(int64_t bytes, int64_t replicas) const;
};

}  // namespace gpipe
