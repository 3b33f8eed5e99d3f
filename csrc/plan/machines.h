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

// Defaults: fitted on the 2-core development machine (docs/calibration.md).
struct CpuHostParams {
  int cores = 2;
  double core_bytes_per_s = 2000e9;    // one core's copy / reduce throughput
  double memory_bytes_per_s = 27.5e9;  // the whole host's memory bandwidth
  double launch_latency_s = 59e-6;     // per collective call; * (ranks / cores)^2 above one
  double barrier_latency_s =
      0.01e-6;  // one barrier of all ranks, each on a core of its own (spins)
  // One barrier with more ranks than cores, where it sleeps (futex), at ranks == cores; it
  // grows with (ranks / cores)^2 (docs/calibration.md).
  double sleeping_barrier_latency_s = 8.6e-6;
  double step_latency_s = 0;          // to start one step (loop and call overhead)
  int64_t window_bytes = 256 * 1024;  // staging slot per rank
};

// `ranks` processes of one host exchanging through shared memory with the
// staged executor: phases separated by barriers, every byte moved by the
// reading rank's core, all cores sharing the host's memory bandwidth. With
// more ranks than cores, the cores' time is shared.
MachineModel cpu_host(int ranks, const CpuHostParams& params);

// Names the CLI accepts: "dgx1-p100", "dgx1-v100", "pcie-8gpu", "cpu-<N>"
// (N ranks, default CPU parameters). Throws std::invalid_argument listing them.
MachineModel builtin_machine(const std::string& name);
std::vector<std::string> builtin_machine_names();

}  // namespace xdev::plan
