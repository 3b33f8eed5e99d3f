#include "machines.h"

#include <algorithm>
#include <stdexcept>

namespace xdev::plan {

MachineModel gpu_host(std::string name, const LinkMatrix& links, const GpuHostParams& params) {
  const int n = links.size();
  MachineModel m(std::move(name), n);
  m.links = links;
  m.launch_latency_s = params.launch_latency_s;
  m.step_latency_s = params.step_latency_s;
  m.policy = SharingPolicy::kOldestFirst;
  std::vector<int> pcie_out(static_cast<size_t>(n)), pcie_in(static_cast<size_t>(n));
  for (int d = 0; d < n; ++d) {
    const std::string gpu = "gpu" + std::to_string(d);
    m.set_local(d, {m.add_resource(gpu + " memory", params.memory_bytes_per_s)});
    pcie_out[static_cast<size_t>(d)] = m.add_resource(gpu + " pcie out", params.pcie_bytes_per_s);
    pcie_in[static_cast<size_t>(d)] = m.add_resource(gpu + " pcie in", params.pcie_bytes_per_s);
  }
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      const int count = links.links(a, b);
      if (count > 0) {
        const int id = m.add_resource(
            "nvlink " + std::to_string(a) + "->" + std::to_string(b) + " x" + std::to_string(count),
            count * params.nvlink_bytes_per_s);
        m.set_route(a, b, {id}, params.nvlink_latency_s);
      } else {
        m.set_route(a, b, {pcie_out[static_cast<size_t>(a)], pcie_in[static_cast<size_t>(b)]},
                    params.pcie_latency_s);
      }
    }
  }
  return m;
}

// Sources for the numbers below (docs/cost_model.md has the quotes):
//  - NVLink counts of the DGX-1 with V100: `nvidia-smi topo -m` on a DGX-1V
//    (reproduced in PyTorch's benchmarks/distributed/ddp/README.md; the same
//    matrix appears in NCCL issue #671's DGX-1V topology file, count="2" for
//    GPU0's links to GPU3 and GPU4). The DGX-1 system architecture
//    whitepaper: "Each Tesla V100 GPU has six NVLink connection points, each
//    providing a point-to-point connection to another GPU at a peak bandwidth
//    of 25 GB/s in each direction".
//  - P100: four NVLink 1 links per GPU, 20 GB/s per direction each (80 GB/s
//    per GPU); on the cube-mesh each GPU has four neighbours, one link each.
//  - HBM2: P100 SXM2 732 GB/s, V100 SXM2 900 GB/s (the Tesla whitepapers).
//  - PCIe Gen3 x16: 15.75 GB/s raw, about 12 GB/s measured per direction;
//    NCCL models it as 12 (PCI_WIDTH in src/graph/topo.h).
//  - Latencies: NCCL's own tuning model (src/graph/tuning.cc, v2.7.8): a
//    Simple-protocol collective starts at 8.4 us (baseLat) and every NVLink
//    hop of a fenced flag hand-off costs 3.4 us (hwLat); PCIe 5.7 us. Our
//    GPU steps are that kind of hand-off, so they are charged the same.
MachineModel dgx1_p100() {
  GpuHostParams p;
  p.nvlink_bytes_per_s = 20e9;
  p.memory_bytes_per_s = 732e9;
  MachineModel m = gpu_host("dgx1-p100", LinkMatrix::dgx1(), p);
  m.source = "DGX-1 (P100): NVLink 1, one 20 GB/s link per direction to each of 4 neighbours";
  return m;
}

LinkMatrix dgx1_v100_links() {
  LinkMatrix links = LinkMatrix::dgx1();
  // Doubled pairs of nvidia-smi topo -m on a DGX-1V (NV2); the rest are NV1.
  for (auto [a, b] : {std::pair{0, 3}, {0, 4}, {1, 2}, {1, 5}, {2, 3}, {4, 7}, {5, 6}, {6, 7}}) {
    links.set_links(a, b, 2);
  }
  return links;
}

MachineModel dgx1_v100() {
  GpuHostParams p;
  p.nvlink_bytes_per_s = 25e9;
  p.memory_bytes_per_s = 900e9;
  MachineModel m = gpu_host("dgx1-v100", dgx1_v100_links(), p);
  m.source = "DGX-1 (V100): NVLink 2, six 25 GB/s links per direction, 4 neighbours, 2 doubled";
  return m;
}

MachineModel pcie_8gpu() {
  GpuHostParams p;
  p.memory_bytes_per_s = 900e9;
  p.step_latency_s = 5.7e-6;  // NCCL's PCI hwLat for the Simple protocol
  MachineModel m = gpu_host("pcie-8gpu", LinkMatrix(8), p);
  m.source = "8 GPUs on PCIe Gen3 x16 (12 GB/s per direction), no NVLink";
  return m;
}

MachineModel cpu_host(int ranks, const CpuHostParams& params) {
  if (ranks < 1) throw std::invalid_argument("cpu_host: needs at least one rank");
  if (params.cores < 1) throw std::invalid_argument("cpu_host: needs at least one core");
  MachineModel m("cpu-" + std::to_string(ranks), ranks);
  m.links = LinkMatrix::fully_connected(ranks);
  // More ranks than cores: the executor's barrier sleeps in the kernel instead of spinning
  // (GroupContext::choose_spin_budgets gives it no spin) and every rank's per-call and
  // per-barrier work is time-shared with the others on its core. Measured on 2 cores
  // (docs/calibration.md), both costs grow about with the square of the oversubscription.
  const double over = std::max(1.0, static_cast<double>(ranks) / params.cores);
  m.launch_latency_s = params.launch_latency_s * over * over;
  m.barrier_between_phases = true;
  m.barrier_latency_s = ranks > params.cores ? params.sleeping_barrier_latency_s * over * over
                                             : params.barrier_latency_s;
  m.step_latency_s = params.step_latency_s;
  m.policy = SharingPolicy::kFairShare;
  m.window_bytes = params.window_bytes;
  m.forwards_own_input = true;
  // A rank's core copies what it reads; with more ranks than cores each gets
  // its share of the cores' time.
  const double share = std::min(1.0, static_cast<double>(params.cores) / ranks);
  const int memory = m.add_resource("host memory", params.memory_bytes_per_s);
  std::vector<int> core(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    core[static_cast<size_t>(r)] =
        m.add_resource("rank" + std::to_string(r) + " core", params.core_bytes_per_s * share);
    m.set_local(r, {core[static_cast<size_t>(r)], memory});
    m.set_cross_process_read(r, m.add_resource("rank" + std::to_string(r) + " cross-process copy",
                                               params.cross_process_bytes_per_s * share));
  }
  m.cross_process_call_s = params.cross_process_call_s;
  for (int a = 0; a < ranks; ++a) {
    for (int b = 0; b < ranks; ++b) {
      if (a != b) m.set_route(a, b, {core[static_cast<size_t>(b)], memory}, 0.0);
    }
  }
  m.source = "one host, " + std::to_string(ranks) + " ranks on " + std::to_string(params.cores) +
             " cores, staged shared-memory executor";
  return m;
}

std::vector<std::string> builtin_machine_names() {
  return {"dgx1-p100", "dgx1-v100", "pcie-8gpu", "cpu-<N>"};
}

MachineModel builtin_machine(const std::string& name) {
  if (name == "dgx1-p100") return dgx1_p100();
  if (name == "dgx1-v100") return dgx1_v100();
  if (name == "pcie-8gpu") return pcie_8gpu();
  if (name.rfind("cpu-", 0) == 0) {
    const std::string digits = name.substr(4);
    if (!digits.empty() && digits.size() < 4 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      const int ranks = std::stoi(digits);
      if (ranks >= 1) return cpu_host(ranks, CpuHostParams{});
    }
  }
  throw std::invalid_argument("unknown machine '" + name +
                              "'; built in: dgx1-p100, dgx1-v100, pcie-8gpu, cpu-<N>");
}

}  // namespace xdev::plan
