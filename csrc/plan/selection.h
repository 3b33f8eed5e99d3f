// Selection: which algorithm runs an allreduce, and why.
//
// The seeds' choose_the_best carried to one process per device: a DGX-1-like
// 8-GPU host gets the hierarchical plan with 8 packs; other single-host jobs
// get a native plan (for CPU tensors the one that measures fastest for the
// size); several hosts, unreachable peers, or an op/dtype without a native
// kernel go to the fallback engine. A forced algorithm is honoured or refused
// with a reason; it is never silently replaced.
#pragma once

#include <cstdint>
#include <string>

#include "cost_model.h"
#include "schedule.h"
#include "topology.h"

namespace xdev::plan {

enum class DeviceKind { kCpu, kCuda };

const char* to_string(DeviceKind d);

// CPU allreduce by size (auto) when no machine model is given. With a model
// (the backend always gives one) the choice is the plan the model predicts
// fastest. The size rule, measured on a 2-core machine with 2, 4 and 8 ranks:
//   payload x ranks <= kCpuDirectMaxBytesTimesRanks: direct (one barrier);
//   payload < kCpuReduceToOneMaxBytes: reduce-to-one (only the root works, so
//     ranks that outnumber the cores mostly sleep);
//   otherwise: flat (each rank reduces 1/N of every window).
constexpr int64_t kCpuDirectMaxBytesTimesRanks = 64 * 1024;
constexpr int64_t kCpuReduceToOneMaxBytes = 128 * 1024;

// CPU allreduces of at least this many bytes, of one contiguous tensor, run
// single-copy (peers read each other's tensors in place) when the host
// allows it; smaller ones are staged, where fewer barriers win.
constexpr int64_t kCpuSingleCopyMinBytes = 256 * 1024;

// Whether a native CPU allreduce should run on the single-copy transport.
bool use_single_copy(Algorithm algorithm, int64_t payload_bytes, bool single_buffer,
                     bool available);

struct SelectionInput {
  Algorithm requested = Algorithm::kAuto;
  int world_size = 1;
  int num_hosts = 1;
  DeviceKind device = DeviceKind::kCpu;
  TopologyClass topology = TopologyClass::kFullyConnected;
  bool transport_available = true;  // a native transport exists for this device
  bool op_supported = true;         // the reduce op and dtype have native kernels
  int64_t payload_bytes = 0;
  int64_t num_packs = -1;  // -1: not set by the user
  // For algorithm="auto" on one host: choose by predicted time on this model
  // (its device count must be world_size). Null: the size rule above.
  const MachineModel* model = nullptr;
};

struct Selection {
  Algorithm algorithm = Algorithm::kFallback;
  int64_t num_packs = 0;  // hierarchical plans only; 0 = one pack per tensor
  std::string reason;
  double predicted_s = 0;  // by the model, when it chose; else 0
};

// Throws std::invalid_argument when a forced algorithm cannot run on this job
// (odd world size for hierarchical copy, several hosts for a native plan).
void check_forced_algorithm(Algorithm requested, int world_size, int num_hosts);

Selection select_allreduce(const SelectionInput& in);

}  // namespace xdev::plan
