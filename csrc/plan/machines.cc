#include "machines.h"

#include <algorithm>
#include <stdexcept>

namespace xdev::plan {
namespace {

// What NCCL's topology search finds, per machine (NcclHost): its ring and
// tree graphs take every NVLink of a GPU, at NCCL's own per-link figure for
// the generation (SM60/70/80/90_NVLINK_BW in src/graph/topo.h: 18, 20, 20,
// 20.6 GB/s), split over one channel per link (16 channels on NVSwitch
// hosts); PCIe hosts are limited by their slowest hop. NVLS runs NCCL's
// default 16 channels of one link each (H100 only).
NcclHost nccl_view(int compute_capability, int channels, double channel_gbps, int nvls_channels = 0,
                   double nvls_channel_gbps = 0) {
  NcclHost h;
  h.present = true;
  h.compute_capability = compute_capability;
  h.channels = channels;
  h.channel_gbps = channel_gbps;
  h.nvls_channels = nvls_channels;
  h.nvls_channel_gbps = nvls_channel_gbps;
  return h;
}

// NCCL's per-link NVLink figure by GPU generation (src/graph/topo.h).
double nccl_link_gbps(int compute_capability) {
  return compute_capability >= 90 ? 20.6 : compute_capability >= 70 ? 20.0 : 18.0;
}

// The executor's latencies and windows, shared by every GPU host model.
void set_gpu_executor(MachineModel& m, const GpuHostParams& params) {
  m.launch_latency_s = params.launch_latency_s;
  m.step_latency_s = params.step_latency_s;
  m.policy = SharingPolicy::kOldestFirst;
  if (params.barrier_per_phase) {
    m.barrier_between_phases = true;
    m.barrier_latency_s = params.step_latency_s;  // the barrier is the flag hand-off
    m.step_latency_s = 0;
    m.window_bytes = params.window_bytes;
  }
}

}  // namespace

MachineModel gpu_host(std::string name, const LinkMatrix& links, const GpuHostParams& params,
                      const std::vector<int>& nvswitch_links) {
  const int n = links.size();
  if (!nvswitch_links.empty() && static_cast<int>(nvswitch_links.size()) != n) {
    throw std::invalid_argument("gpu_host: " + std::to_string(nvswitch_links.size()) +
                                " NVSwitch link counts for " + std::to_string(n) + " GPUs");
  }
  for (int count : nvswitch_links) {
    if (count < 0) throw std::invalid_argument("gpu_host: negative NVSwitch link count");
  }
  const auto switch_links = [&](int d) {
    return nvswitch_links.empty() ? 0 : nvswitch_links[static_cast<size_t>(d)];
  };
  MachineModel m(std::move(name), n);
  m.links = links;
  set_gpu_executor(m, params);
  std::vector<int> pcie_out(static_cast<size_t>(n)), pcie_in(static_cast<size_t>(n));
  std::vector<int> port_out(static_cast<size_t>(n), -1), port_in(static_cast<size_t>(n), -1);
  for (int d = 0; d < n; ++d) {
    const std::string gpu = "gpu" + std::to_string(d);
    m.set_local(d, {m.add_resource(gpu + " memory", params.memory_bytes_per_s)});
    pcie_out[static_cast<size_t>(d)] = m.add_resource(gpu + " pcie out", params.pcie_bytes_per_s);
    pcie_in[static_cast<size_t>(d)] = m.add_resource(gpu + " pcie in", params.pcie_bytes_per_s);
    if (switch_links(d) > 0) {
      const double rate = switch_links(d) * params.nvlink_bytes_per_s;
      port_out[static_cast<size_t>(d)] = m.add_resource(gpu + " nvswitch port out", rate);
      port_in[static_cast<size_t>(d)] = m.add_resource(gpu + " nvswitch port in", rate);
    }
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
      } else if (switch_links(a) > 0 && switch_links(b) > 0) {
        m.set_route(a, b, {port_out[static_cast<size_t>(a)], port_in[static_cast<size_t>(b)]},
                    params.nvlink_latency_s);
        // The plans ask the link matrix who reaches whom directly: through the switch, all do.
        m.links.set_links(a, b, std::min(switch_links(a), switch_links(b)));
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
  m.nccl = nccl_host_for(m.links, {}, 60);
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
  m.nccl = nccl_host_for(m.links, {}, 70);
  m.source = "DGX-1 (V100): NVLink 2, six 25 GB/s links per direction, 4 neighbours, 2 doubled";
  return m;
}

// Newer machines (docs/cost_model.md has the quotes):
//  - H100 SXM5: 18 NVLink 4 links, 900 GB/s per GPU in both directions, i.e.
//    25 GB/s raw per link and direction, all to the NVSwitches of the HGX board;
//    HBM3 3.35 TB/s (NVIDIA H100 datasheet). A100 SXM4: 12 NVLink 3 links,
//    600 GB/s per GPU in both directions; HBM2e 2.04 TB/s (A100 datasheet,
//    80 GB). The A100 PCIe NVLink bridge joins two cards with 600 GB/s both
//    ways (12 links); the HGX A100 4-GPU board joins every pair with 4 links.
//  - PCIe Gen4 x16: 32 GB/s raw per direction, about 24 GB/s measured; GPU
//    peer traffic across CPU sockets crosses the socket link, which NCCL models
//    at 10 GB/s for Skylake-class Intel CPUs (SKL_QPI_BW in src/graph/topo.h).
//  - Link rates: xdev's plans are charged what NCCL's model charges its own
//    (20.6 GB/s per NVLink 4 link, 20 per NVLink 3 link: NCCL's effective
//    figures, src/graph/topo.h), so that at sizes where both are bandwidth
//    bound neither side wins by a difference in assumed link efficiency.
//  - Latencies of xdev's own kernels on these GPUs are not calibrated yet (no
//    multi-GPU host has run xdev): 5 us to launch, 2 us per barrier (one
//    NVLink flag hand-off). With them the model's one-shot (`direct`: launch,
//    one barrier) takes 7 us and its two-shot (`flat`, two barriers) 12 us at
//    512 KiB on 8xH100; add the host's share of a call, which NCCL's model
//    leaves out too (nccl-tests measure 19 us at 128 B where it predicts 15),
//    and they meet what published kernels take there: vLLM's one-shot about
//    10 us at 512 B, PyTorch's symmetric-memory two-shot 15 us at 512 KiB.
//    benchmarks/calibrate_gpu.py fits them where ranks share one GPU
//    (docs/calibration.md); these hosts need runs of their own.
namespace {

GpuHostParams nvlink_kernel_params(double link_bytes_per_s, double memory_bytes_per_s) {
  GpuHostParams p;
  p.nvlink_bytes_per_s = link_bytes_per_s;
  p.memory_bytes_per_s = memory_bytes_per_s;
  p.launch_latency_s = 5e-6;
  p.step_latency_s = 2e-6;
  p.barrier_per_phase = true;
  p.window_bytes = kCudaWindowBytes;
  return p;
}

MachineModel nvswitch_host(std::string name, int links_per_gpu, double link_bytes_per_s,
                           double memory_bytes_per_s) {
  return gpu_host(std::move(name), LinkMatrix(8),
                  nvlink_kernel_params(link_bytes_per_s, memory_bytes_per_s),
                  std::vector<int>(8, links_per_gpu));
}

}  // namespace

MachineModel hgx_h100() {
  MachineModel m = nvswitch_host("hgx-h100", 18, 20.6e9, 3.35e12);
  m.nccl = nccl_host_for(LinkMatrix(8), std::vector<int>(8, 18), 90);
  m.source =
      "HGX/DGX H100: 8 GPUs, 18 NVLink 4 links each to the NVSwitches (450 GB/s raw per "
      "direction per GPU; charged NCCL's 20.6 GB/s per link), HBM3 3.35 TB/s";
  return m;
}

MachineModel hgx_a100() {
  MachineModel m = nvswitch_host("hgx-a100", 12, 20e9, 2.04e12);
  m.nccl = nccl_host_for(LinkMatrix(8), std::vector<int>(8, 12), 80);
  m.source =
      "HGX/DGX A100: 8 GPUs, 12 NVLink 3 links each to the NVSwitches (300 GB/s raw per "
      "direction per GPU; charged NCCL's 20 GB/s per link), HBM2e 2.04 TB/s";
  return m;
}

MachineModel nvlink_2gpu() {
  LinkMatrix links(2);
  links.set_links(0, 1, 12);
  MachineModel m = gpu_host("nvlink-2gpu", links, nvlink_kernel_params(20e9, 1.94e12));
  m.nccl = nccl_host_for(links, {}, 80);
  m.source =
      "2 A100 PCIe joined by NVLink bridges: 12 NVLink 3 links (300 GB/s raw per direction; "
      "charged NCCL's 20 GB/s per link)";
  return m;
}

MachineModel nvlink_4gpu() {
  LinkMatrix links(4);
  for (int a = 0; a < 4; ++a) {
    for (int b = a + 1; b < 4; ++b) links.set_links(a, b, 4);
  }
  MachineModel m = gpu_host("nvlink-4gpu", links, nvlink_kernel_params(20e9, 2.04e12));
  m.nccl = nccl_host_for(links, {}, 80);
  m.source =
      "HGX A100 4-GPU: every pair joined by 4 NVLink 3 links (100 GB/s raw per direction; charged "
      "20 GB/s per link)";
  return m;
}

NcclHost nccl_host_for(const LinkMatrix& nvlink, const std::vector<int>& nvswitch_links,
                       int compute_capability, double pcie_bytes_per_s) {
  const int cc = compute_capability;
  const double link_gbps = nccl_link_gbps(cc);
  // NCCL's rings take the least-linked GPU's links (direct and to switches), a channel per link.
  int links_per_gpu = 0;
  for (int d = 0; d < nvlink.size(); ++d) {
    int count = nvswitch_links.empty() ? 0 : nvswitch_links[static_cast<size_t>(d)];
    for (int e = 0; e < nvlink.size(); ++e) count += e == d ? 0 : nvlink.links(d, e);
    links_per_gpu = d == 0 ? count : std::min(links_per_gpu, count);
  }
  const bool switched =
      !nvswitch_links.empty() &&
      std::all_of(nvswitch_links.begin(), nvswitch_links.end(), [](int c) { return c > 0; });
  if (links_per_gpu == 0) {
    NcclHost h = nccl_view(cc, 2, pcie_bytes_per_s / 1e9);
    h.nvlink = false;
    return h;
  }
  const int channels = switched ? 16 : links_per_gpu;
  return nccl_view(cc, channels, links_per_gpu * link_gbps / channels,
                   switched && cc >= 90 ? 16 : 0, link_gbps);
}

MachineModel detected_gpu_host(std::string name, const LinkMatrix& nvlink,
                               const std::vector<int>& nvswitch_links, int compute_capability,
                               int64_t window_bytes) {
  const int cc = compute_capability;
  const double memory = cc >= 90 ? 3.35e12 : cc >= 80 ? 2.04e12 : cc >= 70 ? 900e9 : 732e9;
  GpuHostParams p =
      cc >= 80 ? nvlink_kernel_params(nccl_link_gbps(cc) * 1e9, memory) : GpuHostParams{};
  p.memory_bytes_per_s = memory;
  if (cc < 70) p.nvlink_bytes_per_s = 20e9;
  p.barrier_per_phase = true;
  p.window_bytes = window_bytes;
  MachineModel m = gpu_host(std::move(name), nvlink, p, nvswitch_links);
  m.nccl = nccl_host_for(nvlink, nvswitch_links, cc, p.pcie_bytes_per_s);
  m.source = "detected GPUs (compute capability " + std::to_string(cc) + ")";
  return m;
}

MachineModel shared_gpu_host(int ranks, const GpuHostParams& params) {
  if (ranks < 1) throw std::invalid_argument("shared_gpu_host: needs at least one rank");
  MachineModel m("shared-gpu-" + std::to_string(ranks), ranks);
  // CUDA IPC lets every rank map every other rank's buffers: all pairs are one hop.
  m.links = LinkMatrix::fully_connected(ranks);
  set_gpu_executor(m, params);
  // One HBM behind every byte: a rank's own reads and writes, and its reads of a peer's
  // buffer (the peer's memory is the same device memory).
  const int memory = m.add_resource("gpu memory", params.memory_bytes_per_s);
  for (int a = 0; a < ranks; ++a) {
    m.set_local(a, {memory});
    for (int b = 0; b < ranks; ++b) {
      if (a != b) m.set_route(a, b, {memory}, 0.0);
    }
  }
  // No NCCL candidates: NCCL refuses two ranks on one GPU (m.nccl stays absent).
  m.source = std::to_string(ranks) + " ranks sharing one GPU (MPS): one memory of " +
             std::to_string(params.memory_bytes_per_s / 1e9) + " GB/s for every byte";
  return m;
}

MachineModel pcie_8gpu() {
  constexpr int kGpus = 8, kGpusPerSwitch = 2, kSwitchesPerSocket = 2;
  constexpr double kPcie = 24e9;        // Gen4 x16, per direction, GPU lanes and uplinks alike
  constexpr double kSocketLink = 10e9;  // GPU peer traffic between sockets, per direction
  MachineModel m("pcie-8gpu", kGpus);
  m.links = LinkMatrix(kGpus);
  m.launch_latency_s = 8.4e-6;
  // xdev's CUDA executor: a barrier per phase, one PCIe flag hand-off (NCCL's PCI hwLat
  // for the Simple protocol), windows of its staging slot.
  m.barrier_between_phases = true;
  m.barrier_latency_s = 5.7e-6;
  m.window_bytes = kCudaWindowBytes;
  m.policy = SharingPolicy::kOldestFirst;
  const int switches = kGpus / kGpusPerSwitch;
  std::vector<int> up(switches), down(switches);
  for (int s = 0; s < switches; ++s) {
    up[static_cast<size_t>(s)] = m.add_resource("pcie switch" + std::to_string(s) + " up", kPcie);
    down[static_cast<size_t>(s)] =
        m.add_resource("pcie switch" + std::to_string(s) + " down", kPcie);
  }
  const int socket_link[2] = {m.add_resource("socket 0->1", kSocketLink),
                              m.add_resource("socket 1->0", kSocketLink)};
  std::vector<int> out(kGpus), in(kGpus);
  for (int d = 0; d < kGpus; ++d) {
    const std::string gpu = "gpu" + std::to_string(d);
    m.set_local(d, {m.add_resource(gpu + " memory", 1.94e12)});
    out[static_cast<size_t>(d)] = m.add_resource(gpu + " pcie out", kPcie);
    in[static_cast<size_t>(d)] = m.add_resource(gpu + " pcie in", kPcie);
  }
  for (int a = 0; a < kGpus; ++a) {
    for (int b = 0; b < kGpus; ++b) {
      if (a == b) continue;
      const int sa = a / kGpusPerSwitch, sb = b / kGpusPerSwitch;
      const int socket_a = sa / kSwitchesPerSocket, socket_b = sb / kSwitchesPerSocket;
      std::vector<int> route = {out[static_cast<size_t>(a)]};
      if (sa != sb) route.push_back(up[static_cast<size_t>(sa)]);
      if (socket_a != socket_b) route.push_back(socket_link[socket_a]);
      if (sa != sb) route.push_back(down[static_cast<size_t>(sb)]);
      route.push_back(in[static_cast<size_t>(b)]);
      m.set_route(a, b, route, 0.0);
    }
  }
  // NCCL's rings cross the socket link once each way: 2 channels at its rate.
  m.nccl = nccl_view(80, 2, kSocketLink / 1e9);
  m.nccl.nvlink = false;
  m.source =
      "8 A100 PCIe (HBM2e 1.94 TB/s) on PCIe Gen4 x16 (24 GB/s per direction): 2 sockets, "
      "2 switches of 2 GPUs each per socket, 10 GB/s between sockets; no NVLink";
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
  return {"dgx1-p100",   "dgx1-v100",   "hgx-h100",  "hgx-a100",
          "nvlink-2gpu", "nvlink-4gpu", "pcie-8gpu", "cpu-<N>"};
}

MachineModel builtin_machine(const std::string& name) {
  if (name == "dgx1-p100") return dgx1_p100();
  if (name == "dgx1-v100") return dgx1_v100();
  if (name == "pcie-8gpu") return pcie_8gpu();
  if (name == "hgx-h100") return hgx_h100();
  if (name == "hgx-a100") return hgx_a100();
  if (name == "nvlink-2gpu") return nvlink_2gpu();
  if (name == "nvlink-4gpu") return nvlink_4gpu();
  if (name.rfind("cpu-", 0) == 0) {
    const std::string digits = name.substr(4);
    if (!digits.empty() && digits.size() < 4 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      const int ranks = std::stoi(digits);
      if (ranks >= 1) return cpu_host(ranks, CpuHostParams{});
    }
  }
  throw std::invalid_argument("unknown machine '" + name + "'; built in: " + [] {
    std::string names;
    for (const std::string& n : builtin_machine_names()) names += (names.empty() ? "" : ", ") + n;
    return names + " (N ranks, 1 to 999)";
  }());
}

}  // namespace xdev::plan
