// The balancing command line: profiles a bundled example model layer by layer and prints the
// per-layer table, the balance, each partition's predicted cost and the bottleneck.
//
//   bazel run //balancing:balance -- --model=resnet101 --partitions=4 --by=time --device=cpu
//   bazel run //balancing:balance -- --model=unet --partitions=3 --by=size --json
#include <algorithm>
#include <cstdio>
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
#include "balancing/balance.h"
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

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Balances a bundled model for gpipe::GPipe.");
  absl::ParseCommandLine(argc, argv);
  const std::string by = absl::GetFlag(FLAGS_by);
  if (by != "time" && by != "size") {
    std::fprintf(stderr, "--by must be time or size, got '%s'\n", by.c_str());
    return 2;
  }
  try {
    at::manual_seed(0);
    gpipe::models::NamedModel named = gpipe::models::make_model(absl::GetFlag(FLAGS_model));
    int64_t batch = absl::GetFlag(FLAGS_batch);
    if (batch <= 0) {
      const bool large = named.vocabulary > 0 ||  // a sequence of tokens
                         (named.sample_shape.size() == 3 && named.sample_shape[1] == 224);
      batch = large ? 1 : 32;
    }
    const at::Tensor sample = gpipe::models::sample_batch(named, batch);
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
