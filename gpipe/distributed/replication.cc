// Keeping replicas equal; see replication.h.
#include "gpipe/distributed/replication.h"

#include <chrono>
#include <functional>
#include <map>
#include <thread>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gpipe {
namespace distributed {

void broadcast_from_rank0(const ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                          const std::string& what, c10::Device local) {
  if (group->getSize() == 1) {
    return;
  }
  at::NoGradGuard no_grad;
  // (Gloo broadcasts CPU and GPU tensors where they are; NCCL only GPU ones.)
  const bool device_wire = carries_device_tensors(group);
  for (const at::Tensor& t : tensors) {
    const c10::Device device =
        !device_wire ? t.device() : wire_device(group, t.is_cuda() ? t.device() : local);
    std::vector<at::Tensor> one{t.detach().to(device).contiguous()};
    check_collective(group, absl::StrCat("the broadcast of ", what),
                     [&] { group->broadcast(one)->wait(); });
    if (!one[0].is_same(t)) {
      t.detach().copy_(one[0]);
    }
  }
}

at::Tensor pack_gradients(const std::vector<at::Tensor>& params, c10::Device wire,
                          const std::vector<double>& extra) {
  std::vector<at::Tensor> pieces;
  std::vector<double> flags;
  for (const at::Tensor& p : params) {
    const at::Tensor& grad = p.grad();
    pieces.push_back(grad.defined() ? grad.detach().reshape(-1).to(wire)
                                    : at::zeros({p.numel()}, p.options().device(wire)));
    flags.push_back(grad.defined() ? 1 : 0);
  }
  flags.insert(flags.end(), extra.begin(), extra.end());
  pieces.push_back(at::tensor(flags, at::kDouble).to(pieces[0].options()));
  return at::cat(pieces);
}

void unpack_averages(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  int64_t elements = 0;
  for (const at::Tensor& p : params) elements += p.numel();
  const at::Tensor anyone = flat.narrow(0, elements, static_cast<int64_t>(params.size()))
                                .to(at::kCPU, at::kDouble);
  int64_t offset = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const at::Tensor& p = params[k];
    const at::Tensor average = flat.narrow(0, offset, p.numel()).view_as(p);
    offset += p.numel();
    if (anyone[static_cast<int64_t>(k)].item<double>() <= 0) continue;  // stays undefined
    if (p.grad().defined()) {
      p.mutable_grad().copy_(average);
    } else {
      p.mutable_grad() = average.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
    }
  }
}

void average_gradients(const ProcessGroup& group, const std::vector<at::Tensor>& params,
                       c10::Device local, const std::function<void()>& check) {
  if (group->getSize() == 1) {
    return;
  }
  at::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& p : params) {
    if (!p.requires_grad()) continue;
    by_dtype[p.scalar_type()].push_back(p);
  }
  for (auto& [dtype, ps] : by_dtype) {
    const c10::Device wire = wire_device(group, ps[0].is_cuda() ? ps[0].device() : local);
    std::vector<at::Tensor> flat{pack_gradients(ps, wire)};
    all_reduce_sum(group, flat, "the all-reduce of the replicas' gradients", check);
    flat[0].div_(group->getSize());
    unpack_averages(ps, flat[0]);
  }
}

void all_reduce_sum(const ProcessGroup& group, std::vector<at::Tensor>& tensors,
                    const std::string& what, const std::function<void()>& check) {
  check_collective(group, what, [&] {
    const c10::intrusive_ptr<c10d::Work> work = group->allreduce(tensors);
    while (check && !work->isCompleted()) {
      check();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    work->wait();
  });
}

bool any_rank(const ProcessGroup& group, bool mine, c10::Device local) {
  if (group->getSize() == 1) return mine;
  std::vector<at::Tensor> flag{
      at::tensor({mine ? 1.0 : 0.0}, at::kFloat).to(wire_device(group, local))};
  all_reduce_sum(group, flag, "the all-reduce of whether a gradient is inf or NaN");
  return flag[0].item<double>() > 0;
}

void combine_statistics(const ProcessGroup& group, std::vector<BatchNormStatistics>& stats,
                        c10::Device local, const std::function<void()>& check, bool failed_here,
                        const std::function<void()>& posted) {
  // First whether this rank's forward failed, then each layer's count, mean and m2.
  std::vector<at::Tensor> pieces{at::tensor({failed_here ? 1.0 : 0.0}, at::kDouble)};
  for (const BatchNormStatistics& s : stats) {
    pieces.push_back(at::tensor({s.count}, at::kDouble));
    pieces.push_back(s.mean.to(at::kCPU, at::kDouble).reshape(-1));
    pieces.push_back(s.m2.to(at::kCPU, at::kDouble).reshape(-1));
  }
  const std::vector<at::Tensor> all = all_gather(group, at::cat(pieces), local,
                                                 "the all-gather of batch norm statistics", check,
                                                 posted);
  std::vector<int> failed;
  for (int r = 0; r < group->getSize(); ++r) {
    if (all[static_cast<size_t>(r)][0].item<double>() > 0) failed.push_back(r);
  }
  TORCH_CHECK(failed.empty(), "gpipe::DataParallel: the forward failed on rank",
              failed.size() > 1 ? "s " : " ", absl::StrJoin(failed, ", "), " of ",
              group->getSize(), " (", failed.size() > 1 ? "their" : "its", " own error is raised "
              "there), so no replica updated its batch norm statistics in this step and rank ",
              group->getRank(), "'s forward stops too; every replica's collectives still pair: "
              "go on with the next step");
  int64_t offset = 1;
  for (BatchNormStatistics& s : stats) {
    const int64_t channels = s.mean.numel();
    BatchNormStatistics merged;  // in rank order, on the CPU
    for (const at::Tensor& theirs : all) {
      merged.merge(theirs[offset].item<double>(), theirs.narrow(0, offset + 1, channels),
                   theirs.narrow(0, offset + 1 + channels, channels));
    }
    offset += 1 + 2 * channels;
    if (merged.count > 0) {
      s.count = merged.count;
      s.mean = merged.mean.to(s.mean.device()).view_as(s.mean);
      s.m2 = merged.m2.to(s.m2.device()).view_as(s.m2);
    }
  }
}

}  // namespace distributed
}  // namespace gpipe
