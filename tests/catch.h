// Catch2 for the gpipe tests, version 2 (one header, Debian 12) or 3 (a library, Debian 13 and
// most package managers today): the one place that knows the difference. Tests include this
// header, use the CATCH_-prefixed macros, and match error messages with
// gpipe_test::contains("...").
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#define GPIPE_CATCH2_VERSION 3
#include <catch2/catch_all.hpp>
#else
#define GPIPE_CATCH2_VERSION 2
#include <catch2/catch.hpp>
#endif

#include <string>

namespace gpipe_test {

/// A matcher for a message that contains `text` (Catch2 renamed it in version 3).
inline auto contains(const std::string& text) {
#if GPIPE_CATCH2_VERSION == 3
  return Catch::Matchers::ContainsSubstring(text);
#else
  return Catch::Contains(text);
#endif
}

/// Floating-point comparison within a relative margin: gpipe_test::Approx(1.5).
#if GPIPE_CATCH2_VERSION == 3
using Catch::Approx;
#else
using Catch::Detail::Approx;
#endif

}  // namespace gpipe_test
