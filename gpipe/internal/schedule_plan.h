// Where each action of a schedule is and what it needs (internal, not API): the table that
// check_schedule, with_communication and simulate_schedule work from (Note [Checking a schedule]
// in schedule_check.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"

namespace gpipe {
namespace internal {

constexpr int64_t kTypes = 8;
// The most (stage, micro-batch) pairs a schedule may have (its tables hold kTypes entries each).
constexpr int64_t kMaxSize = 1 << 22;

// The other side of a transfer: SEND_F(s, i) <-> RECV_F(s + 1, i),
// SEND_B(s, i) <-> RECV_B(s - 1, i).
Action counterpart(const Action& a);

// Throws c10::Error when the schedule's sizes cannot be planned (checked before anything is sized
// by them).
void check_sizes(const Schedule& s);

// Where each action of a schedule is, and what each needs.
class Plan {
 public:
  explicit Plan(const Schedule& schedule) : s_(schedule), comm_(has_communication(schedule)) {
    check_sizes(schedule);
    const size_t size = static_cast<size_t>(s_.stages * kTypes * s_.microbatches);
    rank_.assign(size, -1);
    position_.assign(size, -1);
  }

  const Schedule& schedule() const { return s_; }
  bool comm() const { return comm_; }
  int64_t key(const Action& a) const {
    return (a.stage * kTypes + static_cast<int64_t>(a.type)) * s_.microbatches + a.microbatch;
  }
  bool has(const Action& a) const { return rank_[key(a)] >= 0; }
  int64_t rank_of(const Action& a) const { return rank_[key(a)]; }
  int64_t position_of(const Action& a) const { return position_[key(a)]; }
  void place(const Action& a, int64_t rank, int64_t position) {
    rank_[key(a)] = rank;
    position_[key(a)] = position;
  }
  bool crosses(int64_t stage, int64_t neighbour) const {
    return s_.stage_ranks[stage] != s_.stage_ranks[neighbour];
  }
  // The action that computes the gradient stage s sends back for micro-batch i: I if split.
  Action input_gradient(int64_t s, int64_t i) const {
    const Action split{ActionType::kBackwardInput, s, i};
    return has(split) ? split : Action{ActionType::kBackward, s, i};
  }

  // The send that follows compute action `a` where its tensor crosses to another rank: F's
  // output to the next stage, B's (or I's) input gradient to the previous one.
  std::optional<Action> send_after(const Action& a) const {
    const int64_t s = a.stage;
    if (a.type == ActionType::kForward && s + 1 < s_.stages && crosses(s, s + 1)) {
      return Action{ActionType::kSendForward, s, a.microbatch};
    }
    if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) && s > 0 &&
        crosses(s, s - 1)) {
      return Action{ActionType::kSendBackward, s, a.microbatch};
    }
    return std::nullopt;
  }

  // What `a` needs: on its own rank (`local`, which must come before it), and, for a compute
  // action whose input comes from another rank in a schedule without transfers, that action.
  void needs(const Action& a, std::vector<Action>& local, std::optional<Action>& remote) const {
    local.clear();
    remote.reset();
    const int64_t s = a.stage;
    const int64_t i = a.microbatch;
    auto from_neighbour = [&](const Action& producer, const Action& receive, int64_t neighbour) {
      if (!crosses(s, neighbour)) {
        local.push_back(producer);
      } else if (comm_) {
        local.push_back(receive);
      } else {
        remote = producer;
      }
    };
    switch (a.type) {
      case ActionType::kForward:
        if (s > 0) {
          from_neighbour({ActionType::kForward, s - 1, i}, {ActionType::kRecvForward, s, i}, s - 1);
        }
        break;
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
        local.push_back({ActionType::kForward, s, i});
        if (s + 1 < s_.stages) {
          from_neighbour(input_gradient(s + 1, i), {ActionType::kRecvBackward, s, i}, s + 1);
        }
        break;
      case ActionType::kBackwardWeight: local.push_back({ActionType::kBackwardInput, s, i}); break;
      case ActionType::kSendForward: local.push_back({ActionType::kForward, s, i}); break;
      case ActionType::kSendBackward: local.push_back(input_gradient(s, i)); break;
      case ActionType::kRecvForward:
      case ActionType::kRecvBackward: break;
    }
  }

 private:
  const Schedule& s_;
  bool comm_;
  std::vector<int64_t> rank_;
  std::vector<int64_t> position_;
};

// "schedule '<name>': rank r, action p ('<a>')", for errors.
std::string where(const Plan& plan, const Action& a);

// Checks the shape of the schedule and places every action in `plan` (each once).
void place_actions(const Schedule& s, Plan& plan);

}  // namespace internal
}  // namespace gpipe
