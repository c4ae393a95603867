// What the trainers' pipeline flags choose; see choices.h.
#include "examples/training/choices.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <numeric>
#include <chrono>
#include <thread>

#include <c10/util/Exception.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "balancing/balance.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace training {

bool divide_cores(const std::vector<c10::Device>& devices, int64_t threads) {
  const bool on_cpu = std::all_of(devices.begin(), devices.end(),
                                  [](const c10::Device& d) { return d.is_cpu(); });
  if (on_cpu) {
    const int64_t cores = std::max<int64_t>(std::thread::hardware_concurrency(), 1);
    const int64_t partitions = std::max<int64_t>(static_cast<int64_t>(devices.size()), 1);
    set_intra_op_threads(
        static_cast<int>(threads > 0 ? threads : std::max<int64_t>(cores / partitions, 1)));
  }
  return on_cpu;
}

Checkpoint parse_checkpoint(const std::string& name) {
  try {
    return checkpoint_from_name(name);
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "--checkpoint must be always, except_last or never, got '", name, "'");
  }
}

std::vector<int64_t> choose_balance(const std::string& spec, int64_t partitions,
                                    const torch::nn::Sequential& model, const at::Tensor& sample,
                                    int64_t chunks, c10::Device device) {
  if (spec == "auto" || spec == "time") {
    return balance_by_time(partitions, model, sample,
                           BalanceByTimeOptions().timeout(std::chrono::seconds(2)).device(device));
  }
  if (spec == "size") {
    return balance_by_size(partitions, model, sample,
                           BalanceBySizeOptions().chunks(chunks).device(device));
  }
  std::vector<int64_t> balance;
  for (absl::string_view part : absl::StrSplit(spec, ',')) {
    int64_t layers = 0;
    TORCH_CHECK(absl::SimpleAtoi(part, &layers) && layers >= 1, "--balance: '", part,
                "' is not a positive number of layers; use auto, time, size or e.g. 4,5,3");
    balance.push_back(layers);
  }
  TORCH_CHECK(static_cast<int64_t>(balance.size()) == partitions, "--balance has ",
              balance.size(), " partitions but there are ", partitions,
              " (--partitions / --devices)");
  return balance;
}

PipelineShape apply_plan(PipelineShape flags, const std::string& plan_path) {
  if (plan_path.empty()) return flags;
  TORCH_CHECK(flags.microbatch_group == 0, "--microbatch_group ", flags.microbatch_group,
              " with --plan ", plan_path, ": a plan sets the schedule and has no micro-batch "
              "group; leave --microbatch_group out (or 0), or give the pipeline by flags instead "
              "of --plan");
  std::ifstream in(plan_path);
  TORCH_CHECK(in, "--plan: cannot read ", plan_path);
  PipelinePlan plan;
  try {
    plan = PipelinePlan::from_json(
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "--plan ", plan_path, ": ", e.what_without_backtrace());
  }
  PipelineShape shape;
  shape.partitions = static_cast<int64_t>(plan.balance.size());
  shape.devices = plan.devices;
  shape.chunks = plan.chunks;
  shape.checkpoint = checkpoint_name(plan.checkpoint);
  shape.schedule = plan.schedule_text.empty() ? schedule_kind_name(plan.schedule) : "searched";
  shape.schedule_text = plan.schedule_text;
  shape.predicted_step_ms = plan.step_us / 1000;
  shape.predicted_optimizer_ms = plan.optimizer_us / 1000;
  if (plan.optimizer) shape.planned_optimizer = optimizer_kind_name(*plan.optimizer);
  shape.virtual_stages = plan.virtual_stages;
  shape.threads = plan.threads;
  shape.balance = plan.balance;
  shape.balance_from = "--plan";
  return shape;
}

void LoopTimes::clear() {
  step_ms.clear();
  optimizer_ms.clear();
  loop_ms.clear();
}

double median_of(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t k = values.size() / 2;
  return values.size() % 2 == 1 ? values[k] : (values[k - 1] + values[k]) / 2;
}

std::string plan_report(const PipelineShape& shape, const LoopTimes& times,
                        const std::string& optimizer) {
  const double predicted = shape.predicted_step_ms + shape.predicted_optimizer_ms;
  const double step = median_of(times.step_ms);
  const double stepped = median_of(times.optimizer_ms);
  const double loop = median_of(times.loop_ms);
  std::string out = absl::StrFormat(
      "%.1f ms per step predicted (%.1f the step, %.1f its optimizer); measured: the step %.1f ms, "
      "the optimizer %.1f ms, data and logging %.1f ms, %.1f ms in all (%+.1f%% against the "
      "prediction)",
      predicted, shape.predicted_step_ms, shape.predicted_optimizer_ms, step, stepped,
      std::max(0.0, loop - step - stepped), loop, 100 * (predicted - loop) / loop);
  if (!shape.planned_optimizer.empty() && shape.planned_optimizer != optimizer) {
    absl::StrAppend(&out, "; the plan predicted ", shape.planned_optimizer,
                    "'s step and memory, but this trainer steps ", optimizer,
                    " (plan with balance --optimizer=", optimizer, ")");
  }
  return out;
}

PipelineSchedule schedule_of(const PipelineShape& shape) {
  if (!shape.schedule_text.empty()) return PipelineSchedule::text(shape.schedule_text);
  return PipelineSchedule::of(schedule_kind(shape.schedule), shape.virtual_stages,
                              shape.microbatch_group);
}

void check_plan_fits(const std::vector<int64_t>& balance, int64_t layers,
                     const std::string& model) {
  const int64_t planned = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  TORCH_CHECK(planned == layers, "--plan: its balance {", absl::StrJoin(balance, ", "), "} has ",
              planned, " layers but ", model, " has ", layers, "; make the plan for this model");
}

}  // namespace training
}  // namespace gpipe
