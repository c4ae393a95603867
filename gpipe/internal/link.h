// Links (internal, not API): how a partition that the executor runs gets each micro-batch's input
// and gives back its gradients (its upstream), and where its outputs go and their gradients come
// from (its downstream) — a neighbouring partition in this process, the mini-batch's input, the
// loss, or (gpipe/distributed) a stage in another process.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gpipe/loss.h"
#include "gpipe/microbatch.h"
#include "gpipe/internal/stream.h"
#include "gpipe/timeline.h"

namespace gpipe {
namespace internal {

/// A micro-batch's input as a partition receives it: cut from the sender's graph (tensors that
/// required grad there are leaves that require grad here).
struct Activation {
  int64_t microbatches = 0;  // of the step
  Batch batch{std::vector<at::Tensor>{}};
  bool grad_enabled = true;  // whether the sender runs backward (it waits for gradients)
};

/// Where a partition's inputs come from and their gradients go.
class Upstream {
 public:
  virtual ~Upstream() = default;
  /// The next micro-batch's input (micro-batches arrive in order); throws c10::Error when the
  /// link failed.
  virtual Activation receive() = 0;
  /// The gradients of micro-batch `microbatch`'s input tensors that require grad, in order; an
  /// undefined one where no gradient reached the tensor (as the plain model leaves it).
  virtual void send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) = 0;
  /// Whether send_gradients takes undefined gradients; else they are sent as zeros (a transfer
  /// to another process has a fixed shape).
  virtual bool takes_undefined_gradients() const { return true; }
  /// Makes the other side's waits throw a c10::Error with `why`.
  virtual void fail(const std::string& /*why*/) {}
};

/// Where a partition's outputs go and their gradients come from.
class Downstream {
 public:
  virtual ~Downstream() = default;
  /// Sends micro-batch `microbatch`'s output (of `microbatches`).
  virtual void send(int64_t microbatches, int64_t microbatch, const Batch& output,
                    bool grad_enabled) = 0;
  /// The gradients of micro-batch `microbatch`'s output tensors that require grad, in order (an
  /// undefined one where none reached it); throws c10::Error when the link failed.
  virtual std::vector<at::Tensor> receive_gradients(int64_t microbatch) = 0;
  /// Makes the other side's waits throw a c10::Error with `why`.
  virtual void fail(const std::string& /*why*/) {}
};

/// `batch` cut from its graph: detached, moved to `device`, each tensor that required grad a leaf
/// that requires grad.
Batch cut_batch(const Batch& batch, c10::Device device);

/// The tensors of `batch` that require grad (those whose gradients cross back), in order.
std::vector<at::Tensor> requiring_grad(const Batch& batch);

// Note [Links on copy streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A LocalLink between partitions on different devices moves each micro-batch's tensors (and, back,
// their gradients) on copy streams, as forward() does (Note [Copy streams] in copy.h), so that on
// GPUs copies overlap computation under every schedule. The sender, on its own thread:
//
//   copy stream [from][i] waits for the sender's compute stream (the tensors are ready there);
//   the copy is issued with the copy streams of both ends current, without blocking the host
//   (a copy to the CPU lands in pinned memory; one from the CPU is staged in pinned memory
//   first: copy_to_device in copy.h), the source recorded on its copy stream;
//   a point (a CUDA event) is recorded where the copy ends: the destination's copy stream, or the
//   source's when the destination is the CPU.
//
// The receiver, on its thread, makes its compute stream wait for that point and records the
// tensors on it (the caching allocator then keeps their memory until that stream is done), or,
// on the CPU, waits on the host until the copy has landed. Only the receiver waits: the sender's
// next work is issued while the copy runs. Copy streams are per (partition, micro-batch), so one
// micro-batch's copy never waits behind another's. Between CPU partitions no stream is involved
// and a move is a detach.

/// Copy streams of a step: `copy_streams[p][i]` is partition p's for micro-batch i.
using CopyStreams = std::vector<std::vector<c10::Stream>>;

/// Tensors on their way to another device (Note [Links on copy streams]): `values` may be read on
/// the destination once `ready` is reached (null: at once).
struct Moving {
  std::vector<at::Tensor> values;
  std::shared_ptr<const StreamPoint> ready;
};

/// Moves `values` (detached) from `compute`'s device to `to` on the copy streams `copy_from` (on
/// the source device) and `copy_to` (on `to`); undefined tensors stay undefined.
Moving move_tensors(const std::vector<at::Tensor>& values, c10::Device to,
                    const c10::Stream& compute, const c10::Stream& copy_from,
                    const c10::Stream& copy_to);

/// On the receiver's thread: makes its current stream on `device` wait for `moving` (or the host,
/// on the CPU) and returns the tensors, recorded on that stream.
std::vector<at::Tensor> arrive(Moving moving, c10::Device device);

/// Two neighbouring partitions in this process, `from` and `from + 1`: the downstream of one and
/// the upstream of the next, each on a thread of its own, and what both kinds of link share.
/// `copy_streams` (of the step's partitions, indexed as the link's; null between CPU partitions),
/// `timeline` (may be null) and `timeline_offset` (added to partition indices in its events)
/// outlive the link.
class Link : public Upstream, public Downstream {
 public:
  void fail(const std::string& why) override;

 protected:
  Link(std::string who, int64_t from, c10::Device from_device, c10::Device to_device,
       const CopyStreams* copy_streams, Timeline* timeline, int64_t timeline_offset)
      : who_(std::move(who)),
        from_(from),
        from_device_(from_device),
        to_device_(to_device),
        copy_streams_(copy_streams),
        timeline_(timeline),
        timeline_offset_(timeline_offset) {}
  /// Waits until `ready()` (called with mu_ held) or the link failed, which throws a c10::Error
  /// naming both partitions.
  void await(const std::function<bool()>& ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Waits for the first of `queue` (a member guarded by mu_) and takes it; throws as await().
  template <typename T>
  T take_front(std::deque<T>& queue) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    await([&queue] { return !queue.empty(); });
    T front = std::move(queue.front());
    queue.pop_front();
    return front;
  }

  const std::string who_;
  const int64_t from_;
  const c10::Device from_device_, to_device_;
  const CopyStreams* const copy_streams_;
  Timeline* const timeline_;
  const int64_t timeline_offset_;
  absl::Mutex mu_;

 private:
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::string why_ ABSL_GUARDED_BY(mu_);
};

/// Two neighbouring partitions in this process, each on a thread of its own: the downstream of
/// partition `from` and the upstream of partition `from + 1`. Between devices, tensors move on
/// copy streams (Note [Links on copy streams]), each activation copy recorded on `timeline`.
class LocalLink final : public Link {
 public:
  /// See Link.
  LocalLink(std::string who, int64_t from, c10::Device from_device, c10::Device to_device,
            const CopyStreams* copy_streams = nullptr, Timeline* timeline = nullptr,
            int64_t timeline_offset = 0)
      : Link(std::move(who), from, from_device, to_device, copy_streams, timeline,
             timeline_offset) {}

  void send(int64_t microbatches, int64_t microbatch, const Batch& output,
            bool grad_enabled) override;
  Activation receive() override;
  void send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) override;
  std::vector<at::Tensor> receive_gradients(int64_t microbatch) override;

 private:
  struct Sent {
    int64_t microbatches = 0;
    bool atomic = true;
    bool grad_enabled = true;
    std::vector<bool> requires_grad;
    Moving moving;
  };
  // Moves `values` for micro-batch `microbatch` from partition `source` (from_ or from_ + 1) to
  // the other end; records the copy on the timeline.
  Moving move(const std::vector<at::Tensor>& values, int64_t microbatch, int64_t source);

  std::deque<Sent> activations_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Moving> gradients_ ABSL_GUARDED_BY(mu_);
};

// Note [Links that keep the graph]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// forward() runs on the executor too (Note [forward() on the executor] in executor.h), but its
// caller runs one backward through the whole pipeline, so its links keep the autograd graph: a
// GraphLink sends the tensors themselves — the sender's forward has made its copy stream wait for
// its compute stream, by an autograd function, before a checkpoint's recomputation is wired
// beside the output — copies them on the copy streams by autograd functions (Note [Copy streams]
// in copy.h), and the receiver's compute stream waits for the copy the same way; backward makes
// the same trip in reverse. No gradient crosses the link by hand.
//
// Autograd nodes are not thread-safe to link to: making an edge to a node writes to it
// (Node::topological_nr). The sender's forward makes more edges to its output's node after
// sending it (the next micro-batch's dependency on it: Note [Backward order] in executor.h), so
// when the receiver runs on another thread and no copy node stands between them (both ends on
// the CPU), the link puts a node of its own in front of the tensors (pass() in copy.h), made on
// the sender's thread: the receiver's edges then go to that node.

/// Two neighbouring partitions of a forward() (Note [Links that keep the graph]), the sending
/// one's thread `crosses_threads` from the receiving one's; see Link (`copy_streams` not null).
class GraphLink final : public Link {
 public:
  GraphLink(std::string who, int64_t from, c10::Device from_device, c10::Device to_device,
            const CopyStreams* copy_streams, bool crosses_threads, Timeline* timeline = nullptr,
            int64_t timeline_offset = 0)
      : Link(std::move(who), from, from_device, to_device, copy_streams, timeline,
             timeline_offset),
        crosses_threads_(crosses_threads) {}

  void send(int64_t microbatches, int64_t microbatch, const Batch& output,
            bool grad_enabled) override;
  Activation receive() override;
  /// Not used: the gradients take the graph's own way back.
  void send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) override;
  std::vector<at::Tensor> receive_gradients(int64_t microbatch) override;

 private:
  struct Sent {
    int64_t microbatch = 0;
    Activation activation;
    std::shared_ptr<const StreamPoint> landed;  // to the CPU: what the receiver waits for
  };
  const bool crosses_threads_;
  std::deque<Sent> activations_ ABSL_GUARDED_BY(mu_);
};

/// The last partition's downstream in a forward(): keeps each micro-batch's output, with its
/// graph (Note [Links that keep the graph]).
class OutputSink final : public Downstream {
 public:
  void send(int64_t microbatches, int64_t microbatch, const Batch& output,
            bool grad_enabled) override;
  /// Not used: the caller's backward reaches the outputs.
  std::vector<at::Tensor> receive_gradients(int64_t microbatch) override;
  /// The outputs, by micro-batch, taken from the sink.
  std::vector<Batch> take();

 private:
  absl::Mutex mu_;
  std::vector<Batch> outputs_ ABSL_GUARDED_BY(mu_);
};

/// The first partition's upstream: the mini-batch's micro-batches. Tensors that require grad (the
/// input has a history: layers before the pipeline) become leaves; finish() runs the input's own
/// graph once, with every micro-batch's gradients. With `keep_graph` (a forward(): Note [Links
/// that keep the graph]) the micro-batches go in as they are.
class InputSource final : public Upstream {
 public:
  InputSource(std::vector<Batch> microbatches, bool grad_enabled, bool keep_graph = false);
  Activation receive() override;
  void send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) override;
  /// The backward through the input's graph, when it has one and gradients came back.
  void finish();

 private:
  std::vector<Batch> microbatches_;
  bool grad_enabled_;
  size_t next_ = 0;
  absl::Mutex mu_;
  // Per micro-batch: the input's tensors that require grad, and their gradients.
  std::vector<std::vector<at::Tensor>> roots_;
  std::map<int64_t, std::vector<at::Tensor>> gradients_ ABSL_GUARDED_BY(mu_);
};

/// The last partition's downstream: the loss (Note [Losses over micro-batches] in loss.h), or,
/// without a loss function (inference), only the outputs.
class LossSink final : public Downstream {
 public:
  /// `whole_batch`: apply the loss once to the gathered outputs, at the first backward (every
  /// forward has run by then); else to each micro-batch as its output arrives.
  LossSink(Loss loss, at::Tensor target, bool whole_batch, std::string who);
  void send(int64_t microbatches, int64_t microbatch, const Batch& output,
            bool grad_enabled) override;
  std::vector<at::Tensor> receive_gradients(int64_t microbatch) override;

  /// After the step's forwards: the whole-batch loss, if no backward computed it (inference with
  /// a target: an evaluation loss).
  void finish();
  /// The mini-batch's loss (undefined without a loss function), without history.
  at::Tensor loss() const { return loss_; }
  /// The mini-batch's output, gathered, without history.
  Batch output() const;

 private:
  void whole_batch_loss();
  // The loss function's value, checked to be a scalar.
  at::Tensor apply_loss(const Batch& output, const at::Tensor& target) const;
  at::Tensor target_rows(int64_t microbatch, int64_t rows);
  // A micro-batch's share of the mini-batch's terms (Note [Losses over micro-batches]).
  struct Share {
    double host = 1;    // the share, where the counts are on the CPU (or the rows are the terms)
    at::Tensor device;  // else: the share, a float64 scalar on the target's device
    at::Tensor any;     // else: whether the micro-batch has terms (a bool scalar there)
  };
  Share share_of(const at::Tensor& rows);
  // What the loss averages over in `rows` of the target, checked to be a scalar.
  at::Tensor counted(const at::Tensor& rows) const;

  Loss loss_fn_;
  at::Tensor target_;
  bool whole_batch_;
  std::string who_;
  int64_t microbatches_ = 0;
  int64_t target_offset_ = 0;
  bool grad_enabled_ = true;
  std::vector<Batch> leaves_;  // per micro-batch, the output cut from its graph
  std::map<int64_t, std::vector<at::Tensor>> gradients_;
  at::Tensor loss_;
  at::Tensor total_count_;  // the loss's count over the whole target (a Loss with a count)
};

}  // namespace internal
}  // namespace gpipe
