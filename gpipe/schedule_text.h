// Schedules as text: one line per rank, the actions torch.distributed.pipelining writes
// ("0F0 0F1 1F0 0B0 ..."), to read a schedule a user wrote and to print one.
#pragma once

#include <string>

#include "gpipe/schedule.h"

namespace gpipe {

// Note [Schedule text]
// ~~~~~~~~~~~~~~~~~~~~
// Line r (blank lines and comments from '#' on do not count) lists rank r's actions in the order
// it runs them, separated by spaces or commas (a CSV row of torch.distributed.pipelining reads as
// it is). An action is <stage><type><micro-batch>, type one of F, B, I, W, SEND_F, RECV_F,
// SEND_B, RECV_B (Note [Schedules as data]): "0F3" is the forward of micro-batch 3 on stage 0,
// "1SEND_B0" stage 1 sending micro-batch 0's input gradient back. The stages are 0 .. S - 1 and
// the micro-batches 0 .. m - 1, S and m counted from the text; a stage belongs to the rank whose
// line names it. Sends and receives may be left out: with_communication (schedule_check.h) adds
// them. Two ranks with two stages each, interleaved, one micro-batch:
//
//   0F0 2F0 2B0 0B0
//   1F0 3F0 3B0 1B0

/// Reads a schedule written as in Note [Schedule text] and checks it (check_schedule). Throws
/// c10::Error naming the line and the action that is wrong.
///
///   auto schedule = gpipe::parse_schedule("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n");
Schedule parse_schedule(const std::string& text);

/// The schedule as text (Note [Schedule text]): one line per rank, actions separated by spaces.
std::string schedule_text(const Schedule& schedule);

}  // namespace gpipe
