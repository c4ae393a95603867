// Where each action of a schedule is; see schedule_plan.h.
#include "gpipe/internal/schedule_plan.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "gpipe/schedule_check.h"

namespace gpipe {
namespace internal {

Action counterpart(const Action& a) {
  switch (a.type) {
    case ActionType::kSendForward: return {ActionType::kRecvForward, a.stage + 1, a.microbatch};
    case ActionType::kRecvForward: return {ActionType::kSendForward, a.stage - 1, a.microbatch};
    case ActionType::kSendBackward: return {ActionType::kRecvBackward, a.stage - 1, a.microbatch};
    case ActionType::kRecvBackward: return {ActionType::kSendBackward, a.stage + 1, a.microbatch};
    default: TORCH_INTERNAL_ASSERT(false, "counterpart of a compute action");
  }
}

void check_sizes(const Schedule& s) {
  const std::string name = absl::StrCat("schedule '", s.name, "'");
  TORCH_CHECK(s.stages >= 1 && s.microbatches >= 1, name,
              ": needs at least 1 stage and 1 micro-batch, got ", s.stages, " and ",
              s.microbatches);
  TORCH_CHECK(s.stages <= kMaxSize / s.microbatches, name, ": ", s.stages, " stages x ",
              s.microbatches, " micro-batches is more than ", kMaxSize,
              " (stage, micro-batch) pairs");
}

std::string where(const Plan& plan, const Action& a) {
  return absl::StrCat("schedule '", plan.schedule().name, "': rank ", plan.rank_of(a), ", action ",
                      plan.position_of(a), " ('", to_string(a), "')");
}

void place_actions(const Schedule& s, Plan& plan) {
  const std::string name = absl::StrCat("schedule '", s.name, "'");
  TORCH_CHECK(!s.ranks.empty(), name, ": has no ranks");
  TORCH_CHECK(static_cast<int64_t>(s.stage_ranks.size()) == s.stages, name, ": ", s.stages,
              " stages but stage_ranks has ", s.stage_ranks.size(), " entries");
  std::vector<bool> holds(s.ranks.size(), false);
  for (int64_t stage = 0; stage < s.stages; ++stage) {
    const int64_t r = s.stage_ranks[stage];
    TORCH_CHECK(r >= 0 && r < s.num_ranks(), name, ": stage ", stage, " is on rank ", r,
                ", but the ranks are 0 to ", s.num_ranks() - 1);
    holds[r] = true;
  }
  for (int64_t r = 0; r < s.num_ranks(); ++r) {
    TORCH_CHECK(holds[r], name, ": rank ", r, " holds no stage");
    for (int64_t p = 0; p < static_cast<int64_t>(s.ranks[r].size()); ++p) {
      const Action& a = s.ranks[r][p];
      const std::string at =
          absl::StrCat(name, ": rank ", r, ", action ", p, " ('", to_string(a), "')");
      TORCH_CHECK(static_cast<int64_t>(a.type) < kTypes, at, ": unknown action type ",
                  static_cast<int>(a.type));
      TORCH_CHECK(a.stage >= 0 && a.stage < s.stages, at, ": the stages are 0 to ", s.stages - 1);
      TORCH_CHECK(a.microbatch >= 0 && a.microbatch < s.microbatches, at,
                  ": the micro-batches are 0 to ", s.microbatches - 1);
      TORCH_CHECK(s.stage_ranks[a.stage] == r, at, ": stage ", a.stage, " is on rank ",
                  s.stage_ranks[a.stage]);
      if (is_communication(a.type)) {
        const int64_t peer = counterpart(a).stage;
        TORCH_CHECK(peer >= 0 && peer < s.stages, at, ": nothing to transfer (stage ", a.stage,
                    peer < 0 ? " is the first)" : " is the last)");
      }
      TORCH_CHECK(!plan.has(a), at, ": runs twice (also action ", plan.position_of(a), ")");
      plan.place(a, r, p);
    }
  }
}

}  // namespace internal
}  // namespace gpipe
