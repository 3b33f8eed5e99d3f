// The Work handle of a native xdev collective. The backend's worker thread
// completes it; wait() blocks on it (after running the group's queued tasks
// when called from inside one of them) and rethrows a failure as the
// DistBackendError it was stored as; getFuture() is what DDP's comm hooks use,
// and its value is the list of result tensors.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace xdev::backend {

// What the task running a Work's collective tells its waiters: that it holds
// nothing of the call any more (the caller's tensors, its reference to the
// Work). Until then the tensors live on, whatever the caller drops; a tensor
// from the group's symmetric heap would return to it a moment later on one
// rank than on another, and the ranks' next allocations would land at
// different offsets (and stage instead of running in place).
class TaskRelease {
 public:
  void running_on_this_thread() { runner_.store(std::this_thread::get_id()); }
  void released();
  // Returns at once on the thread running the task (a callback of the Work,
  // or one nested in it, waits there; the task is up its stack).
  void wait();

 private:
  std::atomic<std::thread::id> runner_{};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool released_ = false;
};

class XdevWork : public c10d::Work {
 public:
  // devices: where the outputs live, for a future with CUDA stream semantics
  // (empty for CPU tensors).
  XdevWork(int rank, c10d::OpType op_type, const char* profiling_title,
           std::vector<at::Tensor> outputs, std::vector<c10::Device> devices = {});

  // Called on the thread that ran the collective (the CUDA work marks its
  // future with its stream current, see CudaWork).
  virtual void complete();
  void fail(std::exception_ptr error);

  // A future callback of an earlier Work of the group runs on the thread
  // that runs the group's collectives; waiting there for this one, still
  // queued, runs the queued collectives up to it first (WorkQueue::
  // run_queued_while_waiting) instead of waiting for a thread that is busy
  // waiting.
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  // For the task that runs this Work's collective (GroupContext::enqueue_work).
  const std::shared_ptr<TaskRelease>& task_release() const { return task_release_; }

  // Where a collective issued from this Work's future callbacks runs, among
  // the tasks of the queue that completes it (see WorkQueue::run_nested).
  // Ranks issue collectives in the same program order, but the callbacks run
  // when the Work completes, a moment that differs across ranks. To keep the
  // ranks' orders equal, such a collective takes the place it would have had
  // had its callback run when it was attached, as on NCCL, whose futures
  // complete at once: after the tasks submitted by then, ahead of later ones.
  // A callback is attached right after getFuture() (the future is out of
  // reach before), so that is when a Work the program issued takes its place:
  // the count of tasks `submitted` by then.
  void place_callbacks_at_get_future(std::shared_ptr<const std::atomic<uint64_t>> submitted);
  // A Work issued from callbacks takes the place of the callbacks that issued it.
  void place_callbacks_at(uint64_t place) { callbacks_place_ = place; }
  // The place for a collective issued on this thread now: that of the Work
  // whose callbacks are running here, or WorkQueue::kEverything.
  static uint64_t callbacks_place_here();

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<const std::atomic<uint64_t>> submitted_;
  std::atomic<uint64_t> callbacks_place_;  // kEverything until taken
  std::shared_ptr<TaskRelease> task_release_ = std::make_shared<TaskRelease>();
};

// A Work that shows the caller its own tensors where its collective wrote
// others: result() is `result` and the future's value `future_value`.
// all_gather_coalesced's future carries the output lists, one per rank, as
// Gloo gives them (c10d hands that value to the caller as is), while its
// collective wrote one flat list (its result()); a complex reduce-scatter
// runs on real views of the caller's complex tensors, and shows the complex
// tensors, not the views.
class ShownResultWork : public c10d::Work {
 public:
  ShownResultWork(c10::intrusive_ptr<c10d::Work> inner, c10d::OpType op_type,
                  std::vector<at::Tensor> result, c10::IValue future_value);
  // Shows what the inner Work shows, in the same structure, with each tensor
  // passed through `show` (the caller's tensor for one the collective ran on
  // in its place, such as a view of its bytes).
  using ShowTensor = std::function<at::Tensor(const at::Tensor&)>;
  ShownResultWork(c10::intrusive_ptr<c10d::Work> inner, c10d::OpType op_type, ShowTensor show);

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  void synchronize() override { inner_->synchronize(); }
  void abort() override { inner_->abort(); }
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override {
    return inner_->wait(timeout);
  }
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  const c10::intrusive_ptr<c10d::Work> inner_;
  const std::vector<at::Tensor> result_;
  const c10::IValue future_value_;
  const ShowTensor show_;  // set: result_ and future_value_ are unused
  std::mutex mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made on the first getFuture()
};

}  // namespace xdev::backend
