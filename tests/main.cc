// The one test main of every gpipe test binary: Catch2's session, with [cuda] tests skipped when no
// CUDA device is present ([gpus2] ones with fewer than two, [python] ones without Python's torch),
// and a closing summary line that .ci/run adds up across binaries.
#define CATCH_CONFIG_RUNNER
#include "tests/catch.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <torch/cuda.h>

namespace {

size_t skipped_tests = 0;

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
                stats.totals.testCases.failed, skipped_tests);
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
  // own), and without Python's torch (/usr/bin/python3 with python3-torch, which tools/setup.sh
  // installs), the [python] ones (they compare with models and training made in Python).
  auto& specs = session.configData().testsOrTags;
  if (specs.empty()) {
    const bool no_cuda = !torch::cuda::is_available();
    std::vector<std::string> skipped;
    if (no_cuda || torch::cuda::device_count() < 2) skipped.push_back(no_cuda ? "cuda" : "gpus2");
    const auto tags = all_tags(session);
    const auto has = [&tags](const std::string& wanted) {
      for (const std::vector<std::string>& t : tags) {
        if (std::find(t.begin(), t.end(), wanted) != t.end()) return true;
      }
      return false;
    };
    if (has("python") && std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0) {
      skipped.push_back("python");
    }
    std::string spec;  // each exclusion, all of them at once
    for (const std::string& tag : skipped) spec += "~[" + tag + "]";
    for (const std::vector<std::string>& t : tags) {
      for (const std::string& tag : skipped) {
        if (std::find(t.begin(), t.end(), tag) != t.end()) {
          ++skipped_tests;  // each test once, whatever it is skipped for
          break;
        }
      }
    }
    for (const std::string& tag : skipped) {
      size_t count = 0;
      for (const std::vector<std::string>& t : tags) {
        if (std::find(t.begin(), t.end(), tag) != t.end()) ++count;
      }
      if (count > 0) {
        std::printf("%s: skipping %zu [%s] test case(s).\n",
                    tag == "cuda"    ? "No CUDA device"
                    : tag == "gpus2" ? "Fewer than two CUDA devices"
                                     : "No Python torch (/usr/bin/python3 -c 'import torch')",
                    count, tag.c_str());
      }
    }
    if (!spec.empty()) {
      Catch::ConfigData data = session.configData();
      data.testsOrTags.push_back(spec);
#if GPIPE_CATCH2_VERSION == 3
      // A binary of skipped tests only then runs none, which is not a failure (Catch2 3 exits
      // with 2 when no test ran, unless told otherwise).
      data.allowZeroTests = true;
#endif
      // Through useConfigData: all_tags() made the session's Config, which run() would reuse.
      session.useConfigData(data);
    }
  }
  return session.run();
}
