// Fault injection: a layer fails at every (micro-batch, partition) in forward, in recomputation
// and in backward, with a c10::Error, a std::exception or something that is no std::exception.
// Each time the caller gets the error, nothing hangs (a watchdog fails the test instead), threads,
// held skips and memory return to their earlier level, and the next step equals the plain model.
#include "tests/gpipe/test_util.h"

#include "gpipe/internal/partition_threads.h"

#include <malloc.h>

#include <cstdio>
#include <future>
#include <stdexcept>
#include <thread>

#include "absl/strings/str_format.h"

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

constexpr int64_t kRows = 16;  // rows per micro-batch
constexpr int64_t kWidth = 256;

struct Fault {
  int64_t microbatch = -1;  // -1: disarmed
  int64_t partition = -1;
  std::string phase;  // "forward", "recompute" or "backward"
  std::string kind;   // "c10", "std" or "other"
};

struct NotAnException {
  int code;
};

[[noreturn]] void raise(const Fault& f) {
  const std::string what =
      absl::StrFormat("injected %s fault at (%d, %d)", f.phase, f.microbatch, f.partition);
  if (f.kind == "c10") TORCH_CHECK(false, what);
  if (f.kind == "std") throw std::runtime_error(what);
  throw NotAnException{static_cast<int>(f.microbatch * 10 + f.partition)};
}

// y = x * 1, failing where the fault says. Column 0 of row 0 holds the row's index.
struct FaultLayerImpl : nn::Module {
  FaultLayerImpl(int64_t partition, std::shared_ptr<Fault> fault)
      : partition(partition), fault(std::move(fault)) {}
  at::Tensor forward(const at::Tensor& x) {
    const int64_t mb = static_cast<int64_t>(x[0][0].item<double>()) / kRows;
    const Fault& f = *fault;
    const bool here = f.microbatch == mb && f.partition == partition;
    if (here && f.phase == "forward" && !is_recomputing()) raise(f);
    if (here && f.phase == "recompute" && is_recomputing()) raise(f);
    at::Tensor y = x * 1.0;
    if (here && f.phase == "backward" && y.requires_grad() && !is_checkpointing()) {
      Fault copy = f;
      y.register_hook([copy](const at::Tensor&) -> at::Tensor { raise(copy); });
    }
    return y;
  }
  int64_t partition;
  std::shared_ptr<Fault> fault;
};
TORCH_MODULE(FaultLayer);

// Per partition: a fault layer, a Linear whose first output keeps the row index, a skip over the
// next partition boundary.
struct KeepRowImpl : nn::Module {
  KeepRowImpl() { linear = register_module("linear", nn::Linear(kWidth, kWidth)); }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = at::tanh(linear(x));
    return at::cat({x.narrow(1, 0, 1), y.narrow(1, 1, kWidth - 1)}, 1);
  }
  nn::Linear linear{nullptr};
};
TORCH_MODULE(KeepRow);

struct StashImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    stash("carry", x * 0.5);
    return x;
  }
};
TORCH_MODULE(Stash);

struct PopImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor s = pop("carry");
    return at::cat({x.narrow(1, 0, 1), (x + s).narrow(1, 1, kWidth - 1)}, 1);
  }
};
TORCH_MODULE(Pop);

constexpr int64_t kPartitions = 3;

nn::Sequential fault_model(const std::shared_ptr<Fault>& fault) {
  at::manual_seed(17);
  nn::Sequential seq;
  for (int64_t j = 0; j < kPartitions; ++j) {
    seq->push_back(FaultLayer(j, fault));
    seq->push_back(KeepRow());
    if (j == 0) seq->push_back(skippable(Stash(), SkippableOptions().stash({"carry"})));
    if (j == 2) seq->push_back(skippable(Pop(), SkippableOptions().pop({"carry"})));
  }
  seq->to(at::kDouble);
  return seq;
}

size_t heap_bytes() { return mallinfo2().uordblks; }

// Whether the caught exception is the injected one.
bool is_injected(std::exception_ptr e, const Fault& f) {
  const std::string what =
      absl::StrFormat("injected %s fault at (%d, %d)", f.phase, f.microbatch, f.partition);
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    // c10 faults, and others converted by the autograd engine or by gpipe's recomputation.
    return std::string(err.what()).find(f.kind == "other" ? "not a std::exception" : what) !=
           std::string::npos;
  } catch (const std::exception& err) {
    return std::string(err.what()).find(what) != std::string::npos;
  } catch (const NotAnException& err) {
    return f.kind == "other" && err.code == f.microbatch * 10 + f.partition;
  } catch (...) {
    return false;
  }
}

CATCH_TEST_CASE("A fault at any task in forward, recomputation or backward reaches the caller and "
                "leaves the next step exact",
                "[reliability][errors]") {
  const bool threads = GENERATE(false, true);
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast);
  CATCH_CAPTURE(threads, static_cast<int>(mode));
  auto fault = std::make_shared<Fault>();
  GPipe model(fault_model(fault),
              gpipe::internal::with_partition_threads(GPipeOptions({2, 3, 3})
                                                          .devices({at::kCPU, at::kCPU, at::kCPU})
                                                          .chunks(3)
                                                          .checkpoint(mode),
                                                      threads));
  nn::Sequential plain = fault_model(fault);
  const at::Tensor x = rows_input(3 * kRows, kWidth);
  auto step = [&] {
    at::Tensor in = x.clone().requires_grad_(true);
    model->forward(in).sum().backward();
  };
  step();  // warm: threads, learnt metadata, allocator
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  const int threads_before = worker_thread_count();
  const int64_t skips_before = live_skip_tensors();
  size_t heap_after_first = 0;
  int64_t cases = 0;
  for (const char* phase : {"forward", "recompute", "backward"}) {
    for (const char* kind : {"c10", "std", "other"}) {
      // The autograd engine handles std::exceptions only; a layer's backward hook throwing
      // something else is outside what any LibTorch model survives.
      if (std::string(phase) == "backward" && std::string(kind) == "other") continue;
      for (int64_t i = 0; i < 3; ++i) {
        for (int64_t j = 0; j < kPartitions; ++j) {
          // kExceptLast does not recompute the last micro-batch.
          if (std::string(phase) == "recompute" && mode == Checkpoint::kExceptLast && i == 2) {
            continue;
          }
          *fault = Fault{i, j, phase, kind};
          CATCH_INFO("fault " << phase << " " << kind << " at (" << i << ", " << j << ")");
          std::exception_ptr error;
          within(120, [&] {
            try {
              step();
            } catch (...) {
              error = std::current_exception();
            }
          });
          CATCH_REQUIRE(error != nullptr);
          CATCH_CHECK(is_injected(error, *fault));
          error = nullptr;
          CATCH_CHECK(worker_thread_count() == threads_before);
          CATCH_CHECK(live_skip_tensors() == skips_before);
          if (cases == 0) heap_after_first = heap_bytes();
          ++cases;
        }
      }
    }
  }
  // A failed step that leaked its micro-batches' activations (16 x 256 doubles each, several per
  // step) would have grown the heap by megabytes over these steps.
  const double growth_mb = (static_cast<double>(heap_bytes()) - heap_after_first) / 1e6;
  CATCH_INFO("heap growth over " << cases << " failed steps: " << growth_mb << " MB");
  CATCH_CHECK(growth_mb < 4.0);
  std::printf("gpipe-fault: %lld fault-injection cases (threads=%d, checkpoint=%d)\n",
              static_cast<long long>(cases), threads, static_cast<int>(mode));

  // The next step equals the plain model.
  fault->microbatch = -1;
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  check_same_step(plain, model, x);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
