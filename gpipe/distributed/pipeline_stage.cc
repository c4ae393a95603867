// A pipeline stage in a process of its own; see pipeline_stage.h and Note [Stage-local backward].
#include "gpipe/distributed/pipeline_stage.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "gpipe/distributed/internal/configuration.h"
#include "gpipe/distributed/internal/fault.h"
#include "gpipe/distributed/internal/shared_memory.h"
#include "gpipe/distributed/internal/remote_link.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/internal/tied_stages.h"
#include "gpipe/distributed/internal/transfer.h"
#include "gpipe/device.h"
#include "gpipe/internal/executor.h"
#include "gpipe/internal/partition.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/skippable.h"
#include "gpipe/internal/stream.h"
#include "gpipe/thread_state.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace distributed {
PipelineStageImpl::PipelineStageImpl(const torch::nn::Sequential& module,
                                     PipelineStageOptions options, ProcessGroup group)
    : PipelineStageImpl(module, std::move(options), std::move(group), ProcessGroup()) {}

namespace {

// The options against the group and the model, before anything is placed.
void check_options(const PipelineStageOptions& options, const ProcessGroup& group,
                   const torch::nn::Sequential& module, const char* who) {
  TORCH_CHECK(group, who, ": the process group is null; make one with "
              "gpipe::distributed::new_gloo_group");
  const std::vector<int64_t>& balance = options.balance();
  gpipe::internal::check_shared_options(options, module, balance.size(), who);
  const PipelineSchedule& schedule = options.schedule();
  const int64_t v = schedule.virtual_stages();
  TORCH_CHECK(!schedule.is_text(), who,
              ": a schedule written as text is for gpipe::GPipe; give "
              "a stage a ScheduleKind or PipelineSchedule::interleaved(v)");
  TORCH_CHECK(v >= 1 && v <= internal::kMaxChannels, who, ": virtual_stages must be between 1 and ",
              internal::kMaxChannels, ", got ", v);
  TORCH_CHECK(options.shared_memory() == 0 || options.shared_memory() >= internal::kMinSharedRing,
              who, ": shared_memory is ", options.shared_memory(), " bytes; a ring needs at least ",
              internal::kMinSharedRing, " (256 KiB), or 0 for none");
  TORCH_CHECK(options.chunks() <= internal::kMaxMicrobatches, who, ": chunks is ", options.chunks(),
              "; at most ", internal::kMaxMicrobatches,
              " micro-batches cross processes in one step");
  const int ranks = group->getSize();
  // (A balance of the wrong size is refused, naming it, once the skips are checked: place().)
  if (static_cast<int64_t>(balance.size()) == ranks * v) {
    check_schedule_option(schedule, static_cast<int64_t>(balance.size()), options.chunks(), who);
  }
  // (A GPipe's step may split a mini-batch into fewer micro-batches than chunks, a multiple of
  // the ranks; a stage's cannot: every stage plans the step for chunks micro-batches.)
  TORCH_CHECK(!schedule.interleaves() || schedule.microbatch_group() > 0 ||
                  options.chunks() % ranks == 0,
              who, ": the interleaved schedule needs chunks to be a multiple of the number of "
              "stages (", ranks, "), got ", options.chunks());
  if (schedule.interleaves() || v_shaped(schedule.kind())) {
    // Note [Interleaving across processes].
    const std::string name = schedule.interleaves()
                                 ? std::string("interleaved")
                                 : absl::StrCat("V-shaped ", schedule_kind_name(schedule.kind()));
    TORCH_CHECK(ranks >= 2, who, ": the ", name,
                " schedule across processes needs at least 2 "
                "stages, got a group of ",
                ranks, "; run it in one process with GPipe");
    TORCH_CHECK(matches_by_tag(group), who, ": the ", name,
                " schedule across processes needs a "
                "group that matches transfers by tag (Gloo: new_gloo_group); on a group that "
                "matches them in posting order (NCCL), use ScheduleKind::k1F1B or kZeroBubble");
    TORCH_CHECK(options.local_balance().empty() && options.devices().size() <= 1, who,
                ": with the ", name,
                " schedule each of a stage's virtual stages is a partition "
                "of its own; local_balance and several devices cannot split them further (leave "
                "local_balance empty and give at most one device)");
  }
}

// Stage `stage`'s layers per partition (Note [Partitions within a stage]), checked.
std::vector<int64_t> local_balance_of(const PipelineStageOptions& options, int64_t stage,
                                      const char* who) {
  const std::vector<int64_t>& balance = options.balance();
  const std::vector<c10::Device>& devices = options.devices();
  std::vector<int64_t> local_balance = options.local_balance();
  TORCH_CHECK(!local_balance.empty() || devices.size() <= 1, who, ": devices has ",
              devices.size(), " devices but local_balance is empty; give this stage's "
              "layers per partition, one entry per device");
  if (local_balance.empty()) local_balance = {balance[stage]};
  const std::string shown = absl::StrCat("{", absl::StrJoin(local_balance, ", "), "}");
  for (int64_t b : local_balance) {
    TORCH_CHECK(b > 0, who, ": local_balance ", shown, " has a non-positive entry ", b,
                "; every partition needs at least one layer");
  }
  const int64_t local_sum =
      std::accumulate(local_balance.begin(), local_balance.end(), int64_t{0});
  TORCH_CHECK(local_sum == balance[stage], who, ": local_balance ", shown, " adds up to ",
              local_sum, " layers, but stage ", stage, " has ", balance[stage],
              " (its entry of balance {", absl::StrJoin(balance, ", "), "})");
  TORCH_CHECK(devices.size() <= 1 || devices.size() == local_balance.size(), who,
              ": devices has ", devices.size(), " devices but local_balance ", shown, " has ",
              local_balance.size(), " partitions; give one device per partition, or one for "
              "the stage");
  return local_balance;
}

// The rank that holds each entry of balance: the schedule's placement (Schedule::stage_ranks;
// Note [V-shaped placement]); for a balance of the wrong size, refused in place() once the skips
// are checked, entry k on rank k mod n.
std::vector<int64_t> placement(const PipelineStageOptions& options, int ranks) {
  const PipelineSchedule& schedule = options.schedule();
  const int64_t entries = static_cast<int64_t>(options.balance().size());
  const int64_t v = schedule.virtual_stages();
  if (entries == ranks * v) {
    const int64_t group = schedule.interleaves() ? schedule.microbatch_group() : 0;
    return make_schedule(schedule.kind(), ranks, options.chunks(), v, group).stage_ranks;
  }
  std::vector<int64_t> ranks_of(static_cast<size_t>(entries));
  for (int64_t k = 0; k < entries; ++k) ranks_of[k] = k % ranks;
  return ranks_of;
}

}  // namespace

PipelineStageImpl::PipelineStageImpl(const torch::nn::Sequential& module,
                                     PipelineStageOptions options, ProcessGroup group,
                                     ProcessGroup replica_group)
    : options_(std::move(options)),
      group_(std::move(group)),
      replica_group_(std::move(replica_group)) {
  const char* who = "gpipe::distributed::PipelineStage";
  check_options(options_, group_, module, who);
  record_timeline_ = options_.initially_records_timeline();
  std::vector<c10::Device> devices;
  std::vector<torch::nn::Sequential> local = place(module, devices, who);
  start_partitions(module, std::move(local), devices, who);
  connect(module, who);
}

std::vector<torch::nn::Sequential> PipelineStageImpl::place(const torch::nn::Sequential& module,
                                                            std::vector<c10::Device>& devices,
                                                            const char* who) {
  const std::vector<int64_t>& balance = options_.balance();
  const int64_t v = options_.schedule().virtual_stages();
  const int ranks = group_->getSize();
  const int rank = group_->getRank();
  stage_ = rank;
  stage_ranks_ = placement(options_, ranks);
  held_.clear();
  for (size_t k = 0; k < stage_ranks_.size(); ++k) {
    if (stage_ranks_[k] == rank) held_.push_back(static_cast<int64_t>(k));
  }
  // Only this stage's layers move to its device; the others stay on the CPU.
  const std::vector<c10::Device>& given = options_.devices();
  if (given.size() == 1) {
    check_device_available(given[0], absl::StrCat(who, ": the stage's device"));
  }
  for (size_t j = 0; given.size() > 1 && j < given.size(); ++j) {
    check_device_available(given[j], absl::StrCat(who, ": local partition ", j));
  }
  const c10::Device first_device = given.empty() ? c10::Device(c10::kCPU) : given[0];
  std::vector<c10::Device> placed(balance.size(), c10::Device(c10::kCPU));
  for (int64_t k : held_) placed[k] = first_device;
  // Note [Tied parameters]: a tensor shared across devices becomes a clone's copy.
  ties_ = find_ties(module, options_.tied_parameters(), who);
  const std::vector<torch::nn::Sequential> parts = gpipe::internal::split_module(
      clone_across_devices(module, gpipe::internal::layer_devices(balance, placed), who), balance,
      placed);
  const std::vector<SkipKey> crossing = SkipLayout(parts).crossing();
  const char* part = v > 1 ? "virtual stage" : "stage";
  TORCH_CHECK(crossing.empty(), who, ": the skip '", crossing.empty() ? "" : crossing[0].name,
              "' is stashed in one ", part, " and popped in another; ",
              v > 1 ? "with virtual stages (interleaved, V-shaped) skips cannot cross them"
                    : "skips cannot cross processes",
              ". Choose a balance that keeps each stash and its pop in one ", part);
  TORCH_CHECK(static_cast<int64_t>(balance.size()) == ranks * v, who, ": the balance has ",
              balance.size(), v > 1 ? " entries" : " stages", " ({", absl::StrJoin(balance, ", "),
              "}) but the process group has ", ranks, " ranks",
              v > 1 ? absl::StrCat(" of ", v, " virtual stages each") : std::string(),
              "; give one entry per ",
              v > 1 ? "virtual stage (ranks * virtual_stages)" : "process of the pipeline");
  std::vector<torch::nn::Sequential> local;
  if (v > 1) {
    // This stage's virtual stages, each a partition; layers() holds them all, in order.
    layers_ = torch::nn::Sequential();
    for (int64_t k : held_) {
      local.push_back(parts[k]);
      layers_->extend(*local.back());
      devices.push_back(first_device);
    }
  } else {
    // This stage's partitions (Note [Partitions within a stage]).
    const std::vector<int64_t> local_balance = local_balance_of(options_, stage_, who);
    devices = given.size() == local_balance.size()
                  ? given
                  : std::vector<c10::Device>(local_balance.size(), first_device);
    layers_ = clone_across_devices(parts[stage_],
                                   gpipe::internal::layer_devices(local_balance, devices), who);
    local = gpipe::internal::split_module(layers_, local_balance, devices);
  }
  register_module("layers", layers_);
  return local;
}

void PipelineStageImpl::start_partitions(const torch::nn::Sequential& module,
                                         std::vector<torch::nn::Sequential> local,
                                         const std::vector<c10::Device>& devices, const char* who) {
  std::vector<int64_t> stage_of_layer;
  const std::vector<int64_t>& balance = options_.balance();
  for (size_t k = 0; k < balance.size(); ++k) {
    stage_of_layer.insert(stage_of_layer.end(), balance[k], stage_ranks_[k]);
  }
  tied_ = std::make_shared<TiedCopies>(ties_, local);
  const auto whole = module->named_parameters();
  std::vector<at::Tensor> shapes;
  for (const Tie& tie : ties_) shapes.push_back(whole[tie.names[0]]);
  tied_stages_ =
      std::make_unique<internal::TiedStages>(ties_, stage_of_layer, tied_->owners(), shapes);
  skip_layout_ = SkipLayout(local);
  // Partitions run at the same time on threads of their own (as a GPipe's CPU partitions, and
  // with the same caveats about random numbers); a stage's virtual stages run on one thread, in
  // the schedule's order.
  const bool interleaved = holds_virtual_stages();
  if (!interleaved) {
    std::vector<int64_t> threads(local.size());
    std::iota(threads.begin(), threads.end(), int64_t{0});
    gpipe::internal::check_concurrent_generators(
        absl::StrCat(who, " (stage ", stage_, ")"), local, devices, threads,
        checkpoint_stop(options_.checkpoint(), options_.chunks()) > 0);
  }
  for (size_t j = 0; j < local.size(); ++j) {
    gpipe::internal::ExecutorPartition p;
    p.layers = local[j];
    p.device = devices[j];
    p.batch_norms = std::make_shared<BatchNormLayers>(p.layers->modules(/*include_self=*/false));
    p.grad_record = std::make_shared<GradRecord>();
    // The first partition runs on the thread that calls step(), and so do virtual stages.
    if (j == 0 || !interleaved) {
      workers_.push_back(
          j > 0 ? std::make_unique<Worker>(absl::StrCat("stage ", stage_, " part ", j)) : nullptr);
    }
    partitions_.push_back(std::move(p));
  }
}

void PipelineStageImpl::connect(const torch::nn::Sequential& module, const char* who) {
  // Transfers with the neighbouring stages: through the CPU (Gloo), or on this stage's first
  // GPU (NCCL).
  local_ = partitions_[0].device;
  for (const gpipe::internal::ExecutorPartition& p : partitions_) {
    if (p.device.is_cuda()) {
      local_ = p.device;
      break;
    }
  }
  wire_ = wire_device(group_, local_);
  courier_ = std::make_unique<Worker>(absl::StrCat("send ", stage_));
  check_same_configuration(*module);
  // Note [Shared memory between stages on one host]: the links run_step uses.
  if (stages() > 1 && options_.shared_memory() > 0 && internal::packs_activations(group_)) {
    std::vector<internal::SharedLinks::Spec> specs;
    for (const Link& l : links()) specs.push_back({l.downstream, l.peer, l.channel});
    shared_ = std::make_unique<internal::SharedLinks>(group_, local_, specs,
                                                      options_.shared_memory(), who);
  }
  tied_stages_->broadcast(group_, local_);  // Note [Ties across stages]
  const char* stepping = "gpipe::distributed::PipelineStage::step";
  if (replica_group_) {
    std::vector<at::Tensor> state = layers_->parameters();
    for (const at::Tensor& b : layers_->buffers()) state.push_back(b);
    broadcast_from_rank0(replica_group_, state, "replica 0's parameters and buffers", local_);
    if (internal::FaultChannel::can_hear_any(replica_group_)) {
      replica_faults_ = std::make_unique<internal::FaultChannel>(replica_group_, stepping);
    }
  }
  if (internal::FaultChannel::can_hear_any(group_)) {
    faults_ = std::make_unique<internal::FaultChannel>(group_, stepping);
  }
}

PipelineStageImpl::~PipelineStageImpl() = default;

std::vector<PipelineStageImpl::Link> PipelineStageImpl::links() const {
  std::vector<Link> out;
  if (stages() < 2) return out;
  // A partition's chunk on the stage that holds it: the channel of the links it sends on.
  const auto chunk_of = [this](int64_t k) {
    return static_cast<int64_t>(
        std::count(stage_ranks_.begin(), stage_ranks_.begin() + k, stage_ranks_[k]));
  };
  const int64_t last = static_cast<int64_t>(stage_ranks_.size()) - 1;
  const int64_t v = holds_virtual_stages() ? static_cast<int64_t>(held_.size()) : 1;
  for (int64_t c = 0; c < v; ++c) {
    // Partition k hears from k - 1, unless it is the first or k - 1 is on this stage too.
    const int64_t k = held_[c];
    if (k > 0 && stage_ranks_[k - 1] != stage_) {
      out.push_back({false, static_cast<int>(stage_ranks_[k - 1]), chunk_of(k - 1), c});
    }
  }
  for (int64_t c = 0; c < v; ++c) {
    const int64_t k = held_[c];
    if (k < last && stage_ranks_[k + 1] != stage_) {
      out.push_back({true, static_cast<int>(stage_ranks_[k + 1]), c, c});
    }
  }
  return out;
}

std::vector<at::Tensor> PipelineStageImpl::parameters(bool recurse) const {
  return named_parameters(recurse).values();
}

torch::OrderedDict<std::string, at::Tensor> PipelineStageImpl::named_parameters(
    bool recurse) const {
  return unique_parameters(torch::nn::Module::named_parameters(recurse), tied_.get());
}

std::vector<std::vector<int64_t>> PipelineStageImpl::tied_stages() const {
  return tied_stages_->holders();
}

void PipelineStageImpl::check_ties() const { tied_stages_->check_equal(group_, local_); }

int64_t PipelineStageImpl::partitions() const { return static_cast<int64_t>(partitions_.size()); }

int64_t PipelineStageImpl::shared_memory_links() const { return shared_ ? shared_->size() : 0; }

void PipelineStageImpl::check_same_configuration(const torch::nn::Module& whole) {
  // The whole model, not only this stage's layers: every process builds the same Sequential.
  std::vector<std::pair<std::string, int64_t>> fields = internal::module_fields(whole);
  fields.emplace_back("stages", stages());
  fields.emplace_back(
      "balance (hash)",
      static_cast<int64_t>(internal::fingerprint(absl::StrJoin(options_.balance(), ","))));
  fields.emplace_back("chunks", options_.chunks());
  fields.emplace_back("checkpoint mode", static_cast<int64_t>(options_.checkpoint()));
  fields.emplace_back("schedule", static_cast<int64_t>(options_.schedule().kind()));
  fields.emplace_back("virtual stages", options_.schedule().virtual_stages());
  fields.emplace_back("micro-batch group", options_.schedule().microbatch_group());
  fields.emplace_back("shared_memory", options_.shared_memory());
  fields.emplace_back("deferred_batch_norm", options_.deferred_batch_norm() ? 1 : 0);
  fields.emplace_back("replicas", replica_group_ ? replica_group_->getSize() : 1);
  std::string tied;
  for (const auto& [a, b] : options_.tied_parameters()) absl::StrAppend(&tied, a, "=", b, ";");
  fields.emplace_back("tied_parameters (hash)", static_cast<int64_t>(internal::fingerprint(tied)));
  internal::check_same_fields(
      group_, fields, "gpipe::distributed::PipelineStage", "stage",
      "Every process of a pipeline must build the same model with the same options", wire_);
  if (replica_group_) {
    fields.emplace_back("which parameters require grad (hash)",
                        static_cast<int64_t>(gpipe::internal::requires_grad_key(layers_)));
    internal::check_same_fields(
        replica_group_, fields, "gpipe::distributed::PipelineStage", "replica",
        "Every replica of a pipeline must build the same model with the same "
        "options",
        local_);
  }
}

}  // namespace distributed
}  // namespace gpipe
