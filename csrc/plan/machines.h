// Built-in machine models for the cost model, and the parameters they are made of.
//
// The numbers are public figures, cited where they are defined (machines.cc).
// They describe ideal hardware; what they predict is the shape of each
// schedule's cost on that wiring, not a measured time.
#pragma once

#include <string>
#include <vector>

#include "cost_model.h"
#include "topology.h"

namespace xdev::plan {

struct GpuHostParams {
  double nvlink_bytes_per_s = 25e9;  // per link and direction
  double nvlink_latency_s = 0;       // added to each step that reads over NVLink
  double pcie_bytes_per_s = 12e9;    // per GPU and direction, where there is no NVLink
  double pcie_latency_s = 0;
  double memory_bytes_per_s = 900e9;  // device memory (reductions, staging copies)
  double launch_latency_s = 8.4e-6;   // once per collective
  double step_latency_s = 3.4e-6;     // one fenced flag hand-off between GPUs
};

// GPUs joined by `links` (NVLink counts per pair); pairs without NVLink go
// through each GPU's PCIe lane. Runs as a data-flow pipeline (no barriers).
MachineModel gpu_host(std::string name, const LinkMatrix& links, const GpuHostParams& params);

// DGX-1 with P100 (NVLink 1: 4 links of 20 GB/s per direction, one to each
// cube-mesh neighbour) and with V100 (NVLink 2: 6 links of 25 GB/s, four
// pairs per GPU, two of them doubled).
MachineModel dgx1_p100();
MachineModel dgx1_v100();
LinkMatrix dgx1_v100_links();

// 8 GPUs with no NVLink: every transfer crosses PCIe Gen3 x16.
MachineModel pcie_8gpu();

// The CPU host's parameters as benchmarks/calibrate.py fitted them on the 2-core development
// machine, where memory, not a core, is the bottleneck (docs/calibration.md), in the units of
// the file it writes. CpuHostParams and the backend's cpu_* settings (which XDEV_CPU_MODEL
// replaces) both start from these.
namespace cpu_fit {
inline constexpr double kCoreGbps = 2000.0;  // one core's copy / reduce throughput
inline constexpr double kMemoryGbps = 27.5;  // the whole host's memory bandwidth
inline constexpr double kLaunchUs = 59.0;    // per collective call; * (ranks / cores)^2 above one
inline constexpr double kBarrierUs = 0.01;   // one barrier of all ranks, each on its own core
inline constexpr double kStepUs = 0.0;       // to start one step (loop and call overhead)
// One barrier with more ranks than cores, where it sleeps (futex), at ranks == cores; it grows
// with (ranks / cores)^2.
inline constexpr double kSleepingBarrierUs = 8.6;
}  // namespace cpu_fit

struct CpuHostParams {
  int cores = 2;
  double core_bytes_per_s = cpu_fit::kCoreGbps * 1e9;
  double memory_bytes_per_s = cpu_fit::kMemoryGbps * 1e9;
  double launch_latency_s = cpu_fit::kLaunchUs * 1e-6;
  double barrier_latency_s = cpu_fit::kBarrierUs * 1e-6;  // spinning
  double sleeping_barrier_latency_s = cpu_fit::kSleepingBarrierUs * 1e-6;
  double step_latency_s = cpu_fit::kStepUs * 1e-6;
  int64_t window_bytes = 256 * 1024;  // staging slot per rank
  // Single copy: the kernel's cross-process copy (process_vm_readv) of one reader, and what
  // a step that reads peers that way costs to start. Not fitted by benchmarks/calibrate.py:
  // the rate is the one measured for the single-copy allreduce on the development machine
  // (README, single_copy); the start is what a 64 KiB single-copy all-gather took over a
  // staged one in benchmarks/gather_scatter.py --nproc 2 there (lending the buffer, finding
  // the peer's, the first calls, the second barrier on a busy host).
  double cross_process_bytes_per_s = 2.7e9;
  double cross_process_call_s = 40e-6;
};

// `ranks` processes of one host exchanging through shared memory with the
// staged executor: phases separated by barriers, every byte moved by the
// reading rank's core, all cores sharing the host's memory bandwidth. With
// more ranks than cores, the cores' time is shared. Each rank also has a
// cross-process read path (single copy).
MachineModel cpu_host(int ranks, const CpuHostParams& params);

// Names the CLI accepts: "dgx1-p100", "dgx1-v100", "pcie-8gpu", "cpu-<N>"
// (N ranks, default CPU parameters). Throws std::invalid_argument listing them.
MachineModel builtin_machine(const std::string& name);
std::vector<std::string> builtin_machine_names();

}  // namespace xdev::plan
