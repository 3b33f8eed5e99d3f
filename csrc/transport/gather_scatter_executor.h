// Runs a GatherScatterPlan (reduce-scatter or all-gather) over a ShmChannel by
// staging: each window, every rank copies the pieces its peers read into its
// slot, passes one barrier, and runs its steps of the window's schedule (an
// all-gather writes its own piece to its output as it stages it). The
// slot coordinates of the schedule map to tensors as the plan lays them out:
// rank j's piece of window [a, b) is block elements [a, b) of rank j. A block
// may span several tensors (the coalesced forms): block_layout says which.
// Torch-free: tensors arrive as raw contiguous pointers.
//
// Single copy (one tensor, peers allowed to read each other's memory): the
// plan has one window over the whole block and rank j's "slot" is the tensor
// it would stage from (its reduce-scatter input, its all-gather input), which
// peers read in place with process_vm_readv: each byte crosses memory once
// per reader instead of being staged first.
//
// In place (full tensors in the group's symmetric heap, as FSDP2 allocates
// them with set_allocate_memory_from_process_group_for_comm, or a DDP bucket
// in a host's heap reduced in two levels; one tensor's blocks may be uneven;
// several tensors lie within one heap tensor, as the two-level gather/scatter
// cuts a full tensor host by host): the run starts staged; after its first
// barrier, when every rank's descriptor puts full tensor 0 at the same place
// of the heap, each rank reads its peers' full tensors where it maps them and
// nothing more is staged. A reduce-scatter sums block r of every rank's input in rank order
// (the same sum as staged, so the same bits); an all-gather copies each peer's
// block out of the peer's output. Otherwise (places differ, or some rank's
// tensor is elsewhere) every rank goes on staged.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/gather_scatter_plan.h"
#include "../plan/packing.h"
#include "shm_channel.h"

namespace xdev::transport {

struct GatherScatterRequest {
  const plan::GatherScatterPlan* plan = nullptr;
  // Tensor i's block holds block_layout.numel(i) elements (uneven blocks: one
  // tensor, the largest block).
  const plan::FlatLayout* block_layout = nullptr;
  // Per tensor: all N blocks in rank order (reduce-scatter input, all-gather output)...
  std::vector<char*> full;
  // ...and this rank's block (reduce-scatter output, all-gather input). An
  // all-gather's block may be exactly the full tensor's block of this rank (in place).
  std::vector<char*> block;
  // Uneven blocks (one tensor; the plan gives each rank's size): rank j's block
  // starts at element block_starts[j] of the full tensor. Empty: tensor t's
  // blocks all hold block_layout->numel(t) elements, rank j's at j times that.
  std::vector<int64_t> block_starts;
  // All-gather moves bytes: dtype kUInt8 with byte counts serves every dtype.
  kernels::DType dtype = kernels::DType::kFloat32;
  kernels::ReduceOp op = kernels::ReduceOp::kSum;
  // AVG divides the results by this; 0: by the channel's world size. (A
  // reduce-scatter inside one host of a larger group divides by the group's.)
  int64_t avg_divisor = 0;
  // Peers read this rank's input in place (one tensor, a one-window plan).
  bool single_copy = false;
  // Its descriptor's heap_arena/heap_offset say where the full tensor lies in
  // this rank's symmetric heap (arena -1: not there).
  OpContext ctx;
  // Set when the full tensors lie in the symmetric heap: every rank's full
  // tensor 0 as mapped in this process, by rank; tensor t lies at the same
  // distance from it on every rank (the descriptors, equal, say the shapes).
  // Called only after the first barrier, once every rank's place is known to
  // agree (a peer's arena is mapped on first use).
  std::function<std::vector<char*>()> full_copies;
  // Called on this rank once the first barrier has found every rank's
  // descriptor equal, before it reads any peer's data: a collective of
  // several hosts sends its check across hosts from here, so that it travels
  // while this host's ranks move their data. It must not throw: a rank that
  // left here would leave its peers waiting in the step.
  std::function<void()> after_check;
};

class GatherScatterExecutor {
 public:
  // The channel must outlive the executor.
  explicit GatherScatterExecutor(ShmChannel& channel) : channel_(channel) {}

  // Publishes the descriptor, then runs every window; the first barrier also
  // checks that every rank published the same descriptor (MismatchError on
  // all ranks otherwise, and the channel stays usable). Returns whether it
  // ran in place from the symmetric heap (the same on every rank).
  bool run(const GatherScatterRequest& req);

 private:
  void run_single_copy(const GatherScatterRequest& req);
  // After the first barrier, every rank's full tensor at one place of the heap.
  void run_in_place(const GatherScatterRequest& req, const std::vector<char*>& full);

  ShmChannel& channel_;
  std::vector<std::vector<char>> bounce_;  // single copy: one chunk per remote source
};

}  // namespace xdev::transport
