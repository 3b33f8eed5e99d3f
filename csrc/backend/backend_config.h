// Resolved options of one xdev group, as torch_xdev.Options (with XDEV_*
// overrides applied and validated in Python) hands them to C++.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace xdev::backend {

struct BackendConfig {
  std::string algorithm = "auto";
  int64_t num_packs = -1;  // -1: the algorithm's default (N packs for hierarchical copy)
  int64_t agg_small_grads_max_bytes = 0;
  int64_t agg_small_grads_max_group = 0;
  int64_t bytes_per_pack = 0;
  int64_t reduce_to_rank = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  int64_t shm_slot_bytes = 256 << 10;  // per rank and slot set; see README "Performance"
  bool single_copy = false;            // let peers read tensors in place (opt-in)
  int64_t cuda_slot_bytes = 32 << 20;  // per rank and slot set, in GPU memory (x2 per rank)
  // XDEV_TOPO_FILE: an injected GPU link matrix, rows = local ranks (empty: detect).
  std::string topo_file;
  std::vector<std::vector<int64_t>> topo_nvlink;
  std::vector<std::vector<int64_t>> topo_reachable;  // optional; empty: where nvlink > 0
  std::string hostname;                              // this rank's host identity
  std::string group_name;
  bool debug = false;

  // The cost model of this host's shared-memory path that algorithm="auto"
  // chooses by (plan::cpu_host). Defaults: fitted on the 2-core development
  // machine by benchmarks/calibrate.py (docs/calibration.md), where memory, not
  // a core, is the bottleneck; XDEV_CPU_MODEL names a file it wrote.
  double cpu_core_gbps = 2000.0;
  double cpu_memory_gbps = 27.5;
  double cpu_launch_us = 59.0;
  double cpu_barrier_us = 0.01;
  double cpu_step_us = 0.0;
  double cpu_sleeping_barrier_us = 8.6;
};

}  // namespace xdev::backend
