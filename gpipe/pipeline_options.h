// The options that GPipe and PipelineStage share: the checkpoint modes, one core of fields and
// setters (PipelineOptions), and one check of them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/modules/container/sequential.h>

#include "gpipe/schedule_option.h"
#include "gpipe/tied_parameters.h"

namespace gpipe {

/// When micro-batches are checkpointed (their activations recomputed in backward instead of
/// kept). Only in training mode with grad mode on; never in eval mode.
enum class Checkpoint {
  /// Every micro-batch.
  kAlways,
  /// Every micro-batch but the last, whose backward starts right after its forward (default).
  kExceptLast,
  /// None: fastest, most memory.
  kNever,
};

/// How many micro-batches of `chunks` a training forward with `mode` checkpoints (the first ones):
/// chunks, chunks - 1 or 0.
int64_t checkpoint_stop(Checkpoint mode, int64_t chunks);

/// A checkpoint mode's name: "always", "except_last" or "never".
std::string checkpoint_name(Checkpoint mode);
/// The checkpoint mode of a name that checkpoint_name gives; throws c10::Error naming an unknown
/// name.
Checkpoint checkpoint_from_name(const std::string& name);

// Note [One options core]
// ~~~~~~~~~~~~~~~~~~~~~~~
// GPipeOptions and PipelineStageOptions mean the same by the same names: the balance, chunks,
// checkpoint mode, deferred batch norm, tied parameters and schedule are one core of fields
// (PipelineOptionsCore), set through PipelineOptions<Derived>, whose setters return the derived
// options so that one chain mixes shared and own options; check_shared_options checks the core
// for both, with the caller's name opening each message. Each class adds only what is its own:
// GPipe its devices; a stage its devices, its split into partitions and its shared memory.

/// The fields GPipeOptions and PipelineStageOptions share (Note [One options core]); set them
/// through either.
class PipelineOptionsCore {
 public:
  /// Layers per partition of a GPipe, or per stage of a pipeline across processes (per virtual
  /// stage when interleaved); they must add up to the number of layers.
  const std::vector<int64_t>& balance() const noexcept { return balance_; }
  /// The balance, to change in place.
  std::vector<int64_t>& balance() noexcept { return balance_; }
  /// Micro-batches per mini-batch (fewer when the mini-batch has fewer samples).
  int64_t chunks() const noexcept { return chunks_; }
  /// Which micro-batches are checkpointed.
  Checkpoint checkpoint() const noexcept { return checkpoint_; }
  /// Whether BatchNorm layers update their running statistics once per mini-batch, as if they had
  /// seen it whole, instead of once per micro-batch (Note [Deferred batch norm without replacing
  /// modules] in batchnorm.h).
  bool deferred_batch_norm() const noexcept { return deferred_batch_norm_; }
  /// Pairs of parameters ("<layer name>.<parameter>", as the Sequential's named_parameters() names
  /// them) that are one parameter of the model (Varuna's shared_weights): the second takes the
  /// first's value, their gradients are summed and they stay equal (Note [Tied parameters]). A
  /// tensor held by several layers is tied without being named.
  const TiedNames& tied_parameters() const noexcept { return tied_parameters_; }
  /// The schedule of step() (docs/schedules.md; Note [One schedule option]).
  const PipelineSchedule& schedule() const noexcept { return schedule_; }
  /// Whether the deprecated record_timeline option was set: the model's initial switch.
  bool initially_records_timeline() const noexcept { return record_timeline_; }

 protected:
  /// The options with `balance` and every other field at its default.
  explicit PipelineOptionsCore(std::vector<int64_t> balance) : balance_(std::move(balance)) {}

  std::vector<int64_t> balance_;  ///< balance()
  int64_t chunks_ = 1;  ///< chunks()
  Checkpoint checkpoint_ = Checkpoint::kExceptLast;  ///< checkpoint()
  bool deferred_batch_norm_ = false;  ///< deferred_batch_norm()
  TiedNames tied_parameters_;  ///< tied_parameters()
  PipelineSchedule schedule_;  ///< schedule()
  bool record_timeline_ = false;  ///< initially_records_timeline()
};

/// The setters of the shared fields, each returning the derived options (Note [One options
/// core]).
template <typename Derived>
class PipelineOptions : public PipelineOptionsCore {
 public:
  using PipelineOptionsCore::balance;
  using PipelineOptionsCore::checkpoint;
  using PipelineOptionsCore::chunks;
  using PipelineOptionsCore::deferred_batch_norm;
  using PipelineOptionsCore::schedule;
  using PipelineOptionsCore::tied_parameters;

  /// Sets balance(): layers per partition (GPipe) or per stage (PipelineStage).
  Derived& balance(std::vector<int64_t> balance) { return set(balance_, std::move(balance)); }
  /// Sets chunks(): micro-batches per mini-batch, at least 1.
  Derived& chunks(int64_t chunks) { return set(chunks_, chunks); }
  /// Sets checkpoint(): which micro-batches are checkpointed.
  Derived& checkpoint(Checkpoint mode) { return set(checkpoint_, mode); }
  /// Sets deferred_batch_norm(): running statistics once per mini-batch.
  Derived& deferred_batch_norm(bool deferred) { return set(deferred_batch_norm_, deferred); }
  /// Sets tied_parameters(): pairs of parameter names that are one parameter.
  ///
  ///   // The output projection (layer 5) shares the token embedding's (layer 0) weight.
  ///   gpipe::GPipeOptions({3, 3}).tied_parameters({{"0.weight", "5.weight"}})
  Derived& tied_parameters(TiedNames names) { return set(tied_parameters_, std::move(names)); }
  /// A kind — GPipe's fill-drain (the default), 1F1B, interleaved 1F1B, zero bubble (ZB-H1) —,
  /// interleaved 1F1B with its virtual stages (PipelineSchedule::interleaved), or a schedule
  /// written as text (PipelineSchedule::text, GPipe's only); checked at construction. It replaces
  /// the whole value, including what the deprecated setters below set before.
  ///
  ///   gpipe::GPipeOptions({2, 2}).chunks(8).schedule(gpipe::ScheduleKind::k1F1B)
  ///   gpipe::GPipeOptions({1, 1, 1, 1}).chunks(8)
  ///       .schedule(gpipe::PipelineSchedule::interleaved(/*virtual_stages=*/2))
  Derived& schedule(PipelineSchedule schedule) { return set(schedule_, std::move(schedule)); }
  /// A kind, keeping the virtual stages and group set by the deprecated setters below.
  Derived& schedule(ScheduleKind kind) {
    schedule_.set_kind(kind);
    return self();
  }

  // Deprecated spellings (Note [One schedule option]); each sets one field of schedule().
  /// Deprecated: the virtual stages of schedule(); use
  /// schedule(PipelineSchedule::interleaved(virtual_stages)).
  [[deprecated("use schedule(gpipe::PipelineSchedule::interleaved(virtual_stages))")]]
  Derived& virtual_stages(int64_t v) {
    schedule_.set_virtual_stages(v);
    return self();
  }
  /// Deprecated: the micro-batch group of schedule(); use
  /// schedule(PipelineSchedule::interleaved(virtual_stages, group)).
  [[deprecated("use schedule(gpipe::PipelineSchedule::interleaved(virtual_stages, group))")]]
  Derived& microbatch_group(int64_t group) {
    schedule_.set_microbatch_group(group);
    return self();
  }
  /// Deprecated: whether the model starts recording its timeline; use the model's
  /// record_timeline(true), a switch at run time.
  [[deprecated("use the model's record_timeline(true) (a switch at run time)")]]
  Derived& record_timeline(bool on) {
    return set(record_timeline_, on);
  }

 protected:
  /// The options with `balance` and every other field at its default.
  using PipelineOptionsCore::PipelineOptionsCore;

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
  template <typename T, typename V>
  Derived& set(T& field, V&& value) {
    field = std::forward<V>(value);
    return self();
  }
};

namespace internal {
/// The checks of the shared options, GPipe's and PipelineStage's alike, with `who` opening each
/// message: chunks at least 1, a module that can be split, a balance of positive entries adding up
/// to its layers (at most `max_partitions` of them) and skips that are stashed before they are
/// popped. The schedule is checked by check_schedule_option (schedule_option.h).
void check_shared_options(const PipelineOptionsCore& options, const torch::nn::Sequential& module,
                          size_t max_partitions, const std::string& who);
}  // namespace internal

}  // namespace gpipe
