// The balancing command line: profiles a bundled example model layer by layer and prints the
// per-layer table, the balance, each partition's predicted cost and the bottleneck; or, with
// --plan, plans the whole pipeline (balancing/plan.h) and prints the five best plans.
//
//   bazel run //balancing:balance -- --model=resnet101 --partitions=4 --by=time --device=cpu
//   bazel run //balancing:balance -- --model=unet --partitions=3 --by=size --json
//   bazel run //balancing:balance -- --model=resnet20_cifar --plan --devices=cpu,cpu
//       --batch=128 --memory_limit=500000000 --plan_out=/tmp/plan.json
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "balancing/balance.h"
#include "balancing/plan.h"
#if GPIPE_WITH_DISTRIBUTED
#include "balancing/gloo_link.h"
#include "balancing/nccl_link.h"
#endif
#include "gpipe/trace.h"
#include "examples/models/registry.h"

ABSL_FLAG(std::string, model, "resnet50", "a bundled model: resnet18 ... resnet152, "
          "resnet18_cifar ... resnet152_cifar, unet, mlp");
ABSL_FLAG(int, partitions, 4, "number of partitions");
ABSL_FLAG(std::string, by, "time", "time or size");
ABSL_FLAG(std::string, device, "cpu", "where to measure: cpu, cuda or cuda:N");
ABSL_FLAG(int, batch, 0, "sample batch size (0: 1 for ImageNet ResNets, 32 otherwise)");
ABSL_FLAG(double, timeout, 1.0, "seconds of timing passes (--by=time)");
ABSL_FLAG(int, chunks, 8, "micro-batches the GPipe will use (--by=size)");
ABSL_FLAG(double, param_scale, 2.0, "optimizer bytes per parameter byte (--by=size)");
ABSL_FLAG(bool, json, false, "print JSON instead of tables");
ABSL_FLAG(std::string, input, "",
          "<channels>x<size> of the images and 10 classes, as the trainers' data gives them (1x28 "
          "for Fashion-MNIST); default: the model's own");
ABSL_FLAG(int64_t, sequence, 0,
          "token models (gpt_*): tokens per sample, as the GPT trainer's --sequence (0: the "
          "model's context)");
ABSL_FLAG(bool, plan, false,
          "plan the pipeline (partitions up to the --devices, balance, micro-batches, checkpoint "
          "mode, schedule) from one profile and print the five best plans");
ABSL_FLAG(std::string, devices, "cpu,cpu",
          "with --plan: the devices a pipeline may use, one per partition (repeats allowed)");
ABSL_FLAG(int64_t, memory_limit, 0, "with --plan: bytes per device a plan may take (0: no limit)");
ABSL_FLAG(std::string, optimizer, "momentum", "with --plan: sgd, momentum, adam or adamw");
ABSL_FLAG(bool, master_weights, false,
          "with --plan: training keeps float32 master weights of the float16 and bfloat16 "
          "parameters (Note [Training memory] in balancing/memory.h)");
ABSL_FLAG(std::string, autocast, "",
          "with --plan: the forward runs under autocast to this dtype, float16 or bfloat16 (its "
          "weight cache counts); empty: no autocast");
ABSL_FLAG(int64_t, threads, 0,
          "with --plan: intra-op threads per CPU worker (0: the cores divided among the devices)");
ABSL_FLAG(std::string, plan_out, "", "with --plan: write the best plan here (JSON), for the "
          "trainers' --plan");
ABSL_FLAG(std::string, profile_out, "", "with --plan: write the profile here (JSON)");
ABSL_FLAG(bool, processes, false,
          "with --plan: each worker in a process of its own (PipelineStage), activations sent on "
          "the link between processes (Note [Stages and replicas in the plan])");
ABSL_FLAG(int64_t, replicas, 1,
          "with --plan: data-parallel replicas, each stage's gradients averaged over them after "
          "the step; the mini-batch (--batch) is one replica's");
ABSL_FLAG(std::string, process_link, "",
          "with --processes or --replicas: the link between processes as LATENCY_US,BYTES_PER_US,"
          "ALLREDUCE_STEP_US,ALLREDUCE_BYTES_PER_US (a network's numbers); empty: measured on Gloo "
          "over this machine's loopback, unless the profile (--profile_in) has one");
ABSL_FLAG(std::string, backend, "gloo",
          "with --processes: what the stages send on (the trainers' --backend): gloo (through the "
          "CPU where a stage is on a GPU) or nccl (GPU to GPU, for plans whose stages are all on "
          "GPUs: measured between the first two GPUs of --devices, or --nccl_link's numbers)");
ABSL_FLAG(std::string, nccl_link, "",
          "with --backend=nccl: the link between GPUs on NCCL as LATENCY_US,BYTES_PER_US,"
          "ALLREDUCE_STEP_US,ALLREDUCE_BYTES_PER_US; empty: measured, unless the profile "
          "(--profile_in) has one");
ABSL_FLAG(int64_t, shared_memory, int64_t{8} << 20,
          "with --processes: the bytes of each ring in shared memory between stages on this "
          "machine, as PipelineStageOptions::shared_memory (a message that an empty ring always "
          "takes goes through it, measured with the link); 0: every message on Gloo. A profile's link "
          "(--profile_in) keeps its rings, or none, unless this is 0");
ABSL_FLAG(std::string, profile_in, "",
          "with --plan: plan from this profile (JSON, from --profile_out) instead of profiling");

namespace {

// --input: "<channels>x<size>", or the model's own.
gpipe::models::ModelInput model_input() {
  gpipe::models::ModelInput input;
  const std::string spec = absl::GetFlag(FLAGS_input);
  if (spec.empty()) return input;
  const std::vector<std::string> parts = absl::StrSplit(spec, 'x');
  TORCH_CHECK(parts.size() == 2 && absl::SimpleAtoi(parts[0], &input.channels) &&
                  absl::SimpleAtoi(parts[1], &input.size) && input.channels > 0 && input.size > 0,
              "--input must be <channels>x<size> such as 1x28, got '", spec, "'");
  input.classes = 10;
  return input;
}

// A mini-batch of `batch` samples for `named`, of --sequence tokens for a token model.
at::Tensor sample_of(const gpipe::models::NamedModel& named, int64_t batch) {
  at::Tensor sample = gpipe::models::sample_batch(named, batch);
  const int64_t sequence = absl::GetFlag(FLAGS_sequence);
  if (sequence > 0) {
    TORCH_CHECK(named.vocabulary > 0 && sequence <= sample.size(1), "--sequence is for token "
                "models (gpt_*), at most their context (", sample.dim() > 1 ? sample.size(1) : 0,
                "), got ", sequence);
    sample = sample.narrow(1, 0, sequence).contiguous();
  }
  return sample;
}

// A stage on a GPU reaches Gloo through the CPU (Note [Stages and replicas in the plan]): the
// copies between each GPU and the CPU, measured where the profile has none.
void add_cpu_copies(gpipe::PipelineProfile& profile) {
  for (const c10::Device& d : profile.devices) {
    const bool has = d.is_cpu() || std::any_of(profile.copies.begin(), profile.copies.end(),
                                               [&](const gpipe::CopyStats& c) {
                                                 return c.from == d && c.to.is_cpu();
                                               });
    if (has) continue;
    for (const gpipe::CopyStats& c : gpipe::profile_copies({d, c10::Device(c10::kCPU)})) {
      profile.copies.push_back(c);
    }
  }
}

// Four numbers LATENCY_US,BYTES_PER_US,ALLREDUCE_STEP_US,ALLREDUCE_BYTES_PER_US from `flag`'s
// `given` value into `link` (ProcessLinkStats or GpuLinkStats).
template <typename Link>
void parse_link(const char* flag, const std::string& given, Link& link) {
  const std::vector<std::string> parts = absl::StrSplit(given, ',');
  TORCH_CHECK(parts.size() == 4 && absl::SimpleAtod(parts[0], &link.latency_us) &&
                  absl::SimpleAtod(parts[1], &link.bytes_per_us) &&
                  absl::SimpleAtod(parts[2], &link.allreduce_step_us) &&
                  absl::SimpleAtod(parts[3], &link.allreduce_bytes_per_us) && link.valid(),
              flag, " must be four numbers, LATENCY_US,BYTES_PER_US,ALLREDUCE_STEP_US,"
              "ALLREDUCE_BYTES_PER_US (latencies 0 or more, bandwidths positive), got '", given,
              "'");
}

// --backend=nccl: --nccl_link's numbers, or NCCL's link measured between the first two GPUs of
// the profile's devices, into `profile` (unless it has one and the flag is empty).
void set_nccl_link(gpipe::PipelineProfile& profile) {
  gpipe::GpuLinkStats& nccl = profile.process_link.nccl;
  // (Every plan on Gloo, as its stages will send; one pipeline per process, replicated, too.)
  if (absl::GetFlag(FLAGS_backend) == "gloo" || !absl::GetFlag(FLAGS_processes)) {
    nccl = gpipe::GpuLinkStats{};
    return;
  }
  const std::string given = absl::GetFlag(FLAGS_nccl_link);
  if (!given.empty()) {
    parse_link("--nccl_link", given, nccl);
    return;
  }
  if (nccl.measured()) return;  // a profile's (--profile_in)
  std::vector<c10::Device> gpus;
  for (const c10::Device& d : profile.devices) {
    if (d.is_cuda() && std::find(gpus.begin(), gpus.end(), d) == gpus.end()) gpus.push_back(d);
  }
  TORCH_CHECK(gpus.size() >= 2, "--backend=nccl measures NCCL between two GPUs, but --devices has ",
              gpus.size(), "; give two or more (cuda:0,cuda:1), or the link's numbers "
              "(--nccl_link)");
#if GPIPE_WITH_DISTRIBUTED
  nccl = gpipe::measure_nccl_link(gpus[0], gpus[1]);
  std::printf("link between GPUs (NCCL, %s and %s): messages %.1f us + %.0f MB/s; all-reduce "
              "steps %.1f us + %.0f MB/s\n",
              gpus[0].str().c_str(), gpus[1].str().c_str(), nccl.latency_us, nccl.bytes_per_us,
              nccl.allreduce_step_us, nccl.allreduce_bytes_per_us);
#else
  TORCH_CHECK(false, "--backend=nccl needs gpipe::distributed, which this balance was built "
              "without; give --nccl_link");
#endif
}

// --process_link's numbers, or the Gloo link measured, into `profile` (unless it has one and the
// flag is empty).
void set_gloo_link(gpipe::PipelineProfile& profile) {
  add_cpu_copies(profile);
  const std::string given = absl::GetFlag(FLAGS_process_link);
  if (!given.empty()) {
    gpipe::ProcessLinkStats& link = profile.process_link;
    parse_link("--process_link", given, link);
    link.ring = gpipe::RingLinkStats{};  // (a network's: the stages are on other machines)
    return;
  }
  const int64_t ring_bytes = absl::GetFlag(FLAGS_shared_memory);
  TORCH_CHECK(ring_bytes == 0 || ring_bytes >= (int64_t{256} << 10), "--shared_memory is ",
              ring_bytes, "; give 0 (no rings) or a ring's bytes, 262144 (256 KiB) or more");
  gpipe::ProcessLinkStats& link = profile.process_link;
  if (ring_bytes == 0) link.ring = gpipe::RingLinkStats{};
  // A profile's link (--profile_in) stands as it was measured, with its rings or without.
  if (link.measured()) return;
#if GPIPE_WITH_DISTRIBUTED
  link = gpipe::measure_gloo_link();
  std::printf("link between processes (Gloo, loopback): messages %.1f us + %.0f MB/s; "
              "all-reduce steps %.1f us + %.0f MB/s\n",
              link.latency_us, link.bytes_per_us, link.allreduce_step_us,
              link.allreduce_bytes_per_us);
  if (ring_bytes == 0 || !absl::GetFlag(FLAGS_processes)) return;
  try {
    link.ring = gpipe::measure_shared_memory_link(ring_bytes);
  } catch (const std::exception& e) {
    // The stages fall back to Gloo where they cannot make their rings; so does the plan.
    std::printf("rings in shared memory could not be measured, every message planned on Gloo: "
                "%s\n", e.what());
    return;
  }
  std::printf("rings in shared memory of %lld bytes: messages %.1f us + %.0f MB/s, up to %lld "
              "bytes\n",
              static_cast<long long>(ring_bytes), link.ring.latency_us, link.ring.bytes_per_us,
              static_cast<long long>(link.ring.max_message));
#else
  TORCH_CHECK(false, "--processes and --replicas need the link between processes: this balance "
              "was built without gpipe::distributed (Gloo's headers), so give --process_link");
#endif
}

// The links between processes into `profile`: Gloo's, then NCCL's (--backend).
void set_process_link(gpipe::PipelineProfile& profile) {
  set_gloo_link(profile);
  set_nccl_link(profile);
}

// --backend and --nccl_link, before anything is measured.
void check_backend_flags() {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  TORCH_CHECK(backend == "gloo" || backend == "nccl", "--backend is '", backend,
              "'; give gloo or nccl");
  TORCH_CHECK(backend == "nccl" || absl::GetFlag(FLAGS_nccl_link).empty(),
              "--nccl_link is for --backend=nccl; give both, or neither");
  TORCH_CHECK(backend == "gloo" || absl::GetFlag(FLAGS_processes),
              "--backend=nccl is for --processes (a stage per process, each on a GPU)");
}

// --plan: profile (or read a profile), plan, print the best plans, write the best.
int plan_main(int64_t batch) {
  check_backend_flags();
  std::vector<c10::Device> devices;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_devices), ',')) {
    devices.emplace_back(std::string(name));
  }
  const gpipe::OptimizerKind kind = gpipe::optimizer_kind(absl::GetFlag(FLAGS_optimizer));
  gpipe::PlanOptions plan_options = gpipe::PlanOptions()
                                        .memory_limit(absl::GetFlag(FLAGS_memory_limit))
                                        .optimizer(kind)
                                        .master_weights(absl::GetFlag(FLAGS_master_weights));
  const std::string autocast = absl::GetFlag(FLAGS_autocast);
  TORCH_CHECK(autocast.empty() || autocast == "float16" || autocast == "bfloat16",
              "--autocast must be float16, bfloat16 or empty, got '", autocast, "'");
  if (!autocast.empty()) {
    plan_options.autocast(autocast == "float16" ? at::kHalf : at::kBFloat16);
  }
  gpipe::PipelineProfile profile;
  if (!absl::GetFlag(FLAGS_profile_in).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_profile_in));
    TORCH_CHECK(in, "--profile_in: cannot read ", absl::GetFlag(FLAGS_profile_in));
    profile = gpipe::PipelineProfile::from_json(
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  } else {
    gpipe::models::NamedModel named =
        gpipe::models::make_model(absl::GetFlag(FLAGS_model), model_input());
    const at::Tensor sample = sample_of(named, batch);
    // The smallest micro-batch a candidate can have (the most chunks the planner tries), not 1:
    // a model with batch norm over 1x1 maps cannot train on one sample (AmoebaNet-D at 28x28).
    const std::vector<int64_t> chunks = plan_options.chunks();
    const int64_t most = *std::max_element(chunks.begin(), chunks.end());
    profile = gpipe::profile_pipeline(
        named.model, sample, devices,
        gpipe::PipelineProfileOptions()
            .timeout(std::chrono::duration<double>(absl::GetFlag(FLAGS_timeout)))
            .threads(absl::GetFlag(FLAGS_threads))
            .min_batch(std::max<int64_t>((batch + most - 1) / most, 1)));
  }
  plan_options.processes(absl::GetFlag(FLAGS_processes)).replicas(absl::GetFlag(FLAGS_replicas));
  if (plan_options.processes() || plan_options.replicas() > 1) set_process_link(profile);
  if (!absl::GetFlag(FLAGS_profile_out).empty()) {
    gpipe::write_file(absl::GetFlag(FLAGS_profile_out), profile.to_json());
  }
  const std::vector<gpipe::PipelinePlan> plans = gpipe::plan(profile, plan_options);
  if (!absl::GetFlag(FLAGS_plan_out).empty()) {
    gpipe::write_file(absl::GetFlag(FLAGS_plan_out), plans.front().to_json() + "\n");
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", plans.front().to_json().c_str());
    return 0;
  }
  std::vector<int64_t> sizes;
  for (const gpipe::LayerProfile& p : profile.sizes) sizes.push_back(p.batch);
  const bool cpu = std::any_of(profile.devices.begin(), profile.devices.end(),
                               [](const c10::Device& d) { return d.is_cpu(); });
  std::printf("model %s, mini-batch %lld, %lld layers, devices %s; profiled at micro-batches of "
              "%s%s\n\n",
              absl::GetFlag(FLAGS_model).c_str(), static_cast<long long>(profile.batch),
              static_cast<long long>(profile.layers()), absl::GetFlag(FLAGS_devices).c_str(),
              absl::StrJoin(sizes, ", ").c_str(),
              cpu ? absl::StrFormat("; CPU capacity %.2f workers of %d thread(s)",
                                    profile.cpu_capacity, profile.threads)
                        .c_str()
                  : "");
  std::printf("the %zu best plans%s (predicted step time: forward and backward of a mini-batch; "
              "peak memory per device):\n",
              plans.size(),
              absl::GetFlag(FLAGS_memory_limit) > 0
                  ? absl::StrCat(" within ", absl::GetFlag(FLAGS_memory_limit), " bytes").c_str()
                  : "");
  for (size_t k = 0; k < plans.size(); ++k) {
    std::printf("%zu. %s\n", k + 1, plans[k].describe().c_str());
  }
  if (!absl::GetFlag(FLAGS_plan_out).empty()) {
    std::printf("\nthe best plan: %s (the trainers take it with --plan=%s)\n",
                absl::GetFlag(FLAGS_plan_out).c_str(), absl::GetFlag(FLAGS_plan_out).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Balances a bundled model for gpipe::GPipe, or plans its pipeline.");
  absl::ParseCommandLine(argc, argv);
  const std::string by = absl::GetFlag(FLAGS_by);
  if (by != "time" && by != "size") {
    std::fprintf(stderr, "--by must be time or size, got '%s'\n", by.c_str());
    return 2;
  }
  try {
    at::manual_seed(0);
    gpipe::models::NamedModel named =
        gpipe::models::make_model(absl::GetFlag(FLAGS_model), model_input());
    int64_t batch = absl::GetFlag(FLAGS_batch);
    if (batch <= 0) {
      const bool large = named.vocabulary > 0 ||  // a sequence of tokens
                         (named.sample_shape.size() == 3 && named.sample_shape[1] == 224);
      batch = large ? 1 : 32;
    }
    if (absl::GetFlag(FLAGS_plan)) return plan_main(batch);
    const at::Tensor sample = sample_of(named, batch);
    const std::vector<int64_t> shape = sample.sizes().vec();
    const c10::Device device(absl::GetFlag(FLAGS_device));
    const int64_t partitions = absl::GetFlag(FLAGS_partitions);
    gpipe::check_partitions(partitions, static_cast<int64_t>(named.model->size()));

    const auto timeout = by == "time" ? std::chrono::duration<double>(absl::GetFlag(FLAGS_timeout))
                                      : std::chrono::duration<double>(0);
    const gpipe::LayerProfile profile = gpipe::profile_layers(
        named.model, sample, gpipe::ProfileOptions().timeout(timeout).device(device));
    const std::vector<double> costs =
        by == "time" ? gpipe::time_costs(profile)
                     : gpipe::size_costs(profile, absl::GetFlag(FLAGS_chunks),
                                         absl::GetFlag(FLAGS_param_scale));
    const std::vector<int64_t> balance = gpipe::block_partition(costs, partitions);
    const std::vector<double> partition_costs = gpipe::block_costs(costs, balance);
    const double worst = *std::max_element(partition_costs.begin(), partition_costs.end());
    const char* unit = by == "time" ? "us" : "bytes";

    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"model\": \"%s\", \"by\": \"%s\", \"device\": \"%s\", \"batch\": %lld, "
          "\"passes\": %lld, \"layers\": %s, \"balance\": [%s], \"partition_costs\": [%s], "
          "\"bottleneck\": %.1f, \"unit\": \"%s\"}\n",
          absl::GetFlag(FLAGS_model).c_str(), by.c_str(), device.str().c_str(),
          static_cast<long long>(batch), static_cast<long long>(profile.passes),
          profile.json().c_str(), absl::StrJoin(balance, ", ").c_str(),
          absl::StrJoin(partition_costs, ", ",
                        [](std::string* s, double c) { absl::StrAppendFormat(s, "%.1f", c); })
              .c_str(),
          worst, unit);
      return 0;
    }
    std::printf("model %s, sample %s, device %s, %lld timing pass(es)\n\n",
                absl::GetFlag(FLAGS_model).c_str(),
                absl::StrCat("[", absl::StrJoin(shape, ", "), "]").c_str(), device.str().c_str(),
                static_cast<long long>(profile.passes));
    std::printf("%s\n", profile.table().c_str());
    std::printf("balance by %s into %lld partitions: {%s}\n", by.c_str(),
                static_cast<long long>(partitions), absl::StrJoin(balance, ", ").c_str());
    size_t next = 0;
    for (size_t j = 0; j < balance.size(); ++j) {
      std::printf("  partition %zu: layers %zu-%zu, predicted %.1f %s%s\n", j, next,
                  next + balance[j] - 1, partition_costs[j], unit,
                  partition_costs[j] == worst ? "  <- bottleneck" : "");
      next += balance[j];
    }
    const double total = std::accumulate(partition_costs.begin(), partition_costs.end(), 0.0);
    std::printf("bottleneck: %.1f %s (%.1f%% of the total)\n", worst, unit,
                100.0 * worst / std::max(1e-12, total));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
