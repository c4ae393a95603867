// Saving a training run and resuming it: a module's parameters and buffers, its optimizer's state,
// the step and the random generators, in one file, loaded back for bit-identical next steps.
#pragma once

#include <cstdint>
#include <string>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "gpipe/grad_scaler.h"

namespace gpipe {

// Note [Saving and resuming]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A run resumed from a save must take the steps the saved run would have taken, bit for bit: the
// same parameters and buffers (running statistics too), the optimizer's state (momentum, Adam's
// moments and step counts), the step number, and the random generators that dropout and the
// like draw from (the CPU's and each CUDA device's), which checkpointed micro-batches also
// replay. Tensors are loaded into the module's own, by name, in place (copy_): each keeps its
// device (a GPipe's partitions stay where they are), its identity (an optimizer made before the
// load still refers to it) and its dtype; a name, shape or dtype that differs is refused, naming
// it. The optimizer's state comes back on the device it was saved from, so a run resumes on the
// same layout of devices. Across processes (gpipe/distributed/saved_training.h) each stage writes
// its own file and each rank its own generators.

/// Saves what resuming `module`'s training needs to the file `path`: its parameters and buffers
/// by name, `optimizer`'s state (if not null), `step`, this process's random generators, and
/// `scaler`'s state (if not null: gpipe::GradScaler).
///
///   gpipe::save_training("run/step_1000.pt", *model, &adam, step);
///   ...
///   step = gpipe::load_training("run/step_1000.pt", *model, &adam);  // continues exactly
void save_training(const std::string& path, const torch::nn::Module& module,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler = nullptr);

/// Loads what save_training saved into `module` (in place: the same names, shapes and dtypes)
/// and `optimizer` (made over the module's parameters as when saved), restores the random
/// generators and `scaler` (if not null), and returns the step. Throws c10::Error naming what
/// does not match.
int64_t load_training(const std::string& path, torch::nn::Module& module,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler = nullptr);

namespace detail {

// The file of a save split over several (gpipe/distributed/saved_training.h): `layout` says what
// wrote it, and a load into another layout is refused; `module` (if not null), `optimizer` (if
// not null) and `step`; this process's random generators when `random`.
void save_file(const std::string& path, const std::string& layout,
               const torch::nn::Module* module, const torch::optim::Optimizer* optimizer,
               int64_t step, bool random, const GradScaler* scaler = nullptr);
// Loads such a file; returns its step.
int64_t load_file(const std::string& path, const std::string& layout, torch::nn::Module* module,
                  torch::optim::Optimizer* optimizer, bool random, GradScaler* scaler = nullptr);

}  // namespace detail
}  // namespace gpipe
