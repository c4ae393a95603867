// A process group that matches point-to-point operations as NCCL does, over a Gloo group that
// carries them: tags are ignored; the operations between two ranks run one at a time in the order
// each rank posted them (sends and receives alike, as on NCCL's one stream per pair), and each
// waits until its match on the other rank has run. Tests hold gpipe to Note [Point-to-point
// order] with it: where two ranks post in orders that do not agree, it mismatches tensors or
// deadlocks (and fails after the inner group's timeout) as NCCL would, where Gloo, matching by
// tag, would not notice. Collectives go to the inner group as they are.
#pragma once

#include <pthread.h>

#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/distributed/process_group.h"

namespace gpipe_test {

class InOrderGroup : public gpipe::distributed::ProcessGroupBase {
 public:
  explicit InOrderGroup(gpipe::distributed::ProcessGroup inner)
      : gpipe::distributed::ProcessGroupBase(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)) {}

  ~InOrderGroup() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      for (auto& [peer, pair] : pairs_) {
        if (pair->in_flight) pair->in_flight->abort();
      }
    }
    for (auto& [peer, pair] : pairs_) pair->thread.join();
    // What was never run fails.
    for (auto& [peer, pair] : pairs_) {
      for (Operation& op : pair->queue) op.work->fail("the group was destroyed");
    }
  }

  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int peer,
                                      int /*tag*/) override {
    return enqueue(peer, /*is_send=*/true, tensors);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int peer,
                                      int /*tag*/) override {
    return enqueue(peer, /*is_send=*/false, tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& options = c10d::BroadcastOptions()) override {
    return inner_->broadcast(tensors, options);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& options = c10d::AllreduceOptions()) override {
    return inner_->allreduce(tensors, options);
  }
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& options = c10d::AllgatherOptions()) override {
    return inner_->allgather(outputs, inputs, options);
  }

 private:
  // Completed by the pair's thread once the inner operation has run (or failed).
  // Completed once: by the pair's thread, or earlier by abort() (then the pair breaks when its
  // thread gets to it, as an aborted NCCL communicator does).
  class OrderedWork : public c10d::Work {
   public:
    void complete(std::exception_ptr error = nullptr) {
      std::call_once(once_, [&] { finish(std::move(error)); });
    }
    void fail(const std::string& why) {
      try {
        TORCH_CHECK(false, "InOrderGroup: ", why);
      } catch (...) {
        complete(std::current_exception());
      }
    }
    void abort() override { fail("the operation was aborted"); }

   private:
    std::once_flag once_;
  };
  struct Operation {
    bool is_send = false;
    std::vector<at::Tensor> tensors;
    c10::intrusive_ptr<OrderedWork> work;
  };
  // The operations with one peer, run in posting order on a thread of their own.
  struct Pair {
    std::deque<Operation> queue;
    c10::intrusive_ptr<c10d::Work> in_flight;
    int sends = 0, receives = 0;  // the inner tags: the position in each direction
    std::exception_ptr error;     // once one failed, the pair is broken (as an NCCL one)
    const bool* stopping = nullptr;  // the group's stopping_
    std::thread thread;
  };

  c10::intrusive_ptr<c10d::Work> enqueue(int peer, bool is_send, std::vector<at::Tensor> tensors) {
    auto work = c10::make_intrusive<OrderedWork>();
    absl::MutexLock lock(&mu_);
    std::unique_ptr<Pair>& pair = pairs_[peer];
    if (!pair) {
      pair = std::make_unique<Pair>();
      pair->stopping = &stopping_;
      Pair* p = pair.get();
      p->thread = std::thread([this, p, peer] { run(*p, peer); });
    }
    pair->queue.push_back(Operation{is_send, std::move(tensors), work});
    return work;
  }

  void run(Pair& pair, int peer) {
    pthread_setname_np(pthread_self(), "in-order pair");
    while (true) {
      Operation op;
      int tag = 0;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Pair* p) { return *p->stopping || !p->queue.empty(); }, &pair));
        if (stopping_) return;
        op = std::move(pair.queue.front());
        pair.queue.pop_front();
        if (op.work->isCompleted() && !pair.error) {  // aborted: the pair breaks, as on NCCL
          pair.error = op.work->exception();
        }
        if (pair.error) {
          op.work->complete(pair.error);
          continue;
        }
        tag = op.is_send ? pair.sends++ : pair.receives++;
        try {
          pair.in_flight = op.is_send ? inner_->send(op.tensors, peer, tag)
                                      : inner_->recv(op.tensors, peer, tag);
        } catch (...) {
          pair.error = std::current_exception();
          op.work->complete(pair.error);
          continue;
        }
      }
      std::exception_ptr error;
      try {
        pair.in_flight->wait();
      } catch (...) {
        error = std::current_exception();
      }
      absl::MutexLock lock(&mu_);
      pair.in_flight.reset();
      op.work->complete(error);
      if (!op.work->isSuccess()) pair.error = op.work->exception();  // failed, or aborted
    }
  }

  gpipe::distributed::ProcessGroup inner_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<int, std::unique_ptr<Pair>> pairs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpipe_test
