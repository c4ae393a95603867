// The planner; see plan.h.
#include "balancing/plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "balancing/internal/detail.h"
#include "balancing/partition.h"
#include "gpipe/schedule.h"
#include "gpipe/schedule_search.h"
#include "gpipe/schedule_text.h"
#include "gpipe/internal/stream.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace {

using internal::distinct_devices;
using internal::elapsed_us;
using internal::json_field;
using internal::median;
using internal::parse_json;
using nlohmann::json;

// Linux's turns between more threads than cores, per 1 + log2 of the CPUs (Note [Simulating a
// step]): a turn (and the CPU time a thread that slept may come back behind: its credit), and the
// lead a woken thread needs to take a core at once. Its fair scheduler (CFS, before 6.6) gives two
// threads on a core 3 ms turns, 3 ms of credit and a 1 ms wake-up lead; EEVDF (6.6 on) slices
// 0.75 ms, ends them at the tick (4 ms at 250 Hz) and bounds the credit by the larger of two
// slices and a tick. These are between; benchmarks/plan_accuracy's predictions moved by about a
// point for turns from 1.5 to 6 ms.
constexpr double kTurnUs = 2000;
// How long the calibration times the layers alone in each round (at least one pass).
constexpr std::chrono::milliseconds kFreshProfile{300};
constexpr double kWakeupUs = 750;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The simulations local improvement may run in each search of a searched plan (Note [Searched
// plans]): two searches per zero-bubble candidate without checkpointing.
constexpr int64_t kSearchBudget = 1000;

c10::Device parse_device(const std::string& name, const std::string& who) {
  std::optional<c10::Device> device;
  try {
    device.emplace(name);
  } catch (const c10::Error&) {
  }
  TORCH_CHECK(device.has_value(), who, ": '", name, "' is not a device (cpu, cuda:0, ...)");
  return *device;
}

// The devices named by `object`'s "devices".
std::vector<c10::Device> parse_devices(const json& object, const std::string& who) {
  std::vector<c10::Device> out;
  for (const std::string& name : json_field<std::vector<std::string>>(object, "devices", who)) {
    out.push_back(parse_device(name, who));
  }
  return out;
}

std::vector<std::string> device_names(const std::vector<c10::Device>& devices) {
  std::vector<std::string> out;
  for (const c10::Device& d : devices) out.push_back(d.str());
  return out;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

json calibration_json(const PipelineProfile::Calibration& c) {
  return {{"batch", c.batch}, {"ratio", c.ratio}, {"split", c.split}};
}

// `object`'s "calibration".
std::vector<PipelineProfile::Calibration> calibration_from_json(const json& object,
                                                                const std::string& who) {
  std::vector<PipelineProfile::Calibration> out;
  for (const json& c : json_field<json>(object, "calibration", who)) {
    PipelineProfile::Calibration k;
    k.batch = json_field<int64_t>(c, "batch", who);
    k.ratio = json_field<double>(c, "ratio", who);
    // (Profiles saved before the split was calibrated: I and W scaled as the rest.)
    k.split = c.contains("split") ? json_field<double>(c, "split", who) : 1.0;
    TORCH_CHECK(k.batch > 0 && k.ratio > 0 && k.split > 0, who,
                ": a calibration needs a positive batch, ratio and split");
    out.push_back(k);
  }
  return out;
}

// `object`'s "sizes": layer profiles of the same layers.
std::vector<LayerProfile> sizes_from_json(const json& object, const std::string& who) {
  std::vector<LayerProfile> out;
  for (const json& s : json_field<json>(object, "sizes", who)) {
    out.push_back(internal::layer_profile_from_json(s, who));
  }
  TORCH_CHECK(!out.empty(), who, ": \"sizes\" holds no profile");
  for (const LayerProfile& s : out) {
    TORCH_CHECK(s.layers.size() == out[0].layers.size() && s.batch > 0, who,
                ": the profiles in \"sizes\" must have the same layers and a positive batch");
  }
  return out;
}

// The kind of `device` among the profile's other kinds (Note [Placement]); null for the first
// device's kind, and for a kind not profiled (planned as the first).
const PipelineProfile::DeviceKind* kind_of(const PipelineProfile& p, c10::Device device) {
  if (p.devices.empty() || device.type() == p.devices.front().type()) return nullptr;
  for (const PipelineProfile::DeviceKind& k : p.other_kinds) {
    if (k.device.type() == device.type()) return &k;
  }
  return nullptr;
}

// Layer k of `sizes` (profiles ascending in micro-batch size) at a micro-batch of `batch`.
LayerStats interpolated_layer(const std::vector<LayerProfile>& sizes, int64_t k, int64_t batch) {
  // The two profiled sizes around `batch` (the nearest two beyond them).
  size_t upper = 1;
  while (upper + 1 < sizes.size() && sizes[upper].batch < batch) ++upper;
  const LayerProfile& lo = sizes[sizes.size() == 1 ? 0 : upper - 1];
  const LayerProfile& hi = sizes[sizes.size() == 1 ? 0 : upper];
  const LayerStats& a = lo.layers[k];
  const LayerStats& b = hi.layers[k];
  // Linear in the micro-batch between two sizes (beyond them too); proportional with one.
  auto at = [&](double x, double y) {
    double v;
    if (hi.batch == lo.batch) {
      v = x * static_cast<double>(batch) / static_cast<double>(lo.batch);
    } else {
      v = x + (y - x) * static_cast<double>(batch - lo.batch) /
                  static_cast<double>(hi.batch - lo.batch);
    }
    return std::max(0.0, v);
  };
  auto bytes = [&](int64_t x, int64_t y) {
    return static_cast<int64_t>(std::llround(at(static_cast<double>(x), static_cast<double>(y))));
  };
  LayerStats s = a;
  s.forward_us = at(a.forward_us, b.forward_us);
  s.backward_us = at(a.backward_us, b.backward_us);
  s.forward_nograd_us = at(a.forward_nograd_us, b.forward_nograd_us);
  s.backward_input_us = at(a.backward_input_us, b.backward_input_us);
  s.backward_weight_us = at(a.backward_weight_us, b.backward_weight_us);
  s.held_bytes = bytes(a.held_bytes, b.held_bytes);
  s.forward_peak_bytes = bytes(a.forward_peak_bytes, b.forward_peak_bytes);
  s.backward_peak_bytes = bytes(a.backward_peak_bytes, b.backward_peak_bytes);
  s.input_bytes = bytes(a.input_bytes, b.input_bytes);
  s.output_bytes = bytes(a.output_bytes, b.output_bytes);
  return s;
}

}  // namespace

LayerStats PipelineProfile::layer(int64_t k, int64_t batch) const {
  return layer(k, batch, devices.empty() ? c10::Device(c10::kCPU) : devices.front());
}

LayerStats PipelineProfile::layer(int64_t k, int64_t batch, c10::Device device) const {
  TORCH_CHECK(!sizes.empty() && k >= 0 && k < layers(), "PipelineProfile::layer: no layer ", k,
              " in a profile of ", layers());
  const DeviceKind* kind = kind_of(*this, device);
  return interpolated_layer(kind != nullptr ? kind->sizes : sizes, k, batch);
}

namespace {

// `field` of the calibrations at micro-batches of `batch`: linear in log size between the two
// around it, the nearest beyond the ends, 1 without any.
double interpolate(const std::vector<PipelineProfile::Calibration>& calibration, int64_t batch,
                   double PipelineProfile::Calibration::*field) {
  if (calibration.empty()) return 1.0;
  if (batch <= calibration.front().batch) return calibration.front().*field;
  for (size_t k = 1; k < calibration.size(); ++k) {
    const PipelineProfile::Calibration& a = calibration[k - 1];
    const PipelineProfile::Calibration& b = calibration[k];
    if (batch <= b.batch) {
      const double f = std::log(static_cast<double>(batch) / static_cast<double>(a.batch)) /
                       std::log(static_cast<double>(b.batch) / static_cast<double>(a.batch));
      return a.*field + f * (b.*field - a.*field);
    }
  }
  return calibration.back().*field;
}

// A link's four numbers (ProcessLinkStats or GpuLinkStats) as JSON, and back: `what` names it in
// the error ("the process link's", "the process link's nccl").
template <typename Link>
json link_json(const Link& link) {
  return {{"latency_us", link.latency_us},
          {"bytes_per_us", link.bytes_per_us},
          {"allreduce_step_us", link.allreduce_step_us},
          {"allreduce_bytes_per_us", link.allreduce_bytes_per_us}};
}

template <typename Link>
void read_link(const json& l, const std::string& who, const char* what, Link& link) {
  link.latency_us = json_field<double>(l, "latency_us", who);
  link.bytes_per_us = json_field<double>(l, "bytes_per_us", who);
  link.allreduce_step_us = json_field<double>(l, "allreduce_step_us", who);
  link.allreduce_bytes_per_us = json_field<double>(l, "allreduce_bytes_per_us", who);
  TORCH_CHECK(link.valid(), who, ": ",
              what, " latencies must not be negative and its bytes_per_us and "
              "allreduce_bytes_per_us must be positive, got ", link.latency_us, ", ",
              link.allreduce_step_us, ", ", link.bytes_per_us, " and ",
              link.allreduce_bytes_per_us);
}

}  // namespace

double PipelineProfile::time_scale(int64_t batch) const {
  return interpolate(calibration, batch, &Calibration::ratio);
}

double PipelineProfile::time_scale(int64_t batch, c10::Device device) const {
  const DeviceKind* kind = kind_of(*this, device);
  return kind != nullptr ? interpolate(kind->calibration, batch, &Calibration::ratio)
                         : time_scale(batch);
}

double PipelineProfile::split_scale(int64_t batch) const {
  return time_scale(batch) * interpolate(calibration, batch, &Calibration::split);
}

double PipelineProfile::split_scale(int64_t batch, c10::Device device) const {
  const DeviceKind* kind = kind_of(*this, device);
  return kind != nullptr ? time_scale(batch, device) *
                               interpolate(kind->calibration, batch, &Calibration::split)
                         : split_scale(batch);
}

double PipelineProfile::copy_us(c10::Device from, c10::Device to, int64_t bytes) const {
  if (from == to) return 0;
  for (const CopyStats& c : copies) {
    if (c.from == from && c.to == to) return c.time_us(bytes);
  }
  TORCH_CHECK(false, "PipelineProfile: no copy from ", from, " to ", to,
              " was profiled; profile with both devices among profile_pipeline's devices");
}

std::string PipelineProfile::to_json() const {
  json j{{"devices", device_names(devices)},
         {"batch", batch},
         {"input_bytes", input_bytes},
         {"cores", cores},
         {"threads", threads},
         {"cpu_capacity", cpu_capacity},
         {"handoff_us", handoff_us},
         {"device_context_bytes", device_context_bytes},
         {"allocator_reserve", allocator_reserve}};
  j["sizes"] = json::array();
  for (const LayerProfile& p : sizes) j["sizes"].push_back(internal::layer_profile_json(p));
  j["calibration"] = json::array();
  for (const Calibration& c : calibration) j["calibration"].push_back(calibration_json(c));
  j["other_kinds"] = json::array();
  for (const DeviceKind& k : other_kinds) {
    json kind{{"device", k.device.str()}, {"sizes", json::array()}, {"calibration", json::array()}};
    for (const LayerProfile& p : k.sizes) kind["sizes"].push_back(internal::layer_profile_json(p));
    for (const Calibration& c : k.calibration) kind["calibration"].push_back(calibration_json(c));
    j["other_kinds"].push_back(kind);
  }
  if (process_link.measured()) {
    j["process_link"] = link_json(process_link);
    if (process_link.nccl.measured()) j["process_link"]["nccl"] = link_json(process_link.nccl);
    if (process_link.ring.measured()) {
      j["process_link"]["ring"] = {{"latency_us", process_link.ring.latency_us},
                                   {"bytes_per_us", process_link.ring.bytes_per_us},
                                   {"max_message", process_link.ring.max_message}};
    }
  }
  j["optimizers"] = json::array();
  for (const OptimizerStats& o : optimizers) {
    j["optimizers"].push_back({{"device", o.device.str()},
                               {"optimizer", optimizer_kind_name(o.optimizer)},
                               {"tensor_us", o.tensor_us},
                               {"bytes_per_us", o.bytes_per_us},
                               {"layer_us", o.layer_us}});
  }
  j["copies"] = json::array();
  for (const CopyStats& c : copies) {
    j["copies"].push_back({{"from", c.from.str()},
                           {"to", c.to.str()},
                           {"latency_us", c.latency_us},
                           {"bytes_per_us", c.bytes_per_us}});
  }
  return j.dump(1);
}

PipelineProfile PipelineProfile::from_json(const std::string& text) {
  const char* who = "PipelineProfile::from_json";
  const json j = parse_json(text, who);
  PipelineProfile p;
  p.devices = parse_devices(j, who);
  p.batch = json_field<int64_t>(j, "batch", who);
  p.input_bytes = json_field<int64_t>(j, "input_bytes", who);
  p.cores = json_field<int64_t>(j, "cores", who);
  p.threads = json_field<int64_t>(j, "threads", who);
  p.cpu_capacity = json_field<double>(j, "cpu_capacity", who);
  p.handoff_us = json_field<double>(j, "handoff_us", who);
  // (Profiles written before Note [Device overhead]: none.)
  if (j.contains("device_context_bytes")) {
    p.device_context_bytes = json_field<int64_t>(j, "device_context_bytes", who);
    p.allocator_reserve = json_field<double>(j, "allocator_reserve", who);
  }
  TORCH_CHECK(p.device_context_bytes >= 0 && p.allocator_reserve >= 1, who,
              ": device_context_bytes must not be negative and allocator_reserve must be at least "
              "1, got ",
              p.device_context_bytes, " and ", p.allocator_reserve);
  TORCH_CHECK(!p.devices.empty() && p.batch > 0 && p.cores > 0 && p.threads > 0, who,
              ": devices must not be empty and batch, cores and threads must be positive");
  p.sizes = sizes_from_json(j, who);
  p.calibration = calibration_from_json(j, who);
  // (Profiles written before Note [Placement]: no other kinds.)
  if (j.contains("other_kinds")) {
    for (const json& k : json_field<json>(j, "other_kinds", who)) {
      DeviceKind kind;
      kind.device = parse_device(json_field<std::string>(k, "device", who), who);
      kind.sizes = sizes_from_json(k, who);
      kind.calibration = calibration_from_json(k, who);
      TORCH_CHECK(kind.device.type() != p.devices.front().type() &&
                      kind.sizes.size() == p.sizes.size() &&
                      kind.sizes[0].layers.size() == p.sizes[0].layers.size(),
                  who, ": the other kind ", kind.device,
                  " must be unlike the first device and have as many sizes and layers as "
                  "\"sizes\" (", p.sizes.size(), " and ", p.layers(), ")");
      p.other_kinds.push_back(std::move(kind));
    }
  }
  for (const json& c : json_field<json>(j, "copies", who)) {
    CopyStats s;
    s.from = c10::Device(json_field<std::string>(c, "from", who));
    s.to = c10::Device(json_field<std::string>(c, "to", who));
    s.latency_us = json_field<double>(c, "latency_us", who);
    s.bytes_per_us = json_field<double>(c, "bytes_per_us", who);
    TORCH_CHECK(s.bytes_per_us > 0, who, ": a copy's bytes_per_us must be positive");
    p.copies.push_back(s);
  }
  // (Profiles written before Note [The optimizer's step]: none.)
  if (j.contains("optimizers")) {
    for (const json& o : json_field<json>(j, "optimizers", who)) {
      OptimizerStats s;
      s.device = parse_device(json_field<std::string>(o, "device", who), who);
      s.optimizer = optimizer_kind(json_field<std::string>(o, "optimizer", who));
      s.tensor_us = json_field<double>(o, "tensor_us", who);
      s.bytes_per_us = json_field<double>(o, "bytes_per_us", who);
      if (o.contains("layer_us")) s.layer_us = json_field<std::vector<double>>(o, "layer_us", who);
      TORCH_CHECK(s.layer_us.empty() || static_cast<int64_t>(s.layer_us.size()) == p.layers(), who,
                  ": an optimizer's layer_us has ", s.layer_us.size(), " entries for ",
                  p.layers(), " layers; give one per layer, or none");
      TORCH_CHECK(s.tensor_us >= 0 && s.bytes_per_us > 0, who, ": an optimizer's tensor_us must "
                  "not be negative and its bytes_per_us must be positive, got ", s.tensor_us,
                  " and ", s.bytes_per_us);
      p.optimizers.push_back(s);
    }
  }
  // (Profiles without Note [Costs between processes]'s link: none.)
  if (j.contains("process_link")) {
    const json& l = j["process_link"];
    ProcessLinkStats& link = p.process_link;
    read_link(l, who, "the process link's", link);
    // (Profiles measured before the rings were: every message on Gloo.)
    if (l.contains("ring")) {
      const json& r = l["ring"];
      link.ring.latency_us = json_field<double>(r, "latency_us", who);
      link.ring.bytes_per_us = json_field<double>(r, "bytes_per_us", who);
      link.ring.max_message = json_field<int64_t>(r, "max_message", who);
      TORCH_CHECK(link.ring.latency_us >= 0 && link.ring.measured(), who, ": the process link's "
                  "ring must have a latency not negative and bytes_per_us and max_message "
                  "positive, got ", link.ring.latency_us, ", ", link.ring.bytes_per_us, " and ",
                  link.ring.max_message);
    }
    // (Profiles without NCCL's numbers: every plan on Gloo.)
    if (l.contains("nccl")) read_link(l["nccl"], who, "the process link's nccl", link.nccl);
  }
  return p;
}

namespace {

// Note [Planning]'s calibration: the whole model as one partition on the first device, no
// checkpointing, a step of micro-batches of about `low` and `middle` samples, measured over its
// simulation on the profile, under GPipe's schedule (the ratio). And the backward split in two
// (the split): zero bubble's step against GPipe's, each round beside a pass of the layers timed
// alone at that micro-batch size, both simulated on that pass: what I and W cost beyond the
// ratio, the machine's speed at that moment cancelling out (against the profile, taken seconds
// before, it swung from 0.4 to 1.8 from round to round on the project's VM). The medians of three
// rounds.
void calibrate(PipelineProfile& p, const torch::nn::Sequential& model, const at::Tensor& sample,
               int64_t low, int64_t middle) {
  const c10::Device device = p.devices.front();
  std::vector<PipelineProfile::Calibration> found;
  const int before = at::get_num_threads();
  set_intra_op_threads(static_cast<int>(p.threads));
  const at::Tensor x = sample.detach().to(device);
  const at::Tensor target = at::zeros({sample.size(0)}, at::TensorOptions().device(device));
  auto loss = [](const Batch& out, const at::Tensor&) {
    return out.values().front().to(at::kFloat).mean();
  };
  for (int64_t b : std::vector<int64_t>{low, middle}) {
    const int64_t chunks = std::max<int64_t>(1, p.batch / b);
    const int64_t size = (p.batch + chunks - 1) / chunks;
    if (!found.empty() && found.back().batch == size) continue;
    try {
      auto one = [&](ScheduleKind schedule) {
        PipelinePlan plan;
        plan.balance = {p.layers()};
        plan.devices = {device};
        plan.chunks = chunks;
        plan.checkpoint = Checkpoint::kNever;
        plan.schedule = schedule;
        plan.threads = p.threads;
        return plan;
      };
      auto pipeline = [&](const PipelinePlan& plan) {
        torch::nn::Sequential layers;
        const auto names = model->named_children();
        for (size_t k = 0; k < model->size(); ++k) {
          layers->push_back(names[k].key(), (*(model->begin() + k)).clone(device));
        }
        return GPipe(layers, plan.options());
      };
      auto step_us = [&](GPipe& pipe) {
        internal::synchronize(device);
        const auto tick = std::chrono::steady_clock::now();
        pipe->step(x, target, loss);
        internal::synchronize(device);
        const double us = internal::elapsed_us(tick);
        pipe->zero_grad();
        return us;
      };
      PipelinePlan whole = one(ScheduleKind::kGPipe), split = one(ScheduleKind::kZeroBubble);
      GPipe whole_pipe = pipeline(whole);
      step_us(whole_pipe);  // untimed: the gradients' and the allocator's first use
      // The split's steps are optional: where they cannot run, I and W are scaled as the rest.
      GPipe split_pipe{nullptr};
      auto split_step_us = [&]() -> double {
        if (!split_pipe) return 0;
        try {
          return step_us(split_pipe);
        } catch (const c10::Error&) {
          split_pipe = nullptr;
          return 0;
        }
      };
      try {
        split_pipe = pipeline(split);
      } catch (const c10::Error&) {
      }
      split_step_us();
      PipelineProfile profiled = p;
      profiled.calibration.clear();
      const double whole_sim = predict(profiled, whole).step_us;
      std::vector<double> ratios, splits;
      for (int round = 0; round < 3; ++round) {
        const double whole_us = step_us(whole_pipe);
        ratios.push_back(whole_us / std::max(1e-9, whole_sim));
        const double split_us = split_step_us();
        if (split_us <= 0) continue;
        // The layers alone, now, at this micro-batch size.
        PipelineProfile now = profiled;
        now.sizes = {profile_layers(model, sample.narrow(0, 0, size),
                                    ProfileOptions().timeout(kFreshProfile).device(device))};
        const double ratio = whole_us / std::max(1e-9, predict(now, whole).step_us);
        // Zero bubble runs F, I and W: with F scaled by `ratio`, the scale of I and W that makes
        // its simulation what was measured.
        double forward = 0, halves = 0;
        for (int64_t k = 0; k < p.layers(); ++k) {
          const LayerStats& l = now.sizes.front().layers[k];
          forward += l.forward_us;
          halves += l.backward_input_us + l.backward_weight_us;
        }
        const double split_ratio = split_us / std::max(1e-9, predict(now, split).step_us);
        if (halves > 0) {
          splits.push_back(
              std::max(0.1, (split_ratio * (forward + halves) - ratio * forward) / halves) / ratio);
        }
      }
      found.push_back({size, median(ratios),
                       split_pipe && !splits.empty() ? median(splits) : 1.0});
    } catch (const c10::Error&) {
      // Out of memory, or a model whose whole-batch step cannot run here: no calibration at this
      // size.
    }
  }
  set_intra_op_threads(before);
  p.calibration = found;
}

}  // namespace

namespace {

// Note [Device overhead]: what GPU `device` holds beyond its tensors, measured after profiling.
void measure_device_overhead(c10::Device device, PipelineProfile& p) {
  internal::synchronize(device);
  const internal::DeviceMemoryUse use = internal::device_memory_use(device);
  p.device_context_bytes = std::max<int64_t>(0, use.used - use.reserved);
  if (use.peak_allocated > 0) {
    p.allocator_reserve = std::max(
        1.0, static_cast<double>(use.peak_reserved) / static_cast<double>(use.peak_allocated));
  }
}

}  // namespace

std::vector<int64_t> with_device_overhead(const PipelineProfile& profile,
                                          const std::vector<c10::Device>& devices,
                                          std::vector<int64_t> bytes) {
  for (size_t d = 0; d < devices.size() && d < bytes.size(); ++d) {
    if (!devices[d].is_cuda()) continue;
    bytes[d] =
        profile.device_context_bytes +
        static_cast<int64_t>(std::ceil(profile.allocator_reserve * static_cast<double>(bytes[d])));
  }
  return bytes;
}

PipelineProfile profile_pipeline(const torch::nn::Sequential& model, const at::Tensor& sample,
                                 const std::vector<c10::Device>& devices,
                                 const PipelineProfileOptions& options) {
  const char* who = "gpipe::profile_pipeline";
  TORCH_CHECK(!devices.empty(), who, ": give at least one device");
  TORCH_CHECK(sample.defined() && sample.dim() > 0 && sample.size(0) > 0, who,
              ": the sample must be a mini-batch (a tensor with a batch dimension)");
  PipelineProfile p;
  p.devices = devices;
  p.batch = sample.size(0);
  p.input_bytes = static_cast<int64_t>(sample.nbytes());
  p.cores = options.cores() > 0 ? options.cores()
                                : std::max<int64_t>(1, std::thread::hardware_concurrency());
  p.threads = options.threads() > 0
                  ? options.threads()
                  : std::max<int64_t>(1, p.cores / static_cast<int64_t>(devices.size()));
  const int64_t high = options.max_batch() > 0 ? options.max_batch() : p.batch;
  const int64_t low = options.min_batch() > 0 ? options.min_batch() : 1;
  TORCH_CHECK(low <= high && high <= p.batch, who, ": min_batch ", low, " and max_batch ", high,
              " must satisfy min_batch <= max_batch <= the sample's batch (", p.batch, ")");
  // Three sizes: the ends and their geometric mean (time per sample falls fastest at the small
  // end, so the middle one goes there).
  const int64_t middle = std::llround(std::sqrt(static_cast<double>(low * high)));
  // Each CPU worker runs with `threads` intra-op threads (LibTorch's and OpenBLAS's): profile so.
  // Note [Device overhead]: measured on the first GPU among the devices, if any.
  const auto gpu = std::find_if(devices.begin(), devices.end(),
                                [](const c10::Device& d) { return d.is_cuda(); });
  // The copies' probes first (64 MiB tensors, not the model's): their cached blocks are released
  // with the optimizers' below, and stay out of Note [Device overhead]'s peaks.
  p.copies = profile_copies(devices);
  const int before = at::get_num_threads();
  set_intra_op_threads(static_cast<int>(p.threads));
  try {
    // (With each worker's threads, which the trainers' --plan sets for the whole process, the
    // loop's optimizer included: Note [The optimizer's step]. Before the model, and its cached
    // blocks released: its large tensors are not the model's either.)
    p.optimizers = profile_optimizers(devices, &model);
    if (gpu != devices.end()) {
      internal::release_cached_memory(*gpu);
      internal::reset_peak_memory(*gpu);
    }
    for (int64_t b : std::vector<int64_t>{low, middle, high}) {
      if (!p.sizes.empty() && p.sizes.back().batch == b) continue;
      p.sizes.push_back(profile_layers(
          model, sample.narrow(0, 0, b),
          ProfileOptions().timeout(options.timeout()).device(devices.front())));
    }
    // Note [Placement]: the layers on the first device of each other kind, at the same sizes.
    for (const c10::Device& d : devices) {
      if (d.type() == devices.front().type() || kind_of(p, d) != nullptr) continue;
      PipelineProfile::DeviceKind kind;
      kind.device = d;
      for (const LayerProfile& at : p.sizes) {
        kind.sizes.push_back(profile_layers(model, sample.narrow(0, 0, at.batch),
                                            ProfileOptions().timeout(options.timeout()).device(d)));
      }
      p.other_kinds.push_back(std::move(kind));
    }
    // With CPU partitions: what their workers give together.
    const int64_t workers = std::min<int64_t>(
        static_cast<int64_t>(std::count(devices.begin(), devices.end(), c10::Device(c10::kCPU))),
        std::max<int64_t>(1, p.cores / p.threads));
    if (workers > 1) {
      p.cpu_capacity = cpu_capacity(model, sample.narrow(0, 0, middle), workers,
                                    static_cast<int>(p.threads), options.timeout());
    }
  } catch (...) {
    set_intra_op_threads(before);
    throw;
  }
  set_intra_op_threads(before);
  if (devices.size() > 1) p.handoff_us = handoff_us();
  if (options.calibrate()) {
    calibrate(p, model, sample, low, middle);
    for (PipelineProfile::DeviceKind& kind : p.other_kinds) {
      // (The same on a profile of that kind alone.)
      PipelineProfile alone = p;
      alone.devices = {kind.device};
      alone.sizes = kind.sizes;
      alone.other_kinds.clear();
      calibrate(alone, model, sample, low, middle);
      kind.calibration = alone.calibration;
    }
  }
  if (gpu != devices.end()) measure_device_overhead(*gpu, p);
  return p;
}

GPipeOptions PipelinePlan::options() const {
  return GPipeOptions(balance)
      .devices(devices)
      .chunks(chunks)
      .checkpoint(checkpoint)
      .schedule(schedule_text.empty() ? PipelineSchedule::of(schedule, virtual_stages)
                                      : PipelineSchedule::text(schedule_text));
}

std::string PipelinePlan::describe() const {
  std::string out = absl::StrFormat(
      "balance {%s}, %d micro-batches, checkpoint %s, schedule %s", absl::StrJoin(balance, ", "),
      chunks, checkpoint_name(checkpoint),
      schedule_text.empty() ? schedule_kind_name(schedule) : std::string("searched"));
  if (virtual_stages > 1) absl::StrAppend(&out, " (", virtual_stages, " stages per worker)");
  if (processes) absl::StrAppend(&out, ", a process per worker");
  if (replicas > 1) absl::StrAppend(&out, ", ", replicas, " replicas");
  if (!backend.empty()) absl::StrAppend(&out, " on ", backend == "nccl" ? "NCCL" : "Gloo");
  if (step_us > 0) {
    absl::StrAppendFormat(&out, ": %.2f ms", step_us / 1000);
    if (optimizer_us > 0) absl::StrAppendFormat(&out, " + %.2f ms optimizer", optimizer_us / 1000);
    absl::StrAppendFormat(&out, ", peak %s MiB",
                          absl::StrJoin(peak_bytes, " + ", [](std::string* s, int64_t b) {
                            absl::StrAppendFormat(s, "%.1f", mib(b));
                          }));
  }
  return out;
}

std::string PipelinePlan::to_json() const {
  json j{{"balance", balance},
         {"devices", device_names(devices)},
         {"chunks", chunks},
         {"checkpoint", checkpoint_name(checkpoint)},
         {"schedule", schedule_text.empty() ? schedule_kind_name(schedule) : "searched"},
         {"virtual_stages", virtual_stages},
         {"threads", threads},
         {"processes", processes},
         {"replicas", replicas}};
  if (!schedule_text.empty()) j["schedule_text"] = schedule_text;
  if (step_us > 0) {
    j["predicted"] = {{"step_us", step_us},
                      {"optimizer_us", optimizer_us},
                      {"peak_bytes", peak_bytes},
                      {"devices", device_names(distinct_devices(devices))}};
    if (optimizer) j["predicted"]["optimizer"] = optimizer_kind_name(*optimizer);
    if (!backend.empty()) j["predicted"]["backend"] = backend;
  }
  return j.dump(1);
}

PipelinePlan PipelinePlan::from_json(const std::string& text) {
  const char* who = "PipelinePlan::from_json";
  const json j = parse_json(text, who);
  PipelinePlan p;
  p.balance = json_field<std::vector<int64_t>>(j, "balance", who);
  p.devices = parse_devices(j, who);
  p.chunks = json_field<int64_t>(j, "chunks", who);
  p.checkpoint = checkpoint_from_name(json_field<std::string>(j, "checkpoint", who));
  const std::string schedule = json_field<std::string>(j, "schedule", who);
  if (schedule == "searched") {
    // (Note [Searched plans]: F, I and W, one stage per worker, or several placed as the text
    // places them, below.)
    p.schedule = ScheduleKind::kZeroBubble;
    p.schedule_text = json_field<std::string>(j, "schedule_text", who);
    TORCH_CHECK(!p.schedule_text.empty(), who,
                ": the schedule is \"searched\" but its "
                "\"schedule_text\" is empty; make the plan again with balance --plan");
  } else {
    p.schedule = schedule_kind(schedule);
    TORCH_CHECK(!j.contains("schedule_text"), who,
                ": \"schedule_text\" is given but the "
                "schedule is ",
                schedule,
                "; a schedule's text goes with \"schedule\": "
                "\"searched\"");
  }
  p.virtual_stages = json_field<int64_t>(j, "virtual_stages", who);
  // (Interleaved until its text's placement says V, below.)
  if (!p.schedule_text.empty() && p.virtual_stages > 1) {
    p.schedule = ScheduleKind::kInterleavedZeroBubble;
  }
  p.threads = json_field<int64_t>(j, "threads", who);
  // (Plans written before Note [Stages and replicas in the plan]: one process, no replicas.)
  if (j.contains("processes")) p.processes = json_field<bool>(j, "processes", who);
  if (j.contains("replicas")) p.replicas = json_field<int64_t>(j, "replicas", who);
  TORCH_CHECK(p.replicas >= 1, who, ": replicas ", p.replicas, "; give 1 or more");
  TORCH_CHECK(!p.balance.empty() && p.balance.size() == p.devices.size(), who, ": ",
              p.balance.size(), " partitions in \"balance\" but ", p.devices.size(),
              " \"devices\"; give one device per partition");
  for (int64_t b : p.balance) {
    TORCH_CHECK(b > 0, who, ": every partition needs at least one layer, got balance {",
                absl::StrJoin(p.balance, ", "), "}");
  }
  TORCH_CHECK(p.chunks >= 1 && p.virtual_stages >= 1 && p.threads >= 1, who,
              ": chunks, virtual_stages and threads must be positive");
  TORCH_CHECK(static_cast<int64_t>(p.balance.size()) % p.virtual_stages == 0, who,
              ": virtual_stages ", p.virtual_stages, " must divide the partitions (",
              p.balance.size(), ")");
  TORCH_CHECK(!v_shaped(p.schedule) || p.virtual_stages == 2, who, ": the schedule is ",
              schedule_kind_name(p.schedule), ", which puts 2 partitions on each worker in a V, "
              "but virtual_stages is ", p.virtual_stages, "; give 2");
  TORCH_CHECK(p.virtual_stages == 1 || takes_virtual_stages(p.schedule) || v_shaped(p.schedule),
              who, ": virtual_stages is ", p.virtual_stages, " but the schedule is ",
              schedule_kind_name(p.schedule), "; virtual stages are for the interleaved schedules "
              "(interleaved, zb1p) and the V-shaped ones (zbv, dualpipev: 2)");
  if (!p.schedule_text.empty()) {
    Schedule searched;
    try {
      searched = parse_schedule(p.schedule_text);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, who,
                  ": \"schedule_text\" is not a schedule: ", e.what_without_backtrace());
    }
    TORCH_CHECK(searched.microbatches == p.chunks, who, ": the searched schedule runs ",
                searched.microbatches, " micro-batches but \"chunks\" is ", p.chunks);
    TORCH_CHECK(!has_communication(searched), who,
                ": the searched schedule has sends or "
                "receives; a plan's text lists F, I, W (and B) only");
    // One stage per worker in order, two in a V (Note [V-shaped placement]) or several
    // interleaved, as the text places them.
    const int64_t stages = static_cast<int64_t>(p.balance.size());
    const int64_t workers = stages / p.virtual_stages;
    TORCH_CHECK(searched.num_ranks() == workers, who, ": the searched schedule has ",
                searched.ranks.size(), " worker(s) but \"balance\" ", stages,
                " partitions and virtual_stages ", p.virtual_stages, " make ", workers);
    const auto placed_as = [&](ScheduleKind kind) {
      bool placed = searched.stages == stages;
      for (int64_t s = 0; placed && s < searched.stages; ++s) {
        placed = searched.stage_ranks[s] == stage_rank(kind, s, workers);
      }
      return placed;
    };
    if (p.virtual_stages == 2 && placed_as(ScheduleKind::kZeroBubbleV)) {
      p.schedule = ScheduleKind::kZeroBubbleV;
    }
    TORCH_CHECK(placed_as(p.schedule), who, ": the searched schedule runs ", searched.stages,
                " stage(s) on ", searched.ranks.size(), " worker(s), not ", stages,
                " partitions (\"balance\") ",
                p.virtual_stages == 1   ? "one per worker in order"
                : p.virtual_stages == 2 ? "in a V (worker r holding r and 2n - 1 - r) or "
                                          "interleaved (r and r + n)"
                                        : "interleaved (worker r holding r, r + n, ...)",
                "; a searched schedule places partitions so");
  }
  if (j.contains("predicted")) {
    p.step_us = json_field<double>(j["predicted"], "step_us", who);
    // (Plans written before Note [The optimizer's step]: no optimizer time.)
    if (j["predicted"].contains("optimizer_us")) {
      p.optimizer_us = json_field<double>(j["predicted"], "optimizer_us", who);
    }
    p.peak_bytes = json_field<std::vector<int64_t>>(j["predicted"], "peak_bytes", who);
    // (Plans written before PipelinePlan::optimizer: unknown.)
    if (j["predicted"].contains("optimizer")) {
      p.optimizer = optimizer_kind(json_field<std::string>(j["predicted"], "optimizer", who));
    }
    // (Plans written before PipelinePlan::backend: unknown.)
    if (j["predicted"].contains("backend")) {
      p.backend = json_field<std::string>(j["predicted"], "backend", who);
      TORCH_CHECK(p.backend == "gloo" || p.backend == "nccl", who, ": the predicted backend is \"",
                  p.backend, "\"; give \"gloo\" or \"nccl\"");
      TORCH_CHECK(p.processes || p.replicas > 1, who, ": the predicted backend is ", p.backend,
                  " but the plan runs in one process without replicas; leave \"backend\" out");
    }
  }
  return p;
}

namespace {

// Throws unless `plan` fits `profile`: one device per partition, the profile's layers in
// partitions of at least one, virtual stages that divide the partitions, positive chunks.
void check_plan_fits(const PipelineProfile& profile, const PipelinePlan& plan, const char* who) {
  const int64_t stages = static_cast<int64_t>(plan.balance.size());
  TORCH_CHECK(stages >= 1 && static_cast<int64_t>(plan.devices.size()) == stages, who, ": ",
              stages, " partitions and ", plan.devices.size(), " devices; give one per partition");
  int64_t total = 0;
  for (int64_t b : plan.balance) {
    TORCH_CHECK(b > 0, who, ": a partition of ", b, " layers in {",
                absl::StrJoin(plan.balance, ", "), "}");
    total += b;
  }
  TORCH_CHECK(total == profile.layers(), who, ": balance {", absl::StrJoin(plan.balance, ", "),
              "} has ", total, " layers, the profile ", profile.layers());
  TORCH_CHECK(plan.virtual_stages >= 1 && stages % plan.virtual_stages == 0, who,
              ": virtual_stages ", plan.virtual_stages, " must divide ", stages, " partitions");
  TORCH_CHECK(!v_shaped(plan.schedule) || plan.virtual_stages == 2, who, ": the ",
              schedule_kind_name(plan.schedule), " schedule puts 2 partitions on each worker in a "
              "V, but virtual_stages is ", plan.virtual_stages, "; give 2");
  TORCH_CHECK(plan.chunks >= 1, who, ": chunks must be positive, got ", plan.chunks);
  TORCH_CHECK(plan.replicas >= 1, who, ": replicas ", plan.replicas, "; give 1 or more");
  TORCH_CHECK((!plan.processes && plan.replicas == 1) || profile.process_link.measured(), who,
              ": the plan runs ", plan.processes ? "a process per worker" : "",
              plan.processes && plan.replicas > 1 ? " and " : "",
              plan.replicas > 1 ? absl::StrCat(plan.replicas, " replicas") : "",
              " but the profile has no link between processes; measure one into it "
              "(profile.process_link = gpipe::measure_gloo_link(), or balance --processes / "
              "--replicas)");
}

// Sets each of `places`' compute (its capacity and cores) and the turns on a CPU's cores in
// `costs` (Note [Simulating a step]).
void set_device_costs(const PipelineProfile& profile, const PipelinePlan& plan,
                      const std::vector<c10::Device>& places, PipelineCosts& costs) {
  for (const c10::Device& d : places) {
    const double free = static_cast<double>(profile.cores) /
                        static_cast<double>(std::max<int64_t>(1, plan.threads));
    costs.capacity.push_back(!d.is_cpu() ? 1.0
                             : profile.cpu_capacity > 0 ? std::min(profile.cpu_capacity, free)
                                                        : free);
    // (Cores for whole workers: 1.5 workers' worth take turns two at a time, each at capacity / 2.)
    costs.cores.push_back(d.is_cpu() ? std::max<int64_t>(1, std::llround(std::ceil(free))) : 0);
  }
  // Turns on a CPU's cores (Note [Simulating a step]): Linux's defaults, which scale with
  // 1 + log2 of the CPUs (at most 8).
  const double factor =
      1 + std::floor(std::log2(static_cast<double>(std::clamp<int64_t>(profile.cores, 1, 8))));
  costs.slice_us = kTurnUs * factor;
  costs.wakeup_us = kWakeupUs * factor;
  costs.sleeper_credit_us = kTurnUs * factor;
}

// What a stage keeps of each of its layers `ls` (Note [Planning]): what its forward saved beyond
// its output, and its output where it or the next layer keeps it (the stage's last output is the
// backward's root: the executor keeps it).
std::vector<int64_t> kept_per_layer(const std::vector<LayerStats>& ls) {
  const size_t count = ls.size();
  std::vector<int64_t> kept(count);
  for (size_t k = 0; k < count; ++k) {
    const LayerStats& l = ls[k];
    const bool output_kept = k + 1 == count || l.saves_output || ls[k + 1].saves_input;
    kept[k] = output_kept ? l.held_bytes : std::max<int64_t>(0, l.held_bytes - l.output_bytes);
  }
  return kept;
}

// Sets a stage's working memory in `c` (Note [Simulating a step]) from its layers `ls` and what it
// keeps of each: a forward's peak over what it finally keeps, and a backward's over what it starts
// with (the later layers' saved tensors freed by then).
void set_workspace(const std::vector<LayerStats>& ls, const std::vector<int64_t>& kept,
                   StageCost& c) {
  const size_t count = ls.size();
  int64_t so_far = 0, peak_forward = 0;
  const int64_t kept_total = std::accumulate(kept.begin(), kept.end(), int64_t{0});
  for (size_t k = 0; k < count; ++k) {
    const int64_t input_alive = k > 0 && kept[k - 1] < ls[k - 1].held_bytes ? ls[k].input_bytes : 0;
    peak_forward = std::max(peak_forward, so_far + input_alive +
                                              std::max(ls[k].forward_peak_bytes, ls[k].held_bytes));
    so_far += kept[k];
  }
  c.forward_workspace_bytes = std::max<int64_t>(0, peak_forward - kept_total);
  int64_t later = 0;
  for (size_t k = count; k-- > 0;) {
    c.backward_workspace_bytes =
        std::max(c.backward_workspace_bytes, ls[k].backward_peak_bytes - later);
    later += kept[k];
  }
}

// The bytes of the gradients of `ls`' trainable parameters: what replicas all-reduce.
int64_t gradient_bytes(const std::vector<LayerStats>& ls) {
  int64_t bytes = 0;
  for (const LayerStats& l : ls) bytes += l.trainable_param_bytes;
  return bytes;
}

// Whether `plan` runs on NCCL (Note [Costs between processes]): the profile has its numbers, and
// every stage is on a GPU in a process of its own.
bool on_nccl(const PipelineProfile& profile, const PipelinePlan& plan) {
  if (!plan.processes || !profile.process_link.nccl.measured()) return false;
  // (NCCL refuses two ranks on one GPU: each worker's GPU its own.)
  const int64_t stages = static_cast<int64_t>(plan.balance.size());
  const int64_t workers = stages / std::max<int64_t>(1, plan.virtual_stages);
  std::vector<c10::Device> gpu_of(workers, c10::Device(c10::kCPU));
  for (int64_t s = 0; s < stages; ++s) {
    if (!plan.devices[s].is_cuda()) return false;
    gpu_of[stage_rank(plan.schedule, s, workers)] = plan.devices[s];
  }
  return distinct_devices(gpu_of).size() == gpu_of.size();
}

// A stage's output of `bytes` sent from `from` to `to` in another process, through a ring in shared
// memory or on Gloo (Note [Stages and replicas in the plan]): through the CPU where either is a
// GPU; or, `nccl`, from GPU to GPU on NCCL.
double message_us(const PipelineProfile& profile, c10::Device from, c10::Device to,
                  int64_t bytes, bool nccl) {
  if (nccl) return profile.process_link.nccl.message_us(bytes);
  const c10::Device cpu(c10::kCPU);
  return profile.copy_us(from, from.is_cpu() ? from : cpu, bytes) +
         profile.process_link.message_us(bytes) +
         profile.copy_us(to.is_cpu() ? to : cpu, to, bytes);
}

// Stage s's costs over its layers `ls` at micro-batch size b, all but its lane and device; adds
// its parameters' and buffers' bytes to `params` and `buffers`. `nccl`: on_nccl(profile, plan).
StageCost stage_cost(const PipelineProfile& profile, const PipelinePlan& plan, int64_t s, int64_t b,
                     const std::vector<LayerStats>& ls, const ParameterMemory& memory, bool nccl,
                     int64_t& state_bytes) {
  StageCost c;
  const std::vector<int64_t> kept = kept_per_layer(ls);
  set_workspace(ls, kept, c);
  int64_t grads_at_outputs = 0;
  for (size_t k = 0; k < ls.size(); ++k) {
    const LayerStats& l = ls[k];
    c.forward_us += l.forward_us;
    c.forward_nograd_us += l.forward_nograd_us;
    c.backward_us += l.backward_us;
    c.backward_input_us += l.backward_input_us;
    c.backward_weight_us += l.backward_weight_us;
    c.held_bytes += kept[k];
    grads_at_outputs += l.output_bytes;
    state_bytes += parameter_state_bytes(l, memory);  // Note [Training memory]
    if (k == 0 && s > 0 && plan.devices[s] != plan.devices[s - 1]) {
      // The input copied from the previous device stays until the backward.
      c.held_bytes += l.input_bytes;
      c.checkpointed_bytes += l.input_bytes;
    }
  }
  // Note [Planning]'s calibration at this micro-batch size, on the stage's kind of device.
  const double scale = profile.time_scale(b, plan.devices[s]);
  const double split = profile.split_scale(b, plan.devices[s]);
  c.forward_us *= scale;
  c.forward_nograd_us *= scale;
  c.backward_us *= scale;
  c.backward_input_us *= split;
  c.backward_weight_us *= split;
  c.recompute_us = c.forward_us;
  const LayerStats& last = ls.back();
  c.checkpointed_bytes += last.output_bytes;
  c.grad_kept_bytes = grads_at_outputs;
  const int64_t stages = static_cast<int64_t>(plan.balance.size());
  if (s + 1 < stages) {
    // (A V's turn, stages n - 1 and n, stays in its worker's process.)
    const int64_t lanes = stages / plan.virtual_stages;
    const bool between_processes = plan.processes && stage_rank(plan.schedule, s, lanes) !=
                                                         stage_rank(plan.schedule, s + 1, lanes);
    c.copy_us = between_processes
                    ? message_us(profile, plan.devices[s], plan.devices[s + 1], last.output_bytes,
                                 nccl)
                    : profile.copy_us(plan.devices[s], plan.devices[s + 1], last.output_bytes);
  }
  if (plan.replicas > 1 && plan.processes) {
    // The gradients, and which of them exist (Note [Stages and replicas in the plan]), on NCCL or
    // Gloo.
    const auto reduce = [&](int64_t bytes) {
      return nccl ? profile.process_link.nccl.allreduce_us(bytes, plan.replicas)
                  : profile.process_link.allreduce_us(bytes, plan.replicas);
    };
    c.allreduce_us = reduce(gradient_bytes(ls)) + reduce(4);
  }
  return c;
}

}  // namespace

PipelineCosts pipeline_costs(const PipelineProfile& profile, const PipelinePlan& plan,
                             OptimizerKind optimizer) {
  ParameterMemory memory;
  memory.optimizer = optimizer;
  return pipeline_costs(profile, plan, memory);
}

PipelineCosts pipeline_costs(const PipelineProfile& profile, const PipelinePlan& plan,
                             const ParameterMemory& memory) {
  check_plan_fits(profile, plan, "gpipe::pipeline_costs");
  const int64_t stages = static_cast<int64_t>(plan.balance.size());
  const int64_t lanes = stages / plan.virtual_stages;
  const std::vector<c10::Device> places = distinct_devices(plan.devices);
  const int64_t b = (profile.batch + plan.chunks - 1) / plan.chunks;

  PipelineCosts costs;
  costs.checkpoint_stop = checkpoint_stop(plan.checkpoint, plan.chunks);
  costs.handoff_us = profile.handoff_us;
  costs.static_bytes.assign(places.size(), 0);
  set_device_costs(profile, plan, places, costs);
  auto place = [&](const c10::Device& d) {
    return static_cast<int64_t>(std::find(places.begin(), places.end(), d) - places.begin());
  };
  costs.static_bytes[place(plan.devices.front())] += profile.input_bytes;
  int64_t first = 0;
  int64_t gradients = 0;
  const bool nccl = on_nccl(profile, plan);
  for (int64_t s = 0; s < stages; ++s) {
    std::vector<LayerStats> ls;
    for (int64_t k = first; k < first + plan.balance[s]; ++k) {
      ls.push_back(profile.layer(k, b, plan.devices[s]));
    }
    int64_t state_bytes = 0;
    StageCost c = stage_cost(profile, plan, s, b, ls, memory, nccl, state_bytes);
    c.lane = stage_rank(plan.schedule, s, lanes);
    c.device = place(plan.devices[s]);
    costs.static_bytes[c.device] += state_bytes;
    costs.stages.push_back(c);
    gradients += gradient_bytes(ls);
    first += plan.balance[s];
  }
  if (plan.replicas > 1 && !plan.processes) {
    // One process's pipeline replicated: all of its gradients on one group, after the step
    // (Gloo's: on_nccl is for a process per worker).
    costs.step_allreduce_us = profile.process_link.allreduce_us(gradients, plan.replicas);
  }
  return costs;
}

namespace {

// The parameters each stage of `plan` steps (Note [The optimizer's step]).
std::vector<SteppedParameters> stepped_parameters(const PipelineProfile& profile,
                                                  const PipelinePlan& plan,
                                                  const ParameterMemory& memory) {
  const int64_t stages = static_cast<int64_t>(plan.balance.size());
  const int64_t lanes = stages / std::max<int64_t>(1, plan.virtual_stages);
  std::vector<SteppedParameters> out;
  int64_t first = 0;
  for (int64_t s = 0; s < stages; ++s) {
    SteppedParameters p;
    p.device = plan.devices[s];
    p.worker = stage_rank(plan.schedule, s, lanes);
    // (The layers' own steps, where measured on this kind of device for this optimizer.)
    const OptimizerStats* measured =
        find_optimizer_stats(profile.optimizers, memory.optimizer, p.device.type());
    if (measured != nullptr && static_cast<int64_t>(measured->layer_us.size()) != profile.layers()) {
      measured = nullptr;
    }
    if (measured != nullptr) p.measured_us = 0;
    for (int64_t k = first; k < first + plan.balance[s]; ++k) {
      const LayerStats& l = profile.sizes.front().layers[k];
      p.tensors += l.trainable_tensors;
      p.bytes += l.trainable_param_bytes;
      // (Master weights: float32 copies of the narrow ones, stepped instead of them; the layer's
      // step was measured over its own dtypes, so their extra bytes cost the large tensor's.)
      const int64_t master_extra =
          memory.master_weights ? 4 * l.narrow_param_elements - l.narrow_param_bytes : 0;
      p.bytes += master_extra;
      if (measured != nullptr) {
        p.measured_us += measured->layer_us[k] + measured->time_us(0, master_extra);
      }
    }
    out.push_back(p);
    first += plan.balance[s];
  }
  return out;
}

}  // namespace

PipelineSimulation predict(const PipelineProfile& profile, PipelinePlan& plan,
                           OptimizerKind optimizer) {
  ParameterMemory memory;
  memory.optimizer = optimizer;
  return predict(profile, plan, memory);
}

PipelineSimulation predict(const PipelineProfile& profile, PipelinePlan& plan,
                           const ParameterMemory& memory) {
  const int64_t stages = static_cast<int64_t>(plan.balance.size());
  const int64_t lanes = stages / std::max<int64_t>(1, plan.virtual_stages);
  // (A plan of another schedule with virtual stages is refused here, not simulated on too few
  // lanes.)
  const Schedule schedule = plan.schedule_text.empty()
                                ? make_schedule(plan.schedule, lanes, plan.chunks,
                                                std::max<int64_t>(1, plan.virtual_stages))
                                : parse_schedule(plan.schedule_text);
  PipelineSimulation sim = simulate_pipeline(schedule, pipeline_costs(profile, plan, memory));
  plan.step_us = sim.step_us;
  plan.peak_bytes = sim.peak_bytes;
  plan.peak_bytes = with_device_overhead(profile, distinct_devices(plan.devices), sim.peak_bytes);
  plan.optimizer = memory.optimizer;
  plan.backend = !plan.processes && plan.replicas == 1 ? ""
                 : on_nccl(profile, plan)               ? "nccl"
                                                        : "gloo";
  plan.optimizer_us = optimizer_step_us(profile.optimizers, memory.optimizer,
                                        stepped_parameters(profile, plan, memory), plan.processes);
  return sim;
}

namespace {

// Note [Searched plans]: the search on `plan`'s own stage costs, each worker holding at most
// `max_in_flight` micro-batches; `searched` gets `plan` running what it found as text (not yet
// predicted).
SearchedSchedule search_costs(const PipelineProfile& profile, const PipelinePlan& plan,
                              int64_t max_in_flight, const ParameterMemory& memory,
                              PipelinePlan& searched) {
  searched = plan;
  // (F, I and W: zero bubble's actions, one stage per worker, two in a V or v interleaved.)
  const int64_t per_worker = std::max<int64_t>(1, plan.virtual_stages);
  searched.schedule = per_worker == 1          ? ScheduleKind::kZeroBubble
                      : v_shaped(plan.schedule) ? ScheduleKind::kZeroBubbleV
                                                : ScheduleKind::kInterleavedZeroBubble;
  searched.schedule_text.clear();
  ScheduleSearchOptions search;
  search.v_shape = v_shaped(searched.schedule);
  search.virtual_stages = search.v_shape ? 1 : per_worker;
  for (const StageCost& c : pipeline_costs(profile, searched, memory).stages) {
    // (The search takes positive times: a stage without parameters has no W to speak of.)
    search.stage_costs.push_back({std::max(c.forward_us, 1e-3), std::max(c.backward_input_us, 1e-3),
                                  std::max(c.backward_weight_us, 1e-3), c.copy_us});
  }
  search.budget = kSearchBudget;
  search.max_in_flight.assign(plan.balance.size() / per_worker, max_in_flight);
  SearchedSchedule result = search_schedule(plan.chunks, search);
  searched.schedule_text = schedule_text(result.schedule);
  return result;
}

}  // namespace

PipelinePlan search_plan(const PipelineProfile& profile, const PipelinePlan& plan,
                         int64_t max_in_flight, const ParameterMemory& memory,
                         SearchedSchedule* found) {
  const int64_t n = static_cast<int64_t>(plan.balance.size());
  const bool v_shape = v_shaped(plan.schedule) && plan.virtual_stages == 2;
  const bool interleaved = takes_virtual_stages(plan.schedule) && plan.virtual_stages >= 2;
  TORCH_CHECK(n >= 1 && (plan.virtual_stages <= 1 || v_shape || interleaved) &&
                  plan.devices.size() == plan.balance.size(),
              "gpipe::search_plan: the plan must have one device per partition and one partition "
              "per worker (virtual_stages 1), two in a V (zbv or dualpipev, virtual_stages 2) or "
              "several interleaved (interleaved or zb1p, virtual_stages 2 or more); it has ",
              plan.balance.size(), " partition(s), ", plan.devices.size(),
              " device(s) and virtual_stages ", plan.virtual_stages);
  TORCH_CHECK(max_in_flight >= 1, "gpipe::search_plan: max_in_flight must be at least 1, got ",
              max_in_flight);
  const int64_t workers = n / std::max<int64_t>(1, plan.virtual_stages);
  TORCH_CHECK(!interleaved || (workers >= 2 && plan.chunks % workers == 0),
              "gpipe::search_plan: an interleaved plan needs 2 or more workers and a multiple of "
              "them as micro-batches; it has ", workers, " worker(s) and ", plan.chunks,
              " micro-batches");
  // (Note [Searched plans]: a text for m micro-batches runs only where the batch splits into m.)
  const int64_t m = plan.chunks;
  TORCH_CHECK(m >= 1 && m <= profile.batch &&
                  ceil_div(profile.batch, ceil_div(profile.batch, m)) == m,
              "gpipe::search_plan: a mini-batch of ", profile.batch, " does not split into ", m,
              " micro-batches (the engine makes pieces of ceil(batch / chunks) samples); give a "
              "count it splits into");
  PipelinePlan searched;
  SearchedSchedule result = search_costs(profile, plan, max_in_flight, memory, searched);
  predict(profile, searched, memory);
  if (found != nullptr) *found = std::move(result);
  return searched;
}

namespace {

int64_t peak_of(const PipelinePlan& p) {
  return *std::max_element(p.peak_bytes.begin(), p.peak_bytes.end());
}

// Whether `p` fits PlanOptions::memory_limit (0: no limit).
bool fits_limit(const PlanOptions& options, const PipelinePlan& p) {
  return options.memory_limit() == 0 || peak_of(p) <= options.memory_limit();
}

bool same_shape(const PipelinePlan& a, const PipelinePlan& b) {
  return a.balance == b.balance && a.devices == b.devices && a.chunks == b.chunks &&
         a.checkpoint == b.checkpoint;
}

// The searched plan of a zero-bubble candidate `zb` without checkpointing (Note [Searched
// plans]), when one is faster than every generated candidate of its shape in `all` that fits.
std::optional<PipelinePlan> searched_plan(const PipelineProfile& profile,
                                          const PlanOptions& options, const PipelinePlan& zb,
                                          const std::vector<PipelinePlan>& all) {
  // (Limits count (stage, micro-batch) pairs a worker holds, of each of its stages: `zb`'s own
  // peak (ZB-H1's n, zbv's 2n over n workers, zb1p's), then every pair.)
  const int64_t per_worker = std::max<int64_t>(1, zb.virtual_stages);
  const int64_t workers = static_cast<int64_t>(zb.balance.size()) / per_worker;
  const std::vector<int64_t> peaks =
      simulate_schedule(make_schedule(zb.schedule, workers, zb.chunks, per_worker),
                        ActionCosts{1, 1, 1, 0})
          .peak_in_flight;
  const int64_t own = *std::max_element(peaks.begin(), peaks.end());
  const int64_t m = zb.chunks * per_worker;
  std::optional<PipelinePlan> best;
  const std::vector<int64_t> limits =
      own < m ? std::vector<int64_t>{own, m} : std::vector<int64_t>{m};
  for (int64_t in_flight : limits) {
    PipelinePlan p;
    const SearchedSchedule found =
        search_costs(profile, zb, in_flight, options.parameter_memory(), p);
    // (A generated seed that nothing beat is that schedule's own candidate already.)
    if (found.origin == found.best_generated_name) continue;
    predict(profile, p, options.parameter_memory());
    if (fits_limit(options, p) && (!best || p.step_us < best->step_us)) best = std::move(p);
  }
  if (!best) return std::nullopt;
  for (const PipelinePlan& g : all) {
    if (same_shape(g, *best) && fits_limit(options, g) && g.step_us <= best->step_us) {
      return std::nullopt;
    }
  }
  return best;
}

// Adds the searched plans of `all`'s zero-bubble candidates without checkpointing.
void add_searched_plans(const PipelineProfile& profile, const PlanOptions& options,
                        std::vector<PipelinePlan>& all) {
  std::vector<PipelinePlan> found;
  for (const PipelinePlan& p : all) {
    const bool searchable =
        p.schedule == ScheduleKind::kZeroBubble ||
        (p.schedule == ScheduleKind::kZeroBubbleV && p.virtual_stages == 2) ||
        (p.schedule == ScheduleKind::kInterleavedZeroBubble && p.virtual_stages >= 2);
    if (!searchable || p.checkpoint != Checkpoint::kNever || p.balance.size() < 2) continue;
    if (std::optional<PipelinePlan> s = searched_plan(profile, options, p, all)) {
      found.push_back(std::move(*s));
    }
  }
  for (PipelinePlan& p : found) all.push_back(std::move(p));
}

// Note [Placement]: each placement of n workers on the profile's devices, as the workers'
// devices: every sequence of kinds the devices allow, each kind's devices taken in their order.
// A profile without other kinds (one kind, or written before them) places the first n.
std::vector<std::vector<c10::Device>> placements(const PipelineProfile& profile, int64_t n) {
  const std::vector<c10::Device>& devices = profile.devices;
  if (profile.other_kinds.empty()) {
    return {std::vector<c10::Device>(devices.begin(), devices.begin() + n)};
  }
  std::vector<std::vector<c10::Device>> kinds;  // by kind, in the order of their first device
  for (const c10::Device& d : devices) {
    auto same = std::find_if(kinds.begin(), kinds.end(), [&](const std::vector<c10::Device>& k) {
      return k.front().type() == d.type();
    });
    if (same == kinds.end()) {
      kinds.push_back({d});
    } else {
      same->push_back(d);
    }
  }
  std::vector<std::vector<c10::Device>> out;
  std::vector<size_t> used(kinds.size(), 0);
  std::vector<c10::Device> workers;
  std::function<void()> extend = [&] {
    if (static_cast<int64_t>(workers.size()) == n) {
      out.push_back(workers);
      return;
    }
    for (size_t k = 0; k < kinds.size(); ++k) {
      if (used[k] == kinds[k].size()) continue;
      workers.push_back(kinds[k][used[k]++]);
      extend();
      --used[k];
      workers.pop_back();
    }
  };
  extend();
  return out;
}

// The balance of least bottleneck time when stage s's layer k takes time[s][k] (Note [Placement]):
// over the cut points, best[s][j] is the least bottleneck of the first j layers in stages 0..s.
std::vector<int64_t> partition_by_stage_times(const std::vector<std::vector<double>>& time) {
  const size_t stages = time.size(), layers = time.front().size();
  std::vector<std::vector<double>> prefix(stages, std::vector<double>(layers + 1, 0));
  for (size_t s = 0; s < stages; ++s) {
    for (size_t k = 0; k < layers; ++k) prefix[s][k + 1] = prefix[s][k] + time[s][k];
  }
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages, std::vector<double>(layers + 1, inf));
  std::vector<std::vector<size_t>> cut(stages, std::vector<size_t>(layers + 1, 0));
  for (size_t j = 1; j <= layers; ++j) best[0][j] = prefix[0][j];
  for (size_t s = 1; s < stages; ++s) {
    for (size_t j = s + 1; j <= layers; ++j) {
      for (size_t i = s; i < j; ++i) {
        const double bottleneck = std::max(best[s - 1][i], prefix[s][j] - prefix[s][i]);
        if (bottleneck < best[s][j]) {
          best[s][j] = bottleneck;
          cut[s][j] = i;
        }
      }
    }
  }
  std::vector<int64_t> balance(stages);
  size_t end = layers;
  for (size_t s = stages; s-- > 0;) {
    const size_t start = s == 0 ? 0 : cut[s][end];
    balance[s] = static_cast<int64_t>(end - start);
    end = start;
  }
  return balance;
}

// Each worker's time under `balance`, stage s's layer k taking time[s][k] (one row: every stage)
// and stage s running on worker stage_workers[s].
std::vector<double> worker_loads(const std::vector<std::vector<double>>& time,
                                 const std::vector<int64_t>& balance,
                                 const std::vector<int64_t>& stage_workers) {
  std::vector<double> loads(
      *std::max_element(stage_workers.begin(), stage_workers.end()) + 1, 0.0);
  int64_t first = 0;
  for (size_t s = 0; s < balance.size(); ++s) {
    const std::vector<double>& row = time[time.size() == 1 ? 0 : s];
    for (int64_t k = first; k < first + balance[s]; ++k) loads[stage_workers[s]] += row[k];
    first += balance[s];
  }
  std::sort(loads.rbegin(), loads.rend());
  return loads;
}

// Every balance of `layers` layers into `stages` stages, in turn, while `visit` returns true.
void each_balance(int64_t layers, int64_t stages, std::vector<int64_t>& balance,
                  const std::function<void()>& visit) {
  const int64_t s = static_cast<int64_t>(balance.size());
  if (s + 1 == stages) {
    balance.push_back(layers);
    visit();
    balance.pop_back();
    return;
  }
  for (int64_t here = 1; here <= layers - (stages - s - 1); ++here) {
    balance.push_back(here);
    each_balance(layers - here, stages, balance, visit);
    balance.pop_back();
  }
}

// The balance whose busiest worker's time (then the next busiest's) is least, where a worker runs
// several stages (interleaved, a V) and its load is their sum (Note [Planning]): every balance
// where there are at most kExactBalances; else `balance` with layers moved across its cuts, one
// at a time, while that lowers it.
constexpr double kExactBalances = 20000;
std::vector<int64_t> balance_workers(const std::vector<std::vector<double>>& time,
                                     std::vector<int64_t> balance,
                                     const std::vector<int64_t>& stage_workers) {
  const int64_t stages = static_cast<int64_t>(balance.size());
  const int64_t layers = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  std::vector<double> best = worker_loads(time, balance, stage_workers);
  double count = 1;  // C(layers - 1, stages - 1)
  for (int64_t k = 1; k < stages; ++k) count = count * static_cast<double>(layers - k) / k;
  if (count <= kExactBalances) {
    std::vector<int64_t> each;
    each_balance(layers, stages, each, [&] {
      std::vector<double> loads = worker_loads(time, each, stage_workers);
      if (loads < best) {
        best = std::move(loads);
        balance = each;
      }
    });
    return balance;
  }
  for (bool moved = true; moved;) {
    moved = false;
    for (int64_t c = 0; c + 1 < stages; ++c) {
      for (int64_t shift : {-1, 1}) {  // one layer from stage c to c + 1, or back
        if (balance[c] + shift < 1 || balance[c + 1] - shift < 1) continue;
        balance[c] += shift;
        balance[c + 1] -= shift;
        std::vector<double> loads = worker_loads(time, balance, stage_workers);
        if (loads < best) {
          best = std::move(loads);
          moved = true;
        } else {
          balance[c] -= shift;
          balance[c + 1] += shift;
        }
      }
    }
  }
  return balance;
}

// The balances a candidate tries (Note [Planning]): of least bottleneck time (each layer's time on
// the device of the stage holding it, Note [Placement]), of least bottleneck memory, and, where a
// worker runs several stages (`stage_workers`), of the least busy busiest worker.
std::vector<std::vector<int64_t>> candidate_balances(const PipelineProfile& profile,
                                                     const ParameterMemory& memory,
                                                     const std::vector<c10::Device>& stage_devices,
                                                     const std::vector<int64_t>& stage_workers,
                                                     int64_t b, int64_t m, bool checkpointed) {
  const int64_t layers = profile.layers();
  const size_t stages = stage_devices.size();
  // (Stages whose devices are profiled as one: one row of times, and no calibration needed.)
  const bool one_kind = std::all_of(
      stage_devices.begin(), stage_devices.end(), [&](const c10::Device& d) {
        return kind_of(profile, d) == kind_of(profile, stage_devices.front());
      });
  std::vector<std::vector<double>> time(one_kind ? 1 : stages, std::vector<double>(layers));
  std::vector<double> size(layers);  // (the same on any device)
  for (size_t s = 0; s < time.size(); ++s) {
    const c10::Device d = stage_devices[s];
    if (s > 0 && d == stage_devices[s - 1]) {
      time[s] = time[s - 1];
      continue;
    }
    const double scale = one_kind ? 1.0 : profile.time_scale(b, d);
    for (int64_t k = 0; k < layers; ++k) {
      const LayerStats l = profile.layer(k, b, d);
      time[s][k] = scale * ((checkpointed ? l.forward_nograd_us + l.forward_us : l.forward_us) +
                            l.backward_us);
      if (s > 0) continue;
      size[k] = static_cast<double>(checkpointed ? l.output_bytes : l.held_bytes * m) +
                static_cast<double>(parameter_state_bytes(l, memory));
    }
  }
  std::vector<std::vector<int64_t>> balances{
      one_kind ? block_partition(time.front(), static_cast<int64_t>(stages))
               : partition_by_stage_times(time)};
  std::vector<int64_t> by_size = block_partition(size, static_cast<int64_t>(stages));
  if (by_size != balances.front()) balances.push_back(by_size);
  const std::set<int64_t> workers(stage_workers.begin(), stage_workers.end());
  if (workers.size() < stages) {
    std::vector<int64_t> by_workers = balance_workers(time, balances.front(), stage_workers);
    if (std::find(balances.begin(), balances.end(), by_workers) == balances.end()) {
      balances.push_back(std::move(by_workers));
    }
  }
  return balances;
}

// Adds to `all` the candidates of n workers on `workers` (Note [Planning]), predicted.
void add_candidates(const PipelineProfile& profile, const PlanOptions& options,
                    const std::vector<c10::Device>& workers, std::vector<PipelinePlan>& all) {
  const char* who = "gpipe::plan";
  const int64_t n = static_cast<int64_t>(workers.size());
  for (ScheduleKind kind : options.schedules()) {
    const bool interleaved = takes_virtual_stages(kind);
    const bool v_shape = v_shaped(kind);
    if ((interleaved || v_shape) && n < 2) continue;
    const int64_t v = interleaved ? options.virtual_stages() : v_shape ? 2 : 1;
    const int64_t stages = n * v;
    if (stages > profile.layers()) continue;
    std::vector<c10::Device> stage_devices;
    std::vector<int64_t> stage_workers;
    for (int64_t s = 0; s < stages; ++s) {
      stage_workers.push_back(stage_rank(kind, s, n));
      stage_devices.push_back(workers[stage_workers.back()]);
    }
    for (int64_t m : options.chunks()) {
      TORCH_CHECK(m >= 1, who, ": chunks must be positive, got ", m);
      if (m > profile.batch || (interleaved && m % n != 0)) continue;
      // (DualPipeV with fewer than 2n - 1 micro-batches runs zbv's order: zbv's candidate.)
      if (kind == ScheduleKind::kDualPipeV && m < 2 * n - 1) continue;
      // (Note [Searched plans]: only counts the mini-batch splits into.)
      const int64_t b = ceil_div(profile.batch, m);
      if (ceil_div(profile.batch, b) != m) continue;
      for (Checkpoint mode : options.checkpoints()) {
        const bool checkpointed = checkpoint_stop(mode, m) > 0;
        for (const std::vector<int64_t>& balance :
             candidate_balances(profile, options.parameter_memory(), stage_devices,
                                stage_workers, b, m, checkpointed)) {
          PipelinePlan p;
          p.balance = balance;
          p.devices = stage_devices;
          p.chunks = m;
          p.checkpoint = mode;
          p.schedule = kind;
          p.virtual_stages = v;
          p.threads = profile.threads;
          p.processes = options.processes();
          p.replicas = options.replicas();
          predict(profile, p, options.parameter_memory());
          all.push_back(std::move(p));
        }
      }
    }
  }
}

}  // namespace

std::vector<PipelinePlan> plan(const PipelineProfile& profile, const PlanOptions& options) {
  const char* who = "gpipe::plan";
  TORCH_CHECK(profile.layers() > 0, who, ": the profile has no layers");
  TORCH_CHECK(options.top() >= 1, who, ": top must be at least 1, got ", options.top());
  TORCH_CHECK(options.virtual_stages() >= 2, who,
              ": virtual_stages (of the interleaved schedule) must be at least 2, got ",
              options.virtual_stages());
  TORCH_CHECK(options.memory_limit() >= 0, who, ": memory_limit must not be negative");
  TORCH_CHECK(options.replicas() >= 1, who, ": replicas ", options.replicas(),
              "; give 1 or more");
  TORCH_CHECK((!options.processes() && options.replicas() == 1) ||
                  profile.process_link.measured(),
              who, ": processes or replicas need the profile's link between processes; measure "
              "one into it (profile.process_link = gpipe::measure_gloo_link(), or balance "
              "--processes / --replicas)");
  const int64_t layers = profile.layers();
  std::vector<PipelinePlan> all;
  std::vector<int64_t> counts = options.partitions();
  const int64_t most = static_cast<int64_t>(profile.devices.size());
  if (counts.empty()) {
    for (int64_t n = 1; n <= most; ++n) counts.push_back(n);
  }
  for (int64_t n : counts) {
    TORCH_CHECK(n >= 1 && n <= most, who, ": cannot plan ", n, " partitions on ", most,
                " device(s); give between 1 and ", most, " (one device per partition)");
    for (const std::vector<c10::Device>& workers : placements(profile, n)) {
      add_candidates(profile, options, workers, all);
    }
  }
  TORCH_CHECK(!all.empty(), who, ": no candidate: check PlanOptions' chunks and schedules (",
              layers, " layers, a mini-batch of ", profile.batch, ")");
  if (options.search()) add_searched_plans(profile, options, all);
  std::vector<PipelinePlan> fit;
  for (const PipelinePlan& p : all) {
    if (fits_limit(options, p)) fit.push_back(p);
  }
  if (fit.empty()) {
    const PipelinePlan& least = *std::min_element(
        all.begin(), all.end(),
        [&](const PipelinePlan& a, const PipelinePlan& b) { return peak_of(a) < peak_of(b); });
    const PipelineCosts costs = pipeline_costs(profile, least, options.parameter_memory());
    // (On a GPU with its context and reserve: Note [Device overhead].)
    const std::vector<int64_t> static_bytes =
        with_device_overhead(profile, distinct_devices(least.devices), costs.static_bytes);
    const int64_t fixed = *std::max_element(static_bytes.begin(), static_bytes.end());
    const bool params = fixed > options.memory_limit();
    TORCH_CHECK(false, who, ": no plan fits in ", options.memory_limit(), " bytes (",
                absl::StrFormat("%.1f", mib(options.memory_limit())), " MiB) per device on ",
                profile.devices.size(), " device(s): the least memory any needs is ",
                peak_of(least), " bytes (", least.describe(), "), of which ", fixed,
                " bytes are parameters, gradients, optimizer state, buffers and the input (with "
                "a GPU's context and its allocator's reserve). ",
                params ? "Those alone exceed the limit: give more devices (each then holds fewer "
                         "layers), a lighter optimizer, or a larger limit"
                       : "The activations are the excess: give a smaller mini-batch (smaller "
                         "micro-batches), more chunks in PlanOptions::chunks, more devices, or "
                         "a larger limit");
  }
  std::stable_sort(fit.begin(), fit.end(), [&](const PipelinePlan& a, const PipelinePlan& b) {
    const double a_us = a.step_us + a.optimizer_us;
    const double b_us = b.step_us + b.optimizer_us;
    return a_us != b_us ? a_us < b_us : peak_of(a) < peak_of(b);
  });
  if (static_cast<int64_t>(fit.size()) > options.top()) fit.resize(options.top());
  return fit;
}

std::vector<PipelinePlan> plan(const torch::nn::Sequential& model, const at::Tensor& sample,
                               const std::vector<c10::Device>& devices,
                               const PlanOptions& options,
                               const PipelineProfileOptions& profile_options) {
  return plan(profile_pipeline(model, sample, devices, profile_options), options);
}

}  // namespace gpipe
