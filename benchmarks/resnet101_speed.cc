// The reference's ResNet-101 speed benchmark (torchgpipe's benchmarks/resnet101-speed): the
// fine-grained ResNet-101 (370 layers) trained with SGD on a synthetic data set, the plain model
// against GPipe with 1, 2, 4 and 8 partitions and the reference's balances, batch sizes and
// micro-batches. Full size (224 x 224, 50,000 samples an epoch, 10 epochs) on CUDA; on the CPU a
// reduced size (32 x 32 images, smaller batches, the experiments with 1 and 2 partitions).
//
//   bazel run -c opt //benchmarks:resnet101_speed -- --size=reduced --json_out=/tmp/r101.json
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "benchmarks/reference_runner.h"
#include "examples/models/resnet.h"

ABSL_FLAG(int, epochs, 0, "epochs (default: 10 full size, 3 reduced)");
ABSL_FLAG(int64_t, dataset_size, 0, "samples per epoch (default: 50000 full size, 192 reduced)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace bench = gpipe::bench;
  const bool cuda = bench::use_cuda(absl::GetFlag(FLAGS_size), 1);
  auto model = [] { return gpipe::models::resnet_fine(101); };
  std::vector<bench::Experiment> experiments;
  if (cuda) {
    // The reference's experiments (benchmarks/resnet101-speed/main.py).
    auto add = [&](const char* name, std::vector<int64_t> balance, int64_t batch, int64_t chunks) {
      experiments.push_back({name, model, std::move(balance), batch, chunks,
                             gpipe::Checkpoint::kExceptLast, {3, 224, 224}, 1000});
    };
    add("baseline", {}, 118, 1);
    add("pipeline-1", {370}, 220, 2);
    add("pipeline-2", {135, 235}, 25000, 1667);
    add("pipeline-4", {44, 92, 124, 110}, 5632, 256);
    add("pipeline-8", {26, 22, 33, 44, 44, 66, 66, 69}, 5400, 150);
  } else {
    auto add = [&](const char* name, std::vector<int64_t> balance, int64_t batch, int64_t chunks) {
      experiments.push_back({name, model, std::move(balance), batch, chunks,
                             gpipe::Checkpoint::kExceptLast, {3, 32, 32}, 1000});
    };
    add("baseline", {}, 16, 1);
    add("pipeline-1", {370}, 32, 2);
    add("pipeline-2", {135, 235}, 64, 8);
  }
  const int epochs = absl::GetFlag(FLAGS_epochs) > 0 ? absl::GetFlag(FLAGS_epochs) : (cuda ? 10 : 3);
  const int64_t samples = absl::GetFlag(FLAGS_dataset_size) > 0 ? absl::GetFlag(FLAGS_dataset_size)
                                                               : (cuda ? 50000 : 192);
  bench::run_speed("ResNet-101 (370 layers) speed", bench::select(experiments, cuda,
                                                                  absl::GetFlag(FLAGS_experiments)),
                   cuda, samples, epochs, 1, absl::GetFlag(FLAGS_json_out));
  return 0;
}
