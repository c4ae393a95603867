// How often deferred batch norm read a call's statistics from the sinks (Note [Statistics from
// the sinks] in gpipe/batchnorm.h), for tests that check that the path is taken.
#pragma once

#include <cstdint>

namespace gpipe {
namespace internal {

/// The calls gathered from the sinks since the process began (all threads).
int64_t sink_readings();

}  // namespace internal
}  // namespace gpipe
