// Predicted reduce-scatter and all-gather times: each way of running one
// through the machine model the allreduce is chosen by (cost_model.h), and the
// choice by predicted time.
//
// The forms differ in where a rank reads its peers' pieces from:
//   staged         through shared-memory slots, window by window
//                  (GatherScatterPlan): every rank first copies what its peers
//                  read into its slot; one barrier per window.
//   single_copy    one window over the whole block, read in place from the
//                  peers' private memory through the kernel (process_vm_readv:
//                  the machine's cross-process read path); a closing barrier
//                  keeps inputs alive until every peer has read them.
//   in_place       one window over the whole block, read in place from memory
//                  every rank maps (the group's symmetric heap on a CPU host,
//                  peer-mapped memory on GPUs): nothing staged, no syscall;
//                  the same closing barrier.
// The last two are the direct form (every rank reads its slice from all
// peers); staged is the windowed one. On a machine with NCCL, NCCL's own
// candidates (nccl_model.h) are predicted next to them.
//
// Pure C++17, no torch or CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cost_model.h"
#include "gather_scatter_plan.h"
#include "schedule.h"

namespace xdev::plan {

enum class GatherScatterForm { kStaged, kSingleCopy, kInPlace };

const char* to_string(GatherScatterForm f);  // "staged", "single_copy", "in_place"

struct GatherScatterCandidate {
  GatherScatterForm form = GatherScatterForm::kStaged;
  // Staged: the bytes of one rank's staging slot (the window); 0 = the
  // machine's window_bytes, and unlimited where that is 0 too.
  int64_t window_bytes = 0;
  // Ring reference (all-gather or reduce-scatter half of NCCL's ring, on the
  // machine's rings): for comparison only, never chosen.
  bool ring_reference = false;
  // NCCL's own algorithm and protocol (nccl_model.h): the engine, not a form.
  bool nccl = false;
  NcclCandidate nccl_candidate;  // when nccl

  // "staged", "staged/64KiB", "single_copy", "ring (reference)", "nccl_ring/LL"
  std::string label() const;
};

struct GatherScatterPrediction {
  GatherScatterCandidate candidate;
  int64_t bytes = 0;  // the full tensor: all N blocks (nccl-tests' size)
  double seconds = 0;
  double algbw = 0;  // bytes / seconds
  double busbw = 0;  // algbw * (N - 1) / N
};

// The program a candidate runs for a full tensor of `bytes` (N blocks of
// bytes / N, rounded down to whole elements of elem_bytes). A reduce-scatter
// reduces elements of elem_bytes; an all-gather moves bytes, as the executor
// does. Throws std::invalid_argument for a single-copy candidate on a machine
// without a cross-process read path.
Program gather_scatter_program(const MachineModel& m, GatherScatterKind kind,
                               const GatherScatterCandidate& c, int64_t bytes, int64_t elem_bytes);

GatherScatterPrediction predict_gather_scatter(const MachineModel& m, GatherScatterKind kind,
                                               const GatherScatterCandidate& c, int64_t bytes,
                                               int64_t elem_bytes = 4);

// Which direct forms a call may take: single copy needs every rank to allow
// cross-process reads (and one tensor); in place needs every rank's tensor in
// memory all map. `nccl` adds NCCL's candidates where the machine has NCCL.
struct GatherScatterOptions {
  bool single_copy = false;
  bool in_place = false;
  bool nccl = false;
};

// What could run on this machine: staged (the machine's window), single copy
// where `opts` and the machine allow it, in place where `opts` does.
std::vector<GatherScatterCandidate> gather_scatter_candidates(const MachineModel& m,
                                                              const GatherScatterOptions& opts);

struct GatherScatterChoice {
  GatherScatterPrediction best;         // the fastest runnable candidate, NCCL's included
  GatherScatterPrediction best_native;  // the fastest of xdev's forms
  bool has_nccl = false;                // NCCL candidates were weighed
  GatherScatterPrediction best_nccl;    // the fastest of them, when has_nccl
  std::vector<GatherScatterPrediction> predictions;  // every one considered, ring reference last
};

// The fastest of gather_scatter_candidates(m, opts) and, with opts.nccl, of
// the machine's NCCL candidates for `bytes` (ties go to the earlier one, so
// to xdev's forms), and every prediction behind the choice.
GatherScatterChoice choose_gather_scatter(const MachineModel& m, GatherScatterKind kind,
                                          int64_t bytes, const GatherScatterOptions& opts,
                                          bool with_ring_reference = false, int64_t elem_bytes = 4);

}  // namespace xdev::plan
