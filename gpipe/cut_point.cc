// Cut points and sections; see cut_point.h and Note [Cut points].
#include "gpipe/cut_point.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "gpipe/internal/resharding.h"

namespace gpipe {
namespace {

constexpr const char* kWho = "gpipe::cut";

// A section's forward() ends at its last cut point with this (not a std::exception, so that a
// user's catch of those lets it through).
struct SectionEnd {
  at::Tensor output;
};

}  // namespace

// A section's forward() failed before its start (on its placeholder).
struct SectionImpl::PrefixFailed {
  std::string message;
};

namespace {

// What the cut points of this thread's forward() do: record (cut()'s dry run) or serve a
// section (Note [Cut points]).
struct Run {
  bool dry = false;
  int64_t calls = 0;  // cut points called so far
  // The dry run: the batch, each cut point called, its input and the leaf it returned.
  int64_t batch = 0;
  std::vector<const CutPointImpl*> seen;
  std::vector<at::Tensor> inputs, leaves;
  // A section: the cut point where it starts (-1: the model's start) and ends (never reached
  // for the last), its input, and what to do at its start.
  int64_t start = -1, end = 0;
  std::string who;  // the section, for errors
  at::Tensor input;
  std::function<void()> on_start;
};

thread_local Run* current_run = nullptr;

// Sets this thread's run for its lifetime.
class RunScope {
 public:
  explicit RunScope(Run* run) : previous_(current_run) { current_run = run; }
  ~RunScope() { current_run = previous_; }
  RunScope(const RunScope&) = delete;
  RunScope& operator=(const RunScope&) = delete;

 private:
  Run* previous_;
};

// Every module's mode in `model`, parents before children (modules() is pre-order).
using Modes = std::vector<std::pair<torch::nn::Module*, bool>>;
Modes modes_of(torch::nn::Module& model) {
  Modes out;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    out.emplace_back(m.get(), m->is_training());
  }
  return out;
}

// Sets each module's mode back (a parent's train() sets its children's, which come after it).
void restore(const Modes& modes) {
  for (const auto& [module, training] : modes) module->train(training);
}

// Each tensor by its key in a CutPlan: its path, buffers with "buffer " (as saves name them:
// internal::state_of).
std::map<std::string, at::Tensor> tensors_by_path(const torch::nn::Module& model) {
  const auto state = internal::state_of(model);
  return std::map<std::string, at::Tensor>(state.begin(), state.end());
}

// The path of a tensor key without "buffer ".
std::string path_of(const std::string& key) {
  return key.rfind("buffer ", 0) == 0 ? key.substr(7) : key;
}

// Whether the tensor or module path `path` lies in the module at `module` ("" is the root).
bool inside(const std::string& path, const std::string& module) {
  return module.empty() || path == module || path.rfind(module + ".", 0) == 0;
}

std::string flat_name(const std::string& path) {
  return path.empty() ? std::string("model") : absl::StrReplaceAll(path, {{".", "_"}});
}

// Calls `f` on every leaf that `root`'s autograd graph reaches.
void each_leaf(const at::Tensor& root, const std::function<void(const at::Tensor&)>& f) {
  if (!root.defined() || !root.requires_grad()) return;
  if (!root.grad_fn()) {
    f(root);
    return;
  }
  std::vector<torch::autograd::Node*> stack{root.grad_fn().get()};
  std::unordered_set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* leaf = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      f(leaf->variable);
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
}

// The dry run (Note [Cut points]): the model in eval mode on the sample, every floating
// parameter requiring grad, each cut point's output a leaf. Restores the model's mode and
// requires_grad flags.
Run dry_run(const CutPlan& plan, const at::Tensor& sample, at::Tensor& output) {
  torch::nn::Module& model = *plan.model;
  std::vector<at::Tensor> frozen;
  for (at::Tensor& p : model.parameters()) {
    if (p.is_floating_point() && !p.requires_grad()) {
      frozen.push_back(p);
      p.requires_grad_(true);
    }
  }
  const Modes modes = modes_of(model);
  Run run;
  run.dry = true;
  run.batch = sample.size(0);
  const auto put_back = [&] {
    restore(modes);
    for (at::Tensor& p : frozen) p.requires_grad_(false);
  };
  model.eval();
  try {
    at::AutoGradMode grad(true);
    RunScope scope(&run);
    output = plan.forward(model, sample);
  } catch (...) {
    put_back();
    throw;
  }
  put_back();
  TORCH_CHECK(run.calls >= 1, kWho,
              ": the model's forward() calls no CutPoint; register CutPoints and "
              "call them where a pipeline may cut (Note [Cut points] in gpipe/cut_point.h)");
  return run;
}

// Each trainable tensor's interval: the one whose result's graph reaches it (Note [Cut points]).
std::map<std::string, int64_t> attribute_parameters(const CutPlan& plan, const Run& run,
                                                    const at::Tensor& output) {
  std::unordered_map<const void*, std::string> path;
  for (const auto& item : plan.model->named_parameters()) {
    path.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  std::unordered_map<const void*, int64_t> leaf_cut;
  for (size_t j = 0; j < run.leaves.size(); ++j) {
    leaf_cut.emplace(run.leaves[j].unsafeGetTensorImpl(), static_cast<int64_t>(j));
  }
  std::map<std::string, int64_t> interval_of;
  for (int64_t s = 0; s <= plan.cut_points; ++s) {
    const at::Tensor& root = s < plan.cut_points ? run.inputs[s] : output;
    const std::string after =
        s == 0 ? std::string("the model's start") : absl::StrCat("cut point ", s - 1);
    each_leaf(root, [&](const at::Tensor& leaf) {
      if (const auto j = leaf_cut.find(leaf.unsafeGetTensorImpl()); j != leaf_cut.end()) {
        TORCH_CHECK(j->second == s - 1, kWho, ": the output of cut point ", j->second,
                    " reaches the code after ", after,
                    " other than through it; only the tensor a cut point is given crosses it "
                    "(compute the value after the cut point, or carry it in that tensor)");
        return;
      }
      const auto p = path.find(leaf.unsafeGetTensorImpl());
      if (p == path.end()) return;
      const auto [it, added] = interval_of.emplace(p->second, s);
      TORCH_CHECK(added || it->second == s, kWho, ": parameter '", p->second,
                  "' is used both after ",
                  it->second == 0 ? std::string("the model's start")
                                  : absl::StrCat("cut point ", it->second - 1),
                  " and after ", after,
                  ", but each parameter belongs to one section: register a copy for the "
                  "second use and tie the two (GPipeOptions::tied_parameters), or, if a value "
                  "computed before a cut point is used after it, carry it through the cut point");
    });
  }
  return interval_of;
}

// The interval of the nearest module above `key`'s tensor whose tensors in `placed` lie in
// intervals: the one they lie in, or -1 when they lie in several or none do.
int64_t interval_above(const std::string& key, const std::map<std::string, int64_t>& placed) {
  std::string module = path_of(key);
  while (!module.empty()) {
    const size_t dot = module.rfind('.');
    module = dot == std::string::npos ? std::string() : module.substr(0, dot);
    std::set<int64_t> intervals;
    for (const auto& [other, s] : placed) {
      if (inside(path_of(other), module)) intervals.insert(s);
    }
    if (!intervals.empty()) return intervals.size() == 1 ? *intervals.begin() : -1;
  }
  return -1;
}

// Every tensor's interval (Note [Cut points]): a trainable one's from the graph; another
// parameter's from the nearest module above it whose parameters lie in one interval (else the
// first interval); a buffer's likewise from the parameters, else a constant.
void attribute_all(CutPlan& plan, std::map<std::string, int64_t> placed) {
  const std::map<std::string, at::Tensor> tensors = tensors_by_path(*plan.model);
  const std::map<std::string, int64_t> reached = placed;
  for (const auto& [key, tensor] : tensors) {
    if (key.rfind("buffer ", 0) == 0 || reached.count(key) > 0) continue;
    placed.emplace(key, std::max<int64_t>(interval_above(key, reached), 0));
  }
  std::map<std::string, int64_t> parameters = placed;
  plan.owned.assign(plan.cut_points + 1, {});
  for (const auto& [key, tensor] : tensors) {
    const auto it = placed.find(key);
    const int64_t s = it != placed.end() ? it->second : interval_above(key, parameters);
    (s >= 0 ? plan.owned[s] : plan.constants).push_back(key);
  }
}

// Refuses the model unless its sections, one after another on the sample, give its output.
void check_sections(const CutPlan& plan, torch::nn::Sequential& sections,
                    const at::Tensor& sample) {
  at::NoGradGuard no_grad;
  const Modes model_modes = modes_of(*plan.model), section_modes = modes_of(*sections);
  plan.model->eval();
  sections->eval();
  at::Tensor want, got = sample;
  std::string failed;
  try {
    want = plan.forward(*plan.model, sample);
    for (const auto& section : sections->children()) {
      got = std::dynamic_pointer_cast<SectionImpl>(section)->forward(got);
    }
  } catch (const c10::Error& e) {
    failed = e.what_without_backtrace();
  } catch (const std::exception& e) {
    failed = e.what();
  }
  restore(model_modes);
  restore(section_modes);
  const bool same =
      failed.empty() && got.sizes() == want.sizes() && got.dtype() == want.dtype() &&
      (want.is_floating_point() ? at::allclose(got, want, 1e-5, 1e-6) : at::equal(got, want));
  std::string how = "they fail: " + failed;
  if (failed.empty()) {
    how = got.sizes() == want.sizes() && want.is_floating_point()
              ? absl::StrCat("largest difference ", (got - want).abs().max().item<double>())
              : absl::StrCat("shape ", c10::str(got.sizes()), " against ", c10::str(want.sizes()));
  }
  TORCH_CHECK(same, kWho,
              ": the sections, run one after another on the sample, do not give the model's "
              "output (",
              how,
              "): a value computed before a cut point reaches the code after it other than "
              "through the cut point, or the code before a section's start reads tensor values "
              "(Note [Cut points] in gpipe/cut_point.h)");
}

}  // namespace

at::Tensor CutPointImpl::forward(const at::Tensor& input) {
  Run* run = current_run;
  if (run == nullptr) return input;
  const int64_t index = run->calls++;
  if (run->dry) {
    const auto again = std::find(run->seen.begin(), run->seen.end(), this);
    TORCH_CHECK(again == run->seen.end(), kWho, ": cut point ", index,
                " is a CutPoint already called in this forward() (as cut point ",
                again - run->seen.begin(),
                "); call each CutPoint at most once per forward(), one registered per place");
    TORCH_CHECK(input.defined() && input.dim() >= 1 && input.size(0) == run->batch, kWho,
                ": cut point ", index, " is given a tensor of shape ",
                input.defined() ? c10::str(input.sizes()) : std::string("(undefined)"),
                ", whose first dimension is not the batch (", run->batch,
                "); a cut point takes one tensor whose first dimension is the batch");
    run->seen.push_back(this);
    run->inputs.push_back(input);
    at::Tensor leaf = input.detach();
    if (leaf.is_floating_point()) leaf.requires_grad_(true);
    run->leaves.push_back(leaf);
    return leaf;
  }
  if (index == run->start) {
    TORCH_CHECK(
        input.sizes().slice(1) == run->input.sizes().slice(1), run->who, ": its input has shape ",
        c10::str(run->input.sizes()), ", but forward() gives cut point ", index,
        " a tensor of shape ", c10::str(input.sizes()), " for a placeholder batch of ",
        input.size(0),
        "; a cut model takes inputs of the sample's shape but for the batch (Note [Cut points])");
    run->on_start();
    return run->input;
  }
  if (index == run->end) throw SectionEnd{input};
  return input;
}

SectionImpl::SectionImpl(std::shared_ptr<const CutPlan> plan, int64_t first, int64_t last)
    : SectionImpl(std::move(plan), first, last, nullptr) {}

SectionImpl::SectionImpl(std::shared_ptr<const CutPlan> plan, int64_t first, int64_t last,
                         std::shared_ptr<torch::nn::Module> source)
    : plan_(std::move(plan)), first_(first), last_(last), model_(std::move(source)) {
  TORCH_CHECK(plan_ != nullptr && 0 <= first_ && first_ <= last_ && last_ <= plan_->cut_points,
              "gpipe::Section: intervals [", first_, ", ", last_,
              "] are not within the plan's 0 .. ", plan_ ? plan_->cut_points : 0);
  input_dtype_ = plan_->sample_dtype;
  reset();
}

void SectionImpl::reset() {
  // The copy: of the plan's model when made, of the section it is cloned from when cloned.
  const std::shared_ptr<torch::nn::Module> source = model_ ? model_ : plan_->model;
  TORCH_CHECK(source != nullptr, who(),
              ": reset() has no model to copy once cut() has returned; cut the model again");
  try {
    model_ = source->clone();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kWho, ": the model cannot be copied (", e.what_without_backtrace(),
                "); a model cut at cut points must be a torch::nn::Cloneable");
  }
  running_ = std::make_shared<std::mutex>();
  std::map<std::string, at::Tensor> tensors = tensors_by_path(*model_);
  // Cloneable's copies require grad as their reset() made them: keep the source's flags.
  for (const auto& [key, source_tensor] : tensors_by_path(*source)) {
    if (key.rfind("buffer ", 0) != 0) tensors.at(key).requires_grad_(source_tensor.requires_grad());
  }
  const std::set<std::string> owned = owned_keys();
  // The largest submodules whose tensors are all owned, then owned tensors outside them.
  std::vector<std::string> registered;
  const auto under_registered = [&registered](const std::string& path) {
    return std::any_of(registered.begin(), registered.end(),
                       [&path](const std::string& m) { return inside(path, m); });
  };
  for (const auto& item : model_->named_modules("", /*include_self=*/true)) {
    if (under_registered(item.key())) continue;
    bool any = false, all = true;
    for (const auto& [key, tensor] : tensors) {
      if (!inside(path_of(key), item.key())) continue;
      any = true;
      all = all && owned.count(key) > 0;
    }
    if (any && all) {
      register_module(flat_name(item.key()), item.value());
      registered.push_back(item.key());
    }
  }
  placeholders_.clear();
  constants_.clear();
  const std::set<std::string> constants(plan_->constants.begin(), plan_->constants.end());
  for (auto& [key, tensor] : tensors) {
    if (constants.count(key) > 0) {
      constants_.push_back(tensor);
    } else if (owned.count(key) == 0) {
      placeholders_.push_back({tensor, tensor.sizes().vec()});
    } else if (!under_registered(path_of(key))) {
      if (key.rfind("buffer ", 0) == 0) {
        register_buffer(flat_name(path_of(key)), tensor);
      } else {
        register_parameter(flat_name(key), tensor, tensor.requires_grad());
      }
    }
  }
  place_others([](const at::Tensor& t) { return t; });
}

std::set<std::string> SectionImpl::owned_keys() const {
  std::set<std::string> owned;
  for (int64_t s = first_; s <= last_; ++s) {
    owned.insert(plan_->owned[s].begin(), plan_->owned[s].end());
  }
  return owned;
}

std::vector<std::pair<std::string, at::Tensor>> SectionImpl::owned_tensors() const {
  const std::set<std::string> owned = owned_keys();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [key, tensor] : tensors_by_path(*model_)) {
    if (owned.count(key) > 0) out.emplace_back(key, tensor);
  }
  return out;
}

void SectionImpl::place_others(const std::function<at::Tensor(const at::Tensor&)>& move) {
  for (at::Tensor& c : constants_) c.set_data(move(c));
  for (Placeholder& p : placeholders_) {
    // One zero of the tensor's dtype and device, moved as Module::to moves every tensor.
    const at::Tensor zero = move(at::zeros({}, p.tensor.options()));
    p.tensor.set_data(p.shape.empty() ? zero : zero.expand(p.shape));
  }
}

void SectionImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, dtype, non_blocking);
  if (c10::isFloatingType(plan_->sample_dtype)) input_dtype_ = dtype;
  place_others([&](const at::Tensor& t) {
    return t.to(t.options().device(device).dtype(dtype), non_blocking);
  });
}

void SectionImpl::to(torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(dtype, non_blocking);
  if (c10::isFloatingType(plan_->sample_dtype)) input_dtype_ = dtype;
  place_others([&](const at::Tensor& t) { return t.to(t.options().dtype(dtype), non_blocking); });
}

void SectionImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
  place_others([&](const at::Tensor& t) { return t.to(t.options().device(device), non_blocking); });
}

at::Tensor SectionImpl::forward(const at::Tensor& input) {
  std::lock_guard<std::mutex> lock(*running_);
  while (true) {
    try {
      return run(input, placeholder_batch_);
    } catch (const PrefixFailed& failed) {
      TORCH_CHECK(placeholder_batch_ == 0, who(), ": forward() failed before cut point ",
                  first_ - 1,
                  ", where it runs on a placeholder (a batch of one zero sample): ", failed.message,
                  " (the code before a section's start may not read tensor values: Note [Cut "
                  "points] in gpipe/cut_point.h)");
      // Code that cannot run on an empty batch (a view(b, -1)) runs on one zero sample.
      placeholder_batch_ = 1;
    }
  }
}

at::Tensor SectionImpl::run(const at::Tensor& input, int64_t placeholder_batch) {
  const CutPlan& plan = *plan_;
  Run run;
  run.start = first_ - 1;
  run.end = last_;
  run.who = who();
  run.input = input;
  std::optional<at::NoGradGuard> no_grad;
  at::Tensor from = input;
  // Before its start: a placeholder batch of zero samples (or one), every module in eval mode,
  // no autograd; at its start each module's own mode back.
  std::optional<Modes> modes;
  if (first_ > 0) {
    no_grad.emplace();
    modes = modes_of(*model_);
    model_->train(false);
    std::vector<int64_t> shape{placeholder_batch};
    shape.insert(shape.end(), plan.sample_shape.begin(), plan.sample_shape.end());
    from = at::zeros(shape, input.options().dtype(input_dtype_));
    run.on_start = [&] {
      no_grad.reset();
      restore(*modes);
      modes.reset();
    };
  }
  RunScope scope(&run);
  at::Tensor output;
  try {
    output = plan.forward(*model_, from);
  } catch (SectionEnd& end) {
    return std::move(end.output);
  } catch (const c10::Error& e) {
    if (modes) restore(*modes);
    if (run.calls <= run.start) throw PrefixFailed{e.what_without_backtrace()};
    throw;
  } catch (...) {
    if (modes) restore(*modes);
    throw;
  }
  TORCH_CHECK(last_ == plan.cut_points && run.calls > run.start, who(),
              ": forward() returned after calling ", run.calls, " cut point(s), before cut point ",
              run.calls <= run.start ? run.start : last_,
              "; a forward() must call the same cut points every time");
  return output;
}

std::string SectionImpl::who() const {
  return first_ == last_ ? absl::StrCat("gpipe::Section ", first_)
                         : absl::StrCat("gpipe::Section ", first_, "-", last_);
}

void SectionImpl::train(bool on) {
  torch::nn::Module::train(on);
  model_->train(on);
}

std::shared_ptr<torch::nn::Module> SectionImpl::clone(
    const c10::optional<c10::Device>& device) const {
  at::NoGradGuard no_grad;
  // A section of a copy of this one's model (reset() copies model_: values, modes and flags).
  auto copy = std::make_shared<SectionImpl>(plan_, first_, last_, model_);
  copy->placeholder_batch_ = placeholder_batch_;
  copy->input_dtype_ = input_dtype_;
  if (device) copy->to(*device);
  return copy;
}

namespace internal {

torch::nn::Sequential cut_model(const std::shared_ptr<torch::nn::Module>& model,
                                ModelForward forward, const at::Tensor& sample,
                                const std::vector<int64_t>& balance) {
  TORCH_CHECK(model != nullptr, kWho, ": the model is null");
  TORCH_CHECK(sample.defined() && sample.dim() >= 1 && sample.size(0) >= 2, kWho,
              ": the sample must be a batch of at least 2 samples (first dimension the batch), "
              "not of shape ",
              sample.defined() ? c10::str(sample.sizes()) : std::string("(undefined)"));
  auto plan = std::make_shared<CutPlan>();
  plan->model = model;
  plan->forward = std::move(forward);
  plan->sample_shape = sample.sizes().slice(1).vec();
  plan->sample_dtype = sample.scalar_type();
  at::Tensor output;
  const Run run = dry_run(*plan, sample, output);
  plan->cut_points = run.calls;
  attribute_all(*plan, attribute_parameters(*plan, run, output));
  std::vector<int64_t> spans = balance;
  if (spans.empty()) spans.assign(plan->cut_points + 1, 1);
  int64_t total = 0;
  for (int64_t n : spans) {
    TORCH_CHECK(n >= 1, kWho, ": balance {", absl::StrJoin(balance, ", "),
                "} has an entry below 1; each section spans at least one interval");
    total += n;
  }
  TORCH_CHECK(total == plan->cut_points + 1, kWho, ": balance {", absl::StrJoin(balance, ", "),
              "} spans ", total, " intervals, but the model's ", plan->cut_points,
              " cut point(s) make ", plan->cut_points + 1,
              "; give intervals per section summing to that");
  torch::nn::Sequential sections;
  int64_t first = 0;
  for (size_t k = 0; k < spans.size(); ++k) {
    sections->push_back(std::to_string(k), Section(plan, first, first + spans[k] - 1));
    first += spans[k];
  }
  check_sections(*plan, sections, sample);
  plan->model = nullptr;  // the sections hold their copies: no process keeps the whole model
  return sections;
}

}  // namespace internal

void uncut(const torch::nn::Sequential& sections, torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> mine = tensors_by_path(model);
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (the model's, the trained)
  for (const auto& child : sections->children()) {
    const auto section = std::dynamic_pointer_cast<SectionImpl>(child);
    TORCH_CHECK(section != nullptr,
                "gpipe::uncut: a layer of the Sequential is not a Section; give the Sequential "
                "that gpipe::cut made");
    for (const auto& [key, tensor] : section->owned_tensors()) {
      const auto it = mine.find(key);
      TORCH_CHECK(it != mine.end() && it->second.sizes() == tensor.sizes(),
                  "gpipe::uncut: the model has no tensor '", path_of(key), "' of shape ",
                  c10::str(tensor.sizes()), "; give the model that was cut");
      copies.emplace_back(it->second, tensor);
    }
  }
  for (auto& [to, from] : copies) to.copy_(from);
}

}  // namespace gpipe
