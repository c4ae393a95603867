// The link between processes: what a message and an all-reduce cost on c10d's Gloo, measured
// between two ranks on this machine, and the arithmetic the planner uses for stages in processes of
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
// Processes on one machine send activations through rings in shared memory rather than Gloo
// (Note [Rings without names] in gpipe/distributed/internal/shared_memory.h), faster than the
// loopback for large activations. NCCL (GPU to GPU) is not measured here.

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

  /// Whether the link was measured (or given).
  bool measured() const { return bytes_per_us > 0 && allreduce_bytes_per_us > 0; }
  /// The time of a message of `bytes` (0 for none).
  double message_us(int64_t bytes) const;
  /// The time of an all-reduce of `bytes` over `replicas` ranks (Gloo's ring; 0 for one rank).
  double allreduce_us(int64_t bytes, int64_t replicas) const;
};

}  // namespace gpipe
