// Balancers; see balance.h.
#include "balancing/balance.h"

#include <c10/util/Exception.h>

namespace gpipe {

void check_partitions(int64_t partitions, int64_t layers) {
  TORCH_CHECK(partitions >= 1, "balance: partitions must be at least 1, got ", partitions);
  TORCH_CHECK(partitions <= layers, "balance: cannot split a Sequential of ", layers,
              " layers into ", partitions, " partitions; each partition needs a layer, so use at "
              "most ", layers);
}

std::vector<double> time_costs(const LayerProfile& profile) {
  std::vector<double> costs;
  for (const LayerStats& s : profile.layers) costs.push_back(s.forward_us + s.backward_us);
  return costs;
}

std::vector<double> size_costs(const LayerProfile& profile, int64_t chunks, double param_scale) {
  TORCH_CHECK(chunks >= 1, "balance_by_size: chunks must be at least 1, got ", chunks);
  TORCH_CHECK(param_scale >= 0, "balance_by_size: param_scale must be non-negative, got ",
              param_scale);
  // Activations scale with the micro-batch: ceil(batch / chunks) rows of the sample's batch.
  const double batch = static_cast<double>(std::max<int64_t>(profile.batch, 1));
  const double micro = static_cast<double>((profile.batch + chunks - 1) / chunks);
  std::vector<double> costs;
  for (const LayerStats& s : profile.layers) {
    const double held = static_cast<double>(std::max<int64_t>(s.held_bytes, 0));
    costs.push_back(held * micro / batch + static_cast<double>(s.param_bytes) * param_scale);
  }
  return costs;
}

std::vector<int64_t> balance_by_time(int64_t partitions, const torch::nn::Sequential& module,
                                     const at::Tensor& sample,
                                     const BalanceByTimeOptions& options) {
  check_partitions(partitions, static_cast<int64_t>(module->size()));
  const LayerProfile profile = profile_layers(
      module, sample, ProfileOptions().timeout(options.timeout()).device(options.device()));
  return block_partition(time_costs(profile), partitions);
}

std::vector<int64_t> balance_by_size(int64_t partitions, const torch::nn::Sequential& module,
                                     const at::Tensor& sample,
                                     const BalanceBySizeOptions& options) {
  check_partitions(partitions, static_cast<int64_t>(module->size()));
  const LayerProfile profile = profile_layers(
      module, sample, ProfileOptions().timeout(std::chrono::seconds(0)).device(options.device()));
  return block_partition(size_costs(profile, options.chunks(), options.param_scale()), partitions);
}

}  // namespace gpipe
