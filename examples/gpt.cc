// Trains a byte-level GPT (examples/models/gpt.h) in a GPipe on real English text: the fortunes
// that Debian's fortunes package installs (or any text file), with held-out text for validation
// in bits per byte beside the unigram and bigram entropies of that text, and samples of generated
// text at the end.
//
//   bazel run -c opt //examples:gpt                       # about 4 minutes on 2 cores
//   bazel run -c opt //examples:gpt -- --data=text:/path/to/book.txt --schedule=1f1b
//   torchrun --no_python --nproc_per_node=2 bazel-bin/examples/gpt --distributed  # 2 stages
//   bazel run -c opt //examples:gpt -- --save=/tmp/gpt --save_every=100   # then --resume=/tmp/gpt
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "balancing/balance.h"
#include "examples/models/gpt.h"
#include "examples/models/registry.h"
#include "examples/training/choices.h"
#include "examples/training/saves.h"
#include "examples/training/text.h"
#include "gpipe/clip_grad.h"
#include "gpipe/gpipe.h"
#include "gpipe/grad_scaler.h"
#include "gpipe/loss.h"
#include "gpipe/saved_training.h"
#include "gpipe/thread_state.h"
#include "gpipe/worker.h"
#if GPIPE_WITH_DISTRIBUTED
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/distributed/saved_training.h"
#endif

ABSL_FLAG(std::string, data, "fortunes",
          "fortunes[:<folder>] (Debian's fortunes package) or text:<file>; every tenth fortune "
          "(or 4 KiB block) is held out for validation");
ABSL_FLAG(std::string, model, "gpt_4_128", "gpt_<blocks>_<width> (vocabulary 256: bytes)");
ABSL_FLAG(int64_t, sequence, 64, "bytes per training sequence (at most the context, 256)");
ABSL_FLAG(std::string, devices, "",
          "cpu, or a list such as cuda:0,cuda:1 (default: every GPU, else the CPU)");
ABSL_FLAG(int64_t, partitions, 2, "pipeline partitions");
ABSL_FLAG(std::string, balance, "auto",
          "auto or time (balance_by_time), size (balance_by_size), or layers per partition");
ABSL_FLAG(int64_t, chunks, 4, "micro-batches per mini-batch");
ABSL_FLAG(std::string, checkpoint, "except_last", "always, except_last or never");
ABSL_FLAG(std::string, schedule, "gpipe",
          "gpipe (forward() and backward()), or 1f1b, interleaved, zb, zbv, zb1p, dualpipev "
          "(GPipe::step)");
ABSL_FLAG(int64_t, virtual_stages, 1, "with --schedule=interleaved or zb1p: partitions per worker");
ABSL_FLAG(int64_t, microbatch_group, 0,
          "with --schedule=interleaved: micro-batches that go through a virtual stage before "
          "the next (Megatron-LM's microbatch_group_size_per_vp_stage; 0: the workers, or "
          "stages, which gives the usual interleaved 1F1B)");
ABSL_FLAG(std::string, plan, "",
          "a plan from //balancing:balance --plan --plan_out=<file> (--model=gpt_<L>_<D> "
          "--batch=<batch_size>): its partitions, devices, balance, micro-batches, checkpoint mode, "
          "schedule and threads replace those flags");
ABSL_FLAG(bool, amp, false,
          "autocast: bfloat16 on the CPU; float16 on CUDA with dynamic loss scaling "
          "(gpipe::GradScaler)");
ABSL_FLAG(int64_t, steps, 1600, "training steps");
ABSL_FLAG(int64_t, batch_size, 32, "sequences per mini-batch");
ABSL_FLAG(double, lr, 1e-3, "AdamW's learning rate after warm-up; a cosine down to a tenth");
ABSL_FLAG(int64_t, eval_every, 200, "validate every this many steps (and at the end)");
ABSL_FLAG(int64_t, eval_windows, 512, "validation windows of --sequence bytes (0: all)");
ABSL_FLAG(int64_t, sample_bytes, 400, "bytes of generated text at the end");
ABSL_FLAG(double, temperature, 0.8, "sampling temperature");
ABSL_FLAG(int64_t, threads, 0,
          "intra-op threads on the CPU (default: the cores divided among the partitions)");
ABSL_FLAG(int64_t, seed, 0, "random seed");
ABSL_FLAG(double, clip_grad_norm, 0,
          "clip the gradients to this norm, taken over the whole model (every partition and "
          "stage, the tie once); 0: no clipping");
ABSL_FLAG(bool, ragged, false,
          "training sequences of random lengths from a quarter of --sequence to --sequence, "
          "padded: the loss averages over the real tokens only, under every schedule");
ABSL_FLAG(std::string, svg, "", "draw the last step's schedule here (SVG)");
ABSL_FLAG(std::string, save, "",
          "save the training (parameters, optimizer, step) in <this>/latest every --save_every "
          "steps and at the end (gpipe::save_training; with --distributed, a file per stage)");
ABSL_FLAG(int64_t, save_every, 0, "with --save: save every this many steps (0: at the end only)");
ABSL_FLAG(std::string, resume, "",
          "resume the training saved in this folder (a save, or a --save folder, whose newest "
          "complete save it takes) from the step after the save's: the same model, --steps and "
          "batch flags; the layout (--partitions, --distributed) may differ (under torchrun "
          "--max-restarts, a restarted run resumes from --save by itself)");
ABSL_FLAG(bool, distributed, false,
          "one pipeline stage per process on the CPU under torchrun (--partitions stages, "
          "WORLD_SIZE / partitions replicas, each drawing its own sequences); the tie between "
          "the first and the last stage is summed across them");

namespace gpipe {
namespace {

// AdamW's learning rate at step `step` (from 1) of `steps`: `lr` after a linear warm-up over the
// first tenth (at most 50 steps), then a cosine down to a tenth of it.
void set_learning_rate(torch::optim::AdamW& optimizer, double lr, int64_t step, int64_t steps) {
  const int64_t warmup = std::min<int64_t>(50, steps / 10);
  const double progress = static_cast<double>(step - warmup) /
                          static_cast<double>(std::max<int64_t>(steps - warmup, 1));
  const double warm = static_cast<double>(step) / static_cast<double>(std::max<int64_t>(warmup, 1));
  const double rate =
      step <= warmup ? lr * warm : lr * (0.1 + 0.45 * (1 + std::cos(M_PI * progress)));
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(rate);
  }
}

// The default devices: every GPU in turn by worker (a V-shaped schedule's worker r runs
// partitions r and 2n - 1 - r: Note [V-shaped placement]), else the CPU.
std::vector<c10::Device> parse_devices(const std::string& spec, int64_t partitions,
                                       gpipe::ScheduleKind kind) {
  if (spec.empty() && torch::cuda::is_available()) {
    const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
    std::vector<c10::Device> out;
    for (int64_t j = 0; j < partitions; ++j) {
      const int64_t workers = gpipe::v_shaped(kind) ? (partitions + 1) / 2 : partitions;
      const int64_t worker = gpipe::stage_rank(kind, j, workers);
      out.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(worker % gpus));
    }
    return out;
  }
  if (spec.empty() || spec == "cpu") return std::vector<c10::Device>(partitions, c10::kCPU);
  std::vector<c10::Device> out;
  for (absl::string_view d : absl::StrSplit(spec, ',')) out.emplace_back(std::string(d));
  TORCH_CHECK(static_cast<int64_t>(out.size()) == partitions, "--devices lists ", out.size(),
              " devices for ", partitions, " partitions (--partitions)");
  return out;
}

// How many validation windows of `length` bytes --eval_windows asks of `text` (0: all).
int64_t validation_windows(const at::Tensor& text, int64_t length) {
  const int64_t available = (text.numel() - 1) / length;
  const int64_t asked = absl::GetFlag(FLAGS_eval_windows);
  return asked > 0 ? std::min(asked, available) : available;
}

// What the corpus is, with its validation text's entropies.
void print_corpus(const training::TextCorpus& corpus, double unigram, double bigram) {
  std::printf("%s: %lld training and %lld validation bytes; validation unigram entropy %.3f, "
              "bigram %.3f bits per byte\n",
              corpus.name.c_str(), static_cast<long long>(corpus.train.numel()),
              static_cast<long long>(corpus.validation.numel()), unigram, bigram);
}

// Targets that are padding: next_token_loss (cross_entropy) leaves them out of its mean.
constexpr int64_t kPadding = -100;

// The next-byte loss as a mean over the targets that are not padding, under every schedule
// (Note [Losses over micro-batches]).
gpipe::Loss token_loss(gpipe::LossFunction next_token) {
  return gpipe::Loss(std::move(next_token), gpipe::count_targets_except(kPadding));
}

// --ragged: each window cut to a random length from a quarter of it to all of it, the rest
// padding (input byte 0, target kPadding), as batches of documents of different lengths are.
void make_ragged(at::Tensor& ids, at::Tensor& targets, at::Generator generator) {
  if (!absl::GetFlag(FLAGS_ragged)) return;
  const int64_t length = ids.size(1);
  const at::Tensor lengths =
      at::randint(std::max<int64_t>(1, length / 4), length + 1, {ids.size(0)}, generator);
  const at::Tensor padding = at::arange(length).unsqueeze(0).ge(lengths.unsqueeze(1));
  ids = ids.masked_fill(padding, 0);
  targets = targets.masked_fill(padding, kPadding);
}

// The training data's position after `steps` steps: each step's windows drawn again (and
// dropped), so that a resumed run trains on the sequences the saved run would have.
void skip_windows(const training::TextCorpus& corpus, int64_t steps, int64_t batch, int64_t length,
                  at::Generator generator) {
  for (int64_t step = 1; step <= steps; ++step) {
    auto [ids, targets] = training::random_windows(corpus.train, batch, length, generator);
    make_ragged(ids, targets, generator);
  }
}

// The step a run goes on after: that of the save to resume (--resume's, or --save's in a process
// torchrun restarted), loaded by `load` (which returns its step), with the training data moved
// there; 0 without one. `report`: say so.
int64_t resume_training(const std::function<int64_t(const std::string&)>& load,
                        const training::TextCorpus& corpus, int64_t steps, int64_t batch,
                        int64_t length, at::Generator generator, bool report) {
  const std::string resume =
      training::save_to_resume(absl::GetFlag(FLAGS_save), absl::GetFlag(FLAGS_resume));
  if (resume.empty()) return 0;
  const int64_t done = load(resume);
  TORCH_CHECK(done < steps, "--resume: ", resume, " is a save of step ", done, " and --steps is ",
              steps, ": nothing is left to train; give more --steps");
  skip_windows(corpus, done, batch, length, generator);
  if (report) {
    std::printf("resumed from %s at step %lld\n", resume.c_str(), static_cast<long long>(done));
  }
  return done;
}

// Whether step `step` of `steps` ends with a save into --save.
bool saves_after(int64_t step, int64_t steps) {
  const int64_t every = absl::GetFlag(FLAGS_save_every);
  return !absl::GetFlag(FLAGS_save).empty() && ((every > 0 && step % every == 0) || step == steps);
}

// What --clip_grad_norm and --ragged change, if anything, for the run's header.
void print_training_options() {
  const double clip = absl::GetFlag(FLAGS_clip_grad_norm);
  if (clip > 0) std::printf("gradients clipped to norm %g over the whole model\n", clip);
  if (absl::GetFlag(FLAGS_ragged)) {
    std::printf("ragged: sequences padded after a random length; the loss averages over the "
                "real tokens only\n");
  }
}

// The mean next-byte loss (nats) over the validation windows of `text`.
double validate(GPipe& model, const at::Tensor& text, int64_t length, int64_t batch, bool amp,
                c10::DeviceType amp_device, c10::ScalarType amp_dtype) {
  const int64_t n = validation_windows(text, length);
  at::NoGradGuard no_grad;
  model->eval();
  double total = 0;
  for (int64_t start = 0; start < n; start += batch) {
    const int64_t rows = std::min(batch, n - start);
    const auto [ids, next] = training::consecutive_windows(text, start, rows, length);
    std::unique_ptr<Autocast> autocast;
    if (amp) autocast = std::make_unique<Autocast>(amp_device, amp_dtype);
    const at::Tensor logits = model->forward(ids.to(model->devices().front()));
    total += models::next_token_loss(logits.to(at::kFloat), next).item<double>() * rows;
  }
  model->train();
  return total / static_cast<double>(n);
}

std::string generate(GPipe& model, const std::string& prompt, int64_t bytes, int64_t context,
                     double temperature, at::Generator generator) {
  at::NoGradGuard no_grad;
  model->eval();
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  std::string out = prompt;
  for (int64_t k = 0; k < bytes; ++k) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - context);
    const std::vector<int64_t> window(ids.begin() + start, ids.end());
    const at::Tensor input =
        at::tensor(window, at::kLong).unsqueeze(0).to(model->devices().front());
    const at::Tensor logits = model->forward(input).select(1, -1).squeeze(0).to(at::kCPU);
    const at::Tensor p = (logits.to(at::kDouble) / temperature).softmax(0);
    const int64_t next = at::multinomial(p, 1, false, generator).item<int64_t>();
    ids.push_back(next);
    out.push_back(static_cast<char>(next));
  }
  model->train();
  return out;
}

#if GPIPE_WITH_DISTRIBUTED
namespace dist = gpipe::distributed;

// Layers per stage for `stages` stages of a GPT of `blocks` blocks: whole blocks, as even as they
// go, the embedding with the first and ln_f and the head with the last (skips stay in a stage).
std::vector<int64_t> block_balance(int64_t blocks, int64_t stages) {
  TORCH_CHECK(stages >= 1 && stages <= std::max<int64_t>(blocks, 1), "--distributed: ", stages,
              " stages for ", blocks, " blocks; give at most one stage per block");
  std::vector<int64_t> balance;
  for (int64_t s = 0; s < stages; ++s) {
    const int64_t mine = blocks / stages + (s < blocks % stages ? 1 : 0);
    balance.push_back(6 * mine + (s == 0 ? 1 : 0) + (s == stages - 1 ? 2 : 0));
  }
  return balance;
}

// --distributed: this process's stage of one of the pipelines.
int run_distributed(const training::TextCorpus& corpus, double unigram, double bigram) {
  TORCH_CHECK(!absl::GetFlag(FLAGS_amp), "--amp is not supported with --distributed yet");
  const std::string devices = absl::GetFlag(FLAGS_devices);
  TORCH_CHECK(devices.empty() || devices == "cpu", "--distributed runs each stage on the CPU; "
              "--devices must be empty or cpu, got '", devices, "'");
  const int64_t stages = absl::GetFlag(FLAGS_partitions);
  const dist::PipelineGroups groups = dist::new_pipeline_groups(dist::options_from_env(),
                                                                static_cast<int>(stages));
  const bool leader = groups.stage == 0 && groups.replica == 0;
  models::NamedModel named = models::make_model(absl::GetFlag(FLAGS_model));
  TORCH_CHECK(named.vocabulary == 256, "--model must be a byte-level gpt_<blocks>_<width>");
  const int64_t blocks = (static_cast<int64_t>(named.model->size()) - 3) / 6;
  // Interleaved: one entry per virtual stage (stage s holds s, s + stages, ...); on a V (zbv,
  // dualpipev), two per stage (s and 2 stages - 1 - s: the head and its tied embedding on stage 0).
  const gpipe::ScheduleKind kind = schedule_kind(absl::GetFlag(FLAGS_schedule));
  const int64_t virtual_stages =
      gpipe::v_shaped(kind) ? 2 : std::max<int64_t>(absl::GetFlag(FLAGS_virtual_stages), 1);
  const int64_t partitions = stages * virtual_stages;
  std::vector<int64_t> balance = block_balance(blocks, partitions);
  if (absl::GetFlag(FLAGS_balance) != "auto") {
    balance = training::choose_balance(absl::GetFlag(FLAGS_balance), partitions, named.model,
                                       at::Tensor(), absl::GetFlag(FLAGS_chunks), c10::kCPU);
  }
  const int64_t batch = absl::GetFlag(FLAGS_batch_size);
  const int64_t length = absl::GetFlag(FLAGS_sequence);
  auto options = dist::PipelineStageOptions(balance)
                     .chunks(absl::GetFlag(FLAGS_chunks))
                     .checkpoint(training::parse_checkpoint(absl::GetFlag(FLAGS_checkpoint)))
                     .schedule(gpipe::PipelineSchedule::of(kind, virtual_stages,
                                                           absl::GetFlag(FLAGS_microbatch_group)));
  const gpipe::LossFunction next_token = [](const Batch& logits, const at::Tensor& targets) {
    return models::next_token_loss(logits.tensor(), targets);
  };
  dist::PipelineStage stage =
      groups.replicas > 1 ? dist::PipelineStage(named.model, options, groups.pipeline,
                                                groups.replica_group)
                          : dist::PipelineStage(named.model, options, groups.pipeline);
  if (leader) {
    print_corpus(corpus, unigram, bigram);
    // (On a V the embedding and the head tied to it are both stage 0's.)
    const std::string tie = stage->tied_stages().empty()
                                ? std::string("the tie in one stage")
                                : absl::StrCat("the tie held by stages {",
                                               absl::StrJoin(stage->tied_stages()[0], ", "), "}");
    std::printf(
        "distributed: %d stages x %d replicas, balance {%s}, %s, %lld micro-batches of "
        "%lld sequences of %lld bytes per replica\n",
        groups.stages, groups.replicas, absl::StrJoin(balance, ", ").c_str(), tie.c_str(),
        static_cast<long long>(absl::GetFlag(FLAGS_chunks)), static_cast<long long>(batch),
        static_cast<long long>(length));
    print_training_options();
  }
  const double lr = absl::GetFlag(FLAGS_lr);
  torch::optim::AdamW optimizer(
      stage->parameters(), torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).weight_decay(0.01));
  // Every stage of a replica draws the same sequences (the first needs the inputs, the last the
  // targets); each replica its own.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(absl::GetFlag(FLAGS_seed) + 1 +
                                                            1000 * groups.replica);
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  // Every process finds the same save: they read the same folders, and none is saving now.
  const int64_t done = resume_training(
      [&](const std::string& save) { return dist::load_training(save, *stage, &optimizer); },
      corpus, steps, batch, length, generator, leader);
  const int rank = dist::options_from_env().rank();
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double validation = 0;
  for (int64_t step = done + 1; step <= steps; ++step) {
    set_learning_rate(optimizer, lr, step, steps);
    auto [ids, targets] = training::random_windows(corpus.train, batch, length, generator);
    make_ragged(ids, targets, generator);
    optimizer.zero_grad();
    stage->step(stage->is_first() ? Batch(ids) : dist::no_input(),
                stage->is_last() ? targets : at::Tensor(), token_loss(next_token));
    if (absl::GetFlag(FLAGS_clip_grad_norm) > 0) {
      stage->clip_grad_norm(absl::GetFlag(FLAGS_clip_grad_norm));
    }
    training::kill_if_asked(rank, step);  // with the step's gradients, before its update
    optimizer.step();
    if (saves_after(step, steps)) {
      dist::save_training(absl::GetFlag(FLAGS_save) + "/latest", *stage, &optimizer, step);
    }
    if (step % absl::GetFlag(FLAGS_eval_every) == 0 || step == steps) {
      const auto [vids, vnext] = training::consecutive_windows(
          corpus.validation, 0, validation_windows(corpus.validation, length), length);
      stage->eval();
      const auto result = stage->evaluate(stage->is_first() ? Batch(vids) : dist::no_input(),
                                          stage->is_last() ? vnext : at::Tensor(), next_token);
      stage->train();
      validation = result.loss.item<double>();
      if (leader) {
        std::printf("step %5lld  %6.1f s  validation %.3f bits per byte\n",
                    static_cast<long long>(step), seconds(), validation / std::log(2.0));
        std::fflush(stdout);
      }
    }
  }
  std::printf("stage %d replica %d parameters: %s\n", groups.stage, groups.replica,
              training::parameters_digest(*stage).c_str());
  if (leader) {
    std::printf("summary: %d stages x %d replicas: validation %.3f bits per byte after %lld "
                "steps in %.0f s (unigram entropy %.3f, bigram %.3f)\n",
                groups.stages, groups.replicas, validation / std::log(2.0),
                static_cast<long long>(steps), seconds(), unigram, bigram);
  }
  return 0;
}
#endif

int run() {
  TORCH_CHECK(absl::GetFlag(FLAGS_schedule) != "auto",
              "--schedule=auto (a searched schedule) is "
              "the image trainers' (ResNet, AmoebaNet) so far; give the GPT a schedule by name");
  at::manual_seed(absl::GetFlag(FLAGS_seed));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(absl::GetFlag(FLAGS_seed) + 1);
  const training::TextCorpus corpus = training::load_text(absl::GetFlag(FLAGS_data));
  const auto [unigram, bigram] = training::unigram_bigram_entropy(corpus.validation);
  if (absl::GetFlag(FLAGS_distributed)) {
    TORCH_CHECK(absl::GetFlag(FLAGS_plan).empty(), "--plan is a plan for one process's pipeline "
                "(//balancing:balance --plan); it does not apply with --distributed");
#if GPIPE_WITH_DISTRIBUTED
    return run_distributed(corpus, unigram, bigram);
#else
    TORCH_CHECK(false, "--distributed: this build has no gpipe::distributed (Gloo's headers, "
                "gloo/algorithm.h, were not found when it was built: install libgloo-dev and "
                "build again)");
#endif
  }
  // The pipeline's shape: from the flags, or from --plan.
  training::PipelineShape flags;
  flags.partitions = absl::GetFlag(FLAGS_partitions);
  flags.chunks = absl::GetFlag(FLAGS_chunks);
  flags.checkpoint = absl::GetFlag(FLAGS_checkpoint);
  flags.schedule = absl::GetFlag(FLAGS_schedule);
  flags.virtual_stages = absl::GetFlag(FLAGS_virtual_stages);
  flags.microbatch_group = absl::GetFlag(FLAGS_microbatch_group);
  flags.threads = absl::GetFlag(FLAGS_threads);
  flags.balance_from = absl::GetFlag(FLAGS_balance);
  const training::PipelineShape shape = training::apply_plan(flags, absl::GetFlag(FLAGS_plan));
  const int64_t partitions = shape.partitions;
  const int64_t batch = absl::GetFlag(FLAGS_batch_size);
  const int64_t chunks = shape.chunks;
  const int64_t length = absl::GetFlag(FLAGS_sequence);
  const std::string& checkpoint = shape.checkpoint;
  TORCH_CHECK(partitions >= 1, "--partitions must be positive, got ", partitions);
  TORCH_CHECK(batch >= 1 && chunks >= 1, "--batch_size and --chunks must be positive");
  const std::vector<c10::Device> devices =
      shape.devices.empty()
          ? parse_devices(absl::GetFlag(FLAGS_devices), partitions, schedule_kind(shape.schedule))
          : shape.devices;
  const bool on_cpu = training::divide_cores(devices, shape.threads);
  models::NamedModel named = models::make_model(absl::GetFlag(FLAGS_model));
  TORCH_CHECK(named.vocabulary == 256, "--model must be a byte-level gpt_<blocks>_<width>, got '",
              absl::GetFlag(FLAGS_model), "'");
  TORCH_CHECK(length >= 1 && length <= named.sample_shape[0], "--sequence must be in 1 .. ",
              named.sample_shape[0], " (the context), got ", length);
  // (From a generator of its own: the training windows' stream is the same as --distributed's
  // replica 0, so a save resumed in either layout goes on with the same sequences.)
  auto sample_generator = at::make_generator<at::CPUGeneratorImpl>(absl::GetFlag(FLAGS_seed) + 2);
  const auto [sample, unused] =
      training::random_windows(corpus.train, batch, length, sample_generator);
  if (!shape.balance.empty()) {
    training::check_plan_fits(shape.balance, static_cast<int64_t>(named.model->size()),
                              absl::GetFlag(FLAGS_model));
  }
  const std::vector<int64_t> balance =
      !shape.balance.empty()
          ? shape.balance
          : training::choose_balance(absl::GetFlag(FLAGS_balance), partitions, named.model,
                                     sample, chunks, devices.front());
  const std::string& schedule = shape.schedule;
  GPipe model(named.model,
              GPipeOptions(balance)
                  .devices(devices)
                  .chunks(chunks)
                  .checkpoint(training::parse_checkpoint(checkpoint))
                  .schedule(training::schedule_of(shape)));
  model->record_timeline(!absl::GetFlag(FLAGS_svg).empty());
  int64_t parameters = 0;
  for (const at::Tensor& p : model->parameters()) parameters += p.numel();
  const bool amp = absl::GetFlag(FLAGS_amp);
  const c10::DeviceType amp_device = on_cpu ? c10::kCPU : c10::kCUDA;
  const c10::ScalarType amp_dtype = on_cpu ? c10::kBFloat16 : c10::kHalf;
  print_corpus(corpus, unigram, bigram);
  std::printf("%s: %lld layers, %.2fM parameters (the head tied to the token embedding: %zu "
              "tie)\n",
              absl::GetFlag(FLAGS_model).c_str(), static_cast<long long>(named.model->size()),
              parameters / 1e6, model->ties().size());
  std::printf("GPipe: balance {%s} (%s), devices {%s}, %lld micro-batches of %lld sequences of "
              "%lld bytes, checkpoint %s, schedule %s%s\n",
              absl::StrJoin(balance, ", ").c_str(), shape.balance_from.c_str(),
              absl::StrJoin(devices, ", ",
                            [](std::string* s, const c10::Device& d) { s->append(d.str()); })
                  .c_str(),
              static_cast<long long>(chunks), static_cast<long long>(batch),
              static_cast<long long>(length), checkpoint.c_str(),
              schedule.c_str(),
              amp ? (on_cpu ? ", autocast bfloat16" : ", autocast float16 with loss scaling")
                  : "");

  print_training_options();
  const double lr = absl::GetFlag(FLAGS_lr);
  // Decoupled weight decay (AdamW): Adam's own adds it to the gradient, and for LayerNorm gains,
  // whose gradients are small, it then dominates and drives them to zero at the learning rate.
  torch::optim::AdamW optimizer(
      model->parameters(), torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).weight_decay(0.01));
  // float16 gradients underflow without loss scaling; bfloat16 has float32's range.
  GradScaler scaler(GradScalerOptions().enabled(amp && !on_cpu));
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const auto loss_fn = [](const Batch& logits, const at::Tensor& targets) {
    return models::next_token_loss(logits.tensor().to(at::kFloat), targets);
  };
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // The scaler's state is saved when it scales (float16 on CUDA), so that other runs' saves load.
  GradScaler* const scaler_or_null = scaler.is_enabled() ? &scaler : nullptr;
  const int64_t done = resume_training(
      [&](const std::string& save) {
        return load_training(save, *model, &optimizer, scaler_or_null);
      },
      corpus, steps, batch, length, generator, /*report=*/true);
  double loss_sum = 0;
  int64_t loss_count = 0;
  double validation = 0;
  // The training steps' own times (data, step, optimizer; validation left out), for --plan.
  training::LoopTimes loop_times;
  for (int64_t step = done + 1; step <= steps; ++step) {
    const double step_start = seconds();
    set_learning_rate(optimizer, lr, step, steps);
    auto [ids, targets] = training::random_windows(corpus.train, batch, length, generator);
    make_ragged(ids, targets, generator);
    optimizer.zero_grad();
    at::Tensor loss;
    const double forward_start = seconds();
    {
      std::unique_ptr<Autocast> autocast;
      if (amp) autocast = std::make_unique<Autocast>(amp_device, amp_dtype);
      if (schedule == "gpipe") {
        loss = loss_fn(Batch(model->forward(ids.to(devices.front()))), targets);
      } else {
        loss = model->step(ids.to(devices.front()), targets.to(devices.back()),
                           token_loss([&scaler, &loss_fn](const Batch& logits, const at::Tensor& y) {
                             return scaler.scale(loss_fn(logits, y));
                           }));
        loss = loss / scaler.scale_value();
      }
    }
    if (schedule == "gpipe") scaler.scale(loss).backward();
    loop_times.step_ms.push_back(1000 * (seconds() - forward_start));
    if (absl::GetFlag(FLAGS_clip_grad_norm) > 0) {
      scaler.unscale(model->parameters());  // the norm of the true gradients
      clip_grad_norm(model->parameters(), absl::GetFlag(FLAGS_clip_grad_norm));
    }
    training::kill_if_asked(0, step);  // with the step's gradients, before its update
    const double optimizer_start = seconds();
    scaler.step(optimizer, model->parameters());
    loop_times.optimizer_ms.push_back(1000 * (seconds() - optimizer_start));
    scaler.update();
    if (saves_after(step, steps)) {
      const std::string folder = absl::GetFlag(FLAGS_save) + "/latest";
      std::filesystem::create_directories(folder);
      save_training(folder + "/model.pt", *model, &optimizer, step, scaler_or_null);
    }
    loss_sum += loss.item<double>();
    ++loss_count;
    loop_times.loop_ms.push_back(1000 * (seconds() - step_start));
    if (step % absl::GetFlag(FLAGS_eval_every) == 0 || step == steps) {
      validation = validate(model, corpus.validation, length, batch, amp, amp_device, amp_dtype);
      std::printf(
          "step %5lld  %6.1f s  %7.0f bytes/s  train %.3f  validation %.3f bits per "
          "byte%s\n",
          static_cast<long long>(step), seconds(),
          static_cast<double>((step - done) * batch * length) / seconds(),
          loss_sum / loss_count / std::log(2.0), validation / std::log(2.0),
          scaler.is_enabled()
              ? absl::StrFormat("  (loss scale %g, %lld steps skipped)", scaler.scale_value(),
                                static_cast<long long>(scaler.skipped()))
                    .c_str()
              : "");
      std::fflush(stdout);
      loss_sum = 0;
      loss_count = 0;
    }
  }
  if (!absl::GetFlag(FLAGS_svg).empty()) model->write_timeline_svg(absl::GetFlag(FLAGS_svg));
  if (shape.predicted_step_ms > 0) {
    std::printf("plan: %s (validation left out)\n",
                training::plan_report(shape, loop_times, "adamw").c_str());
  }
  std::printf("\nsamples (temperature %.2f):\n", absl::GetFlag(FLAGS_temperature));
  for (const char* prompt : {"Q: ", "The ", "A "}) {
    std::printf("---\n%s\n", generate(model, prompt, absl::GetFlag(FLAGS_sample_bytes), length,
                                       absl::GetFlag(FLAGS_temperature), generator)
                                  .c_str());
  }
  std::printf("---\nparameters: %s (a checksum of the trained parameters and buffers)\n",
              training::parameters_digest(*model).c_str());
  std::printf(
      "summary: validation %.3f bits per byte after %lld steps in %.0f s "
      "(unigram entropy %.3f, bigram %.3f)\n",
      validation / std::log(2.0), static_cast<long long>(steps), seconds(), unigram, bigram);
  return 0;
}

}  // namespace
}  // namespace gpipe

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Trains a byte-level GPT in a GPipe on real English text.");
  absl::ParseCommandLine(argc, argv);
  try {
    return gpipe::run();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
    return 1;
  }
}
