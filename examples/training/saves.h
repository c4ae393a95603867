// The example trainers' saves and restarts (//examples:resnet, :amoebanet and :gpt): which save a
// run resumes, the fault injection that tests restarts, and a checksum to compare two runs' models
// bit for bit. No flags of its own: each trainer passes its --save and --resume.
#pragma once

#include <cstdint>
#include <string>

#include <torch/nn/module.h>

namespace gpipe {
namespace training {

/// The save in `folder`: its model.pt (a save of one process), or the folder itself (a save
/// across processes, committed by its manifest). Either loads into either kind of run, in any
/// layout (Note [Saves that outlive their layout] in gpipe/saved_training.h).
std::string save_in(const std::string& folder);

/// The newest complete save of `folder`: itself, if it is a save, else the newest of its
/// subfolders (in name order among equal steps: the same in every process); empty if none.
std::string newest_save(const std::string& folder);

/// The save to resume from (a file or a folder, for load_training), given the trainer's --save
/// and --resume: in a process that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0), the
/// newest complete save in `save`, if it holds one; else `resume`'s when given (a save, or a
/// folder of saves, whose newest complete save it takes). Empty: start afresh. Throws c10::Error
/// when `resume` holds no complete save.
std::string save_to_resume(const std::string& save, const std::string& resume);

/// The trainers' fault injection: with GPIPE_TRAINER_KILL="<rank>@<step>", the process of that
/// global rank kills itself with SIGKILL in the middle of that training step (counted from 1
/// over the run), unless torchrun restarted it (TORCHELASTIC_RESTART_COUNT > 0).
void kill_if_asked(int rank, int64_t step);

/// The parameters and buffers of `module` as one checksum (16 hexadecimal digits): FNV-1a over
/// their bytes in order, to compare two runs' results bit for bit.
std::string parameters_digest(const torch::nn::Module& module);

}  // namespace training
}  // namespace gpipe
