// The reference's AmoebaNet-D memory benchmark (torchgpipe's benchmarks/amoebanetd-memory): the
// plain AmoebaNet-D (18, 208) against GPipes of ever larger AmoebaNet-Ds over 1, 2, 4, 8
// partitions with 128 micro-batches of one image, RMSprop, two iterations; peak memory less the
// model's (parameters, gradients, RMSprop's state: 3 x the parameter bytes). Full size on CUDA
// (224 x 224); on the CPU a reduced size (filters divided by 8, 64 x 64 images, 32 images; every
// partition on the CPU).
//
//   bazel run -c opt //benchmarks:amoebanetd_memory -- --size=reduced
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "benchmarks/reference_runner.h"
#include "examples/models/amoebanet.h"


int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace bench = gpipe::bench;
  const std::string size = absl::GetFlag(FLAGS_size);
  const bool cuda = bench::use_cuda(size, 1);
  const int64_t divide = cuda ? 1 : 8;
  const int64_t image = cuda ? 224 : 64;
  const int64_t batch = cuda ? 128 : 32;
  std::vector<bench::Experiment> experiments;
  auto add = [&](const char* name, int64_t layers, int64_t filters, std::vector<int64_t> balance) {
    const int64_t d = filters / divide;
    const int64_t chunks = balance.empty() ? 1 : batch;  // the baseline has no micro-batches
    bench::Experiment e{name, [layers, d] { return gpipe::models::amoebanet_d(layers, d); },
                        std::move(balance), batch, chunks,
                        gpipe::Checkpoint::kExceptLast,
                        {3, image, image}, 1000};
    e.rmsprop = true;
    experiments.push_back(std::move(e));
  };
  // The reference's experiments (benchmarks/amoebanetd-memory/main.py).
  add("baseline", 18, 208, {});
  add("pipeline-1", 18, 416, {24});
  add("pipeline-2", 18, 544, {16, 8});
  add("pipeline-4", 36, 544, {16, 12, 7, 7});
  add("pipeline-8", 72, 512, {23, 16, 11, 6, 6, 5, 5, 6});
  return bench::memory_main(absl::StrFormat("AmoebaNet-D memory (filters / %d, %dx%d images, batch %d)",
                                    divide, image, image, batch),
                            experiments, cuda, 3.0, size, absl::GetFlag(FLAGS_child),
                            absl::GetFlag(FLAGS_experiments), absl::GetFlag(FLAGS_json_out));
}

