// The example trainers' shared program; see trainer.h.
#include "examples/training/trainer.h"

#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/data/dataloader.h>
#include <torch/data/datasets/map.h>
#include <torch/data/samplers/distributed.h>
#include <torch/data/samplers/sequential.h>
#include <torch/data/transforms/stack.h>
#include <torch/optim/adam.h>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "balancing/balance.h"
#include "balancing/plan.h"
#include "balancing/profile.h"
#include "examples/training/common.h"
#include "examples/training/data.h"
#include "examples/training/distributed_trainer.h"  // built with GPIPE_WITH_DISTRIBUTED
#include "gpipe/gpipe.h"
#include "gpipe/grad_scaler.h"
#include "gpipe/internal/atomic_file.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_search.h"
#include "gpipe/schedule_text.h"
#include "gpipe/internal/partition.h"
#include "gpipe/saved_training.h"
#include "gpipe/skip_layout.h"
#include "gpipe/internal/stream.h"
#include "gpipe/thread_state.h"
#include "gpipe/trace.h"
#include "gpipe/worker.h"

ABSL_FLAG(std::string, data, "fashion-mnist",
          "fashion-mnist[:<folder>] (Debian's dataset-fashion-mnist by default), "
          "cifar10:<folder> (CIFAR-10's binary batches) or synthetic[:<channels>x<size>]");
ABSL_FLAG(std::string, data_cache, "",
          "where Fashion-MNIST is uncompressed (default: <temp dir>/gpipe-data)");
ABSL_FLAG(int64_t, synthetic_samples, 2048, "training images of --data=synthetic");
ABSL_FLAG(std::string, devices, "",
          "cpu, or a list such as cuda:0,cuda:1 (one per partition; default: every GPU, else the "
          "CPU, with a thread per partition where the engine decides so); with --distributed, "
          "cpu or cuda (each process on the GPU of its LOCAL_RANK)");
ABSL_FLAG(int64_t, partitions, 0,
          "pipeline partitions (default: the number of --devices, or 2 on the CPU)");
ABSL_FLAG(std::string, balance, "auto",
          "auto or time (balance_by_time), size (balance_by_size), or layers per partition "
          "such as 4,5,3");
ABSL_FLAG(int64_t, chunks, 4, "micro-batches per mini-batch");
ABSL_FLAG(std::string, plan, "",
          "a plan from //balancing:balance --plan --plan_out=<file> (JSON): its partitions, "
          "devices, balance, micro-batches, checkpoint mode, schedule and threads replace "
          "--partitions, --devices, --balance, --chunks, --checkpoint, --schedule, "
          "--virtual_stages and --threads (and refuses --microbatch_group)");
ABSL_FLAG(std::string, checkpoint, "except_last", "always, except_last or never");
ABSL_FLAG(std::string, schedule, "gpipe",
          "gpipe (forward() and backward(), as always), or a schedule that GPipe::step runs: "
          "1f1b (activations of at most n - s micro-batches per partition), interleaved (v "
          "partitions per worker: a smaller bubble), zb (zero bubble ZB-H1), zbv (two partitions "
          "per worker in a V: r and 2n - 1 - r), zb1p (interleaved zero bubble), dualpipev "
          "(DeepSeek's order on zbv's V), or auto (one partition per worker: searched from the "
          "partitions' profiled F, I and W within ZB-H1's memory, gpipe::search_schedule)");
ABSL_FLAG(int64_t, virtual_stages, 1,
          "with --schedule=interleaved or zb1p: partitions per worker (divides --partitions); with "
          "--distributed, virtual stages per process");
ABSL_FLAG(int64_t, microbatch_group, 0,
          "with --schedule=interleaved: micro-batches that go through a virtual stage before "
          "the next (Megatron-LM's microbatch_group_size_per_vp_stage; 0: the workers, or "
          "stages, which gives the usual interleaved 1F1B)");
ABSL_FLAG(bool, amp, false, "autocast: bfloat16 on the CPU, float16 on CUDA (with loss scaling)");
ABSL_FLAG(int64_t, epochs, 2, "passes over the training set");
ABSL_FLAG(int64_t, steps, 0, "stop each epoch after this many steps (0: the whole training set)");
ABSL_FLAG(int64_t, test_batches, 0, "test on this many batches only (0: the whole test set)");
ABSL_FLAG(int64_t, batch_size, 128, "images per mini-batch");
ABSL_FLAG(double, lr, 2e-3,
          "Adam's learning rate at the start; it follows a cosine down to zero at the last step");
ABSL_FLAG(int64_t, threads, 0,
          "intra-op threads on the CPU (default: the cores divided among the partitions)");
ABSL_FLAG(int64_t, seed, 0,
          "random seed of the parameters and of dropout (each epoch's order of the training set "
          "comes from the epoch's number)");
ABSL_FLAG(std::string, trace, "", "write the last step's schedule here as a Chrome trace (JSON)");
ABSL_FLAG(std::string, svg, "", "draw the last step's schedule here (SVG)");
ABSL_FLAG(bool, distributed, false,
          "one pipeline stage per process, started by torchrun (torchrun --no_python "
          "--nproc_per_node=4 resnet --distributed --partitions=2: 2 stages x 2 replicas); "
          "--partitions is the stages per pipeline (default: every process)");
ABSL_FLAG(std::string, backend, "gloo",
          "with --distributed: gloo (tensors cross processes through the CPU) or nccl (GPU to "
          "GPU; with --devices=cuda)");
ABSL_FLAG(bool, bind_cores_to_rank, false,
          "with --distributed: bind each process, every thread of it, to its share of the "
          "host's cores (torchrun's LOCAL_RANK of LOCAL_WORLD_SIZE; "
          "gpipe::distributed::bind_cores_to_rank), as DeepSpeed's launcher flag of that name");
ABSL_FLAG(int64_t, stage_partitions, 1,
          "with --distributed: split each stage into this many partitions, each on a thread of "
          "its own (PipelineStageOptions::local_balance); --balance then has stages x this "
          "entries");
ABSL_FLAG(std::string, save, "",
          "save the training (parameters, optimizer, step, random generators) in this folder: at "
          "the end of every epoch k in <this>/epoch_k, and every --save_every steps in "
          "<this>/latest (gpipe::save_training; with --distributed, a file per stage and a "
          "manifest)");
ABSL_FLAG(int64_t, save_every, 0,
          "with --save: also save every this many steps into <save>/latest, each save replacing "
          "the one before atomically (0: at the ends of epochs only)");
ABSL_FLAG(std::string, resume, "",
          "resume the training saved in this folder: a save (an epoch_k or the latest of --save) "
          "or a --save folder, whose newest complete save it takes; the run goes on from the "
          "step after the save's, in the middle of an epoch too; give the model and batch flags of "
          "the saved run; its layout (--partitions, --balance, --distributed, stages) may differ "
          "(under torchrun --max-restarts, a restarted run resumes from --save by itself)");
ABSL_FLAG(std::string, ideal_svg, "",
          "draw the ideal clock-cycle schedule of the same partitions and micro-batches here (SVG)");

namespace gpipe {
namespace training {

std::string save_to_resume() {
  return save_to_resume(absl::GetFlag(FLAGS_save), absl::GetFlag(FLAGS_resume));
}

namespace {

// The default devices: every GPU in turn by worker (a V-shaped schedule's worker r runs
// partitions r and 2n - 1 - r: Note [V-shaped placement]), else two CPU partitions.
std::vector<c10::Device> parse_devices(const std::string& spec, int64_t& partitions,
                                       gpipe::ScheduleKind kind) {
  std::vector<c10::Device> devices;
  if (spec.empty()) {
    if (torch::cuda::is_available()) {
      const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
      if (partitions == 0) partitions = gpipe::v_shaped(kind) ? 2 * gpus : gpus;
      for (int64_t j = 0; j < partitions; ++j) {
        const int64_t workers = gpipe::v_shaped(kind) ? (partitions + 1) / 2 : partitions;
        const int64_t worker = gpipe::stage_rank(kind, j, workers);
        devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(worker % gpus));
      }
      return devices;
    }
    if (partitions == 0) partitions = 2;
    return std::vector<c10::Device>(partitions, c10::Device(c10::kCPU));
  }
  if (spec == "cpu") {
    if (partitions == 0) partitions = 2;
    return std::vector<c10::Device>(partitions, c10::Device(c10::kCPU));
  }
  for (absl::string_view part : absl::StrSplit(spec, ',')) {
    try {
      devices.emplace_back(std::string(part));
    } catch (const c10::Error&) {
      TORCH_CHECK(false, "--devices: '", part, "' is not a device; use cpu or cuda:<index>");
    }
  }
  if (partitions == 0) partitions = static_cast<int64_t>(devices.size());
  TORCH_CHECK(static_cast<int64_t>(devices.size()) == partitions, "--devices names ",
              devices.size(), " devices but --partitions is ", partitions,
              "; name one device per partition");
  return devices;
}

// The forward's bubble: per partition, the share of the forward's span it computed nothing,
// averaged over the partitions.
double measured_bubble(const std::vector<TimelineEvent>& events, int64_t partitions) {
  double start = 1e300, end = 0;
  std::vector<double> busy(partitions, 0.0);
  for (const TimelineEvent& e : events) {
    if (e.kind != TimelineEvent::Kind::kCompute) continue;
    start = std::min(start, e.start_us);
    end = std::max(end, e.end_us);
    busy[e.partition] += e.end_us - e.start_us;
  }
  if (end <= start) return 0;
  double idle = 0;
  for (double b : busy) idle += 1 - b / (end - start);
  return idle / partitions;
}

// A step's bubble (GPipe::step): the share of the step's span each rank computed nothing,
// averaged over the ranks.
double step_bubble(const std::vector<TimelineEvent>& events, int64_t ranks) {
  double start = 1e300, end = 0, busy = 0;
  for (const TimelineEvent& e : events) {
    start = std::min(start, e.start_us);
    end = std::max(end, e.end_us);
    busy += e.end_us - e.start_us;
  }
  return end <= start ? 0 : 1 - busy / (ranks * (end - start));
}

// The span of a step's timeline, milliseconds.
double step_ms(const std::vector<TimelineEvent>& events) {
  double start = 1e300, end = 0;
  for (const TimelineEvent& e : events) {
    start = std::min(start, e.start_us);
    end = std::max(end, e.end_us);
  }
  return end <= start ? 0 : (end - start) / 1000;
}

// --schedule=auto (Note [Searched plans] in balancing/plan.h): the planner's profile of the model
// at the run's micro-batch size on `devices` (calibrated against whole-model steps, the CPU's
// workers sharing its cores), a schedule searched on the partitions' F, I and W from it, each
// worker holding at most what ZB-H1 holds (n micro-batches), then predicted as the planner
// predicts any plan. The search's result runs as text when its prediction beats the generated
// zero-bubble schedule's, which runs otherwise. `searched` gets the plan that runs (its step_us
// the prediction), `found` what the search found.
gpipe::PipelineSchedule searched_schedule(const torch::nn::Sequential& model,
                                          const std::vector<int64_t>& balance,
                                          const at::Tensor& sample, int64_t chunks,
                                          gpipe::Checkpoint checkpoint,
                                          const std::vector<c10::Device>& devices,
                                          gpipe::PipelinePlan& searched,
                                          gpipe::SearchedSchedule& found) {
  const int64_t rows = (sample.size(0) + chunks - 1) / chunks;
  const gpipe::PipelineProfile profile = gpipe::profile_pipeline(
      model, sample, devices,
      gpipe::PipelineProfileOptions()
          .timeout(std::chrono::milliseconds(500))
          .threads(at::get_num_threads())
          .min_batch(rows)
          .max_batch(rows));
  gpipe::PipelinePlan zb;
  zb.balance = balance;
  zb.devices = devices;
  zb.chunks = chunks;
  zb.checkpoint = checkpoint;
  zb.schedule = gpipe::ScheduleKind::kZeroBubble;
  zb.threads = profile.threads;
  const gpipe::ParameterMemory adam{gpipe::OptimizerKind::kAdam, false, c10::nullopt};
  gpipe::predict(profile, zb, adam);
  const int64_t n = static_cast<int64_t>(balance.size());
  searched = gpipe::search_plan(profile, zb, std::min(n, chunks), adam, &found);
  if (searched.step_us >= zb.step_us) searched = zb;
  return searched.schedule_text.empty()
             ? gpipe::PipelineSchedule::of(gpipe::ScheduleKind::kZeroBubble)
             : gpipe::PipelineSchedule::text(searched.schedule_text);
}

}  // namespace

Data load_data_from_flags() {
  // Keep freed memory instead of returning it to the system above 128 KiB, which costs page
  // faults at every step (see benchmarks/pipeline_efficiency.cc).
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  std::string cache = absl::GetFlag(FLAGS_data_cache);
  if (cache.empty()) cache = (std::filesystem::temp_directory_path() / "gpipe-data").string();
  return load_data(absl::GetFlag(FLAGS_data), cache, absl::GetFlag(FLAGS_synthetic_samples));
}

int train(const TrainerModel& trainer) {
  TORCH_CHECK(!absl::GetFlag(FLAGS_bind_cores_to_rank) || absl::GetFlag(FLAGS_distributed),
              "--bind_cores_to_rank binds each of torchrun's processes to its share of the "
              "cores; it applies with --distributed only (one process: --threads)");
  if (absl::GetFlag(FLAGS_distributed)) {
    TORCH_CHECK(absl::GetFlag(FLAGS_plan).empty(), "--plan is a plan for one process's "
                "pipeline (//balancing:balance --plan); it does not apply with --distributed");
#if GPIPE_WITH_DISTRIBUTED
    return train_distributed(trainer);
#else
    TORCH_CHECK(false, "--distributed: this build has no gpipe::distributed (Gloo's headers, "
                "gloo/algorithm.h, were not found when it was built: install libgloo-dev and "
                "build again)");
#endif
  }
  at::manual_seed(absl::GetFlag(FLAGS_seed));
  Data data = load_data_from_flags();
  const int64_t batch_size = absl::GetFlag(FLAGS_batch_size);
  TORCH_CHECK(batch_size >= 1, "--batch_size must be positive, got ", batch_size);
  // The pipeline's shape: from the flags, or from --plan.
  PipelineShape flags;
  flags.partitions = absl::GetFlag(FLAGS_partitions);
  flags.chunks = absl::GetFlag(FLAGS_chunks);
  flags.checkpoint = absl::GetFlag(FLAGS_checkpoint);
  flags.schedule = absl::GetFlag(FLAGS_schedule);
  flags.virtual_stages = absl::GetFlag(FLAGS_virtual_stages);
  flags.microbatch_group = absl::GetFlag(FLAGS_microbatch_group);
  flags.threads = absl::GetFlag(FLAGS_threads);
  flags.balance_from = absl::GetFlag(FLAGS_balance);
  const PipelineShape shape = apply_plan(flags, absl::GetFlag(FLAGS_plan));
  const int64_t chunks = shape.chunks;
  TORCH_CHECK(chunks >= 1, "--chunks must be positive, got ", chunks);
  const std::string& checkpoint = shape.checkpoint;
  const std::string& schedule = shape.schedule;

  int64_t partitions = shape.partitions;
  TORCH_CHECK(partitions >= 0, "--partitions must be positive, got ", partitions);
  const std::vector<c10::Device> devices =
      shape.devices.empty()
          ? parse_devices(absl::GetFlag(FLAGS_devices), partitions,
                          // (A searched schedule, "auto", places one stage per worker.)
                          schedule == "auto" ? gpipe::ScheduleKind::kGPipe
                                             : gpipe::schedule_kind(schedule))
          : shape.devices;
  const bool on_cpu = divide_cores(devices, shape.threads);

  torch::nn::Sequential model =
      trainer.make(models::ModelInput{data.channels, data.size, data.classes});
  const at::Tensor sample = data.train.images().slice(0, 0, batch_size);
  std::vector<int64_t> balance = shape.balance;
  if (!balance.empty()) {
    check_plan_fits(balance, static_cast<int64_t>(model->size()), trainer.name);
  } else {
    balance = choose_balance(absl::GetFlag(FLAGS_balance), partitions, model, sample, chunks,
                             devices.front());
  }
  gpipe::SearchedSchedule searched;
  gpipe::PipelinePlan auto_plan;
  const gpipe::PipelineSchedule chosen =
      schedule == "auto" ? searched_schedule(model, balance, sample, chunks,
                                             parse_checkpoint(checkpoint), devices, auto_plan,
                                             searched)
                         : schedule_of(shape);
  GPipe pipe(model, GPipeOptions(balance)
                        .devices(devices)
                        .chunks(chunks)
                        .checkpoint(parse_checkpoint(checkpoint))
                        .deferred_batch_norm(true)
                        .schedule(chosen));
  pipe->record_timeline(true);
  // GPipe's own schedule keeps forward() and backward(); the others run as step().
  const bool use_step = schedule != "gpipe";
  // step() runs each partition on a thread of its own; forward() where the engine decides so
  // (Note [Threads of forward()]). Partitions that share one thread get every core.
  const bool own_threads = use_step || pipe->partitions_on_own_threads();
  if (on_cpu && !own_threads && shape.threads <= 0) {
    set_intra_op_threads(static_cast<int>(std::max(std::thread::hardware_concurrency(), 1u)));
  }
  int64_t parameters = 0;
  for (const auto& p : pipe->parameters()) parameters += p.numel();
  std::printf("%s on %s (%lld training, %lld test images of %lldx%lldx%lld): %lld layers, "
              "%.2fM parameters\n",
              trainer.name.c_str(), data.name.c_str(),
              static_cast<long long>(data.train.images().size(0)),
              static_cast<long long>(data.test.images().size(0)),
              static_cast<long long>(data.channels), static_cast<long long>(data.size),
              static_cast<long long>(data.size), static_cast<long long>(model->size()),
              parameters / 1e6);
  std::printf("GPipe: balance {%s} (%s), devices {%s}, %lld micro-batches of a %lld-image batch, "
              "checkpoint %s, schedule %s%s%s%s\n",
              absl::StrJoin(balance, ", ").c_str(), shape.balance_from.c_str(),
              absl::StrJoin(devices, ", ", [](std::string* s, const c10::Device& d) {
                s->append(d.str());
              }).c_str(),
              static_cast<long long>(chunks), static_cast<long long>(batch_size),
              checkpoint.c_str(), schedule.c_str(),
              on_cpu ? absl::StrFormat(own_threads ? ", one worker and %d intra-op thread%s per "
                                                     "partition"
                                                   : ", the partitions on one thread with %d "
                                                     "intra-op thread%s",
                                       at::get_num_threads(),
                                       at::get_num_threads() == 1 ? "" : "s").c_str()
                     : "",
              !use_step && pipe->stage_local_backward() ? ", stage-local backward" : "",
              absl::GetFlag(FLAGS_amp) ? (on_cpu ? ", autocast bfloat16" : ", autocast float16")
                                       : "");
  if (schedule == "auto") {
    std::printf("searched schedule: %s (the search's own model: %.1f ms; the best generated "
                "there, %s: %.1f ms); runs %s, %.1f ms per step predicted by the planner\n",
                searched.origin.c_str(), searched.simulation.makespan / 1000,
                searched.best_generated_name.c_str(), searched.best_generated.makespan / 1000,
                auto_plan.schedule_text.empty() ? "zb (the planner predicts nothing faster)"
                                                : "the searched schedule",
                auto_plan.step_us / 1000);
  }

  torch::optim::Adam optimizer(pipe->parameters(), torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)));
  const c10::Device in = devices.front();
  const c10::Device out = devices.back();
  const bool amp = absl::GetFlag(FLAGS_amp);
  const c10::DeviceType amp_device = on_cpu ? c10::kCPU : c10::kCUDA;
  const c10::ScalarType amp_dtype = on_cpu ? c10::kBFloat16 : c10::kHalf;
  // float16 gradients underflow without loss scaling (gpipe::GradScaler, Note [Loss scaling]);
  // bfloat16 has float32's range.
  GradScaler scaler(GradScalerOptions().enabled(amp && !on_cpu));

  // Each epoch's order comes from the epoch's number, not from the random generators, so that a
  // run resumed in the middle of an epoch sees the rest of the same order.
  const auto train_loader = [&](int64_t epoch) {
    torch::data::samplers::DistributedRandomSampler sampler(
        static_cast<size_t>(data.train.images().size(0)), 1, 0, /*allow_duplicates=*/false);
    sampler.set_epoch(static_cast<size_t>(epoch));
    return torch::data::make_data_loader(
        data.train.map(torch::data::transforms::Stack<>()), std::move(sampler),
        torch::data::DataLoaderOptions(batch_size).drop_last(true));
  };
  auto test_loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      data.test.map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions(batch_size));

  const int64_t epochs = absl::GetFlag(FLAGS_epochs);
  const int64_t max_steps = absl::GetFlag(FLAGS_steps);
  const int64_t steps_per_epoch = data.train.images().size(0) / batch_size;
  const int64_t steps = max_steps > 0 ? std::min(max_steps, steps_per_epoch) : steps_per_epoch;
  const auto run_start = std::chrono::steady_clock::now();
  double last_accuracy = 0;
  double last_throughput = 0;
  std::vector<TimelineEvent> last_forward;
  std::vector<double> spans;  // each step's span on its timeline, this epoch's steps
  training::LoopTimes loop_times;  // this epoch's steps, for --plan's report
  const auto ms_since = [](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
        .count();
  };
  const double lr = absl::GetFlag(FLAGS_lr);
  const int64_t total_steps = std::max<int64_t>(epochs * steps, 1);
  int64_t global_step = 0;
  const std::string save = absl::GetFlag(FLAGS_save);
  const int64_t save_every = absl::GetFlag(FLAGS_save_every);
  // The scaler's state is saved when it scales (float16 on CUDA), so that other runs' saves load.
  GradScaler* const scaler_or_null = scaler.is_enabled() ? &scaler : nullptr;
  const auto save_into = [&](const std::string& folder) {
    std::filesystem::create_directories(folder);
    save_training(folder + "/model.pt", *pipe, &optimizer, global_step, scaler_or_null);
  };
  const std::string resume = save_to_resume();
  if (!resume.empty()) global_step = load_training(resume, *pipe, &optimizer, scaler_or_null);
  // The saved run went on with its step global_step + 1: this epoch's step `skip` + 1.
  const int64_t first_epoch = global_step / std::max<int64_t>(steps, 1) + 1;
  const int64_t skip = global_step % std::max<int64_t>(steps, 1);
  if (!resume.empty()) {
    std::printf(
        "resumed from %s at step %lld: epoch %lld %s\n", resume.c_str(),
        static_cast<long long>(global_step), static_cast<long long>(first_epoch),
        skip == 0 ? "from its start" : absl::StrCat("after its first ", skip, " steps").c_str());
  }
  for (int64_t epoch = first_epoch; epoch <= epochs; ++epoch) {
    pipe->train();
    const int64_t skipped = epoch == first_epoch ? skip : 0;
    Progress progress(epoch, (steps - skipped) * batch_size);
    int64_t step = 0;
    double loss_sum = 0;
    spans.clear();
    loop_times.clear();
    auto loader = train_loader(epoch);
    auto iteration_start = std::chrono::steady_clock::now();
    for (auto& batch : *loader) {
      if (step == steps) break;
      if (step < skipped) {  // trained on before the save
        ++step;
        iteration_start = std::chrono::steady_clock::now();
        continue;
      }
      optimizer.zero_grad();
      at::Tensor loss;
      const auto step_start = std::chrono::steady_clock::now();
      {
        std::unique_ptr<Autocast> autocast;
        if (amp) autocast = std::make_unique<Autocast>(amp_device, amp_dtype);
        if (use_step) {
          loss = pipe->step(batch.data.to(in), batch.target.to(out),
                            [&scaler](const Batch& logits, const at::Tensor& target) {
                              return scaler.scale(at::cross_entropy_loss(
                                  logits.tensor().to(at::kFloat), target));
                            }) / scaler.scale_value();
        } else {
          at::Tensor logits = pipe->forward(batch.data.to(in));
          loss = at::cross_entropy_loss(logits.to(at::kFloat), batch.target.to(out));
        }
      }
      if (!use_step) scaler.scale(loss).backward();
      loop_times.step_ms.push_back(ms_since(step_start));
      kill_if_asked(0, global_step + 1);  // with the step's gradients, before its update
      spans.push_back(step_ms(pipe->last_timeline()));
      set_cosine_lr(optimizer, lr, global_step, total_steps);
      const auto optimizer_start = std::chrono::steady_clock::now();
      scaler.step(optimizer, pipe->parameters());  // skipped when a gradient overflowed
      loop_times.optimizer_ms.push_back(ms_since(optimizer_start));
      scaler.update();
      ++step;
      ++global_step;
      loss_sum += loss.item<double>();
      progress.update((step - skipped) * batch_size, loss_sum / (step - skipped));
      if (!save.empty() && save_every > 0 && global_step % save_every == 0) {
        save_into(save + "/latest");
      }
      loop_times.loop_ms.push_back(ms_since(iteration_start));
      iteration_start = std::chrono::steady_clock::now();
    }
    progress.finish();
    const double train_seconds = progress.seconds();
    last_throughput = (step - skipped) * batch_size / train_seconds;
    last_forward = pipe->last_timeline();
    if (epoch == epochs) {
      if (!absl::GetFlag(FLAGS_trace).empty()) pipe->write_chrome_trace(absl::GetFlag(FLAGS_trace));
      if (!absl::GetFlag(FLAGS_svg).empty()) pipe->write_timeline_svg(absl::GetFlag(FLAGS_svg));
      if (!absl::GetFlag(FLAGS_ideal_svg).empty()) {
        const int64_t stop =
            checkpoint_stop(parse_checkpoint(checkpoint), chunks);
        write_file(absl::GetFlag(FLAGS_ideal_svg),
                   use_step ? schedule_svg(pipe->schedule(chunks))
                            : schedule_svg(chunks, partitions, stop));
      }
    }

    // Test accuracy, pipelined too.
    pipe->eval();
    at::NoGradGuard no_grad;
    int64_t correct = 0;
    int64_t seen = 0;
    int64_t batches = 0;
    for (auto& batch : *test_loader) {
      if (absl::GetFlag(FLAGS_test_batches) > 0 && batches == absl::GetFlag(FLAGS_test_batches)) {
        break;
      }
      at::Tensor logits = pipe->forward(batch.data.to(in));
      correct += logits.argmax(1).eq(batch.target.to(out)).sum().item<int64_t>();
      seen += batch.target.size(0);
      ++batches;
    }
    last_accuracy = 100.0 * correct / std::max<int64_t>(seen, 1);
    std::printf(
        "epoch %lld: train loss %.4f, %.1f samples/s (%s); test accuracy %.2f%% "
        "(%lld images)\n",
        static_cast<long long>(epoch), loss_sum / std::max<int64_t>(step - skipped, 1),
        last_throughput, duration(train_seconds).c_str(), last_accuracy,
        static_cast<long long>(seen));
    if (!save.empty()) {
      const std::string folder = absl::StrCat(save, "/epoch_", epoch);
      save_into(folder);
      std::printf("saved in %s (step %lld)\n", folder.c_str(),
                  static_cast<long long>(global_step));
    }
    std::fflush(stdout);
  }

  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  const double ideal = static_cast<double>(partitions - 1) / (chunks + partitions - 1);
  const std::string bubble =
      use_step
          ? absl::StrFormat("last step's bubble %.0f%% (the %s schedule's simulated bubble %.0f%%)",
                            100 * step_bubble(last_forward,
                                              static_cast<int64_t>(pipe->schedule(chunks).ranks.size())),
                            schedule,
                            100 * simulate_schedule(pipe->schedule(chunks)).bubble)
          : absl::StrFormat("last step's forward bubble %.0f%% (ideal clock-cycle schedule "
                            "(n-1)/(m+n-1) = %.0f%%)",
                            100 * measured_bubble(last_forward, partitions), 100 * ideal);
  std::printf("summary: balance {%s}; %lld micro-batches; %s; %.1f samples/s; test accuracy "
              "%.2f%%; %s in all\n",
              absl::StrJoin(balance, ", ").c_str(), static_cast<long long>(chunks),
              bubble.c_str(), last_throughput, last_accuracy, duration(total).c_str());
  if (schedule == "auto") {
    std::printf(
        "searched schedule: the last epoch's steps took %.1f ms on their timelines (the median; "
        "the last %.1f ms), %.1f ms predicted\n",
        median_of(spans), step_ms(last_forward), auto_plan.step_us / 1000);
  }
  if (shape.predicted_step_ms > 0) {
    std::printf(
        "plan: %.1f ms per step predicted; the last epoch's steps took %.1f ms on their "
        "timelines (the median; the last %.1f ms)\n",
        shape.predicted_step_ms, median_of(spans), step_ms(last_forward));
    std::printf("plan: %s\n", training::plan_report(shape, loop_times, "adam").c_str());
  }
  std::printf("parameters: %s (a checksum of the trained parameters and buffers)\n",
              parameters_digest(*pipe).c_str());
  std::vector<c10::Device> seen_devices;
  for (const c10::Device& d : devices) {
    if (std::find(seen_devices.begin(), seen_devices.end(), d) != seen_devices.end()) continue;
    seen_devices.push_back(d);
    if (d.is_cuda()) {
      std::printf("peak memory on %s: %.1f MiB allocated\n", d.str().c_str(),
                  gpipe::internal::peak_memory_allocated(d) / 1048576.0);
    } else {
      struct rusage usage {};
      getrusage(RUSAGE_SELF, &usage);
      std::printf("peak memory on %s: %.1f MiB resident (the whole process)\n", d.str().c_str(),
                  usage.ru_maxrss / 1024.0);
    }
  }
  if (!absl::GetFlag(FLAGS_trace).empty()) {
    std::printf("trace of the last step: %s (open in https://ui.perfetto.dev)\n",
                absl::GetFlag(FLAGS_trace).c_str());
  }
  if (!absl::GetFlag(FLAGS_svg).empty()) {
    std::printf("picture of the last step: %s\n", absl::GetFlag(FLAGS_svg).c_str());
  }
  return 0;
}

}  // namespace training
}  // namespace gpipe
