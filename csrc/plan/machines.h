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
  // How the executor runs a schedule. false: a data-flow pipeline in which a
  // pack's next phase starts as soon as its data is there (what the wiring
  // allows; the DGX-1 models). true: xdev's CUDA executor as it is: a barrier
  // of every rank (one flag hand-off, step_latency_s) between phases, and
  // windows of window_bytes (its cuda_slot_bytes), so packs do not pipeline.
  bool barrier_per_phase = false;
  int64_t window_bytes = 0;
};

// GPUs joined by `links` (NVLink counts per pair) and, where `nvswitch_links`
// is given (one entry per GPU: its NVLinks to the host's NVSwitches, 0 for
// none), by NVSwitches. A switch is a non-blocking crossbar: what limits a
// transfer through it is the sender's and the receiver's ports (their link
// count times the per-link rate), so a pair without a direct NVLink whose GPUs
// both reach a switch routes over [sender's port out, receiver's port in].
// Remaining pairs go through each GPU's PCIe lane. Runs as a data-flow
// pipeline (no barriers). Throws std::invalid_argument when nvswitch_links is
// neither empty nor one entry per GPU, or has a negative entry.
MachineModel gpu_host(std::string name, const LinkMatrix& links, const GpuHostParams& params,
                      const std::vector<int>& nvswitch_links = {});

// DGX-1 with P100 (NVLink 1: 4 links of 20 GB/s per direction, one to each
// cube-mesh neighbour) and with V100 (NVLink 2: 6 links of 25 GB/s, four
// pairs per GPU, two of them doubled).
MachineModel dgx1_p100();
MachineModel dgx1_v100();
LinkMatrix dgx1_v100_links();

// 8 GPUs with no NVLink, as in most PCIe servers: two CPU sockets, each with
// two PCIe Gen4 switches of two GPUs. Peers under one switch exchange through
// it; peers of one socket through the switches' uplinks to the CPU's root
// complex; peers of different sockets also cross the inter-socket link.
MachineModel pcie_8gpu();

// HGX / DGX H100: 8 GPUs, each with 18 NVLink 4 links to the NVSwitches.
MachineModel hgx_h100();
// HGX / DGX A100: 8 GPUs, each with 12 NVLink 3 links to the NVSwitches.
MachineModel hgx_a100();
// Two A100 PCIe cards joined by NVLink bridges (12 NVLink 3 links).
MachineModel nvlink_2gpu();
// HGX A100 4-GPU: every pair of the 4 GPUs joined by 4 NVLink 3 links.
MachineModel nvlink_4gpu();

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

// `ranks` processes sharing ONE GPU (tests, single-GPU boxes; with MPS their
// kernels run at once). Every byte goes through the GPU's one memory resource
// (params.memory_bytes_per_s), shared by all ranks: a step's local reads and
// writes and its reads of a peer's buffer (CUDA IPC into the same device
// memory) alike. So a reduce or copy of b bytes from k sources moves k * b of
// reads plus b of writes there (2 * b where it writes both slot and output),
// and a staging copy 2 * b (read the input, write the slot).
// Every pair is directly reachable, so every plan can run. Latencies and
// windows as in gpu_host (barrier_per_phase: xdev's CUDA executor); the
// NVLink and PCIe fields are unused. No NCCL (it refuses ranks sharing a GPU).
// Throws std::invalid_argument for ranks < 1. Fitted to measurements by
// benchmarks/calibrate_gpu.py.
MachineModel shared_gpu_host(int ranks, const GpuHostParams& params);

// xdev's CUDA staging slot per rank (Options.cuda_slot_bytes' default).
inline constexpr int64_t kCudaWindowBytes = 32 << 20;

// The machine model of a job's GPUs as the backend detects them: one device
// per rank, joined by `nvlink` (direct NVLink counts) and `nvswitch_links` (per
// GPU, links to NVSwitches; may be empty), of compute capability
// `compute_capability` (major x 10 + minor). Link and memory rates, xdev's
// kernel latencies and what NCCL would find (NcclHost) follow the GPU
// generation as for the built-in machines; pairs without NVLink cross PCIe
// Gen3 x16. The executor is xdev's CUDA executor (barrier_per_phase) with
// windows of `window_bytes`. `name` names it in reasons and logs.
MachineModel detected_gpu_host(std::string name, const LinkMatrix& nvlink,
                               const std::vector<int>& nvswitch_links, int compute_capability,
                               int64_t window_bytes = kCudaWindowBytes);

// What NCCL's topology search would find on GPUs joined so (NcclHost): its
// rings and trees take every NVLink of the least-linked GPU at NCCL's per-link
// figure for the generation, a channel per link (16 on NVSwitch hosts, with
// NVLS on Hopper); without NVLinks, PCIe at `pcie_bytes_per_s`.
NcclHost nccl_host_for(const LinkMatrix& nvlink, const std::vector<int>& nvswitch_links,
                       int compute_capability, double pcie_bytes_per_s = 12e9);

// Names the CLI accepts: "dgx1-p100", "dgx1-v100", "hgx-h100", "hgx-a100",
// "nvlink-2gpu", "nvlink-4gpu", "pcie-8gpu", "cpu-<N>" (N ranks, default CPU
// parameters). Throws std::invalid_argument listing them.
MachineModel builtin_machine(const std::string& name);
std::vector<std::string> builtin_machine_names();

}  // namespace xdev::plan
