// Schedules as text; see Note [Schedule text].
#include "gpipe/schedule_text.h"

#include <cctype>
#include <cstdint>
#include <vector>

#include <c10/util/Exception.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gpipe/schedule_check.h"

namespace gpipe {
namespace {

constexpr const char* kForm =
    "expected <stage><type><micro-batch> with type F, B, I, W, SEND_F, RECV_F, SEND_B or RECV_B, "
    "e.g. 0F3";

// Stages and micro-batches are below this (Note [Checking a schedule] limits their product).
constexpr int64_t kMaxIndex = 1 << 20;

bool parse_action(absl::string_view token, Action& action) {
  size_t digits = 0;
  while (digits < token.size() && std::isdigit(static_cast<unsigned char>(token[digits]))) ++digits;
  size_t letters = digits;
  while (letters < token.size() && !std::isdigit(static_cast<unsigned char>(token[letters]))) {
    ++letters;
  }
  static const std::pair<const char*, ActionType> kTypes[] = {
      {"F", ActionType::kForward},           {"B", ActionType::kBackward},
      {"I", ActionType::kBackwardInput},     {"W", ActionType::kBackwardWeight},
      {"SEND_F", ActionType::kSendForward},  {"RECV_F", ActionType::kRecvForward},
      {"SEND_B", ActionType::kSendBackward}, {"RECV_B", ActionType::kRecvBackward}};
  const absl::string_view type = token.substr(digits, letters - digits);
  bool known = false;
  for (const auto& [name, value] : kTypes) {
    if (type == name) {
      action.type = value;
      known = true;
    }
  }
  return known && digits > 0 && letters < token.size() &&
         absl::SimpleAtoi(token.substr(0, digits), &action.stage) &&
         absl::SimpleAtoi(token.substr(letters), &action.microbatch);
}

}  // namespace

Schedule parse_schedule(const std::string& text) {
  Schedule schedule;
  schedule.name = "custom";
  std::vector<int64_t> stage_lines;  // the line that first named each stage
  int64_t line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> tokens =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r,"), absl::SkipWhitespace());
    if (tokens.empty()) continue;
    const int64_t rank = schedule.num_ranks();
    auto& actions = schedule.ranks.emplace_back();
    for (absl::string_view token : tokens) {
      Action a;
      TORCH_CHECK(parse_action(token, a), "parse_schedule: line ", line_number, " (rank ", rank,
                  "): '", token, "' is not an action: ", kForm);
      TORCH_CHECK(a.stage < kMaxIndex && a.microbatch < kMaxIndex, "parse_schedule: line ",
                  line_number, " (rank ", rank, "): '", token, "' has a stage or micro-batch over ",
                  kMaxIndex - 1);
      if (a.stage >= static_cast<int64_t>(schedule.stage_ranks.size())) {
        schedule.stage_ranks.resize(a.stage + 1, -1);
        stage_lines.resize(a.stage + 1, -1);
      }
      int64_t& owner = schedule.stage_ranks[a.stage];
      TORCH_CHECK(owner == -1 || owner == rank, "parse_schedule: line ", line_number, " (rank ",
                  rank, "): '", token, "' names stage ", a.stage, ", which rank ", owner,
                  " (line ", stage_lines[a.stage], ") holds; a stage is on one rank");
      if (owner == -1) stage_lines[a.stage] = line_number;
      owner = rank;
      schedule.microbatches = std::max(schedule.microbatches, a.microbatch + 1);
      actions.push_back(a);
    }
  }
  TORCH_CHECK(!schedule.ranks.empty(), "parse_schedule: the text has no actions");
  schedule.stages = static_cast<int64_t>(schedule.stage_ranks.size());
  for (int64_t s = 0; s < schedule.stages; ++s) {
    TORCH_CHECK(schedule.stage_ranks[s] >= 0, "parse_schedule: no rank names stage ", s,
                ", but stage ", schedule.stages - 1, " is named: the stages are 0 to ",
                schedule.stages - 1);
  }
  check_schedule(schedule);
  return schedule;
}

std::string schedule_text(const Schedule& schedule) {
  std::string out;
  for (const auto& actions : schedule.ranks) {
    absl::StrAppend(&out,
                    absl::StrJoin(actions, " ",
                                  [](std::string* o, const Action& a) {
                                    absl::StrAppend(o, to_string(a));
                                  }),
                    "\n");
  }
  return out;
}

}  // namespace gpipe
