// The example trainers across processes; see distributed_trainer.h.
#include "examples/training/distributed_trainer.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <numeric>

#include <ATen/ATen.h>
#include <torch/data/dataloader.h>
#include <torch/data/datasets/map.h>
#include <torch/data/samplers/distributed.h>
#include <torch/data/transforms/stack.h>
#include <torch/optim/adam.h>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "examples/training/common.h"
#include "gpipe/distributed/core_binding.h"
#include "gpipe/distributed/internal/fault.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/saved_training.h"
#include "gpipe/trace.h"
#include "gpipe/worker.h"

ABSL_DECLARE_FLAG(int64_t, partitions);
ABSL_DECLARE_FLAG(std::string, balance);
ABSL_DECLARE_FLAG(int64_t, chunks);
ABSL_DECLARE_FLAG(std::string, checkpoint);
ABSL_DECLARE_FLAG(std::string, schedule);
ABSL_DECLARE_FLAG(int64_t, virtual_stages);
ABSL_DECLARE_FLAG(int64_t, microbatch_group);
ABSL_DECLARE_FLAG(int64_t, epochs);
ABSL_DECLARE_FLAG(int64_t, steps);
ABSL_DECLARE_FLAG(int64_t, test_batches);
ABSL_DECLARE_FLAG(int64_t, batch_size);
ABSL_DECLARE_FLAG(double, lr);
ABSL_DECLARE_FLAG(int64_t, threads);
ABSL_DECLARE_FLAG(int64_t, seed);
ABSL_DECLARE_FLAG(std::string, svg);
ABSL_DECLARE_FLAG(std::string, trace);
ABSL_DECLARE_FLAG(std::string, devices);
ABSL_DECLARE_FLAG(bool, amp);
ABSL_DECLARE_FLAG(int64_t, stage_partitions);
ABSL_DECLARE_FLAG(bool, bind_cores_to_rank);
ABSL_DECLARE_FLAG(std::string, save);
ABSL_DECLARE_FLAG(std::string, resume);
ABSL_DECLARE_FLAG(int64_t, save_every);
ABSL_DECLARE_FLAG(std::string, backend);

namespace gpipe {
namespace training {
namespace {

namespace dist = gpipe::distributed;

// Every process takes world rank 0's balance: stage 0 of each pipeline sends it along the
// pipeline after replica 0's stages sent it to the other replicas.
std::vector<int64_t> agree_on_balance(std::vector<int64_t> balance,
                                      const dist::PipelineGroups& groups, c10::Device device) {
  std::vector<at::Tensor> t{
      at::tensor(balance, at::kLong).to(dist::wire_device(groups.pipeline, device))};
  dist::check_collective(groups.replica_group, "the broadcast of the balance",
                         [&] { groups.replica_group->broadcast(t)->wait(); });
  dist::check_collective(groups.pipeline, "the broadcast of the balance",
                         [&] { groups.pipeline->broadcast(t)->wait(); });
  const at::Tensor b = t[0].to(at::kCPU).contiguous();
  return std::vector<int64_t>(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
}

}  // namespace

int train_distributed(const TrainerModel& trainer) {
  const std::string devices = absl::GetFlag(FLAGS_devices);
  TORCH_CHECK(devices.empty() || devices == "cpu" || devices == "cuda",
              "--distributed runs each stage on the CPU (--devices=cpu) or on the GPU of its "
              "process's LOCAL_RANK (--devices=cuda); --devices=", devices,
              " is not supported with it");
  TORCH_CHECK(absl::GetFlag(FLAGS_backend) != "nccl" || devices == "cuda", "--backend=nccl "
              "carries GPU tensors only; add --devices=cuda (each process on the GPU of its "
              "LOCAL_RANK)");
  TORCH_CHECK(!absl::GetFlag(FLAGS_amp), "--amp is not supported with --distributed yet");
  // Before the groups start Gloo's threads, which inherit it (Note [Binding cores to ranks]).
  std::vector<int> bound_cpus;
  if (absl::GetFlag(FLAGS_bind_cores_to_rank)) bound_cpus = dist::bind_cores_to_rank();
  const dist::GroupOptions options =
      dist::options_from_env().backend(absl::GetFlag(FLAGS_backend));
  const c10::Device device =
      devices == "cuda"
          ? c10::Device(c10::kCUDA,
                        static_cast<c10::DeviceIndex>(
                            dist::env_int("LOCAL_RANK", 0,
                                          std::numeric_limits<c10::DeviceIndex>::max(),
                                          "--distributed")
                                .value_or(0)))
          : c10::Device(c10::kCPU);
  const int stages = absl::GetFlag(FLAGS_partitions) > 0
                         ? static_cast<int>(absl::GetFlag(FLAGS_partitions))
                         : options.world_size();
  const int64_t per_stage = absl::GetFlag(FLAGS_stage_partitions);
  TORCH_CHECK(per_stage >= 1, "--stage_partitions must be at least 1, got ", per_stage);
  // Interleaved: each stage holds v virtual stages (Note [Interleaving across processes]); on a
  // V (zbv, dualpipev), 2: stage s holds s and 2n - 1 - s.
  TORCH_CHECK(absl::GetFlag(FLAGS_schedule) != "auto",
              "--schedule=auto (a searched schedule) "
              "runs in one process only so far; give --distributed a schedule by name");
  const gpipe::ScheduleKind kind = schedule_kind(absl::GetFlag(FLAGS_schedule));
  const int64_t virtual_stages = gpipe::v_shaped(kind) ? 2 : absl::GetFlag(FLAGS_virtual_stages);
  TORCH_CHECK(virtual_stages == 1 || per_stage == 1, "--stage_partitions ", per_stage,
              " does not combine with ", virtual_stages,
              " virtual stages per stage (--schedule=", absl::GetFlag(FLAGS_schedule),
              "): each virtual stage is a partition of its own");
  const dist::PipelineGroups groups = dist::new_pipeline_groups(options, stages);
  // The cores of this host divided among its processes' partitions (bound: this process's).
  const int local =
      bound_cpus.empty() ? static_cast<int>(
                         dist::env_int("LOCAL_WORLD_SIZE", 1, 1 << 20, "--distributed")
                             .value_or(options.world_size())) : 1;
  const int64_t cores = std::max<int64_t>(
      static_cast<int64_t>(bound_cpus.empty() ? dist::allowed_cpus().size() : bound_cpus.size()),
      1);
  set_intra_op_threads(static_cast<int>(
      absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads)
                                       : std::max<int64_t>(cores / (local * per_stage), 1)));

  at::manual_seed(absl::GetFlag(FLAGS_seed));
  Data data = load_data_from_flags();
  const int64_t batch_size = absl::GetFlag(FLAGS_batch_size);
  const int64_t chunks = absl::GetFlag(FLAGS_chunks);
  TORCH_CHECK(batch_size % groups.replicas == 0, "--batch_size ", batch_size, " does not split "
              "evenly over the ", groups.replicas, " replicas; use a multiple of ",
              groups.replicas);
  torch::nn::Sequential model =
      trainer.make(models::ModelInput{data.channels, data.size, data.classes});
  const at::Tensor sample = data.train.images().slice(0, 0, batch_size / groups.replicas);
  // Layers per partition, stages x per_stage of them; each stage takes per_stage in a row
  // (or, interleaved, stages x virtual_stages: stage s takes s, s + stages, ...; on a V, s and
  // 2 stages - 1 - s).
  const std::vector<int64_t> partition_balance = agree_on_balance(
      choose_balance(absl::GetFlag(FLAGS_balance), stages * per_stage * virtual_stages, model,
                     sample, chunks, c10::Device(c10::kCPU)),
      groups, device);
  std::vector<int64_t> balance;  // per stage, or per virtual stage
  if (virtual_stages > 1) balance = partition_balance;
  for (int s = 0; s < stages && virtual_stages == 1; ++s) {
    balance.push_back(std::accumulate(partition_balance.begin() + s * per_stage,
                                      partition_balance.begin() + (s + 1) * per_stage,
                                      int64_t{0}));
  }
  std::vector<int64_t> local_balance;
  if (per_stage > 1) {
    local_balance.assign(partition_balance.begin() + groups.stage * per_stage,
                         partition_balance.begin() + (groups.stage + 1) * per_stage);
  }
  const Checkpoint checkpoint = parse_checkpoint(absl::GetFlag(FLAGS_checkpoint));
  auto cross_entropy = [](const Batch& out, const at::Tensor& target) {
    return at::cross_entropy_loss(out.tensor().to(at::kFloat), target);
  };
  dist::PipelineStage stage(model,
                            dist::PipelineStageOptions(balance)
                                .chunks(chunks)
                                .checkpoint(checkpoint)
                                .deferred_batch_norm(true)
                                .devices({device})
                                .local_balance(local_balance)
                                .schedule(gpipe::PipelineSchedule::of(
                                    kind, virtual_stages, absl::GetFlag(FLAGS_microbatch_group))),
                            groups.pipeline, groups.replica_group);
  stage->record_timeline(true);
  // The last stage of replica 0 knows the loss and the accuracy: it reports.
  const bool reporter = stage->is_last() && groups.replica == 0;
  if (reporter) {
    int64_t parameters = 0;
    for (const auto& p : model->parameters()) parameters += p.numel();
    std::printf("%s on %s: %lld layers, %.2fM parameters\n", trainer.name.c_str(),
                data.name.c_str(), static_cast<long long>(model->size()), parameters / 1e6);
    std::printf("distributed: %d processes = %d stages x %d replicas; balance {%s}%s; %lld "
                "micro-batches of each replica's %lld images; checkpoint %s; schedule %s; %d intra-op "
                "thread%s per %s%s\n",
                options.world_size(), stages, groups.replicas,
                absl::StrJoin(balance, ", ").c_str(),
                per_stage > 1
                    ? absl::StrCat(", ", per_stage, " partitions per stage {",
                                   absl::StrJoin(partition_balance, ", "), "}").c_str()
                    : virtual_stages > 1
                    ? absl::StrCat(" (", virtual_stages, " virtual stages per stage)").c_str()
                    : "",
                static_cast<long long>(chunks),
                static_cast<long long>(batch_size / groups.replicas),
                absl::GetFlag(FLAGS_checkpoint).c_str(), absl::GetFlag(FLAGS_schedule).c_str(),
                at::get_num_threads(),
                at::get_num_threads() == 1 ? "" : "s", per_stage > 1 ? "partition" : "process",
                bound_cpus.empty()
                    ? ""
                    : absl::StrCat("; each process bound to its share of the host's cores "
                                   "(this one's: {", absl::StrJoin(bound_cpus, ", "), "})")
                          .c_str());
    std::fflush(stdout);
  }

  torch::optim::Adam optimizer(stage->parameters(),
                               torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)));
  // Sharded data: each replica reads only its shard of every epoch (the stages of a replica the
  // same one), batch_size / replicas images a step. The shards are the same size on every rank:
  // the samples that do not divide evenly over the replicas are dropped each epoch
  // (allow_duplicates false), and so is each shard's last, partial batch.
  const int64_t local_batch = batch_size / groups.replicas;
  const auto train_sampler = [&](int64_t epoch) {
    torch::data::samplers::DistributedRandomSampler sampler(
        static_cast<size_t>(data.train.images().size(0)), static_cast<size_t>(groups.replicas),
        static_cast<size_t>(groups.replica), /*allow_duplicates=*/false);
    sampler.set_epoch(static_cast<size_t>(epoch));  // the order of each epoch, in every process
    return sampler;
  };
  auto test_loader = torch::data::make_data_loader(
      data.test.map(torch::data::transforms::Stack<>()),
      torch::data::samplers::DistributedSequentialSampler(
          static_cast<size_t>(data.test.images().size(0)), static_cast<size_t>(groups.replicas),
          static_cast<size_t>(groups.replica), /*allow_duplicates=*/false),
      torch::data::DataLoaderOptions(local_batch).drop_last(true));
  const auto run = [&](const at::Tensor& images, const at::Tensor& labels) {
    return stage->step(stage->is_first() ? Batch(images.to(device)) : dist::no_input(),
                       stage->is_last() ? labels.to(device) : at::Tensor(), cross_entropy);
  };

  const int64_t epochs = absl::GetFlag(FLAGS_epochs);
  const int64_t steps_per_epoch = data.train.images().size(0) / groups.replicas / local_batch;
  const int64_t steps = absl::GetFlag(FLAGS_steps) > 0
                            ? std::min(absl::GetFlag(FLAGS_steps), steps_per_epoch)
                            : steps_per_epoch;
  const int64_t total_steps = std::max<int64_t>(epochs * steps, 1);
  const double lr = absl::GetFlag(FLAGS_lr);
  int64_t global_step = 0;
  const std::string save = absl::GetFlag(FLAGS_save);
  const int64_t save_every = absl::GetFlag(FLAGS_save_every);
  // Every process finds the same save: they read the same folders, and none is saving now.
  const std::string resume = save_to_resume();
  if (!resume.empty()) global_step = dist::load_training(resume, *stage, &optimizer);
  // The saved run went on with its step global_step + 1: this epoch's step `skip` + 1.
  const int64_t first_epoch = global_step / std::max<int64_t>(steps, 1) + 1;
  const int64_t skip = global_step % std::max<int64_t>(steps, 1);
  if (reporter && !resume.empty()) {
    std::printf(
        "resumed from %s at step %lld: epoch %lld %s\n", resume.c_str(),
        static_cast<long long>(global_step), static_cast<long long>(first_epoch),
        skip == 0 ? "from its start" : absl::StrCat("after its first ", skip, " steps").c_str());
  }
  // Fault injection (GPIPE_TRAINER_KILL): in the middle of a step, between its schedule and the
  // waits for its last transfers.
  bool training_step = false;  // the hook runs in evaluation's steps too
  dist::internal::set_step_end_hook([&](int64_t) {
    if (training_step) kill_if_asked(options.rank(), global_step + 1);
  });
  double throughput = 0, accuracy = 0;
  // The last epoch's steps (stage->step: forward, backward, the replicas' all-reduce; not the data
  // or the optimizer), to compare with a plan's prediction (balance --plan --processes).
  std::vector<double> step_ms;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t epoch = first_epoch; epoch <= epochs; ++epoch) {
    stage->train();
    auto train_loader = torch::data::make_data_loader(
        data.train.map(torch::data::transforms::Stack<>()), train_sampler(epoch),
        torch::data::DataLoaderOptions(local_batch).drop_last(true));
    const int64_t skipped = epoch == first_epoch ? skip : 0;
    Progress progress(epoch, (steps - skipped) * batch_size);
    int64_t step = 0;
    double loss_sum = 0;
    step_ms.clear();
    for (auto& batch : *train_loader) {
      if (step == steps) break;
      if (step < skipped) {  // trained on before the save
        ++step;
        continue;
      }
      optimizer.zero_grad();
      training_step = true;
      const auto step_start = std::chrono::steady_clock::now();
      const at::Tensor loss = run(batch.data, batch.target);
      step_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start)
              .count());
      training_step = false;
      set_cosine_lr(optimizer, lr, global_step, total_steps);
      optimizer.step();
      ++step;
      ++global_step;
      if (reporter) {
        loss_sum += loss.item<double>();
        progress.update((step - skipped) * batch_size, loss_sum / (step - skipped));
      }
      if (!save.empty() && save_every > 0 && global_step % save_every == 0) {
        dist::save_training(save + "/latest", *stage, &optimizer, global_step);
      }
    }
    if (reporter) progress.finish();
    throughput = (step - skipped) * batch_size / progress.seconds();

    // Test accuracy: forward only, every replica on its shard of the test set.
    stage->eval();
    at::NoGradGuard no_grad;
    int64_t correct = 0, seen = 0, batches = 0;
    for (auto& batch : *test_loader) {
      if (absl::GetFlag(FLAGS_test_batches) > 0 && batches == absl::GetFlag(FLAGS_test_batches)) {
        break;
      }
      run(batch.data, batch.target);
      if (stage->is_last()) {
        const at::Tensor labels = batch.target.to(device);
        correct += stage->output().tensor().argmax(1).eq(labels).sum().item<int64_t>();
        seen += labels.size(0);
      }
      ++batches;
    }
    accuracy = 100.0 * correct / std::max<int64_t>(seen, 1);
    if (!save.empty()) {
      const std::string folder = absl::StrCat(save, "/epoch_", epoch);
      dist::save_training(folder, *stage, &optimizer, global_step);
      if (reporter) {
        std::printf("saved in %s (step %lld)\n", folder.c_str(),
                    static_cast<long long>(global_step));
      }
    }
    if (reporter) {
      std::printf(
          "epoch %lld: train loss %.4f, %.1f samples/s (%s, all replicas); test "
          "accuracy %.2f%% (replica 0: %lld images)\n",
          static_cast<long long>(epoch), loss_sum / std::max<int64_t>(step - skipped, 1),
          throughput, duration(progress.seconds()).c_str(), accuracy, static_cast<long long>(seen));
      std::fflush(stdout);
    }
  }

  // The last training step across the pipeline, drawn by stage 0 of replica 0 (the eval
  // forwards since then recorded their own timelines: one more training step, not counted).
  if (!absl::GetFlag(FLAGS_svg).empty() || !absl::GetFlag(FLAGS_trace).empty()) {
    stage->train();
    auto train_loader = torch::data::make_data_loader(
        data.train.map(torch::data::transforms::Stack<>()), train_sampler(epochs + 1),
        torch::data::DataLoaderOptions(local_batch).drop_last(true));
    auto batch = train_loader->begin();
    optimizer.zero_grad();
    run((*batch).data, (*batch).target);
    const auto events = stage->gather_timeline();
    const std::vector<c10::Device> partition_devices(stages * per_stage * virtual_stages, device);
    if (stage->is_first() && groups.replica == 0) {
      if (!absl::GetFlag(FLAGS_svg).empty()) {
        std::ofstream(absl::GetFlag(FLAGS_svg)) << timeline_svg(events, partition_devices);
        std::printf("picture of a step across the %d stages (%lld partitions): %s\n", stages,
                    static_cast<long long>(partition_devices.size()),
                    absl::GetFlag(FLAGS_svg).c_str());
      }
      if (!absl::GetFlag(FLAGS_trace).empty()) {
        std::ofstream(absl::GetFlag(FLAGS_trace)) << chrome_trace_json(events, partition_devices);
      }
    }
  }
  if (reporter) {
    struct rusage usage {};
    getrusage(RUSAGE_SELF, &usage);
    std::printf("summary: %d stages x %d replicas, balance {%s}; %.1f samples/s; the last epoch's "
                "median step %.2f ms; test accuracy %.2f%%; %s in all; peak memory of the last "
                "stage's process %.1f MiB\n",
                stages, groups.replicas, absl::StrJoin(balance, ", ").c_str(), throughput,
                median_of(step_ms), accuracy,
                duration(std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                             .count()).c_str(),
                usage.ru_maxrss / 1024.0);
  }
  dist::internal::set_step_end_hook(nullptr);
  if (groups.replica == 0) {
    std::printf("stage %d parameters: %s (a checksum of its trained parameters and buffers)\n",
                groups.stage, parameters_digest(*stage).c_str());
  }
  return 0;
}

}  // namespace training
}  // namespace gpipe
