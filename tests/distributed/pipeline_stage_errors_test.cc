// Pipeline stages that fail across processes: a stage that dies, stages configured differently
// (a stage that fails and stays alive: pipeline_stage_fault_test.cc).
#include "tests/distributed/stage_test_util.h"

namespace gpipe {
namespace distributed {
namespace {

using namespace stage_test;  // NOLINT: the shared helpers

// Stage 1's layer that ends its process during the second micro-batch of the first step.
struct DieImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    if (++calls == 2) std::_Exit(3);
    return x;
  }
  int calls = 0;
};
TORCH_MODULE(Die);

constexpr const char* kDeadStage =
    "a stage that dies mid-step makes the other's step fail with an error that says so";

CATCH_TEST_CASE(kDeadStage, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    const bool shared = std::getenv("GPIPE_TEST_SHARED_MEMORY") == nullptr;
    torch::manual_seed(7);
    nn::Sequential seq(nn::Linear(6, 8), nn::Tanh(), Die(), nn::Linear(8, 3));
    seq->to(at::kDouble);
    PipelineStage stage(
        seq, PipelineStageOptions({2, 2}).chunks(4).shared_memory(shared ? 8 << 20 : 0), join());
    CATCH_CHECK(stage->shared_memory_links() == (shared ? 1 : 0));
    auto [x, y] = batch(0);
    if (!stage->is_first()) {
      stage->step(no_input(), y, mse);
    } else if (shared) {
      // Waiting in the ring for its gradients, it finds the process gone (a zombie here: the
      // test waits for rank 0 first).
      CATCH_CHECK_THROWS_WITH(stage->step(Batch(x), {}, mse),
                              gpipe_test::contains("waiting for gradients from rank 1 on rank 0 in "
                                                   "shared memory, but the other process (pid ") &&
                                  gpipe_test::contains(") has exited"));
    } else {
      CATCH_CHECK_THROWS_WITH(stage->step(Batch(x), {}, mse),
                              gpipe_test::contains("failed on rank 0 of 2") &&
                                  gpipe_test::contains("another process may have died"));
    }
    return;
  }
  for (const bool shared : {true, false}) {
    CATCH_INFO((shared ? "through shared memory" : "over Gloo"));
    const std::string folder = folder_for(shared ? "dead_shared" : "dead");
    std::map<std::string, std::string> env{{"GPIPE_TIMEOUT_S", "20"}};
    if (!shared) env["GPIPE_TEST_SHARED_MEMORY"] = "0";
    const auto results = run_ranks(kDeadStage, 2, folder, env);
    CATCH_INFO(gpipe_test::outputs(results));
    CATCH_CHECK(results[1].exit_code == 3);
    CATCH_CHECK(results[0].exit_code == 0);  // it saw the error it expected, within the timeout
    std::filesystem::remove_all(folder);
  }
}

constexpr const char* kNoRoom =
    "stages whose rings cannot be made warn and train over Gloo to the plain model";

CATCH_TEST_CASE(kNoRoom, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    train_stage(PipelineStageOptions(kBalance).chunks(kChunks));
    return;
  }
  // 1 TiB a ring: more than an eighth of the memory left (refused at once, allocating nothing).
  check_stages(kNoRoom, folder_for("no_room"),
               {{"GPIPE_TEST_SHARED_MEMORY", std::to_string(int64_t{1} << 40)},
                {"GPIPE_TEST_SHARED_FAILS", "1"}},
               /*loss_tolerance=*/1e-12);
}

constexpr const char* kMismatch = "stages configured differently are refused at construction";

CATCH_TEST_CASE(kMismatch, "[distributed][stage][errors]") {
  if (test_rank() >= 0) {
    const int64_t chunks = test_rank() == 0 ? 2 : 4;
    CATCH_CHECK_THROWS_WITH(
        PipelineStage(make_model(), PipelineStageOptions(kBalance).chunks(chunks), join()),
        gpipe_test::contains("rank 1's stage differs from rank 0's: chunks: 4 (rank 0: 2)"));
    return;
  }
  check_ranks_pass(kMismatch, "mismatch");
}

}  // namespace
}  // namespace distributed
}  // namespace gpipe
