// The reference's AmoebaNet-D (18, 256) speed benchmark (torchgpipe's
// benchmarks/amoebanetd-speed): n = 2, 4, 8 partitions by m = 1, 4, 32 micro-batches with the
// reference's balances and batch sizes, SGD on a synthetic data set. Full size (224 x 224, 10,000
// samples an epoch, 10 epochs) on CUDA; on the CPU a reduced size (AmoebaNet-D (18, 64), 32 x 32
// images, batches divided by 8, n = 2 only).
//
//   bazel run -c opt //benchmarks:amoebanetd_speed -- --size=reduced
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "benchmarks/reference_runner.h"
#include "examples/models/amoebanet.h"

ABSL_FLAG(int, epochs, 0, "epochs (default: 10 full size, 3 reduced)");
ABSL_FLAG(int64_t, dataset_size, 0, "samples per epoch (default: 10000 full size, 320 reduced)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace bench = gpipe::bench;
  const bool cuda = bench::use_cuda(absl::GetFlag(FLAGS_size), 2);
  const int64_t filters = cuda ? 256 : 64;
  auto model = [filters] { return gpipe::models::amoebanet_d(18, filters); };
  const int64_t divide = cuda ? 1 : 8;
  std::vector<bench::Experiment> experiments;
  // The reference's experiments (benchmarks/amoebanetd-speed/main.py): m = 1 checkpoints always.
  auto add = [&](const char* name, std::vector<int64_t> balance, int64_t batch, int64_t chunks) {
    if (!cuda && balance.size() > 2) return;
    experiments.push_back({name, model, std::move(balance), batch / divide, chunks,
                           chunks == 1 ? gpipe::Checkpoint::kAlways
                                       : gpipe::Checkpoint::kExceptLast,
                           {3, cuda ? 224 : 32, cuda ? 224 : 32}, 1000});
  };
  add("n2m1", {7, 17}, 96, 1);
  add("n2m4", {9, 15}, 256, 4);
  add("n2m32", {9, 15}, 1280, 32);
  add("n4m1", {3, 4, 5, 12}, 160, 1);
  add("n4m4", {3, 6, 7, 8}, 360, 4);
  add("n4m32", {3, 6, 7, 8}, 1152, 32);
  add("n8m1", {2, 2, 2, 2, 2, 3, 4, 7}, 196, 1);
  add("n8m4", {2, 2, 2, 3, 3, 4, 4, 4}, 480, 4);
  add("n8m32", {2, 2, 2, 3, 3, 4, 4, 4}, 1280, 32);
  const int epochs = absl::GetFlag(FLAGS_epochs) > 0 ? absl::GetFlag(FLAGS_epochs) : (cuda ? 10 : 3);
  const int64_t samples = absl::GetFlag(FLAGS_dataset_size) > 0 ? absl::GetFlag(FLAGS_dataset_size)
                                                               : (cuda ? 10000 : 320);
  bench::run_speed(absl::StrFormat("AmoebaNet-D (18, %d) speed", filters),
                   bench::select(experiments, cuda, absl::GetFlag(FLAGS_experiments)), cuda,
                   samples, epochs, 1, absl::GetFlag(FLAGS_json_out));
  return 0;
}
