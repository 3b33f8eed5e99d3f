// Device programs: one window of a CollectivePlan, seen from one rank, as a flat
// list of contiguous element moves that a GPU kernel runs without consulting
// the plan.
//
// Pure C++17 and plain old data, so the same struct is read by the CUDA
// window kernel (csrc/transport/cuda_executor.cu) and by the host reference
// interpreter of the unit tests. The GPU path works on one contiguous input
// and one contiguous output tensor per collective (the backend flattens
// coalesced lists; an allreduce's input is its output), so every move is
// "n source ranges -> one destination range" with element offsets.
//
// Ordering contract with the kernel: the ops of one phase run concurrently
// (different thread blocks may be in different ops), and phases are separated
// by a barrier of every rank. So within a phase no op of a rank may read what
// another op of the same rank writes; compile_device_program checks that, and
// find_schedule_hazard already forbids it across ranks.
#pragma once

#include <cstdint>
#include <vector>

#include "collective_plan.h"
#include "gather_scatter_plan.h"

namespace xdev::plan {

constexpr int kMaxDeviceRanks = 16;  // ranks of one host the GPU path supports
constexpr int kMaxDevicePhases = 8;  // every native schedule has at most 4

struct DeviceOp {
  int32_t phase = 0;          // 0: staging, then 1..num_phases
  int32_t is_reduce = 0;      // 0: copy sources[0]; 1: reduce all sources in order
  int32_t finalize = 0;       // produces a total: AVG divides here
  int32_t dst_is_output = 0;  // 1: the rank's output tensor; 0: the rank's own staging slot
  // 1: sources name ranks' copies of the tensor (in memory every rank maps),
  // not their slots; the in-place program's ops read nothing else.
  int32_t sources_are_copies = 0;
  int32_t num_sources = 0;
  int32_t sources[kMaxDeviceRanks] = {};  // rank whose slot is read, or kOwnInput (its input)
  // Elements from the start of each source: a reduce-scatter reads its own
  // contribution from its input and its peers' from where each staged it.
  int64_t src_offsets[kMaxDeviceRanks] = {};
  int64_t dst_offset = 0;  // elements from the start of the destination
  int64_t count = 0;
};

struct DeviceProgram {
  int num_phases = 0;
  std::vector<DeviceOp> ops;         // ordered by phase
  std::vector<int32_t> phase_begin;  // ops of phase p: [phase_begin[p], phase_begin[p + 1])
};

// Thread blocks of one rank's window kernel. The GPU barrier needs every block
// of every rank sharing the GPU resident at once (under MPS, ranks that share
// a GPU run their kernels side by side), and another kernel beside ours must
// not keep some of our blocks waiting either: so all of one GPU's ranks
// together take at most half its multiprocessors, one block each, and at
// least one block per rank. 4 ranks of 64 blocks on an H100's 132 SMs hung
// until the timeout: one rank's last blocks waited for SMs its peers held
// while those waited for it in the barrier.
int device_blocks_per_rank(int multiprocessors, int ranks_on_gpu, int max_blocks);

// The ops `rank` runs in window w of a single-tensor payload (payload offset ==
// tensor element offset). Copies of a slot range onto itself are dropped.
// Throws std::invalid_argument when the window does not fit the limits above
// or when two ops of one phase would race on the rank's own slot.
DeviceProgram compile_device_program(const WindowPlan& w, int rank);

// The ops `rank` runs in window k of a reduce-scatter or all-gather plan, one
// tensor per side: a reduce-scatter's input is the full tensor (rank j's
// block from the sum of the blocks before it) and its output the rank's
// block; an all-gather's the other way round. Slot memory follows
// GatherScatterPlan::slot_memory_offset. Throws std::invalid_argument as
// compile_device_program does.
DeviceProgram compile_gather_scatter_program(const GatherScatterPlan& plan, int64_t k, int rank);

// The ops `rank` runs for an in-place allreduce of `total` elements of
// elem_bytes whose tensor lies at the same place in every rank's symmetric
// heap, so that every rank's copy is mapped here: no slot, nothing staged,
// one window whatever the size. Rank r owns slice r
// (shared_buffer_slices). Phase 0 does nothing: its barrier says every
// rank's tensor is ready. Phase 1 reduces the rank's slice from every copy,
// in rank order, into its own copy (the only rank that computes it, so every
// rank ends with the same bits); phase 2 copies every other slice from its
// owner's copy; phase 3 is empty: its barrier keeps each copy as it is until
// every peer has read it. No op writes anything another op of its phase, of
// any rank, reads.
DeviceProgram compile_in_place_program(int64_t total, int64_t elem_bytes, int world_size, int rank);

}  // namespace xdev::plan
