// Runs a CollectivePlan over a ShmChannel by staging: ranks copy their inputs
// into their shared slots and the schedule moves data between slots, one
// window at a time. Works for any schedule and any tensor list. Each window
// runs in its plan::forward_own_input form, a rank reading its own contribution
// from its tensor and staging only what peers read, with plan::hand_back_totals
// on top: on two ranks a total goes back to the slot its peer staged. Torch-free:
// tensors arrive as raw pointers laid out by a FlatLayout.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/collective_plan.h"
#include "shm_channel.h"

namespace xdev::transport {

struct CollectiveRequest {
  const plan::CollectivePlan* plan = nullptr;
  const plan::FlatLayout* layout = nullptr;
  std::vector<char*> tensors;  // contiguous data of each tensor; read and written in place
  kernels::DType dtype = kernels::DType::kFloat32;
  kernels::ReduceOp op = kernels::ReduceOp::kSum;
  OpContext ctx;
  // Called once, when every rank has passed the first window's barrier and the
  // descriptor check; returning true ends the collective there (it ran some
  // other way: in place, SharedBufferExecutor::run_opened). Its answer must be
  // the same on every rank.
  std::function<bool()> after_first_barrier;
};

class ShmExecutor {
 public:
  // The channel must outlive the executor.
  explicit ShmExecutor(ShmChannel& channel) : channel_(channel) {}

  // Publishes the descriptor, then runs every window. The first barrier also
  // checks that all ranks published the same descriptor.
  void run(const CollectiveRequest& req);

  // A bare barrier of all ranks, with the same descriptor check.
  void barrier(const OpContext& ctx);

 private:
  void stage(const CollectiveRequest& req, const plan::WindowPlan& w, const plan::Schedule& sched,
             char* slot) const;
  void run_step(const CollectiveRequest& req, const plan::WindowPlan& w, const plan::Step& s,
                int64_t parity) const;
  // hand_back_totals(forward_own_input(s)); windows of one plan mostly repeat,
  // so the last one is kept.
  const plan::Schedule& forwarded(const plan::Schedule& s);

  ShmChannel& channel_;
  plan::Schedule last_schedule_;
  plan::Schedule last_forwarded_;
};

}  // namespace xdev::transport
