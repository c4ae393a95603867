// What the trainers' pipeline flags choose, shared by //examples/training's trainer and
// //examples:gpt (without flags of its own, so that each program defines its own).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/modules/container/sequential.h>

#include "balancing/plan.h"
#include "gpipe/checkpoint.h"
#include "gpipe/gpipe.h"

namespace gpipe {
namespace training {

/// --checkpoint's mode: always, except_last or never.
Checkpoint parse_checkpoint(const std::string& name);

/// Whether every partition is on the CPU; if so, the CPU as a pipeline of cores: the intra-op
/// threads set to `threads` (--threads), or when it is 0, the cores divided among the partitions
/// (each has a worker).
bool divide_cores(const std::vector<c10::Device>& devices, int64_t threads);

/// --balance: auto or time (balance_by_time), size (balance_by_size), or "4,5,3".
std::vector<int64_t> choose_balance(const std::string& spec, int64_t partitions,
                                    const torch::nn::Sequential& model, const at::Tensor& sample,
                                    int64_t chunks, c10::Device device);

/// The pipeline's shape as a trainer's flags give it, or as a plan (--plan) replaces them.
struct PipelineShape {
  int64_t partitions = 0;
  /// Empty: the program parses its --devices (each its own way).
  std::vector<c10::Device> devices;
  int64_t chunks = 1;
  std::string checkpoint = "except_last";
  std::string schedule = "gpipe";
  int64_t virtual_stages = 1;
  /// Interleaved: micro-batches per group (Note [Micro-batch groups]; 0: the schedule's default).
  int64_t microbatch_group = 0;
  int64_t threads = 0;
  /// The plan's balance; empty: choose_balance with --balance.
  std::vector<int64_t> balance;
  /// Where the balance comes from, for the trainers' summaries: --balance's value or "--plan".
  std::string balance_from = "auto";
  /// A plan's searched schedule as text (PipelinePlan::schedule_text; `schedule` is then
  /// "searched"); empty otherwise.
  std::string schedule_text;
  /// A plan's predicted step time, milliseconds; 0 without a plan or a prediction.
  double predicted_step_ms = 0;
  /// A plan's predicted optimizer step after it (PipelinePlan::optimizer_us), milliseconds; 0
  /// without a plan or that prediction.
  double predicted_optimizer_ms = 0;
  /// The optimizer a plan's predictions are for (optimizer_kind_name; PipelinePlan::optimizer);
  /// empty without a plan or where its file does not say.
  std::string planned_optimizer;
};

/// What step() runs for `shape`: its searched schedule's text, or its schedule kind with its
/// virtual stages and micro-batch group.
PipelineSchedule schedule_of(const PipelineShape& shape);

/// What each training step of a loop took, milliseconds, for a plan's report: the step's call
/// (forward and backward), the optimizer's step after it, and the loop's whole iteration (the
/// rest is the data, the loss's value and the logging). Host time: on CUDA what the host waited.
struct LoopTimes {
  std::vector<double> step_ms, optimizer_ms, loop_ms;
  /// Empties all three (a new epoch).
  void clear();
};

/// The median of `values`: the middle one, or the mean of the two middle ones (0 for none).
double median_of(std::vector<double> values);

/// A plan's prediction beside what the loop took, as the trainers print it (the medians):
/// "66.1 ms per step predicted (65.6 the step, 0.5 its optimizer); measured: the step 74.1 ms,
/// the optimizer 0.6 ms, data and logging 3.3 ms, 78.0 ms in all (-15.3% against the
/// prediction)"; and where the plan was made for another optimizer than `optimizer`, the one the
/// trainer steps (an optimizer_kind_name), which and how to plan for this one.
std::string plan_report(const PipelineShape& shape, const LoopTimes& times,
                        const std::string& optimizer);

/// `flags` with the plan in --plan's file (//balancing:balance --plan --plan_out=<file>) in their
/// place when `plan_path` is not empty. Throws c10::Error naming the file when it cannot be read
/// or is not a plan.
PipelineShape apply_plan(PipelineShape flags, const std::string& plan_path);

/// Refuses a planned balance that does not cover `layers` layers (a plan made for another model).
void check_plan_fits(const std::vector<int64_t>& balance, int64_t layers,
                     const std::string& model);

}  // namespace training
}  // namespace gpipe
