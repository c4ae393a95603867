// Ties across stages: a tied parameter whose places lie in several processes of a pipeline (the
// token embedding on the first stage, the output projection on the last), kept one parameter by
// collectives over the pipeline's group.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "gpipe/distributed/process_group.h"
#include "gpipe/tied_parameters.h"

namespace gpipe {
namespace distributed {
namespace internal {

// Note [Ties across stages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every process builds the whole model, so every stage knows every tie (Note [Tied parameters] in
// gpipe/tied_parameters.h) and which stages hold a place of it. Each such stage keeps its own
// tensor for it (its owner in this process). They stay one parameter:
//
// - At construction, every stage holding the tie takes the value of the first of them (the
//   lowest stage): one broadcast over the pipeline's group per tie.
// - After each step's backward, and after this stage's own copies were summed into its owner,
//   the stages sum the tie's gradient: one all-reduce over the pipeline's group per dtype, every
//   tie packed in it, a flag beside each (a tie no stage has a gradient for keeps none, as in
//   Note [Parameters that no replica used]). Every stage, holding the tie or not, then has the
//   gradient the plain model's one parameter has, and the stages holding it step it alike, so
//   the copies stay equal without being sent again.
// - Replicated stages (S x R) do this within each pipeline first; the replicas' average then
//   averages the sums as it averages every other gradient.
//
// Every stage of the pipeline takes part in these collectives, those without the tie with zeros:
// every rank then calls the same collectives in the same order, and no group of its own is made
// for the stages of each tie (Megatron makes an embedding group of the first and the last stage
// only). The cost: stages between them move the tie's size of zeros once per step. The sum runs
// inside step(): an optimizer stepping one stage's parameters() after step() returns sees the
// summed gradient.
//
// Nothing sends a tie again after construction, so a stage whose optimizer steps it otherwise
// (another learning rate, weight decay or clipping) would part it from the others silently.
// check_equal() (PipelineStage::check_ties, called by save_training before it writes) finds that:
// one all-reduce of each holder's checksum of the tie's bytes (its maximum and minus its
// minimum), equal when the holders agree.
//
// Only the step's own gradients are summed. Gradients accumulated over several steps before the
// optimizer's (gradient accumulation) already hold the earlier steps' sums on every stage:
// summing the whole gradient again would count them once per stage. So begin_step() sets each
// owner's gradient aside, the step's backward starts it afresh, and sum_gradients() adds the
// summed fresh one to what was set aside.

/// The ties of a pipeline whose places lie in two or more stages, as this stage sees them.
class TiedStages {
 public:
  /// `ties` over the whole model; `stage_of_layer[i]` the stage that runs layer i; `owners` this
  /// stage's tensor of each tie (TiedCopies::owners(); undefined where it holds none); `shapes`
  /// one tensor per tie with its shape and dtype (the whole model's).
  TiedStages(const std::vector<Tie>& ties, const std::vector<int64_t>& stage_of_layer,
             const std::vector<at::Tensor>& owners, const std::vector<at::Tensor>& shapes);

  /// Whether any tie spans stages.
  bool empty() const { return entries_.empty(); }
  /// The stages holding each tie that spans stages (for tests and messages).
  std::vector<std::vector<int64_t>> holders() const;
  /// This stage's tensors of the ties that a lower stage holds too, which that stage counts
  /// (Note [Clipping by the global norm] in gpipe/clip_grad.h).
  std::vector<at::Tensor> held_below(int64_t stage) const;
  /// Every holder takes the value of the lowest stage holding the tie (a collective over `group`).
  void broadcast(const ProcessGroup& group, c10::Device local) const;
  /// Throws c10::Error, on every stage, where a tie's holders hold different values (a
  /// collective over `group`: Note [Ties across stages]).
  void check_equal(const ProcessGroup& group, c10::Device local) const;
  /// Before a step's backward: sets the owners' gradients aside (Note [Ties across stages]).
  void begin_step();
  /// Sums the step's gradients of the ties over `group` (a collective), calling `check` while it
  /// waits, and adds what begin_step() set aside.
  void sum_gradients(const ProcessGroup& group, c10::Device local,
                     const std::function<void()>& check);

 private:
  struct Entry {
    std::string name;             // its first place's
    std::vector<int64_t> stages;  // ascending
    at::Tensor owner;             // undefined where this stage holds none
    at::Tensor like;              // shape and dtype
    bool requires_grad = true;
    at::Tensor before;            // the owner's gradient from earlier steps (begin_step)
  };
  std::vector<Entry> entries_;
};

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
