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

// One way to run an allreduce: a native algorithm with its number of packs,
// or the ring reference (NCCL's algorithm on the machine's NVLink rings,
// modelled with the same per-hop costs; never run by xdev).
struct Candidate {
  Algorithm algorithm = Algorithm::kFlat;
  int64_t num_packs = 0;  // the hierarchical plans only
  bool ring_reference = false;

  std::string label() const;  // "hierarchical_copy/8", "flat", "ring (reference)"
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

// What xdev could run on this machine: direct, reduce_to_one, flat, and for
// even device counts hierarchical_copy with N, 4N or 16N packs and
// hierarchical_balanced with N, 3N, 12N or 48N packs (where every rank has a
// direct link to its partner). Machines whose executor has a barrier per
// phase do not pipeline packs, so there only N packs are considered.
std::vector<Candidate> runnable_candidates(const MachineModel& m);

struct ModelChoice {
  Prediction best;                      // the fastest runnable candidate
  std::vector<Prediction> predictions;  // every candidate considered, ring reference last
};

// The fastest runnable candidate for `bytes` (ties go to the earlier one in
// runnable_candidates), and every prediction behind the choice. When
// `num_packs` >= 0 the hierarchical candidates are restricted to it.
ModelChoice choose_allreduce(const MachineModel& m, int64_t bytes, int64_t num_packs = -1,
                             bool with_ring_reference = false);

}  // namespace xdev::plan
