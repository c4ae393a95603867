// Ties across stages; see tied_stages.h.
#include "gpipe/distributed/internal/tied_stages.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include "absl/strings/str_join.h"

#include "gpipe/distributed/replication.h"
#include "gpipe/internal/atomic_file.h"

namespace gpipe {
namespace distributed {
namespace internal {

TiedStages::TiedStages(const std::vector<Tie>& ties, const std::vector<int64_t>& stage_of_layer,
                       const std::vector<at::Tensor>& owners,
                       const std::vector<at::Tensor>& shapes) {
  for (size_t k = 0; k < ties.size(); ++k) {
    std::set<int64_t> stages;
    for (int64_t layer : ties[k].layers) stages.insert(stage_of_layer[layer]);
    if (stages.size() < 2) continue;
    Entry e;
    e.name = ties[k].names.front();
    e.stages.assign(stages.begin(), stages.end());
    e.owner = owners[k];
    e.like = shapes[k];
    e.requires_grad = shapes[k].requires_grad();
    entries_.push_back(std::move(e));
  }
}

std::vector<std::vector<int64_t>> TiedStages::holders() const {
  std::vector<std::vector<int64_t>> out;
  for (const Entry& e : entries_) out.push_back(e.stages);
  return out;
}

std::vector<at::Tensor> TiedStages::held_below(int64_t stage) const {
  std::vector<at::Tensor> out;
  for (const Entry& e : entries_) {
    if (e.owner.defined() && e.stages.front() < stage) out.push_back(e.owner);
  }
  return out;
}

void TiedStages::broadcast(const ProcessGroup& group, c10::Device local) const {
  at::NoGradGuard no_grad;
  for (const Entry& e : entries_) {
    const c10::Device wire = wire_device(group, e.owner.defined() && e.owner.is_cuda()
                                                    ? e.owner.device()
                                                    : local);
    std::vector<at::Tensor> one{e.owner.defined()
                                    ? e.owner.detach().to(wire).contiguous()
                                    : at::empty(e.like.sizes(), e.like.options().device(wire))};
    c10d::BroadcastOptions options;
    options.rootRank = static_cast<int>(e.stages.front());
    check_collective(group, "the broadcast of a tied parameter from the first stage holding it",
                     [&] { group->broadcast(one, options)->wait(); });
    if (e.owner.defined() && !one[0].is_same(e.owner)) e.owner.detach().copy_(one[0]);
  }
}

void TiedStages::check_equal(const ProcessGroup& group, c10::Device local) const {
  if (entries_.empty()) return;
  // Per tie, [h, -h] where this stage holds it (h: its bytes' FNV-1a, 62 bits, so that -h is an
  // int64 too) and the least int64 twice elsewhere: the maximum over the stages of both words is
  // the holders' greatest h and minus their least, equal when the holders agree. Exact for any
  // dtype, inf and NaN alike, and two words per tie on the wire.
  const int64_t n = static_cast<int64_t>(entries_.size());
  at::Tensor words = at::full({2 * n}, std::numeric_limits<int64_t>::min(), at::kLong);
  int64_t* w = words.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    const at::Tensor& owner = entries_[static_cast<size_t>(k)].owner;
    if (!owner.defined()) continue;
    const at::Tensor bytes = owner.detach().to(c10::kCPU).contiguous();
    const auto h =
        static_cast<int64_t>(gpipe::internal::checksum(bytes.data_ptr(), bytes.nbytes()) >> 2);
    w[2 * k] = h;
    w[2 * k + 1] = -h;
  }
  std::vector<at::Tensor> both{words.to(wire_device(group, local))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  check_collective(group, "the check of tied parameters across the stages holding them",
                   [&] { group->allreduce(both, options)->wait(); });
  const at::Tensor reduced = both[0].to(c10::kCPU);
  const int64_t* r = reduced.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    const Entry& e = entries_[static_cast<size_t>(k)];
    TORCH_CHECK(r[2 * k] == -r[2 * k + 1], "gpipe::distributed: tied parameter ", e.name,
                " differs between the stages holding it (", absl::StrJoin(e.stages, ", "),
                "); every stage's optimizer must step it alike (the same optimizer, learning "
                "rate and weight decay on each, and stage->clip_grad_norm, which counts it once: "
                "Note [Ties across stages])");
  }
}

void TiedStages::begin_step() {
  for (Entry& e : entries_) {
    if (!e.requires_grad || !e.owner.defined()) continue;
    e.before = e.owner.grad();
    e.owner.mutable_grad() = at::Tensor();
  }
}

void TiedStages::sum_gradients(const ProcessGroup& group, c10::Device local,
                               const std::function<void()>& check) {
  at::NoGradGuard no_grad;
  // Per dtype, in the ties' order (the same on every stage).
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const Entry& e : entries_) {
    if (!e.requires_grad) continue;
    // A stand-in without a gradient where this stage holds none: zeros, flag 0.
    by_dtype[e.like.scalar_type()].push_back(
        e.owner.defined() ? e.owner : at::empty(e.like.sizes(), e.like.options()));
  }
  for (auto& [dtype, tensors] : by_dtype) {
    const at::Tensor& first = tensors[0];
    const c10::Device wire = wire_device(group, first.is_cuda() ? first.device() : local);
    std::vector<at::Tensor> flat{pack_gradients(tensors, wire)};
    all_reduce_sum(group, flat, "the all-reduce of tied parameters' gradients over the stages",
                   check);
    unpack_averages(tensors, flat[0]);  // sums: not divided
  }
  // Note [Ties across stages]: the earlier steps' gradients back.
  for (Entry& e : entries_) {
    if (!e.before.defined()) continue;
    if (e.owner.grad().defined()) e.before.add_(e.owner.grad());
    e.owner.mutable_grad() = std::move(e.before);
    e.before = at::Tensor();
  }
}

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
