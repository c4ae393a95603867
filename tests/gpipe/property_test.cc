// Randomized transparency: a few hundred random models, balances, chunk counts, checkpoint modes
// and threadings per run, each checked against the plain Sequential (outputs, parameter gradients
// and the input's gradient, float64). The run prints its seed; GPIPE_PROPERTY_SEED replays one,
// GPIPE_PROPERTY_CASES sets how many cases run. Where a GPU is present, a second suite places
// every partition at random on the CPU or a GPU (GPIPE_PROPERTY_CUDA_CASES, default 100).
#include "tests/gpipe/test_util.h"

#include "gpipe/internal/partition_threads.h"

#include <torch/cuda.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>

namespace gpipe {
namespace testing {
namespace {

namespace nn = torch::nn;

// x.detach() * 2: cuts the gradient.
struct CutImpl : nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x.detach() * 2; }
};
TORCH_MODULE(Cut);

// Stashes tanh(x) under its name and passes x on.
struct KeepImpl : nn::Module {
  explicit KeepImpl(std::string name) : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) {
    stash(name, at::tanh(x));
    return x;
  }
  std::string name;
};
TORCH_MODULE(Keep);

// Adds what was stashed under its name.
struct MergeImpl : nn::Module {
  explicit MergeImpl(std::string name) : name(std::move(name)) {}
  at::Tensor forward(const at::Tensor& x) { return x + pop(name); }
  std::string name;
};
TORCH_MODULE(Merge);

// {x, labels} -> {tanh(W x) * (1 + labels % 3), labels}: a tuple batch with an integer tensor.
struct LabelledImpl : nn::Module {
  explicit LabelledImpl(int64_t features) {
    linear = register_module("linear", nn::Linear(features, features));
  }
  std::vector<at::Tensor> forward(std::vector<at::Tensor> x) {
    at::Tensor scale = (x[1] % 3 + 1).to(x[0].scalar_type()).unsqueeze(1);
    return {at::tanh(linear(x[0])) * scale, x[1]};
  }
  nn::Linear linear{nullptr};
};
TORCH_MODULE(Labelled);

// {x, labels} -> {x.detach(), labels}.
struct LabelledCutImpl : nn::Module {
  std::vector<at::Tensor> forward(std::vector<at::Tensor> x) { return {x[0].detach(), x[1]}; }
};
TORCH_MODULE(LabelledCut);

struct Case {
  std::string description;
  std::function<nn::Sequential()> make;
  bool tuple = false;
  bool dropout = false;
  bool batch_norm = false;
  int64_t layers = 0;
  std::vector<int64_t> input_shape;
};

// A random image model: convolutions, BatchNorms, pooling, activations, Identity, Dropout, layers
// that cut the gradient and skips, then a Linear head.
Case image_case(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int64_t channels = pick(2, 4);
  const int64_t side = pick(3, 5);
  const int64_t body = pick(2, 9);
  static const char* const kKinds[] = {"conv", "bn",      "relu",    "tanh",   "identity",
                                       "avg",  "max",     "dropout", "cut",    "conv"};
  std::vector<std::string> kinds;
  for (int64_t k = 0; k < body; ++k) kinds.push_back(kKinds[pick(0, 9)]);
  // Up to two skips, at random places (nested or not, crossing partitions or not).
  const int64_t skips = pick(0, 2);
  for (int64_t s = 0; s < skips; ++s) {
    const std::string name = "s" + std::to_string(s);
    int64_t a = pick(0, static_cast<int64_t>(kinds.size()));
    kinds.insert(kinds.begin() + a, "keep:" + name);
    int64_t b = pick(a + 1, static_cast<int64_t>(kinds.size()));
    kinds.insert(kinds.begin() + b, "merge:" + name);
  }
  Case c;
  std::ostringstream desc;
  desc << "image C=" << channels << " HW=" << side << " layers=[";
  for (const std::string& k : kinds) {
    desc << k << " ";
    c.dropout = c.dropout || k == "dropout";
    c.batch_norm = c.batch_norm || k == "bn";
  }
  desc << "flatten linear]";
  c.description = desc.str();
  c.layers = static_cast<int64_t>(kinds.size()) + 2;
  c.input_shape = {channels, side, side};
  c.make = [kinds, channels, side] {
    nn::Sequential seq;
    for (const std::string& k : kinds) {
      if (k == "conv") seq->push_back(nn::Conv2d(nn::Conv2dOptions(channels, channels, 3).padding(1)));
      else if (k == "bn") seq->push_back(nn::BatchNorm2d(channels));
      else if (k == "relu") seq->push_back(nn::ReLU());
      else if (k == "tanh") seq->push_back(nn::Tanh());
      else if (k == "identity") seq->push_back(nn::Identity());
      else if (k == "avg") seq->push_back(nn::AvgPool2d(nn::AvgPool2dOptions(3).stride(1).padding(1)));
      else if (k == "max") seq->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(1).padding(1)));
      else if (k == "dropout") seq->push_back(nn::Dropout(0.3));
      else if (k == "cut") seq->push_back(Cut());
      else if (k.rfind("keep:", 0) == 0) {
        const std::string name = k.substr(5);
        seq->push_back(skippable(Keep(name), SkippableOptions().stash({name})));
      } else {
        const std::string name = k.substr(6);
        seq->push_back(skippable(Merge(name), SkippableOptions().pop({name})));
      }
    }
    seq->push_back(nn::Flatten());
    seq->push_back(nn::Linear(channels * side * side, 3));
    return seq;
  };
  return c;
}

// A random tuple model on {features, integer labels}.
Case tuple_case(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int64_t features = pick(2, 6);
  const int64_t n = pick(2, 7);
  std::vector<bool> cut;
  std::ostringstream desc;
  desc << "tuple F=" << features << " layers=[";
  for (int64_t k = 0; k < n; ++k) {
    cut.push_back(pick(0, 5) == 0);
    desc << (cut.back() ? "cut " : "labelled ");
  }
  desc << "]";
  Case c;
  c.description = desc.str();
  c.tuple = true;
  c.layers = n;
  c.input_shape = {features};
  c.make = [cut, features] {
    nn::Sequential seq;
    for (bool k : cut) {
      if (k) seq->push_back(LabelledCut());
      else seq->push_back(Labelled(features));
    }
    return seq;
  };
  return c;
}

// Outputs, input gradient and parameter gradients of one forward/backward.
struct Result {
  std::vector<at::Tensor> outputs;
  at::Tensor input_grad;
  std::vector<at::Tensor> grads;
};

void check_alike(const Result& a, const Result& b) {
  CATCH_REQUIRE(a.outputs.size() == b.outputs.size());
  for (size_t k = 0; k < a.outputs.size(); ++k) {
    CATCH_CHECK(a.outputs[k].requires_grad() == b.outputs[k].requires_grad());
    if (a.outputs[k].is_floating_point()) {
      CATCH_CHECK(max_diff(a.outputs[k], b.outputs[k]) <= 1e-10);
    } else {
      CATCH_CHECK(a.outputs[k].cpu().equal(b.outputs[k].cpu()));
    }
  }
  CATCH_CHECK(a.input_grad.defined() == b.input_grad.defined());
  if (a.input_grad.defined() && b.input_grad.defined()) {
    CATCH_CHECK(max_diff(a.input_grad, b.input_grad) <= 1e-10);
  }
  CATCH_REQUIRE(a.grads.size() == b.grads.size());
  for (size_t k = 0; k < a.grads.size(); ++k) {
    CATCH_INFO("parameter " << k);
    CATCH_CHECK(a.grads[k].defined() == b.grads[k].defined());
    if (a.grads[k].defined() && b.grads[k].defined()) {
      CATCH_CHECK(max_diff(a.grads[k], b.grads[k]) <= 1e-10);
    }
  }
}

// Runs `forward` on the inputs and backward from a weighted sum of the floating outputs.
Result run(const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& forward,
           torch::nn::Module& module, const std::vector<at::Tensor>& inputs,
           const at::Tensor& weight) {
  std::vector<at::Tensor> in = inputs;
  in[0] = in[0].clone().requires_grad_(true);
  Result r;
  r.outputs = forward(in);
  at::Tensor y = r.outputs[0];
  if (y.requires_grad()) {
    (y * weight.to(y.device())).sum().backward();
  }
  r.input_grad = in[0].grad();
  for (const at::Tensor& p : module.parameters()) r.grads.push_back(p.grad());
  return r;
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoll(v, nullptr, 10) : fallback;
}

// Runs `cases` random cases from `seed`. With `gpus` > 0, each partition is placed at random on
// the CPU or one of the first `gpus` GPUs (worker threads only where no GPU holds two partitions,
// which GPipe refuses); the plain model, the oracle, stays on the CPU.
void random_cases(uint64_t seed, int64_t cases, int64_t gpus) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int64_t ran = 0;
  for (int64_t n = 0; n < cases; ++n) {
    Case c = pick(0, 3) == 0 ? tuple_case(rng) : image_case(rng);
    // A random balance: the layers cut into 1..4 non-empty partitions.
    const int64_t parts = pick(1, std::min<int64_t>(4, c.layers));
    std::vector<int64_t> cuts;
    for (int64_t k = 1; k < c.layers; ++k) cuts.push_back(k);
    std::shuffle(cuts.begin(), cuts.end(), rng);
    cuts.resize(parts - 1);
    cuts.push_back(0);
    cuts.push_back(c.layers);
    std::sort(cuts.begin(), cuts.end());
    std::vector<int64_t> balance;
    for (size_t k = 1; k < cuts.size(); ++k) balance.push_back(cuts[k] - cuts[k - 1]);
    const int64_t chunks = pick(1, 5);
    const int64_t batch = pick(1, 8);
    const Checkpoint mode = static_cast<Checkpoint>(pick(0, 2));
    const bool train = pick(0, 3) != 0;
    // Dropout is compared between checkpointed and plain pipelines drawing in the same order, so
    // it runs without worker threads.
    bool threads = !(train && c.dropout) && pick(0, 1) == 1;
    std::vector<c10::Device> devices;
    for (size_t j = 0; j < balance.size(); ++j) {
      const int64_t d = gpus == 0 ? -1 : pick(-1, gpus - 1);
      devices.push_back(d < 0 ? c10::Device(at::kCPU)
                              : c10::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)));
      for (size_t i = 0; i < j; ++i) {
        if (devices[j].is_cuda() && devices[i] == devices[j]) threads = false;
      }
    }
    const uint64_t model_seed = rng();

    std::ostringstream config;
    config << "case " << n << " (seed " << seed << "): " << c.description << " balance={";
    for (int64_t b : balance) config << b << ",";
    config << "} chunks=" << chunks << " batch=" << batch << " checkpoint="
           << static_cast<int>(mode) << " train=" << train << " threads=" << threads
           << " devices={";
    for (const c10::Device& d : devices) config << d << ",";
    config << "}";
    CATCH_INFO(config.str());

    std::vector<at::Tensor> inputs;
    std::vector<int64_t> shape{batch};
    shape.insert(shape.end(), c.input_shape.begin(), c.input_shape.end());
    inputs.push_back(at::randn(shape, at::kDouble));
    if (c.tuple) inputs.push_back(at::randint(0, 10, {batch}, at::kLong));
    std::vector<at::Tensor> pipe_inputs;
    for (const at::Tensor& t : inputs) pipe_inputs.push_back(t.to(devices.front()));

    auto options = gpipe::internal::with_partition_threads(
        GPipeOptions(balance).devices(devices).chunks(chunks).checkpoint(mode), threads);
    auto pipe_forward = [&](GPipe& model) {
      return [&model, &c](const std::vector<at::Tensor>& in) {
        if (c.tuple) return model->forward(in);
        return std::vector<at::Tensor>{model->forward(in[0])};
      };
    };
    GPipe model(build(c.make, model_seed), options);
    train ? model->train() : model->eval();
    const int64_t out_features = c.tuple ? c.input_shape[0] : 3;
    const at::Tensor weight = at::randn({batch, out_features}, at::kDouble);
    const uint64_t run_seed = rng();

    Result expected;
    if (train && c.dropout) {
      // The oracle: the same pipeline without checkpointing, drawing the same random numbers.
      GPipe reference(build(c.make, model_seed),
                      GPipeOptions(options).checkpoint(Checkpoint::kNever));
      reference->train();
      at::manual_seed(run_seed);
      expected = run(pipe_forward(reference), *reference, pipe_inputs, weight);
    } else {
      // The plain model, one micro-batch at a time in training (a BatchNorm normalises each
      // micro-batch on its own statistics), on the whole batch in eval mode.
      nn::Sequential plain = build(c.make, model_seed);
      train ? plain->train() : plain->eval();
      const int64_t split = train ? chunks : 1;
      auto plain_forward = [&](const std::vector<at::Tensor>& in) {
        std::vector<std::vector<at::Tensor>> pieces(in.size());
        for (size_t k = 0; k < in.size(); ++k) pieces[k] = in[k].chunk(split);
        std::vector<std::vector<at::Tensor>> outs;
        for (size_t i = 0; i < pieces[0].size(); ++i) {
          if (c.tuple) {
            outs.push_back(plain->forward<std::vector<at::Tensor>>(
                std::vector<at::Tensor>{pieces[0][i], pieces[1][i]}));
          } else {
            outs.push_back({plain->forward(pieces[0][i])});
          }
        }
        std::vector<at::Tensor> result;
        for (size_t k = 0; k < outs[0].size(); ++k) {
          std::vector<at::Tensor> column;
          for (auto& o : outs) column.push_back(o[k]);
          result.push_back(at::cat(column));
        }
        return result;
      };
      expected = run(plain_forward, *plain, inputs, weight);
    }
    at::manual_seed(run_seed);
    const Result got = run(pipe_forward(model), *model, pipe_inputs, weight);
    check_alike(expected, got);
    if (train && !c.dropout) {
      // The same case through GPipe::step in a random schedule, with a loss that sums as `run`'s
      // does (each micro-batch's loss is weighted by its share of the samples: Note [Losses over
      // micro-batches]).
      const int64_t m = static_cast<int64_t>(inputs[0].chunk(chunks).size());
      // Two stages per rank for the interleaved and V schedules: an even number of partitions.
      static const char* const kKinds[] = {"gpipe", "1f1b",  "zb",       "interleaved",
                                           "zb1p",  "zbv",   "dualpipev"};
      std::string kind = kKinds[pick(0, parts % 2 == 0 ? 6 : 2)];
      const bool chunked = kind == "interleaved" || kind == "zb1p";
      const bool v_shape = kind == "zbv" || kind == "dualpipev";
      const int64_t v = (chunked && m % (parts / 2) == 0) || v_shape ? 2 : 1;
      if (chunked && v == 1) kind = kind == "zb1p" ? "zb" : "1f1b";
      CATCH_INFO("GPipe::step, schedule " << kind);
      GPipe stepped(build(c.make, model_seed),
                    GPipeOptions(options).schedule(PipelineSchedule::of(schedule_kind(kind), v)));
      stepped->train();
      const at::Tensor x = pipe_inputs[0].clone().requires_grad_(true);
      const Batch in = c.tuple ? Batch(std::vector<at::Tensor>{x, pipe_inputs[1]}) : Batch(x);
      const LossFunction sum = [batch](const Batch& out, const at::Tensor& w) {
        return (out[0] * w).sum() * (static_cast<double>(batch) / out[0].size(0));
      };
      stepped->step(in, weight.to(devices.back()), sum);
      CATCH_CHECK(x.grad().defined() == expected.input_grad.defined());
      if (x.grad().defined() && expected.input_grad.defined()) {
        CATCH_CHECK(max_diff(x.grad(), expected.input_grad) <= 1e-10);
      }
      const std::vector<at::Tensor> params = stepped->parameters();
      CATCH_REQUIRE(params.size() == expected.grads.size());
      for (size_t k = 0; k < params.size(); ++k) {
        CATCH_INFO("parameter " << k);
        CATCH_CHECK(params[k].grad().defined() == expected.grads[k].defined());
        if (params[k].grad().defined() && expected.grads[k].defined()) {
          CATCH_CHECK(max_diff(params[k].grad(), expected.grads[k]) <= 1e-10);
        }
      }
    }
    ++ran;
  }
  CATCH_CHECK(ran == cases);
}

// Runs the suite with the seed from GPIPE_PROPERTY_SEED (else a random one) and the number of
// cases from `cases_variable` (else `default_cases`), printing both first so that a failure can
// be replayed.
void run_suite(const char* what, const char* cases_variable, int64_t default_cases, int64_t gpus) {
  const uint64_t seed = static_cast<uint64_t>(
      env_int("GPIPE_PROPERTY_SEED", static_cast<int64_t>(std::random_device{}())));
  const int64_t cases = env_int(cases_variable, default_cases);
  std::printf("gpipe-property: seed %llu, %lld randomized %scases (replay with "
              "GPIPE_PROPERTY_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<long long>(cases), what,
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  random_cases(seed, cases, gpus);
}

CATCH_TEST_CASE("Random models, balances, chunks, checkpoint modes and threads give the plain "
                "model's outputs and gradients",
                "[property]") {
  run_suite("", "GPIPE_PROPERTY_CASES", 300, 0);
}

CATCH_TEST_CASE("Random models placed at random on the CPU and GPUs give the plain model's "
                "outputs and gradients",
                "[property][cuda]") {
  run_suite("CPU/GPU ", "GPIPE_PROPERTY_CUDA_CASES", 100,
            static_cast<int64_t>(torch::cuda::device_count()));
}

}  // namespace
}  // namespace testing
}  // namespace gpipe
