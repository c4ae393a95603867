// The timeline written out; see trace.h.
#include "gpipe/trace.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace gpipe {
namespace {

const char* kind_name(TimelineEvent::Kind kind) {
  switch (kind) {
    case TimelineEvent::Kind::kCompute: return "compute";
    case TimelineEvent::Kind::kCopy: return "copy";
    case TimelineEvent::Kind::kSkipCopy: return "skip_copy";
    case TimelineEvent::Kind::kRecompute: return "recompute";
    case TimelineEvent::Kind::kBackward: return "backward";
    case TimelineEvent::Kind::kBackwardInput: return "backward_input";
    case TimelineEvent::Kind::kBackwardWeight: return "backward_weight";
  }
  return "unknown";
}

// The event's name in a trace or a picture, e.g. "3" for task 3, "3 copy 0>1".
std::string label(const TimelineEvent& e) {
  switch (e.kind) {
    case TimelineEvent::Kind::kCompute:
      return absl::StrCat(e.microbatch, e.checkpointed ? "*" : "");
    case TimelineEvent::Kind::kCopy:
      return absl::StrFormat("%d copy %d>%d", e.microbatch, e.from, e.partition);
    case TimelineEvent::Kind::kSkipCopy:
      return absl::StrFormat("%d skips %d>%d", e.microbatch, e.from, e.partition);
    case TimelineEvent::Kind::kRecompute:
      return absl::StrCat(e.microbatch, " recompute");
    case TimelineEvent::Kind::kBackward:
      return absl::StrCat(e.microbatch, " backward");
    case TimelineEvent::Kind::kBackwardInput:
      return absl::StrCat(e.microbatch, " I");
    case TimelineEvent::Kind::kBackwardWeight:
      return absl::StrCat(e.microbatch, " W");
  }
  return "?";
}

int64_t partition_count(const std::vector<TimelineEvent>& events,
                        const std::vector<c10::Device>& devices) {
  int64_t n = static_cast<int64_t>(devices.size());
  for (const TimelineEvent& e : events) {
    n = std::max(n, e.partition + 1);
  }
  return n;
}

std::string track_name(int64_t j, const std::vector<c10::Device>& devices) {
  if (j < static_cast<int64_t>(devices.size())) {
    return absl::StrCat("partition ", j, " (", devices[j].str(), ")");
  }
  return absl::StrCat("partition ", j);
}

// Escapes text for an SVG element or attribute (the JSON strings here need no escaping: they are
// made of digits, letters, spaces, parentheses, ':' and '>').
std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Colours by kind: forward tasks blue, recomputation orange, backward green, copies grey.
const char* fill(const TimelineEvent& e) {
  switch (e.kind) {
    case TimelineEvent::Kind::kCompute: return e.checkpointed ? "#6a9fd8" : "#2f6fb5";
    case TimelineEvent::Kind::kRecompute: return "#f0a04b";
    case TimelineEvent::Kind::kBackward: return "#5aa469";
    case TimelineEvent::Kind::kBackwardInput: return "#2a9d8f";
    case TimelineEvent::Kind::kBackwardWeight: return "#8ab17d";
    case TimelineEvent::Kind::kCopy:
    case TimelineEvent::Kind::kSkipCopy: return "#9a9a9a";
  }
  return "#000000";
}

constexpr double kLeft = 150;    // room for the track names
constexpr double kRow = 34;      // height of a partition's row
constexpr double kTop = 30;
constexpr double kWidth = 900;   // of the drawing area

std::string svg_open(double width, double height, const std::string& title) {
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"8\" y=\"18\" font-size=\"13\">%s</text>\n",
      width, height, width, height, xml_escape(title));
}

}  // namespace

std::string chrome_trace_json(const std::vector<TimelineEvent>& events,
                              const std::vector<c10::Device>& devices) {
  std::vector<std::string> items;
  const int64_t n = partition_count(events, devices);
  // Process 0: host times; process 1, when any event has them: device times (CUDA).
  const bool device_times = std::any_of(events.begin(), events.end(), [](const TimelineEvent& e) {
    return e.has_device_times();
  });
  for (int pid = 0; pid < (device_times ? 2 : 1); ++pid) {
    items.push_back(absl::StrFormat(
        "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": \"%s\"}}",
        pid, pid == 0 ? "gpipe (host time)" : "gpipe (device time)"));
    items.push_back(absl::StrFormat(
        "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, "
        "\"args\": {\"sort_index\": %d}}",
        pid, pid));
    for (int64_t j = 0; j < n; ++j) {
      items.push_back(absl::StrFormat(
          "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
          "\"args\": {\"name\": \"%s\"}}",
          pid, j, track_name(j, devices)));
      items.push_back(absl::StrFormat(
          "{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
          "\"args\": {\"sort_index\": %d}}",
          pid, j, j));
    }
  }
  auto item = [&](const TimelineEvent& e, int pid, double start_us, double end_us) {
    items.push_back(absl::StrFormat(
        "{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, "
        "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"microbatch\": %d, \"partition\": %d, "
        "\"from\": %d, \"tensors\": %d, \"checkpointed\": %s}}",
        label(e), kind_name(e.kind), pid, e.partition, start_us,
        std::max(0.0, end_us - start_us), e.microbatch, e.partition, e.from, e.tensors,
        e.checkpointed ? "true" : "false"));
  };
  for (const TimelineEvent& e : events) {
    item(e, 0, e.start_us, e.end_us);
  }
  for (const TimelineEvent& e : events) {
    if (e.has_device_times()) {
      item(e, 1, e.device_start_us, e.device_end_us);
    }
  }
  return absl::StrCat("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n  ",
                      absl::StrJoin(items, ",\n  "), "\n]}\n");
}

std::string timeline_svg(const std::vector<TimelineEvent>& events,
                         const std::vector<c10::Device>& devices) {
  const int64_t n = partition_count(events, devices);
  // Each event at its device times where they were measured (CUDA), else at its host times.
  auto span = [](const TimelineEvent& e) {
    return e.has_device_times() ? std::make_pair(e.device_start_us, e.device_end_us)
                                : std::make_pair(e.start_us, e.end_us);
  };
  const bool device_times = std::any_of(events.begin(), events.end(), [](const TimelineEvent& e) {
    return e.has_device_times();
  });
  double end = 0;
  for (const TimelineEvent& e : events) {
    end = std::max(end, span(e).second);
  }
  end = std::max(end, 1.0);
  const double scale = kWidth / end;
  const double height = kTop + n * kRow + 50;
  std::string out = svg_open(kLeft + kWidth + 20, height,
                             device_times ? "gpipe: the schedule as it ran (device time)"
                                          : "gpipe: the schedule as it ran (host time)");
  out += "<defs><pattern id=\"hatch\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
         "patternTransform=\"rotate(45)\"><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" "
         "stroke=\"white\" stroke-width=\"2\" stroke-opacity=\"0.5\"/></pattern></defs>\n";
  for (int64_t j = 0; j < n; ++j) {
    const double y = kTop + j * kRow;
    absl::StrAppendFormat(&out, "<text x=\"8\" y=\"%.1f\">%s</text>\n", y + kRow / 2 + 4,
                          xml_escape(track_name(j, devices)));
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                          "stroke=\"#dddddd\"/>\n",
                          kLeft, y + kRow - 2, kLeft + kWidth, y + kRow - 2);
  }
  for (const TimelineEvent& e : events) {
    const bool copy =
        e.kind == TimelineEvent::Kind::kCopy || e.kind == TimelineEvent::Kind::kSkipCopy;
    const auto [start_us, end_us] = span(e);
    const double x = kLeft + start_us * scale;
    const double w = std::max(1.0, (end_us - start_us) * scale);
    const double y = kTop + e.partition * kRow + (copy ? kRow - 8 : 2);
    const double h = copy ? 4 : kRow - 12;
    absl::StrAppendFormat(&out,
                          "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" "
                          "fill=\"%s\"><title>%s: %.1f-%.1f us</title></rect>\n",
                          x, y, w, h, fill(e), xml_escape(label(e)), start_us, end_us);
    if (e.kind == TimelineEvent::Kind::kCompute && e.checkpointed) {
      absl::StrAppendFormat(&out,
                            "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" "
                            "fill=\"url(#hatch)\"/>\n",
                            x, y, w, h);
    }
    if (!copy && w > 14) {
      absl::StrAppendFormat(&out,
                            "<text x=\"%.2f\" y=\"%.1f\" fill=\"white\" text-anchor=\"middle\">"
                            "%d</text>\n",
                            x + w / 2, y + h / 2 + 4, e.microbatch);
    }
  }
  // Time axis: about ten ticks at round numbers of microseconds.
  const double axis_y = kTop + n * kRow + 6;
  const double raw = end / 10;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / magnitude < 2 ? 2 * magnitude
                      : raw / magnitude < 5 ? 5 * magnitude
                                            : 10 * magnitude;
  absl::StrAppendFormat(&out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
                        kLeft, axis_y, kLeft + kWidth, axis_y);
  for (double t = 0; t <= end; t += step) {
    const double x = kLeft + t * scale;
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                          x, axis_y, x, axis_y + 4, x, axis_y + 16,
                          t >= 1000 ? absl::StrFormat("%g ms", t / 1000)
                                    : absl::StrFormat("%g us", t));
  }
  absl::StrAppendFormat(&out,
                        "<text x=\"%.1f\" y=\"%.1f\">blue: forward task (hatched: checkpointed), "
                        "orange: recomputation, green: backward, teal: input gradients (I), light "
                        "green: weight gradients (W), grey: copy</text>\n",
                        kLeft, axis_y + 34);
  out += "</svg>\n";
  return out;
}

std::string schedule_svg(int64_t microbatches, int64_t partitions, int64_t checkpoint_stop) {
  TORCH_CHECK(microbatches >= 1 && partitions >= 1,
              "schedule_svg: micro-batches and partitions must be at least 1, got ", microbatches,
              " and ", partitions);
  const int64_t m = microbatches;
  const int64_t n = partitions;
  const int64_t ticks = m + n - 1;
  // Forward ticks, then backward ticks (tick k of backward runs (i, j) with
  // (m - 1 - i) + (n - 1 - j) = k); a checkpointed task's backward tick holds its recomputation
  // and its backward.
  const double cell = std::min(40.0, kWidth / (2 * ticks));
  const double height = kTop + n * kRow + 50;
  std::string out = svg_open(
      kLeft + 2 * ticks * cell + 20, height,
      absl::StrFormat("ideal clock-cycle schedule: %d micro-batches, %d partitions; bubble "
                      "(n-1)/(m+n-1) = %.0f%%",
                      m, n, 100.0 * (n - 1) / (m + n - 1)));
  for (int64_t j = 0; j < n; ++j) {
    const double y = kTop + j * kRow;
    absl::StrAppendFormat(&out, "<text x=\"8\" y=\"%.1f\">partition %d</text>\n",
                          y + kRow / 2 + 4, j);
    for (int64_t i = 0; i < m; ++i) {
      const double fx = kLeft + (i + j) * cell;
      const double bx = kLeft + (ticks + (m - 1 - i) + (n - 1 - j)) * cell;
      const bool checkpointed = i < checkpoint_stop;
      // A cell at `x`, labelled with the micro-batch.
      auto draw = [&](double x, const char* colour) {
        absl::StrAppendFormat(&out,
                              "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                              "fill=\"%s\" stroke=\"white\"/>"
                              "<text x=\"%.1f\" y=\"%.1f\" fill=\"white\" "
                              "text-anchor=\"middle\">%d</text>\n",
                              x, y + 2, cell, kRow - 12, colour, x + cell / 2, y + kRow / 2 + 1,
                              i);
      };
      draw(fx, checkpointed ? "#6a9fd8" : "#2f6fb5");
      draw(bx, checkpointed ? "#f0a04b" : "#5aa469");
    }
  }
  const double axis_y = kTop + n * kRow + 14;
  absl::StrAppendFormat(&out,
                        "<text x=\"%.1f\" y=\"%.1f\">forward: tick k runs (i, j) with i + j = k; "
                        "backward in reverse (orange: recomputed, then backward)</text>\n",
                        kLeft, axis_y);
  out += "</svg>\n";
  return out;
}

std::string schedule_svg(const Schedule& schedule, const ActionCosts& costs) {
  const ScheduleSimulation sim = simulate_schedule(schedule, costs);
  const int64_t n = schedule.num_ranks();
  const int64_t v = schedule.virtual_stages();
  const double scale = kWidth / std::max(sim.makespan, 1e-9);
  const double height = kTop + n * kRow + 40;
  std::string out = svg_open(
      kLeft + kWidth + 20, height,
      absl::StrFormat("%s schedule: %d ranks, %d micro-batches%s; simulated bubble %.0f%%, "
                      "peak in flight %s",
                      schedule.name, n, schedule.microbatches,
                      v > 1 ? absl::StrFormat(", %d stages per rank", v) : std::string(),
                      100 * sim.bubble, absl::StrJoin(sim.peak_in_flight, "/")));
  for (int64_t r = 0; r < n; ++r) {
    const double y = kTop + r * kRow;
    absl::StrAppendFormat(&out, "<text x=\"8\" y=\"%.1f\">rank %d</text>\n", y + kRow / 2 + 4,
                          r);
    for (const SimulatedAction& done : sim.actions[r]) {
      const Action& a = done.action;
      const char* colour = a.type == ActionType::kForward         ? "#2f6fb5"
                           : a.type == ActionType::kBackward      ? "#5aa469"
                           : a.type == ActionType::kBackwardInput ? "#2a9d8f"
                                                                  : "#8e6bbf";
      const double x = kLeft + done.start * scale;
      const double w = std::max(1.0, (done.end - done.start) * scale);
      // With several stages per rank, later stages are drawn lighter.
      const double opacity = v > 1 ? 1.0 - 0.45 * static_cast<double>(a.stage / n) / (v - 1) : 1.0;
      absl::StrAppendFormat(&out,
                            "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" "
                            "fill=\"%s\" fill-opacity=\"%.2f\" stroke=\"white\">"
                            "<title>%s: %g-%g</title></rect>\n",
                            x, y + 2, w, kRow - 12, colour, opacity, to_string(a), done.start,
                            done.end);
      if (w > 12) {
        absl::StrAppendFormat(&out,
                              "<text x=\"%.2f\" y=\"%.1f\" fill=\"white\" "
                              "text-anchor=\"middle\">%s</text>\n",
                              x + w / 2, y + kRow / 2 + 1,
                              v > 1 && w > 24 ? absl::StrCat(a.microbatch, "/", a.stage)
                                              : absl::StrCat(a.microbatch));
      }
    }
  }
  absl::StrAppendFormat(&out,
                        "<text x=\"%.1f\" y=\"%.1f\">blue: forward, green: backward, teal: "
                        "input gradient (I), purple: weight gradient (W)%s; costs F %g, I %g, "
                        "W %g, transfer %g</text>\n",
                        kLeft, kTop + n * kRow + 14,
                        v > 1 ? "; labels micro-batch/stage, later stages lighter" : "",
                        costs.forward, costs.backward_input, costs.backward_weight,
                        costs.transfer);
  out += "</svg>\n";
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(file.good(), "gpipe: cannot open '", path, "' for writing: ", std::strerror(errno));
  file << text;
  file.close();
  TORCH_CHECK(!file.fail(), "gpipe: cannot write '", path, "': ", std::strerror(errno));
}

}  // namespace gpipe
