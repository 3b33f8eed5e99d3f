// Learns a group's GPUs through its Store: the first step of the CUDA path's
// rendezvous (cuda_collectives_impl.cc).
#include "cuda_gpu_exchange.h"

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../plan/machines.h"
#include "../../transport/cuda_ipc_channel.h"
#include "../../transport/nvml_links.h"

namespace xdev::backend {
namespace {

using transport::check_cuda;

// Per-rank counts as one Store value, "c0 c1 ...", and back (no iostreams: see
// docs/h100_results.md on the statically linked libstdc++).
std::string counts_to_text(const std::vector<int>& counts) {
  std::string text;
  for (int c : counts) text += (text.empty() ? "" : " ") + std::to_string(c);
  return text;
}

std::vector<int> counts_from_text(const std::string& text) {
  std::vector<int> counts;
  const char* p = text.c_str();
  char* end = nullptr;
  for (long v = std::strtol(p, &end, 10); end != p; v = std::strtol(p, &end, 10)) {
    counts.push_back(static_cast<int>(v));
    p = end;
  }
  return counts;
}

// Whether a CUDA MPS control daemon is there for this process's CUDA clients:
// its control pipe lies in CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps),
// where the CUDA runtime looks for it.
bool mps_daemon_visible() {
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string control =
      std::string(dir != nullptr && *dir ? dir : "/tmp/nvidia-mps") + "/control";
  struct stat st{};
  return ::stat(control.c_str(), &st) == 0;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

bool learn_gpus(GroupContext& group, const std::string& key, int device, CudaGroupInfo* out) {
  c10d::Store& store = group.store();
  const BackendConfig& config = group.config();
  const int rank = group.rank(), size = group.size();
  CudaGroupInfo& info = *out;
  char bus[64] = {};
  check_cuda(cudaDeviceGetPCIBusId(bus, sizeof bus, device), "cudaDeviceGetPCIBusId");
  store.set(key + "gpu/" + std::to_string(rank), config.hostname + "\n" + bus);
  std::vector<std::string> hosts;
  for (int r = 0; r < size; ++r) {
    const std::string v = store.get_to_str(key + "gpu/" + std::to_string(r));
    const size_t nl = v.find('\n');
    hosts.push_back(v.substr(0, nl));
    info.gpus.push_back(v.substr(nl + 1));
  }
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
             "cudaDeviceGetAttribute");
  // Each rank's compute capability and, in the same exchange, whether it sees
  // a CUDA MPS daemon: ranks sharing a GPU run at once only under MPS, and
  // every rank must see one for all to choose alike.
  store.set(key + "cc/" + std::to_string(rank),
            std::to_string(major * 10 + minor) + (mps_daemon_visible() ? " mps" : ""));
  info.mps = true;
  for (int r = 0; r < size; ++r) {
    const std::string value = store.get_to_str(key + "cc/" + std::to_string(r));
    const int cc = std::stoi(value);  // the number before " mps"
    info.compute_capability = r == 0 ? cc : std::min(info.compute_capability, cc);
    info.mps = info.mps && value.find(" mps") != std::string::npos;
  }

  // My row of reachability: my GPU to each rank's.
  std::string row(static_cast<size_t>(size), '0');
  for (int r = 0; r < size; ++r) {
    if (hosts[r] != config.hostname) continue;
    int peer = -1;
    if (cudaDeviceGetByPCIBusId(&peer, info.gpus[r].c_str()) != cudaSuccess) {
      cudaGetLastError();  // not visible to this process: unreachable
      continue;
    }
    int can = peer == device ? 1 : 0;
    if (peer != device)
      check_cuda(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
    row[r] = can ? '1' : '0';
  }
  store.set(key + "reach/" + std::to_string(rank), row);
  info.reachable = plan::LinkMatrix(size);
  bool all_reachable = true;
  std::vector<std::string> rows;
  for (int r = 0; r < size; ++r)
    rows.push_back(store.get_to_str(key + "reach/" + std::to_string(r)));
  for (int i = 0; i < size; ++i) {
    for (int j = i + 1; j < size; ++j) {
      const bool both = rows[i][j] == '1' && rows[j][i] == '1';
      info.reachable.set_links(i, j, both ? 1 : 0);
      all_reachable = all_reachable && both;
    }
  }
  // The group's ranks on each rank's GPU (itself included): NCCL refuses a
  // group where any GPU has two, and they split the GPU's SMs.
  std::vector<int> ranks_on_gpu(static_cast<size_t>(size), 0);
  for (int i = 0; i < size; ++i) {
    for (int j = 0; j < size; ++j) {
      if (hosts[i] == hosts[j] && lower(info.gpus[i]) == lower(info.gpus[j])) {
        ++ranks_on_gpu[static_cast<size_t>(i)];
      }
    }
  }
  info.ranks_on_this_gpu = ranks_on_gpu[static_cast<size_t>(rank)];
  info.ranks_share_gpu = *std::max_element(ranks_on_gpu.begin(), ranks_on_gpu.end()) > 1;
  info.gpu_time_sliced = info.ranks_share_gpu && !info.mps;

  // Links: an injected file, else NVML as rank 0 sees it (one answer for all).
  plan::LinkMatrix class_reach = info.reachable;
  if (!config.topo_nvlink.empty()) {
    TORCH_CHECK_VALUE(static_cast<int>(config.topo_nvlink.size()) == size,
                      "XDEV_TOPO_FILE=", config.topo_file, " describes ", config.topo_nvlink.size(),
                      " GPUs but the group has ", size,
                      " ranks; its rows are the GPUs of local ranks 0..N-1");
    info.nvlink = plan::LinkMatrix::from_rows(config.topo_nvlink, "XDEV_TOPO_FILE's nvlink");
    class_reach =
        config.topo_reachable.empty()
            ? plan::reachable_from_links(info.nvlink)
            : plan::LinkMatrix::from_rows(config.topo_reachable, "XDEV_TOPO_FILE's reachable");
    info.topology_source = "XDEV_TOPO_FILE=" + config.topo_file;
    for (int64_t c : config.topo_nvswitch) info.nvswitch.push_back(static_cast<int>(c));
    TORCH_CHECK_VALUE(info.nvswitch.empty() || static_cast<int>(info.nvswitch.size()) == size,
                      "XDEV_TOPO_FILE=", config.topo_file, " gives ", info.nvswitch.size(),
                      " NVSwitch link counts but the group has ", size, " ranks");
  } else {
    if (rank == 0) {
      const transport::NvlinkReport report = transport::probe_nvlinks(info.gpus);
      store.set(key + "nvlink", report.links.to_text());
      store.set(key + "nvswitch", counts_to_text(report.nvswitch));
      store.set(key + "nvlink_source", report.available ? "nvml" : report.note);
    }
    info.nvlink =
        plan::LinkMatrix::from_text(store.get_to_str(key + "nvlink"), "the NVLink matrix");
    info.nvswitch = counts_from_text(store.get_to_str(key + "nvswitch"));
    info.topology_source = store.get_to_str(key + "nvlink_source");
  }
  info.topology = plan::classify_gpus(info.nvlink, class_reach, info.nvswitch);
  if (!info.ranks_share_gpu && group.num_hosts() == 1 && size > 1) {
    info.model =
        plan::detected_gpu_host("this host's " + std::to_string(size) + " GPUs",
                                plan::direct_links(info.nvlink, info.nvswitch), info.nvswitch,
                                info.compute_capability, config.cuda_slot_bytes);
  }
  return all_reachable;
}

}  // namespace xdev::backend
