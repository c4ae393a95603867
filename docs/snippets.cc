// The C++ blocks of the docs that are fragments, not whole programs, compiled: each block's text
// lies between two `// [tag]` lines here, in a function whose parameters are the names the
// fragment assumes. `bazel build //docs:snippets` fails when the API a block shows changes, and
// tools/check_doc_snippets.py fails when a block's text in the docs differs from its text here.
// (The #include lines inside functions are the blocks' own; the headers are included above, so
// there they include nothing.)
// clang-format off
#include <cstdlib>
#include <iostream>
#include <map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "balancing/balance.h"
#include "balancing/plan.h"
#include "gpipe/distributed/data_parallel.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/clip_grad.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/flatten.h"
#include "gpipe/gpipe.h"
#include "gpipe/grad_scaler.h"
#include "gpipe/loss.h"
#include "gpipe/skippable.h"
#include "gpipe/thread_state.h"
#include "gpipe/trace.h"

namespace gpipe_doc_snippets {

using Batches = std::vector<std::pair<at::Tensor, at::Tensor>>;

void balancing_calls(torch::nn::Sequential sequential, at::Tensor sample) {
// [balance_calls]
#include "balancing/balance.h"

std::vector<int64_t> b = gpipe::balance_by_time(/*partitions=*/4, sequential, sample,
    gpipe::BalanceByTimeOptions().timeout(std::chrono::seconds(1)).device(torch::kCPU));
std::vector<int64_t> s = gpipe::balance_by_size(4, sequential, sample,
    gpipe::BalanceBySizeOptions().chunks(8).param_scale(2.0).device(torch::kCPU));
gpipe::LayerProfile p = gpipe::profile_layers(sequential, sample, gpipe::ProfileOptions());
gpipe::GPipe model(sequential, gpipe::GPipeOptions(b).chunks(8));
// [balance_calls]
}

void balancing_plan(torch::nn::Sequential model, at::Tensor minibatch) {
// [plan]
#include "balancing/plan.h"

// One profile of the model on the devices it may use (here three CPU workers' worth).
gpipe::PipelineProfile profile = gpipe::profile_pipeline(model, minibatch, {torch::kCPU, torch::kCPU});
gpipe::write_file("profile.json", profile.to_json());  // plan later, elsewhere: from_json

std::vector<gpipe::PipelinePlan> plans = gpipe::plan(profile,
    gpipe::PlanOptions().memory_limit(int64_t{512} << 20).optimizer(gpipe::OptimizerKind::kAdam));
std::cout << plans.front().describe() << "\n";   // balance, m, checkpoint, schedule: ms, MiB
gpipe::GPipe pipe(model, plans.front().options());
gpipe::PipelineSimulation sim = gpipe::predict(profile, plans.front());
gpipe::write_file("predicted.svg", gpipe::timeline_svg(sim.events, plans.front().devices));
// [plan]
}

void distributed_data_parallel(torch::nn::Sequential seq, const Batches& my_shard_of_each_batch) {
// [data_parallel]
#include "gpipe/distributed/data_parallel.h"

auto group = gpipe::distributed::new_gloo_group(gpipe::distributed::options_from_env());
gpipe::GPipe pipe(seq, gpipe::GPipeOptions({2, 2}).chunks(4).deferred_batch_norm(true));
gpipe::distributed::DataParallel model(pipe, group);
torch::optim::SGD sgd(model->parameters(), 0.1);
for (auto& [x, y] : my_shard_of_each_batch) {
  sgd.zero_grad();
  torch::nn::functional::cross_entropy(model->forward(x), y).backward();  // averaged here
  sgd.step();
}
// [data_parallel]
}

void distributed_stages(torch::nn::Sequential model, const Batches& batches) {
// [pipeline_stage]
#include "gpipe/distributed/pipeline_stage.h"

namespace dist = gpipe::distributed;
auto group = dist::new_gloo_group(dist::options_from_env());   // 2 processes: 2 stages
auto loss_fn = [](const gpipe::Batch& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.tensor(), y);
};
dist::PipelineStage stage(model, dist::PipelineStageOptions({3, 2}).chunks(8), group);
torch::optim::SGD sgd(stage->parameters(), 0.1);              // this stage's parameters only
for (auto& [x, y] : batches) {
  sgd.zero_grad();
  at::Tensor loss = stage->is_first() ? stage->step(gpipe::Batch(x), {}, loss_fn)
                                      : stage->step(dist::no_input(), y, loss_fn);  // the last
  sgd.step();
}
// [pipeline_stage]
}

void distributed_gpus(torch::nn::Sequential model) {
// [stage_gpus]
namespace dist = gpipe::distributed;
const int local_rank = std::atoi(std::getenv("LOCAL_RANK"));            // torchrun sets it
const c10::Device gpu(c10::kCUDA, local_rank);                           // a GPU per process
auto groups = dist::new_pipeline_groups(dist::options_from_env().backend("nccl"), /*stages=*/2);
dist::PipelineStage stage(model, dist::PipelineStageOptions({3, 2}).chunks(8).devices({gpu}),
                          groups.pipeline, groups.replica_group);
// [stage_gpus]
}

void distributed_sampler(torch::data::datasets::TensorDataset dataset, size_t dataset_size,
                         size_t R, size_t r, size_t epoch, size_t batch) {
// [sampler]
// replica r of R: its shard of the epoch, in the order of the epoch (the same in every process)
torch::data::samplers::DistributedRandomSampler sampler(dataset_size, R, r,
                                                        /*allow_duplicates=*/false);
sampler.set_epoch(epoch);
auto loader = torch::data::make_data_loader(dataset, std::move(sampler),
                                            torch::data::DataLoaderOptions(batch / R).drop_last(true));
// [sampler]
}

void schedules_interleaved(torch::nn::Sequential seq, at::Tensor x, at::Tensor y,
                           torch::optim::Optimizer& optimizer) {
// [interleaved]
gpipe::GPipe model(seq, gpipe::GPipeOptions({2, 2, 2, 2}).chunks(8)
                            .schedule(gpipe::PipelineSchedule::interleaved(2)));
at::Tensor loss = model->step(x, y, [](const gpipe::Batch& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.tensor(), y);
});
optimizer.step();
// [interleaved]
}

gpipe::distributed::PipelineStageOptions schedules_group() {
  return
// [group]
// 2 processes, 2 virtual stages each, 16 micro-batches in groups of 4.
gpipe::distributed::PipelineStageOptions({2, 2, 2, 2}).chunks(16)
    .schedule(gpipe::PipelineSchedule::interleaved(/*virtual_stages=*/2, /*group=*/4))
// [group]
      ;
}

void transformers_tie(torch::nn::Sequential seq) {
// [tie]
gpipe::GPipe model(seq, gpipe::GPipeOptions({3, 3}).tied_parameters({{"0.weight", "5.weight"}}));
// [tie]
}

namespace flatten_block {
// [flatten]
struct StackImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  at::Tensor forward(const at::Tensor& x) { return SequentialImpl::forward(x); }
};
TORCH_MODULE(Stack);

torch::nn::Sequential nested(torch::nn::Linear(4, 8), Stack(torch::nn::Linear(8, 8), torch::nn::ReLU()),
                             torch::nn::Linear(8, 2));
torch::nn::Sequential flat = gpipe::flatten(nested);  // "0", "1_0", "1_1", "2"
// [flatten]
}  // namespace flatten_block

void transformers_autocast(gpipe::GPipe model, at::Tensor x, at::Tensor y,
                           at::Tensor (*loss_fn)(const at::Tensor&, const at::Tensor&),
                           torch::optim::Optimizer& optimizer, at::Tensor loss) {
// [autocast]
gpipe::GradScaler scaler;
{
  gpipe::Autocast autocast(c10::kCUDA, c10::kHalf);
  loss = loss_fn(model->forward(x), y);
}
scaler.scale(loss).backward();
scaler.step(optimizer, model->parameters());  // skipped when any gradient is inf or NaN
scaler.update();
// [autocast]
}

void transformers_scaler_stages(gpipe::GradScaler& scaler, gpipe::distributed::PipelineStage stage,
                                torch::optim::Optimizer& optimizer) {
// [scaler_stages]
scaler.step(optimizer, stage->parameters(), [&](bool found) {
  found = gpipe::distributed::any_rank(stage->group(), found, stage->device());
  return stage->replica_group()
             ? gpipe::distributed::any_rank(stage->replica_group(), found, stage->device())
             : found;
});
// [scaler_stages]
}

void transformers_token_loss(gpipe::GPipe model, at::Tensor ids, at::Tensor targets,
                             torch::optim::Optimizer& optimizer) {
// [token_loss]
namespace F = torch::nn::functional;
const gpipe::Loss loss(
    [](const gpipe::Batch& logits, const at::Tensor& targets) {  // targets: -100 = padding
      return F::cross_entropy(logits.tensor().flatten(0, 1), targets.flatten());
    },
    gpipe::count_targets_except(-100));
at::Tensor l = model->step(ids, targets, loss);   // the plain model's loss and gradients
gpipe::clip_grad_norm(model->parameters(), 1.0);  // the norm of the whole model's gradients
optimizer.step();
// [token_loss]
}

void skips_own_map(at::Tensor x) {
// [own_map]
std::map<gpipe::MicroBatch, at::Tensor> saved;
saved[gpipe::current_microbatch()] = x;          // in one layer
x = x + saved.at(gpipe::current_microbatch());   // in a later one
// [own_map]
}

}  // namespace gpipe_doc_snippets
// clang-format on
