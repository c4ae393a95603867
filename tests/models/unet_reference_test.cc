// The reference's benchmark U-Net: its layer and parameter counts, stashes paired with pops by
// level, and a GPipe of it equal to the plain model with skips crossing partitions.
#include "tests/models/model_test_util.h"

#include "examples/models/unet_reference.h"

namespace gpipe {
namespace testing {
namespace {

CATCH_TEST_CASE("the reference U-Net has its layer and parameter counts", "[models][unet]") {
  // torchgpipe's benchmarks/unet-memory: U-Net (6, 72) has 362.2M parameters (362,157,516 by the
  // reference's code); (1, 64) is 65 layers and 28,276,448 parameters.
  torch::nn::Sequential small = models::unet_reference(5, 1, 64);
  CATCH_CHECK(small->size() == 65);
  CATCH_CHECK(parameter_count(*small) == 28276448);
#ifndef __SANITIZE_ADDRESS__  // a 1.4 GB model: counted in the plain builds, not again under ASan
  torch::nn::Sequential baseline = models::unet_reference(5, 6, 72);
  CATCH_CHECK(baseline->size() == 44 * 6 + 21);
  CATCH_CHECK(parameter_count(*baseline) == 362157516);
  CATCH_CHECK_NOTHROW(verify_skippables(baseline));
#endif
  CATCH_CHECK_THROWS_WITH(models::unet_reference(5, 0, 64), gpipe_test::contains("got 0"));
}

CATCH_TEST_CASE("a GPipe of the reference U-Net equals the plain model with skips crossing "
                "partitions",
                "[models][unet][transparency]") {
  const Checkpoint mode = GENERATE(Checkpoint::kNever, Checkpoint::kAlways);
  CATCH_CAPTURE(static_cast<int>(mode));
  // depth 3, one convolution per level: 6 * 3 (encoder) + 4 + 6 * 3 (decoder) + 1 = 41 layers;
  // the cuts put every level's stash and pop in different partitions.
  auto make = [] { return models::unet_reference(3, 1, 8, /*input_channels=*/2, 1); };
  CATCH_REQUIRE(make()->size() == 41);
  at::manual_seed(6);
  check_transparent(make, at::randn({4, 2, 16, 16}, at::kDouble),
                    GPipeOptions({7, 15, 19}).devices({at::kCPU, at::kCPU, at::kCPU}).chunks(2)
                        .checkpoint(mode),
                    [](torch::nn::Module& m) { m.eval(); });  // dropout off: masks differ by order
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
