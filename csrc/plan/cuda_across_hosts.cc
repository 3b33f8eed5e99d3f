#include "cuda_across_hosts.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace xdev::plan {

NcclHost across_hosts_nccl_host(const NcclHost& host, int ranks_per_host) {
  NcclHost g = host;
  g.channels = std::max(1, host.channels / std::max(1, ranks_per_host));
  g.nvls_channels = 0;
  g.nvls_channel_gbps = 0;
  return g;
}

NcclNetwork across_hosts_nccl_network(const NcclNetwork& net, int ranks_per_host) {
  NcclNetwork g = net;
  g.nic_gbps = net.nic_gbps / std::max(1, ranks_per_host);
  return g;
}

CudaAcrossHostsPrediction predict_cuda_across_hosts(const MachineModel& host,
                                                    const NcclNetwork& net, int64_t bytes) {
  const int h = net.nodes, l = host.num_devices();
  if (h < 2) throw std::invalid_argument("predict_cuda_across_hosts: needs at least two hosts");
  if (l < 2 || !host.nccl.present) {
    throw std::invalid_argument(
        "predict_cuda_across_hosts: each host needs at least two GPUs and NCCL");
  }
  if (bytes < 0) throw std::invalid_argument("predict_cuda_across_hosts: bytes must be >= 0");
  CudaAcrossHostsPrediction p;
  p.hosts = h;
  p.ranks_per_host = l;
  p.nccl = best_nccl_allreduce(host.nccl, h * l, bytes, net);

  // What xdev runs on CUDA tensors inside a host today: staged through its
  // IPC slots, or NCCL's own reduce-scatter and all-gather.
  GatherScatterOptions inside;
  inside.nccl = true;
  p.reduce_scatter =
      choose_gather_scatter(host, GatherScatterKind::kReduceScatter, bytes, inside).best;
  p.all_gather = choose_gather_scatter(host, GatherScatterKind::kAllGather, bytes, inside).best;
  p.across = best_nccl_allreduce(across_hosts_nccl_host(host.nccl, l), h, bytes / l,
                                 across_hosts_nccl_network(net, l));
  p.two_level_s = p.reduce_scatter.seconds + p.across.seconds + p.all_gather.seconds;
  p.two_level_faster = p.two_level_s < p.nccl.seconds;

  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%d hosts x %d GPUs: NCCL over all ranks (%s) predicted %.1f us; two levels "
                "%.1f us (inside: %s reduce-scatter %.1f us, all-gather %s %.1f us; across: %s "
                "among %d ranks %.1f us)",
                h, l, p.nccl.candidate.label().c_str(), p.nccl.seconds * 1e6, p.two_level_s * 1e6,
                p.reduce_scatter.candidate.label().c_str(), p.reduce_scatter.seconds * 1e6,
                p.all_gather.candidate.label().c_str(), p.all_gather.seconds * 1e6,
                p.across.candidate.label().c_str(), h, p.across.seconds * 1e6);
  p.reason = buf;
  return p;
}

}  // namespace xdev::plan
