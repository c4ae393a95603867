// The end of a backward: a callback queued on the running backward that, when the backward fails
// before running it, has a cleanup run in its place.
#pragma once

#include <functional>

namespace gpipe {
namespace internal {

// Note [A callback the failed backward drops]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Engine::queue_callback runs a callback after the running backward's last node, but only when
// that backward succeeds: when a node or hook throws, the engine raises the error and destroys the
// backward's task with its callbacks unrun. What a callback was to end (handed-off backwards,
// armed all-reduces) must then be ended anyway. queue_end_of_backward's callback carries a guard
// that the engine destroys with the task; if the callback has not run, the guard runs `dropped`.
// For a CPU graph the engine destroys the task on the calling thread, before the error reaches
// the user; where the graph has CUDA nodes, a device thread may destroy it, just after.

/// Queues `callback` at the end of the backward running on this thread (the engine's
/// queue_callback); if that backward fails before running it, `dropped` runs instead, when the
/// engine discards it. `dropped` must not throw. A callback queued from another one runs after
/// every callback queued before it.
///
///   queue_end_of_backward([state] { state->finish(); }, [state] { state->abandon(); });
void queue_end_of_backward(std::function<void()> callback, std::function<void()> dropped);

}  // namespace internal
}  // namespace gpipe
