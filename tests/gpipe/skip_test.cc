// Skip connections: stash and pop per micro-batch, routed straight from the stashing partition to
// the popping one; namespaces; optional skips; checkpointing; errors; no leaks; and the
// current_microbatch() pattern.
#include "tests/gpipe/test_util.h"

#include "gpipe/internal/partition_threads.h"

#include <map>
#include <set>

#include <torch/nn/functional/activation.h>

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;
constexpr double kTol = 1e-10;

// Stashes `2 * x` under "skip" (or whatever name it is declared with) and passes x on.
struct SaveImpl : nn::Module {
  explicit SaveImpl(std::string name = "skip") : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) {
    stash(name, x * 2);
    return x;
  }
  std::string name;
};
TORCH_MODULE(Save);

// Adds what was stashed under its name, if anything was (optional skips may be undefined).
struct AddImpl : nn::Module {
  explicit AddImpl(std::string name = "skip") : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor skip = pop(name);
    return skip.defined() ? x + skip : x;
  }
  std::string name;
};
TORCH_MODULE(Add);

// Stashes x only when `give` is set: an optional skip.
struct MaybeSaveImpl : nn::Module {
  explicit MaybeSaveImpl(bool give) : give(give) {}
  at::Tensor forward(const at::Tensor& x) {
    stash("maybe", give ? at::tanh(x) : at::Tensor());
    return x;
  }
  bool give;
};
TORCH_MODULE(MaybeSave);

Skippable<SaveImpl> save(const std::string& name) {
  return skippable(Save(name), SkippableOptions().stash({name}));
}
Skippable<AddImpl> add(const std::string& name) {
  return skippable(Add(name), SkippableOptions().pop({name}));
}

// 11 layers: a long skip "a" (layer 1 to 9), a short skip "b" (4 to 6).
nn::Sequential skip_model() {
  return nn::Sequential(nn::Linear(5, 6), save("a"), nn::Linear(6, 6), nn::Tanh(), save("b"),
                        nn::Linear(6, 6), add("b"), nn::Linear(6, 6), nn::Tanh(), add("a"),
                        nn::Linear(6, 3));
}

// A U-Net-like nest: the same Save/Add classes at two levels, told apart by namespaces, and an
// optional skip that is given or not.
nn::Sequential unet_model(bool give_optional) {
  Namespace outer;
  Namespace inner;
  auto down1 = skippable(Save(), SkippableOptions().stash({"skip"}));
  auto down2 = skippable(Save(), SkippableOptions().stash({"skip"}));
  auto up2 = skippable(Add(), SkippableOptions().pop({"skip"}));
  auto up1 = skippable(Add(), SkippableOptions().pop({"skip"}));
  down1->isolate(outer);
  up1->isolate(outer);
  down2->isolate(inner);
  up2->isolate(inner);
  return nn::Sequential(nn::Linear(4, 6), down1, nn::Linear(6, 6), down2, nn::Tanh(),
                        skippable(MaybeSave(give_optional), SkippableOptions().stash({"maybe"})),
                        nn::Linear(6, 6), up2, nn::Tanh(),
                        skippable(Add("maybe"), SkippableOptions().pop({"maybe"})), up1,
                        nn::Linear(6, 2));
}

GPipeOptions cpu(std::vector<int64_t> balance) {
  const size_t n = balance.size();
  return GPipeOptions(std::move(balance)).devices(std::vector<c10::Device>(n, at::kCPU));
}

// Stashed tensors are counted process-wide, and a plain Sequential that failed mid-way (the error
// tests) leaves its stash in the thread's map, so the tests compare counts before and after.
template <typename Make>
void check_transparent(Make make, const at::Tensor& x, const GPipeOptions& options, bool train) {
  const int64_t live_before = live_skip_tensors();
  testing::check_transparent(make, x, options, [train](nn::Module& m) { m.train(train); }, kTol);
  CATCH_CHECK(live_skip_tensors() == live_before);
}

CATCH_TEST_CASE("a Sequential with short and long skips computes what its layers compute by hand",
                "[skip]") {
  // The oracle for the plain Sequential itself: the same layers called by hand.
  const int64_t live_before = live_skip_tensors();
  nn::Sequential seq = build(skip_model, 3);
  auto linear = [&](size_t k, const at::Tensor& x) {
    return seq[k]->as<nn::Linear>()->forward(x);
  };
  const at::Tensor x = at::randn({4, 5}, at::kDouble);
  at::Tensor h = linear(0, x);
  const at::Tensor a = h * 2;
  h = at::tanh(linear(2, h));
  const at::Tensor b = h * 2;
  h = linear(5, h) + b;
  h = at::tanh(linear(7, h)) + a;
  CATCH_CHECK(max_diff(seq->forward(x), linear(10, h)) <= kTol);
  CATCH_CHECK(live_skip_tensors() == live_before);
}

CATCH_TEST_CASE("GPipe with skips equals the plain Sequential in outputs and gradients",
                "[skip][transparency]") {
  // {2, 3, 3, 3} sends "a" from partition 0 to 3 and "b" from 1 to 2; {2, 5, 4} sends "a" over
  // three partitions (0 to 2) and keeps "b" inside partition 1.
  const auto balance = GENERATE(values<std::vector<int64_t>>(
      {{11}, {5, 6}, {2, 5, 4}, {2, 3, 3, 3}, {1, 4, 2, 4}}));
  const int64_t chunks = GENERATE(1, 2, 3, 4, 7);
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const bool train = GENERATE(true, false);
  const bool threads = GENERATE(false, true);
  CATCH_CAPTURE(balance.size(), chunks, static_cast<int>(mode), train, threads);
  at::manual_seed(8);
  const at::Tensor x = at::randn({7, 5}, at::kDouble);
  check_transparent(skip_model, x,
                    gpipe::internal::with_partition_threads(
                        cpu(balance).chunks(chunks).checkpoint(mode), threads),
                    train);
}

CATCH_TEST_CASE("GPipe with namespaced and optional skips equals the plain Sequential",
                "[skip][transparency]") {
  const auto balance = GENERATE(values<std::vector<int64_t>>({{12}, {2, 10}, {4, 4, 4}, {1, 3, 4, 4}}));
  const int64_t chunks = GENERATE(1, 3, 4);
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const bool give = GENERATE(true, false);
  CATCH_CAPTURE(balance.size(), chunks, static_cast<int>(mode), give);
  at::manual_seed(9);
  const at::Tensor x = at::randn({6, 4}, at::kDouble);
  check_transparent([give] { return unet_model(give); }, x, cpu(balance).chunks(chunks).checkpoint(mode),
                    /*train=*/true);
}

CATCH_TEST_CASE("a skipped tensor moves once, straight from its stashing to its popping partition",
                "[skip][copy]") {
  const int64_t chunks = 3;
  GPipe model(build(skip_model, 1),
              cpu({2, 3, 3, 3}).chunks(chunks).checkpoint(Checkpoint::kExceptLast));
  model->record_timeline(true);
  model->train();
  model->forward(at::randn({6, 5}, at::kDouble)).sum().backward();
  std::map<std::pair<int64_t, int64_t>, int64_t> moves;  // (from, to) -> tensors
  for (const TimelineEvent& e : model->last_timeline()) {
    if (e.kind == TimelineEvent::Kind::kSkipCopy) moves[{e.from, e.partition}] += e.tensors;
  }
  // "a" (partition 0 to 3) and "b" (1 to 2), once per micro-batch; nothing else moves a skip, so
  // partitions 1 and 2 never receive "a".
  const std::map<std::pair<int64_t, int64_t>, int64_t> expected{{{0, 3}, chunks}, {{1, 2}, chunks}};
  CATCH_CHECK(moves == expected);
  // The activations go partition to partition, one tensor per micro-batch.
  int64_t activation_copies = 0;
  for (const TimelineEvent& e : model->last_timeline()) {
    if (e.kind == TimelineEvent::Kind::kCopy) {
      CATCH_CHECK(e.from == e.partition - 1);
      CATCH_CHECK(e.tensors == 1);
      ++activation_copies;
    }
  }
  CATCH_CHECK(activation_copies == chunks * 3);
}

CATCH_TEST_CASE("no stashed tensor outlives its step", "[skip][memory]") {
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever);
  const int64_t live_before = live_skip_tensors();
  GPipe model(build(skip_model, 1), cpu({2, 3, 3, 3}).chunks(4).checkpoint(mode));
  model->train();
  for (int step = 0; step < 100; ++step) {
    at::Tensor y = model->forward(at::randn({8, 5}, at::kDouble));
    y.sum().backward();
    CATCH_REQUIRE(live_skip_tensors() == live_before);
  }
  model->eval();
  {
    at::NoGradGuard no_grad;
    model->forward(at::randn({8, 5}, at::kDouble));
  }
  CATCH_CHECK(live_skip_tensors() == live_before);
}

CATCH_TEST_CASE("a checkpointed step holds its skips until backward, then none",
                "[skip][memory][checkpoint]") {
  const int64_t live_before = live_skip_tensors();
  GPipe model(build(skip_model, 1), cpu({2, 3, 3, 3}).chunks(4).checkpoint(Checkpoint::kAlways));
  model->train();
  at::Tensor y = model->forward(at::randn({8, 5}, at::kDouble));
  // Each checkpointed pop keeps its tensor as an input of the checkpoint: 2 skips x 4.
  CATCH_CHECK(live_skip_tensors() == live_before + 8);
  y.sum().backward();
  CATCH_CHECK(live_skip_tensors() == live_before);
}

CATCH_TEST_CASE("verify_skippables reports every mismatch at once", "[skip][errors]") {
  nn::Sequential seq(
      skippable(Save("x"), SkippableOptions().stash({"x"}).pop({"x"})),  // both
      save("a"), save("a"),                                             // stashed twice
      add("b"),                                                         // never stashed
      save("c"),                                                        // never popped
      add("a"), add("a"));                                              // popped twice
  try {
    verify_skippables(seq);
    CATCH_FAIL("no error");
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    CATCH_CHECK_THAT(message, gpipe_test::contains("do not match"));
    CATCH_CHECK_THAT(message, gpipe_test::contains("layer '0' declares 'x' both as a stash and as a pop"));
    CATCH_CHECK_THAT(message, gpipe_test::contains("layer '2' stashes 'a', which layer '1' already stashes"));
    CATCH_CHECK_THAT(message, gpipe_test::contains("layer '3' pops 'b', but no earlier layer stashes it"));
    CATCH_CHECK_THAT(message, gpipe_test::contains("layer '4' stashes 'c', but no later layer pops it"));
    CATCH_CHECK_THAT(message, gpipe_test::contains("layer '6' pops 'a', which an earlier layer already pops"));
  }
  CATCH_CHECK_THROWS_WITH(GPipe(seq, cpu({7})), gpipe_test::contains("do not match"));
  CATCH_CHECK_NOTHROW(verify_skippables(build(skip_model, 1)));
  CATCH_CHECK_NOTHROW(verify_skippables(unet_model(true)));
}

CATCH_TEST_CASE("the same skip names in different namespaces pass verification", "[skip][errors]") {
  auto down = skippable(Save(), SkippableOptions().stash({"skip"}));
  auto up = skippable(Add(), SkippableOptions().pop({"skip"}));
  nn::Sequential unisolated(save("skip"), down, up, add("skip"));
  CATCH_CHECK_THROWS_WITH(verify_skippables(unisolated), gpipe_test::contains("already stashes"));
  Namespace ns;
  down->isolate(ns);
  up->isolate(ns);
  CATCH_CHECK_NOTHROW(verify_skippables(unisolated));
  CATCH_CHECK_THROWS_WITH(down->isolate(ns, {"nope"}), gpipe_test::contains("'nope' is not one of"));
}

// Layers that break their declarations at run time.
struct StashUndeclaredImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    stash("other", x);
    return x;
  }
};
TORCH_MODULE(StashUndeclared);
struct PopUndeclaredImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x + pop("other"); }
};
TORCH_MODULE(PopUndeclared);
struct LazyImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x; }
};
TORCH_MODULE(Lazy);

CATCH_TEST_CASE("breaking a declaration at run time is a clear error", "[skip][errors]") {
  const at::Tensor x = at::randn({2, 3});
  {
    nn::Sequential seq(skippable(StashUndeclared(), SkippableOptions().stash({"skip"})), add("skip"));
    CATCH_CHECK_THROWS_WITH(seq->forward(x), gpipe_test::contains("stashed 'other', which it does not "
                                                             "declare as a stash (declared "
                                                             "stashes: 'skip')"));
  }
  {
    nn::Sequential seq(save("skip"), skippable(PopUndeclared(), SkippableOptions().pop({"skip"})));
    CATCH_CHECK_THROWS_WITH(seq->forward(x), gpipe_test::contains("popped 'other', which it does not "
                                                             "declare as a pop"));
  }
  {
    nn::Sequential seq(skippable(Lazy(), SkippableOptions().stash({"skip"})), add("skip"));
    CATCH_CHECK_THROWS_WITH(seq->forward(x), gpipe_test::contains("declares 'skip' as a stash, but its "
                                                             "forward did not call "
                                                             "gpipe::stash(\"skip\""));
  }
  {
    nn::Sequential seq(save("skip"), skippable(Lazy(), SkippableOptions().pop({"skip"})));
    CATCH_CHECK_THROWS_WITH(seq->forward(x), gpipe_test::contains("declares 'skip' as a pop, but its "
                                                             "forward did not call gpipe::pop"));
  }
  {
    nn::Sequential seq(add("never"));
    CATCH_CHECK_THROWS_WITH(seq->forward(x), gpipe_test::contains("skip 'never' was not stashed"));
  }
  CATCH_CHECK_THROWS_WITH(stash("skip", x), gpipe_test::contains("outside the forward of a skippable "
                                                            "layer"));
  CATCH_CHECK_THROWS_WITH(pop("skip"), gpipe_test::contains("outside the forward of a skippable layer"));
}

CATCH_TEST_CASE("a run-time skip error inside a GPipe reaches the caller, and the next step works",
                "[skip][errors]") {
  struct FlakyImpl : nn::Module {
    at::Tensor forward(const at::Tensor& x) {
      if (!fail) stash("skip", x);
      return x;
    }
    bool fail = true;
  };
  auto flaky = std::make_shared<FlakyImpl>();
  nn::Sequential seq(nn::Linear(3, 3), skippable(nn::ModuleHolder<FlakyImpl>(flaky),
                                                 SkippableOptions().stash({"skip"})),
                     nn::Linear(3, 3), add("skip"));
  GPipe model(seq, cpu({2, 2}).chunks(2));
  CATCH_CHECK_THROWS_WITH(model->forward(at::randn({4, 3})), gpipe_test::contains("did not call gpipe::stash"));
  flaky->fail = false;
  const int64_t live_before = live_skip_tensors();
  model->forward(at::randn({4, 3})).sum().backward();
  CATCH_CHECK(live_skip_tensors() == live_before);
}

// Throws before popping when `fail` is set.
struct FailingAddImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    TORCH_CHECK(!fail, "failing before the pop");
    return x + pop("skip");
  }
  bool fail = true;
};

CATCH_TEST_CASE("a forward that fails before a pop releases the stashed tensors",
                "[skip][memory][errors]") {
  // With a checkpointed stash, an unpopped skip would hold its micro-batch's graph in a cycle.
  const Checkpoint mode = GENERATE(Checkpoint::kAlways, Checkpoint::kNever);
  const int64_t live_before = live_skip_tensors();
  auto failing = std::make_shared<FailingAddImpl>();
  nn::Sequential seq(nn::Linear(3, 3), save("skip"), nn::Linear(3, 3),
                     skippable(nn::ModuleHolder<FailingAddImpl>(failing),
                               SkippableOptions().pop({"skip"})));
  GPipe model(seq, cpu({2, 2}).chunks(2).checkpoint(mode));
  model->train();
  CATCH_CHECK_THROWS_WITH(model->forward(at::randn({4, 3})), gpipe_test::contains("before the pop"));
  CATCH_CHECK(live_skip_tensors() == live_before);
  failing->fail = false;
  model->forward(at::randn({4, 3})).sum().backward();
  CATCH_CHECK(live_skip_tensors() == live_before);
}

// The seed documents' pattern: a layer saves its input in the user's own map keyed by
// current_microbatch(), and a later layer adds it back.
struct SeedSaveImpl : nn::Module {
  explicit SeedSaveImpl(std::shared_ptr<std::map<MicroBatch, at::Tensor>> saved) : saved(saved) {}
  at::Tensor forward(const at::Tensor& x) {
    (*saved)[current_microbatch()] = x;
    return x;
  }
  std::shared_ptr<std::map<MicroBatch, at::Tensor>> saved;
};
TORCH_MODULE(SeedSave);
struct SeedAddImpl : nn::Module {
  explicit SeedAddImpl(std::shared_ptr<std::map<MicroBatch, at::Tensor>> saved) : saved(saved) {}
  at::Tensor forward(const at::Tensor& x) {
    auto it = saved->find(current_microbatch());
    TORCH_CHECK(it != saved->end(), "nothing saved for this micro-batch");
    at::Tensor skip = it->second;
    saved->erase(it);
    return x + skip;
  }
  std::shared_ptr<std::map<MicroBatch, at::Tensor>> saved;
};
TORCH_MODULE(SeedAdd);

nn::Sequential seed_model() {
  auto saved = std::make_shared<std::map<MicroBatch, at::Tensor>>();
  return nn::Sequential(nn::Linear(4, 5), SeedSave(saved), nn::Linear(5, 5), nn::Tanh(),
                        nn::Linear(5, 5), SeedAdd(saved), nn::Linear(5, 2));
}

CATCH_TEST_CASE("the current_microbatch() pattern equals the plain model without checkpointing",
                "[skip][microbatch]") {
  const auto balance = GENERATE(values<std::vector<int64_t>>({{7}, {2, 5}, {2, 2, 3}}));
  const int64_t chunks = GENERATE(1, 3, 4);
  const bool train = GENERATE(true, false);
  CATCH_CAPTURE(balance.size(), chunks, train);
  at::manual_seed(2);
  check_transparent(seed_model, at::randn({8, 4}, at::kDouble),
                    cpu(balance).chunks(chunks).checkpoint(Checkpoint::kNever), train);
}

// Records current_microbatch() in each phase.
struct KeySpyImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    const char* phase = is_recomputing() ? "recompute" : is_checkpointing() ? "checkpoint" : "forward";
    seen.emplace_back(phase, current_microbatch());
    return x * 1.0;
  }
  std::vector<std::pair<std::string, MicroBatch>> seen;
};
TORCH_MODULE(KeySpy);

CATCH_TEST_CASE("current_microbatch() names the micro-batch, the same in its recomputation",
                "[skip][microbatch][checkpoint]") {
  CATCH_CHECK(current_microbatch() == MicroBatch{});
  KeySpy spy;
  GPipe model(nn::Sequential(nn::Linear(3, 3), spy), cpu({1, 1}).chunks(3));
  model->train();
  model->forward(at::randn({6, 3}).requires_grad_(true)).sum().backward();
  std::map<std::string, std::vector<MicroBatch>> by_phase;
  for (const auto& [phase, key] : spy->seen) by_phase[phase].push_back(key);
  CATCH_REQUIRE(by_phase["checkpoint"].size() == 2);
  CATCH_REQUIRE(by_phase["forward"].size() == 1);
  CATCH_REQUIRE(by_phase["recompute"].size() == 2);
  const uint64_t run = by_phase["forward"][0].run;
  CATCH_CHECK(run != 0);
  CATCH_CHECK(by_phase["checkpoint"][0] == (MicroBatch{run, 0}));
  CATCH_CHECK(by_phase["checkpoint"][1] == (MicroBatch{run, 1}));
  CATCH_CHECK(by_phase["forward"][0] == (MicroBatch{run, 2}));
  std::set<MicroBatch> recomputed(by_phase["recompute"].begin(), by_phase["recompute"].end());
  CATCH_CHECK(recomputed == std::set<MicroBatch>{{run, 0}, {run, 1}});
  // The next forward has new keys.
  spy->seen.clear();
  model->forward(at::randn({6, 3}));
  CATCH_CHECK(spy->seen.front().second.run != run);
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
