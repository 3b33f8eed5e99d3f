// Resolved options of one xdev group, as torch_xdev.Options (with XDEV_*
// overrides applied and validated in Python) hands them to C++.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

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
  std::string hostname;                // this rank's host identity
  std::string group_name;
  bool debug = false;
};

}  // namespace xdev::backend
