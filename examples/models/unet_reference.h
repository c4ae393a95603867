// The reference's benchmark U-Net (torchgpipe's benchmarks/models/unet, "simplified U-Net") as one
// flat torch::nn::Sequential: `depth` encoder levels of `num_convs` (3x3 convolution, channel
// dropout, instance norm, leaky ReLU) blocks whose output is stashed before a 2x2 max pool, a
// bottleneck, `depth` decoder levels that upsample, pop the encoder's features and concatenate
// them (upsampled first), and a 1x1 convolution to the output channels; 44 * num_convs + 21
// layers at depth 5. Each level's stash and pop share a Namespace. Same layer order, channel
// arithmetic and parameter counts as the reference (U-Net (6, 72): 362,157,516).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>

namespace gpipe {
namespace models {

/// Stashes its input as the level's "skip" and returns it.
struct UNetStashImpl : torch::nn::Cloneable<UNetStashImpl> {
  void reset() override {}
  at::Tensor forward(const at::Tensor& x);
};
TORCH_MODULE(UNetStash);

/// Pops the level's "skip", pads the input at the bottom and right to its size if they differ,
/// and returns cat(input, skip) along the channels.
struct UNetPopCatImpl : torch::nn::Cloneable<UNetPopCatImpl> {
  void reset() override {}
  at::Tensor forward(const at::Tensor& x);
};
TORCH_MODULE(UNetPopCat);

/// The reference's U-Net (B = num_convs, C = base_channels), e.g. unet_reference(5, 6, 72) for
/// its memory benchmark's baseline.
///
///   torch::nn::Sequential model = gpipe::models::unet_reference(5, 1, 64);  // 65 layers
torch::nn::Sequential unet_reference(int64_t depth = 5, int64_t num_convs = 5,
                                     int64_t base_channels = 64, int64_t input_channels = 3,
                                     int64_t output_channels = 1);

}  // namespace models
}  // namespace gpipe
