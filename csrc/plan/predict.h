// Predicted allreduce times: every candidate plan run through a machine model,
// and the choice by predicted time that algorithm="auto" makes.
//
// Pure C++17, no torch or CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cost_model.h"
#include "schedule.h"

namespace xdev::plan {

// One way to run an allreduce: a native algorithm with its number of packs;
// NCCL with one of its algorithms and protocols (run by the engine, so
// `algorithm` is kFallback, and predicted by NCCL's own tuning model); or the
// ring reference (a ring on the machine's links simulated with xdev's own
// per-hop costs; never run).
struct Candidate {
  Algorithm algorithm = Algorithm::kFlat;
  int64_t num_packs = 0;  // the hierarchical plans only
  bool ring_reference = false;
  bool nccl = false;
  NcclCandidate nccl_candidate;  // when nccl

  // A native plan: Candidate::native(Algorithm::kFlat).
  static Candidate native(Algorithm algorithm, int64_t num_packs = 0) {
    Candidate c;
    c.algorithm = algorithm;
    c.num_packs = num_packs;
    return c;
  }

  // "hierarchical_copy/8", "flat", "nccl_ring/LL", "ring (reference)"
  std::string label() const;
};

struct Prediction {
  Candidate candidate;
  int64_t bytes = 0;
  double seconds = 0;
  double algbw = 0;  // bytes / seconds
  double busbw = 0;  // algbw * 2 (N - 1) / N, as nccl-tests reports it
};

// The program a candidate runs for `bytes` of elements `elem_bytes` wide:
// its windows (the machine's window_bytes), each window's schedule.
Program allreduce_program(const MachineModel& m, const Candidate& c, int64_t bytes,
                          int64_t elem_bytes);

Prediction predict_allreduce(const MachineModel& m, const Candidate& c, int64_t bytes,
                             int64_t elem_bytes = 4);

// The rings the ring reference runs on: find_rings over the machine's links,
// at most one per NCCL channel where NCCL runs.
std::vector<std::vector<int>> reference_rings(const MachineModel& m);

// The machine's NCCL candidates (nccl_model.h); none on machines without NCCL
// or with one device.
std::vector<Candidate> nccl_candidates(const MachineModel& m);

// What xdev could run on this machine: direct, reduce_to_one, flat, and for
// even device counts hierarchical_copy with N, 4N or 16N packs and
// hierarchical_balanced with N, 3N, 12N or 48N packs (where every rank has a
// direct link to its partner). Machines whose executor has a barrier per
// phase do not pipeline packs, so there only N packs are considered.
std::vector<Candidate> runnable_candidates(const MachineModel& m);

struct ModelChoice {
  Prediction best;                      // the fastest candidate, native or NCCL
  Prediction best_native;               // the fastest native one
  bool has_nccl = false;                // NCCL candidates were weighed
  Prediction best_nccl;                 // the fastest of them, when has_nccl
  std::vector<Prediction> predictions;  // native, then NCCL, then the ring reference
};

// The fastest candidate for `bytes` among runnable_candidates and, with
// `with_nccl`, the machine's NCCL candidates (ties go to the earlier one, so
// native before NCCL), and every prediction behind the choice. When
// `num_packs` >= 0 the hierarchical candidates are restricted to it.
ModelChoice choose_allreduce(const MachineModel& m, int64_t bytes, int64_t num_packs = -1,
                             bool with_ring_reference = false, bool with_nccl = true);

}  // namespace xdev::plan
