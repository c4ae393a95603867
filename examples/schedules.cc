// Shows a pipeline schedule before anything runs: its actions per rank (with the sends and
// receives between ranks), its simulated bubble and micro-batches in flight, and a picture. Reads
// a schedule of your own from a file (Note [Schedule text] in gpipe/schedule_text.h) and checks it.
//
//   bazel run //examples:schedules -- --schedule=1f1b --partitions=4 --chunks=8 --svg=/tmp/1f1b.svg
//   bazel run //examples:schedules -- --text=my_schedule.txt
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_join.h"
#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_text.h"
#include "gpipe/trace.h"

ABSL_FLAG(std::string, schedule, "gpipe", "gpipe, 1f1b, interleaved or zb");
ABSL_FLAG(int, partitions, 4, "ranks (devices or processes)");
ABSL_FLAG(int, chunks, 8, "micro-batches per mini-batch");
ABSL_FLAG(int, virtual_stages, 2, "stages per rank, for --schedule=interleaved");
ABSL_FLAG(std::string, text, "", "read the schedule from this file instead (one line per rank)");
ABSL_FLAG(bool, transfers, true, "print the sends and receives between ranks too");
ABSL_FLAG(double, forward, 1, "simulated time of a forward (F) of a rank's share of the model");
ABSL_FLAG(double, backward_input, 1, "simulated time of an input gradient (I; B is I + W)");
ABSL_FLAG(double, backward_weight, 1, "simulated time of a weight gradient (W)");
ABSL_FLAG(double, transfer, 0, "simulated time of a transfer between ranks");
ABSL_FLAG(std::string, svg, "", "write a picture of the simulated schedule here");

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
          kind == gpipe::ScheduleKind::kInterleaved ? absl::GetFlag(FLAGS_virtual_stages) : 1);
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
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "schedules: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
