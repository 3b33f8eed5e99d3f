#pragma once
// One broadcast over a host's shared-memory channel, shared by the one-host path and by the
// second step of the two-level broadcast: the call's tensors move as bytes, whatever their dtype.

#include <ATen/ATen.h>

#include <vector>

#include "../transport/shm_executor.h"
#include "group_context.h"

namespace xdev::backend {

// Broadcasts `tensors` from `root` among the `world_size` ranks of `executor`'s channel and
// writes the result back into them. `root` is a rank of that channel (the local index inside
// a host for the two-level path); `name` is what a timeout or mismatch error calls the call.
void staged_broadcast(GroupContext& group, transport::ShmExecutor& executor, int world_size,
                      int root, const std::vector<at::Tensor>& tensors, const char* name,
                      transport::Clock::time_point deadline);

}  // namespace xdev::backend
