// Flattening: a model written as nested Sequentials (and ModuleLists of blocks applied in order)
// turned into the one flat Sequential of its leaf layers that a GPipe partitions, so that a
// balance may cut anywhere.
#pragma once

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

namespace gpipe {

// Note [Flattening nested models]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A transformer is usually written as an embedding, a list of blocks and a head, each block a
// module of its own; a GPipe cuts only between the layers of one Sequential. (In C++ a Sequential
// is a layer of another only as a subclass with a forward of fixed types, as torchvision's C++
// models write it: struct StackImpl : SequentialImpl { at::Tensor forward(const at::Tensor& x) {
// return SequentialImpl::forward(x); } }; and a ModuleList, which has no forward, only as the
// root or inside another ModuleList.) flatten() walks the
// model depth first: a Sequential's layers and a ModuleList's elements in order, and puts every
// leaf (any layer that is neither) in one Sequential, the same module objects (so parameters,
// skips and ties stay what they were), each named after its path with '_' for '.' (module names
// cannot hold dots): "blocks_3_attn" for blocks[3]->attn... The flat model computes what the
// nested one computes when the nested one is a chain: every Sequential applies its layers in order
// and every ModuleList is applied element after element, as a Sequential would. A block whose
// forward is not a chain — a residual, x + attn(ln(x)) — is written as layers with a skip
// (gpipe::skippable, stash/pop): the layer before the branch stashes x, the layer after it pops
// x and adds it; examples/models/gpt.h writes each transformer block this way
// (docs/transformers.md).
// A ModuleList's leaf elements must be Sequentials or ModuleLists: a torch::nn::Module pointer
// alone does not say what its forward takes, so it cannot be called as a layer.

/// `module`'s leaf layers in order, in one Sequential (Note [Flattening nested models]).
///
///   Stack block(torch::nn::Linear(8, 8), torch::nn::ReLU());  // a SequentialImpl subclass
///   torch::nn::Sequential nested(torch::nn::Linear(4, 8), block, torch::nn::Linear(8, 2));
///   torch::nn::Sequential flat = gpipe::flatten(nested);  // "0", "1_0", "1_1", "2"
torch::nn::Sequential flatten(const torch::nn::Sequential& module);
/// The same for a ModuleList of blocks (Sequentials or ModuleLists) applied in order.
torch::nn::Sequential flatten(const torch::nn::ModuleList& module);

}  // namespace gpipe
