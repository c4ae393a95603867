// Tests of checking schedules and of their text (gpipe/schedule_check.h, gpipe/schedule_text.h):
// each kind of mistake is refused with an error naming the first bad action, and a schedule read
// from text is the schedule that was written.
#include "tests/catch.h"

#include <sstream>
#include <string>

#include <c10/util/Exception.h>

#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_text.h"
#include "gpipe/trace.h"

namespace gpipe {
namespace {

using gpipe_test::contains;

CATCH_TEST_CASE("schedule_text and parse_schedule give back every generated schedule",
                "[schedule]") {
  const auto kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                             ScheduleKind::kZeroBubble);
  const int64_t v = kind == ScheduleKind::kInterleaved ? 2 : 1;
  const bool wired = GENERATE(false, true);
  const Schedule made = make_schedule(kind, 3, 6, v);
  const Schedule s = wired ? with_communication(made) : made;
  const Schedule read = parse_schedule(schedule_text(s));
  CATCH_CHECK(read.name == "custom");
  CATCH_CHECK(read.stages == s.stages);
  CATCH_CHECK(read.microbatches == 6);
  CATCH_CHECK(read.stage_ranks == s.stage_ranks);
  CATCH_CHECK(read.ranks == s.ranks);
}

CATCH_TEST_CASE("parse_schedule reads CSV rows, comments and blank lines", "[schedule]") {
  const Schedule s = parse_schedule(
      "# two ranks, two micro-batches\n"
      "0F0, 0F1, 0B1, 0B0\n"
      "\n"
      "1F0,1F1,1B1,1B0   # the last stage\n");
  CATCH_CHECK(s.num_ranks() == 2);
  CATCH_CHECK(s.stages == 2);
  CATCH_CHECK(s.microbatches == 2);
  CATCH_CHECK(schedule_text(s) == schedule_text(gpipe_schedule(2, 2)));
}

CATCH_TEST_CASE("parse_schedule names the line and the token it cannot read", "[schedule]") {
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0X0 0B0\n"),
                          contains("line 1 (rank 0): '0X0' is not an action: expected "
                                   "<stage><type><micro-batch>"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0B0\n\nF1\n"),
                          contains("line 3 (rank 1): 'F1' is not an action"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0F\n"), contains("'0F' is not an action"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 1F0 0B0 1B0\n1F0\n"),
                          contains("line 2 (rank 1): '1F0' names stage 1, which rank 0 (line 1) "
                                   "holds"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0B0\n2F0 2B0\n"),
                          contains("no rank names stage 1, but stage 2 is named"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("# nothing\n"), contains("the text has no actions"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F9223372036854775807\n"),
                          contains("has a stage or micro-batch over 1048575"));
}

CATCH_TEST_CASE("check_schedule refuses actions that run twice or never", "[schedule]") {
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0F1 0F0 0B1 0B0\n"),
                          contains("rank 0, action 2 ('0F0'): runs twice (also action 0)"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0F1 0B0\n"),
                          contains("rank 0 never runs '0B1' (nor I and W)"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0B0 0B1\n"), contains("rank 0 never runs '0F1'"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0I0\n"),
                          contains("rank 0 never runs '0W0' (its I runs)"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0W0\n"),
                          contains("rank 0 never runs '0I0' (its W runs)"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0B0 0I0 0W0\n"),
                          contains("action 2 ('0I0'): micro-batch 0 of stage 0 also runs a whole "
                                   "backward ('0B0')"));
}

CATCH_TEST_CASE("check_schedule refuses an action before what it needs on its rank",
                "[schedule]") {
  CATCH_CHECK_THROWS_WITH(parse_schedule("0B0 0F0\n"),
                          contains("rank 0, action 0 ('0B0'): runs before '0F0', which it needs "
                                   "(action 1)"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0I0 0W0 1F0 1B0\n"),
                          contains("action 1 ('0I0'): runs before '1B0', which it needs"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("1F0 0F0 1B0 0B0\n"),
                          contains("action 0 ('1F0'): runs before '0F0'"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0W0 0I0\n"),
                          contains("action 1 ('0W0'): runs before '0I0'"));
}

CATCH_TEST_CASE("check_schedule refuses a schedule that deadlocks across ranks", "[schedule]") {
  // Rank 0 waits in 0B0 for rank 1's backward, which waits behind 1F1 for rank 0's 0F1.
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0B0 0F1 0B1\n1F0 1F1 1B1 1B0\n"),
                          contains("deadlocks: rank 0 at action 1 ('0B0') waits for '1B0'; "
                                   "rank 1 at action 1 ('1F1') waits for '0F1'"));
}

CATCH_TEST_CASE("check_schedule wants every transfer, where a tensor crosses ranks only",
                "[schedule]") {
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0SEND_F0 0RECV_B0 0B0\n1F0 1B0 1SEND_B0\n"),
                          contains("rank 1 never runs '1RECV_F0': its neighbour is on another "
                                   "rank"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0SEND_F0 1F0 1B0 0B0\n"),
                          contains("action 1 ('0SEND_F0'): nothing to transfer"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0RECV_F0 0F0 0B0\n"),
                          contains("action 0 ('0RECV_F0'): nothing to transfer (stage 0 is the "
                                   "first)"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0SEND_F0 0B0\n"),
                          contains("nothing to transfer (stage 0 is the last)"));
  CATCH_CHECK_THROWS_WITH(parse_schedule("0F0 0SEND_F0 0RECV_B0 0B0\n"
                                         "1F0 1RECV_F0 1B0 1SEND_B0\n"),
                          contains("rank 1, action 0 ('1F0'): runs before '1RECV_F0'"));
}

CATCH_TEST_CASE("check_schedule wants both sides of a pair of ranks to post in one order",
                "[schedule]") {
  // Rank 1 receives micro-batch 1 first; rank 0 sends micro-batch 0 first. Gloo (matching by
  // tag) would not mind; NCCL (by order) would deadlock or swap the tensors.
  CATCH_CHECK_THROWS_WITH(
      parse_schedule("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0\n"
                     "1RECV_F1 1RECV_F0 1F0 1F1 1B1 1SEND_B1 1B0 1SEND_B0\n"),
      contains("ranks 0 and 1 post their transfers in different orders: the transfer 0 between "
               "them is '0SEND_F0' on rank 0 but '1RECV_F1' on rank 1 (it would be '1RECV_F0')"));
  // The order with_communication gives the same schedule.
  const Schedule wired = with_communication(gpipe_schedule(2, 2));
  CATCH_CHECK(schedule_text(wired) ==
              "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0\n"
              "1RECV_F0 1F0 1RECV_F1 1F1 1B1 1SEND_B1 1B0 1SEND_B0\n");
}

CATCH_TEST_CASE("with_communication posts 1F1B's transfers in the order the sends run",
                "[schedule]") {
  // Rank 1 receives micro-batch 1's activations before it sends micro-batch 0's gradient,
  // because rank 0 sends them first: the order NCCL needs (Note [Point-to-point order]).
  const Schedule wired = with_communication(one_f_one_b_schedule(2, 3));
  CATCH_CHECK(schedule_text(wired) ==
              "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2\n"
              "1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1RECV_F2 1SEND_B1 1F2 1B2 1SEND_B2\n");
}

CATCH_TEST_CASE("check_schedule refuses a schedule whose shape is wrong", "[schedule]") {
  Schedule s = gpipe_schedule(2, 2);
  s.ranks[1][0].microbatch = 5;
  CATCH_CHECK_THROWS_WITH(check_schedule(s), contains("rank 1, action 0 ('1F5'): the "
                                                      "micro-batches are 0 to 1"));
  s = gpipe_schedule(2, 2);
  s.ranks[0][1].stage = 1;
  CATCH_CHECK_THROWS_WITH(check_schedule(s),
                          contains("rank 0, action 1 ('1F1'): stage 1 is on rank 1"));
  s = gpipe_schedule(2, 2);
  s.stage_ranks = {0, 0};
  CATCH_CHECK_THROWS_WITH(check_schedule(s), contains("rank 1 holds no stage"));
  s.stage_ranks = {0, 2};
  CATCH_CHECK_THROWS_WITH(check_schedule(s),
                          contains("stage 1 is on rank 2, but the ranks are 0 to 1"));
  s = gpipe_schedule(2, 2);
  s.microbatches = -1;
  CATCH_CHECK_THROWS_WITH(check_schedule(s), contains("needs at least 1 stage and 1 micro-batch, "
                                                      "got 2 and -1"));
  s.microbatches = int64_t{1} << 40;
  CATCH_CHECK_THROWS_WITH(check_schedule(s), contains("is more than 4194304 (stage, micro-batch) "
                                                      "pairs"));
  s = gpipe_schedule(2, 2);
  s.ranks[0][0].type = static_cast<ActionType>(9);
  CATCH_CHECK_THROWS_WITH(check_schedule(s), contains("rank 0, action 0 ('0?0'): unknown action "
                                                      "type 9"));
  CATCH_CHECK_THROWS_WITH(simulate_schedule(gpipe_schedule(2, 2), ActionCosts{0, 1, 1, 0}),
                          contains("action costs must be positive"));
}

CATCH_TEST_CASE("schedule_svg draws every action of any schedule at its simulated time",
                "[schedule][trace]") {
  const Schedule s = zero_bubble_schedule(3, 4);
  const std::string svg = schedule_svg(s);
  CATCH_CHECK(svg.rfind("<svg", 0) == 0);
  CATCH_CHECK_THAT(svg, contains("zb schedule: 3 ranks, 4 micro-batches; simulated bubble 14%, "
                                 "peak in flight 3/3/3"));
  size_t boxes = 0;
  for (size_t at = svg.find("<title>"); at != std::string::npos; at = svg.find("<title>", at + 1)) {
    ++boxes;
  }
  CATCH_CHECK(boxes == 3 * 4 * 3);  // F, I and W of each micro-batch on each rank
  // Each box at its simulated time: rank 2's last weight gradient.
  const SimulatedAction last = simulate_schedule(s).actions[2].back();
  std::ostringstream title;
  title << "<title>" << to_string(last.action) << ": " << last.start << "-" << last.end
        << "</title>";
  CATCH_CHECK(to_string(last.action) == "2W3");
  CATCH_CHECK_THAT(svg, contains(title.str()));
  CATCH_CHECK_THAT(schedule_svg(interleaved_schedule(2, 4, 2)),
                   contains("2 ranks, 4 micro-batches, 2 stages per rank"));
}

}  // namespace
}  // namespace gpipe
