// The end of a backward; see end_of_backward.h and Note [A callback the failed backward drops].
#include "gpipe/internal/end_of_backward.h"

#include <memory>
#include <utility>

#include <torch/csrc/autograd/engine.h>

namespace gpipe {
namespace internal {
namespace {

// Shared by the callback's copies: destroyed with the engine's task.
struct Guard {
  std::function<void()> callback, dropped;
  bool ran = false;
  ~Guard() {
    if (!ran) dropped();
  }
};

}  // namespace

void queue_end_of_backward(std::function<void()> callback, std::function<void()> dropped) {
  auto guard = std::make_shared<Guard>();
  guard->callback = std::move(callback);
  guard->dropped = std::move(dropped);
  torch::autograd::Engine::get_default_engine().queue_callback([guard] {
    guard->ran = true;  // the callback ends the backward, also when it throws
    guard->callback();
  });
}

}  // namespace internal
}  // namespace gpipe
