// Runs a CollectivePlan over a ShmChannel: the CPU transport's half of "one
// schedule, two transports". Torch-free: tensors arrive as raw pointers laid
// out by a FlatLayout.
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

// Ranks disagree about the collective (shape, dtype, op, algorithm, order).
// Raised on every rank at the same point; the channel stays usable.
class MismatchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CollectiveRequest {
  const plan::CollectivePlan* plan = nullptr;
  const plan::FlatLayout* layout = nullptr;
  std::vector<char*> tensors;  // contiguous data of each tensor; read and written in place
  kernels::DType dtype = kernels::DType::kFloat32;
  kernels::ReduceOp op = kernels::ReduceOp::kSum;
  OpDescriptor descriptor;
  Clock::time_point deadline;
  std::string what;  // for error messages, e.g. "allreduce #12"
  // Renders a descriptor for the mismatch message.
  std::function<std::string(const OpDescriptor&)> describe;
};

class ShmExecutor {
 public:
  explicit ShmExecutor(ShmChannel channel) : channel_(std::move(channel)) {}

  ShmChannel& channel() { return channel_; }

  // Publishes the descriptor, then runs every window. The first barrier also
  // checks that all ranks published the same descriptor.
  void run(const CollectiveRequest& req);

  // A bare barrier of all ranks, with the same descriptor check.
  void barrier(const OpDescriptor& d, Clock::time_point deadline, const std::string& what,
               const std::function<std::string(const OpDescriptor&)>& describe);

 private:
  void check_descriptors(const OpDescriptor& mine,
                         const std::function<std::string(const OpDescriptor&)>& describe,
                         const std::string& what) const;
  void stage(const CollectiveRequest& req, const plan::WindowPlan& w, char* slot) const;
  void run_step(const CollectiveRequest& req, const plan::WindowPlan& w, const plan::Step& s,
                int64_t parity) const;

  ShmChannel channel_;
  int64_t windows_run_ = 0;  // selects the slot set; advances identically on every rank
};

}  // namespace xdev::transport
