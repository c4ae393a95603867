// The one test main of every gpipe test binary: Catch2's session, with [cuda] tests skipped when no
// CUDA device is present ([gpus2] ones with fewer than two), and a closing summary line that .ci/run adds up across binaries.
#define CATCH_CONFIG_RUNNER
#include "tests/catch.h"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <torch/cuda.h>

namespace {

size_t skipped_cuda_tests = 0;

// Prints "gpipe-test-summary: N passed, N failed, N skipped" when the run ends; failed counts
// test cases with a failed assertion or an unexpected exception.
#if GPIPE_CATCH2_VERSION == 3
using ListenerBase = Catch::EventListenerBase;
#else
using ListenerBase = Catch::TestEventListenerBase;
#endif

// The tags of every registered test case.
std::vector<std::vector<std::string>> all_tags(Catch::Session& session) {
  std::vector<std::vector<std::string>> tags;
#if GPIPE_CATCH2_VERSION == 3
  for (const Catch::TestCaseHandle& test : Catch::getAllTestCasesSorted(session.config())) {
    tags.emplace_back();
    for (const Catch::Tag& tag : test.getTestCaseInfo().tags) {
      tags.back().emplace_back(tag.original.data(), tag.original.size());
    }
  }
#else
  for (const Catch::TestCase& test : Catch::getAllTestCasesSorted(session.config())) {
    tags.emplace_back(test.tags.begin(), test.tags.end());
  }
#endif
  return tags;
}

struct SummaryListener : ListenerBase {
  using ListenerBase::ListenerBase;
  void testRunEnded(const Catch::TestRunStats& stats) override {
    std::cout << std::flush;
    std::printf("gpipe-test-summary: %zu passed, %zu failed, %zu skipped\n",
                stats.totals.testCases.passed + stats.totals.testCases.failedButOk,
                stats.totals.testCases.failed, skipped_cuda_tests);
    std::fflush(stdout);
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(SummaryListener)

int main(int argc, char** argv) {
  Catch::Session session;
  if (int rc = session.applyCommandLine(argc, argv); rc != 0) {
    return rc;
  }
  // Without a CUDA device, a run that names no tests skips the [cuda] ones. A run that names
  // tests runs what it names (a [cuda] test named explicitly then fails for want of a device).
  // Likewise, with fewer than two, the [gpus2] ones (each process of theirs takes a GPU of its
  // own).
  auto& specs = session.configData().testsOrTags;
  const bool no_cuda = !torch::cuda::is_available();
  if ((no_cuda || torch::cuda::device_count() < 2) && specs.empty()) {
    const std::string skipped = no_cuda ? "cuda" : "gpus2";
    specs.push_back("~[" + skipped + "]");
#if GPIPE_CATCH2_VERSION == 3
    // A binary of [cuda] tests only then runs none, which is not a failure (Catch2 3 exits
    // with 2 when no test ran, unless told otherwise).
    session.configData().allowZeroTests = true;
#endif
    for (const std::vector<std::string>& tags : all_tags(session)) {
      for (const std::string& tag : tags) {
        if (tag == skipped) {
          ++skipped_cuda_tests;
        }
      }
    }
    if (skipped_cuda_tests > 0) {
      std::printf("%s: skipping %zu [%s] test case(s).\n",
                  no_cuda ? "No CUDA device" : "Fewer than two CUDA devices", skipped_cuda_tests,
                  skipped.c_str());
    }
  }
  return session.run();
}
