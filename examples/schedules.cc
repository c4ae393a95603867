// Shows a pipeline schedule before anything runs: its actions per rank (with the sends and
// receives between ranks), its simulated bubble and micro-batches in flight, and a picture. Reads
// a schedule of your own from a file (Note [Schedule text] in gpipe/schedule_text.h) and checks it,
// and with --run_svg runs it (GPipe::step) and draws what ran.
//
//   bazel run //examples:schedules -- --schedule=1f1b --partitions=4 --chunks=8 --svg=/tmp/1f1b.svg
//   bazel run //examples:schedules -- --text=my_schedule.txt
//   bazel run //examples:schedules -- --schedule=zb --run_svg=/tmp/zb_ran.svg
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>

#include <ATen/ops/randn.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_join.h"
#include "gpipe/gpipe.h"
#include "gpipe/schedule.h"
#include "gpipe/worker.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_text.h"
#include "gpipe/trace.h"

ABSL_FLAG(std::string, schedule, "gpipe", "gpipe, 1f1b, interleaved, zb, zbv, zb1p or dualpipev");
ABSL_FLAG(int, partitions, 4, "ranks (devices or processes)");
ABSL_FLAG(int, chunks, 8, "micro-batches per mini-batch");
ABSL_FLAG(int, virtual_stages, 2, "stages per rank, for --schedule=interleaved or zb1p");
ABSL_FLAG(int, microbatch_group, 0,
          "for --schedule=interleaved: micro-batches through a stage before the next (Note "
          "[Micro-batch groups] in gpipe/schedule.h; 0: the ranks)");
ABSL_FLAG(std::string, text, "", "read the schedule from this file instead (one line per rank)");
ABSL_FLAG(bool, transfers, true, "print the sends and receives between ranks too");
ABSL_FLAG(double, forward, 1, "simulated time of a forward (F) of a rank's share of the model");
ABSL_FLAG(double, backward_input, 1, "simulated time of an input gradient (I; B is I + W)");
ABSL_FLAG(double, backward_weight, 1, "simulated time of a weight gradient (W)");
ABSL_FLAG(double, transfer, 0, "simulated time of a transfer between ranks");
ABSL_FLAG(std::string, svg, "", "write a picture of the simulated schedule here");
ABSL_FLAG(std::string, run_svg, "",
          "also run the schedule (GPipe::step of 2 x Linear(512) + ReLU per stage on CPU "
          "partitions, one intra-op thread each) and draw what its second step did here");

namespace {

// Runs `schedule` for real, twice, and draws the second step.
void run_and_draw(const gpipe::Schedule& schedule, const std::string& path) {
  torch::nn::Sequential seq;
  for (int64_t k = 0; k < 2 * schedule.stages; ++k) {
    seq->push_back(torch::nn::Linear(512, 512));
    seq->push_back(torch::nn::ReLU());
  }
  gpipe::GPipeOptions options(std::vector<int64_t>(schedule.stages, 4));
  options.devices(std::vector<c10::Device>(schedule.stages, c10::kCPU))
      .chunks(schedule.microbatches)
      .checkpoint(gpipe::Checkpoint::kNever)
      .schedule(gpipe::PipelineSchedule::text(gpipe::schedule_text(schedule)));
  gpipe::set_intra_op_threads(1);
  gpipe::GPipe model(seq, options);
  model->record_timeline(true);
  const at::Tensor x = at::randn({64 * schedule.microbatches, 512});
  const at::Tensor y = at::randn({64 * schedule.microbatches, 512});
  for (int step = 0; step < 2; ++step) {
    model->step(x, y, [](const gpipe::Batch& out, const at::Tensor& target) {
      return (out[0] - target).pow(2).mean();
    });
  }
  gpipe::write_file(path, gpipe::timeline_svg(model->last_timeline(), model->devices()));
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  try {
    gpipe::Schedule schedule;
    if (const std::string path = absl::GetFlag(FLAGS_text); !path.empty()) {
      std::ifstream file(path);
      TORCH_CHECK(file.good(), "cannot read --text=", path);
      std::stringstream text;
      text << file.rdbuf();
      schedule = gpipe::parse_schedule(text.str());
    } else {
      const gpipe::ScheduleKind kind = gpipe::schedule_kind(absl::GetFlag(FLAGS_schedule));
      schedule = gpipe::make_schedule(
          kind, absl::GetFlag(FLAGS_partitions), absl::GetFlag(FLAGS_chunks),
          gpipe::takes_virtual_stages(kind) ? absl::GetFlag(FLAGS_virtual_stages) : 1,
          kind == gpipe::ScheduleKind::kInterleaved ? absl::GetFlag(FLAGS_microbatch_group) : 0);
    }
    gpipe::ActionCosts costs;
    costs.forward = absl::GetFlag(FLAGS_forward);
    costs.backward_input = absl::GetFlag(FLAGS_backward_input);
    costs.backward_weight = absl::GetFlag(FLAGS_backward_weight);
    costs.transfer = absl::GetFlag(FLAGS_transfer);
    // The costs are those of a rank's whole share of the model: each of v stages per rank costs
    // 1/v of it.
    const double v = static_cast<double>(schedule.virtual_stages());
    costs.forward /= v;
    costs.backward_input /= v;
    costs.backward_weight /= v;
    const gpipe::Schedule shown =
        absl::GetFlag(FLAGS_transfers) ? gpipe::with_communication(schedule) : schedule;
    const gpipe::ScheduleSimulation sim = gpipe::simulate_schedule(shown, costs);
    std::printf("%s schedule: %lld ranks, %lld stages, %lld micro-batches\n",
                schedule.name.c_str(), static_cast<long long>(schedule.num_ranks()),
                static_cast<long long>(schedule.stages),
                static_cast<long long>(schedule.microbatches));
    std::printf("%s", gpipe::schedule_text(shown).c_str());
    std::printf("simulated: step %g, bubble %.1f%%, peak in flight per rank %s\n", sim.makespan,
                100 * sim.bubble, absl::StrJoin(sim.peak_in_flight, " ").c_str());
    if (const std::string path = absl::GetFlag(FLAGS_svg); !path.empty()) {
      gpipe::write_file(path, gpipe::schedule_svg(shown, costs));
      std::printf("picture: %s\n", path.c_str());
    }
    if (const std::string path = absl::GetFlag(FLAGS_run_svg); !path.empty()) {
      run_and_draw(schedule, path);
      std::printf("as it ran: %s\n", path.c_str());
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "schedules: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
