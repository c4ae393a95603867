// Error text: an exception's message as another error quotes it.
#pragma once

#include <exception>

#include <c10/util/Exception.h>

namespace gpipe {
namespace internal {

/// An exception's message without the backtrace a c10::Error carries (a message quoted in another
/// error is read by people, not debuggers).
///
///   TORCH_CHECK(false, "the save failed: ", gpipe::internal::without_backtrace(e));
inline const char* without_backtrace(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

}  // namespace internal
}  // namespace gpipe
