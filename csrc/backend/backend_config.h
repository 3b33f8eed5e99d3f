// Settings of one xdev group, as torch_xdev hands them to C++.
//
// Each setting is declared once, in one of the two lists below. The struct's members, the
// Python class torch_xdev._C.BackendConfig (config_bindings.cc), the option keys of describe()
// and the check of the type stub (tests/test_option_declarations.py) are generated from them.
//
// XDEV_OPTION_FIELDS: the user options. Each is also a field of torch_xdev.Options (options.py),
// which parses its XDEV_* variable and checks its value, and copies every field here. The test
// fails when one side declares an option the other lacks, or a different default.
//   X(type, name, default, doc, describe_key): describe_key is the option's key in describe(),
//   or "" where describe() reports what the option resulted in instead (e.g. whether single
//   copy is available) or reports it in a sub-dict (cuda_slot_bytes, under "cuda").
//
// XDEV_INTERNAL_FIELDS: set by torch_xdev._registration from the host and the environment.
//   X(type, name, default, doc)
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "../plan/machines.h"
#include "../plan/two_level.h"

// clang-format off
#define XDEV_OPTION_FIELDS(X)                                                                    \
  X(std::string, algorithm, "auto", "allreduce algorithm, or \"auto\" to choose per call",       \
    "algorithm")                                                                                 \
  X(int64_t, num_packs, -1, "packs for concat-and-split; -1: the algorithm's choice, 0: off",    \
    "num_packs")                                                                                 \
  X(int64_t, agg_small_grads_max_bytes, 0, "small-tensor aggregation: largest tensor grouped",   \
    "agg_small_grads_max_bytes")                                                                 \
  X(int64_t, agg_small_grads_max_group, 0, "small-tensor aggregation: most tensors per group",   \
    "agg_small_grads_max_group")                                                                 \
  X(int64_t, bytes_per_pack, 0, "cut the payload into packs of this many bytes (0: off)",        \
    "bytes_per_pack")                                                                            \
  X(int64_t, reduce_to_rank, 0, "the root of reduce_to_one", "reduce_to_rank")                   \
  X(std::chrono::milliseconds, timeout, std::chrono::minutes(30), "per-collective timeout",      \
    "timeout_s")                                                                                 \
  X(int64_t, shm_slot_bytes, int64_t{256} << 10,                                                 \
    "staging bytes per rank and slot set; larger payloads run in windows", "shm_slot_bytes")     \
  X(int64_t, cuda_slot_bytes, int64_t{32} << 20,                                                 \
    "GPU staging bytes per rank and slot set (two sets per rank)", "")                           \
  X(bool, cuda_host_check, true,                                                                 \
    "check each CUDA collective against the peers' on the host before its kernels are queued",   \
    "")                                                                                          \
  X(bool, single_copy, false, "let peers read large tensors in place (process_vm_readv)", "")    \
  X(bool, shared_buckets, true, "give DDP its gradient buckets in memory every rank maps", "")   \
  X(int64_t, two_level_pieces, 0,                                                                \
    "pipeline a two-level allreduce in this many pieces; 0: the model's choice",                 \
    "two_level_pieces")                                                                          \
  X(bool, debug, false, "log the chosen plans to stderr", "")

#define XDEV_INTERNAL_FIELDS(X)                                                                  \
  X(std::string, hostname, "", "this rank's host identity (XDEV_HOSTNAME)")                      \
  X(std::string, group_name, "", "the group's name")                                             \
  X(std::vector<int64_t>, global_ranks, {},                                                      \
    "the group's members as global ranks, by group rank (empty: the default group)")             \
  X(bool, algorithm_from_environment, false,                                                     \
    "algorithm came from XDEV_ALGO: a group that algorithm cannot run on uses auto")             \
  X(bool, reduce_to_rank_from_environment, false,                                                \
    "reduce_to_rank came from XDEV_REDUCE_TO_RANK: a group without that rank uses rank 0")       \
  X(std::string, topo_file, "", "XDEV_TOPO_FILE: an injected GPU link matrix (empty: detect)")   \
  X(std::vector<std::vector<int64_t>>, topo_nvlink, {}, "NVLinks per pair of local ranks")       \
  X(std::vector<std::vector<int64_t>>, topo_reachable, {},                                       \
    "peer access per pair of local ranks; empty: where nvlink > 0")                              \
  X(std::vector<int64_t>, topo_nvswitch, {}, "NVLinks to NVSwitches per local rank")            \
  X(double, cpu_core_gbps, xdev::plan::cpu_fit::kCoreGbps, "CPU cost model: one core, GB/s")     \
  X(double, cpu_memory_gbps, xdev::plan::cpu_fit::kMemoryGbps, "CPU cost model: memory, GB/s")   \
  X(double, cpu_launch_us, xdev::plan::cpu_fit::kLaunchUs, "CPU cost model: per call, us")       \
  X(double, cpu_barrier_us, xdev::plan::cpu_fit::kBarrierUs, "CPU cost model: barrier, us")      \
  X(double, cpu_step_us, xdev::plan::cpu_fit::kStepUs, "CPU cost model: per step, us")           \
  X(double, cpu_sleeping_barrier_us, xdev::plan::cpu_fit::kSleepingBarrierUs,                    \
    "CPU cost model: barrier with more ranks than cores, us")                                   \
  X(double, net_host_gbps, xdev::plan::network_default::kHostGbps,                               \
    "network model: one host's link, GB/s")                                                      \
  X(double, net_stream_gbps, xdev::plan::network_default::kStreamGbps,                           \
    "network model: one TCP stream, GB/s")                                                       \
  X(double, net_latency_us, xdev::plan::network_default::kLatencyUs,                             \
    "network model: one message between hosts, us")                                              \
  X(double, net_host_cores, 0,                                                                   \
    "network model: one host's cores for its streams; 0: its share of this machine's")
// clang-format on

namespace xdev::backend {

// The cpu_* fields are the cost model of this host's shared-memory path that algorithm="auto"
// chooses by (plan::cpu_host); XDEV_CPU_MODEL names a file of benchmarks/calibrate.py's that
// replaces them.
struct BackendConfig {
#define XDEV_DECLARE_FIELD(type, name, default_value, ...) type name = default_value;
  XDEV_OPTION_FIELDS(XDEV_DECLARE_FIELD)
  XDEV_INTERNAL_FIELDS(XDEV_DECLARE_FIELD)
#undef XDEV_DECLARE_FIELD
};

// The smallest staging slot, in host and in GPU memory, and the alignment of a GPU slot.
inline constexpr int64_t kMinSlotBytes = 4096;
inline constexpr int64_t kCudaSlotAlignment = 256;
// The largest: each rank maps two slot sets of every rank, so a larger slot
// only costs memory, and sizes near 2^63 would overflow the segment's size.
inline constexpr int64_t kMaxSlotBytes = int64_t{1} << 30;
// The most pieces two_level_pieces may force (auto tries up to 16): each is an
// engine call of its own.
inline constexpr int64_t kMaxForcedTwoLevelPieces = 1024;

// The settings a rank picks its plans by, one "name=value" each: the options
// but the timeout and debug, and the cost model's cpu_* and net_* fields.
// Ranks whose settings differ could choose different paths for one call (two
// levels on one host, Gloo on another) and wait for each other until the
// timeout, so a group refuses to start unless every rank has the same
// (GroupContext).
std::vector<std::string> plan_settings(const BackendConfig& config);

// Throws std::invalid_argument naming the first setting out of range. Settings whose range
// depends on the group (reduce_to_rank, an algorithm that needs an even world) are checked
// where the group is known.
void validate(const BackendConfig& config);

// The cost models algorithm="auto" weighs plans with: this host's
// shared-memory path for `ranks` ranks on a machine of `cores` cores (the
// cpu_* settings), and the network between hosts (the net_* settings; its
// host cores, where net_host_cores does not set them, `cores`). Every rank
// passes the same cores (GroupContext), so all pick the same plans.
plan::MachineModel cpu_host_model(const BackendConfig& config, int ranks, int cores);
plan::NetworkParams network_model(const BackendConfig& config, int cores);

}  // namespace xdev::backend
