// The torch glue of the CUDA path: streams, events, the caching allocator and
// the Store rendezvous. Built only when torch has CUDA (setup.py); everything
// that moves bytes is in csrc/transport/cuda_* and csrc/kernels/cuda_*.
#include <ATen/ops/cat.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "../../plan/collective_plan.h"
#include "../../plan/packing.h"
#include "../../transport/cuda_executor.h"
#include "../../transport/cuda_ipc_channel.h"
#include "../../transport/nvml_links.h"
#include "../xdev_backend.h"

namespace xdev::backend {
namespace {

using transport::check_cuda;

// A CUDA event without timing (c10's and ATen's event classes differ across
// the torch versions we build against, and ATen's pulls in cuBLAS headers).
class StreamEvent {
 public:
  StreamEvent() = default;
  ~StreamEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;

  void record(const c10::cuda::CUDAStream& stream) {
    if (event_ == nullptr) {
      c10::cuda::CUDAGuard guard(stream.device_index());
      check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
    }
    check_cuda(cudaEventRecord(event_, stream.stream()), "cudaEventRecord");
  }
  // Work queued on stream after this call starts once the event has passed.
  void block(const c10::cuda::CUDAStream& stream) const {
    if (event_ == nullptr) return;  // never recorded: nothing to wait for
    check_cuda(cudaStreamWaitEvent(stream.stream(), event_, 0), "cudaStreamWaitEvent");
  }
  bool query() const {
    if (event_ == nullptr) return true;
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    check_cuda(status, "cudaEventQuery");
    return true;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// The Work of a native CUDA allreduce. The host part (the barrier that checks
// every rank runs the same collective, and the launches) completes it; the GPU
// part is done when done_ has passed on the internal stream.
class CudaWork : public XdevWork {
 public:
  CudaWork(int rank, std::vector<at::Tensor> outputs, c10::cuda::CUDAStream stream)
      : XdevWork(rank, c10d::OpType::ALLREDUCE, "xdev:all_reduce", outputs,
                 {c10::Device(c10::kCUDA, stream.device_index())}),
        stream_(stream) {}

  // The future records its CUDA events on the current stream: make it ours.
  void complete() override {
    c10::cuda::CUDAStreamGuard guard(stream_);
    XdevWork::complete();
  }

  void record_done() { done_.record(stream_); }

  // wait() calls this once the host part is done: like ProcessGroupNCCL, the
  // caller's current stream waits for the GPU work; the host does not.
  void synchronize() override {
    XdevWork::synchronize();
    done_.block(c10::cuda::getCurrentCUDAStream(stream_.device_index()));
  }

  bool isCompleted() override { return XdevWork::isCompleted() && done_.query(); }

 private:
  c10::cuda::CUDAStream stream_;
  StreamEvent done_;
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// "n v00 v01 ... v(n-1)(n-1)": a Store value. No iostreams: on the H100 image
// we test on, the compiler links libstdc++ statically into the extension, and
// there `std::ostringstream << int` segfaulted.
std::string matrix_to_string(const plan::LinkMatrix& m) {
  std::string text = std::to_string(m.size());
  for (int i = 0; i < m.size(); ++i) {
    for (int j = 0; j < m.size(); ++j) text += ' ' + std::to_string(m.links(i, j));
  }
  return text;
}

plan::LinkMatrix matrix_from_string(const std::string& text) {
  const char* p = text.c_str();
  char* end = nullptr;
  auto next = [&]() {
    const long v = std::strtol(p, &end, 10);
    TORCH_CHECK(end != p, "xdev: malformed link matrix in the Store: '", text, "'");
    p = end;
    return static_cast<int>(v);
  };
  const int n = next();
  plan::LinkMatrix m(n);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      const int v = next();
      if (i < j) m.set_links(i, j, v);
    }
  }
  return m;
}

plan::LinkMatrix matrix_from_rows(const std::vector<std::vector<int64_t>>& rows) {
  plan::LinkMatrix m(static_cast<int>(rows.size()));
  for (size_t i = 0; i < rows.size(); ++i) {
    for (size_t j = i + 1; j < rows[i].size(); ++j) {
      m.set_links(static_cast<int>(i), static_cast<int>(j), static_cast<int>(rows[i][j]));
    }
  }
  return m;
}

}  // namespace

class CudaCollectivesImpl : public CudaCollectives {
 public:
  explicit CudaCollectivesImpl(XdevBackend& backend) : b_(backend) {}
  ~CudaCollectivesImpl() override { shutdown(); }

  const CudaGroupInfo& ensure_ready(int device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (info_) {
      TORCH_CHECK_VALUE(info_->device == device,
                        "xdev: this group runs CUDA collectives on cuda:", info_->device,
                        "; got a tensor on cuda:", device,
                        ". Use one GPU per rank (torch.cuda.set_device(local_rank)).");
      return *info_;
    }
    info_ = rendezvous(device);
    return *info_;
  }

  const CudaGroupInfo* info() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return info_ ? &*info_ : nullptr;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> tensors, kernels::ReduceOp op,
                                           plan::Selection sel,
                                           std::chrono::milliseconds timeout) override {
    const int device = info_->device;
    c10::cuda::CUDAGuard device_guard(device);
    // Our stream starts after everything the caller queued before this call.
    auto ready = std::make_shared<StreamEvent>();
    ready->record(c10::cuda::getCurrentCUDAStream(device));
    for (const at::Tensor& t : tensors) {
      // The caller may free these once its stream moves on; the allocator must
      // not hand their memory out before our stream is done with them.
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *stream_);
    }
    auto work = c10::make_intrusive<CudaWork>(b_.rank_, tensors, *stream_);
    b_.enqueue_work(
        work,
        [this, work, tensors, op, sel, timeout, ready]() {
          c10::cuda::CUDAGuard guard(info_->device);
          c10::cuda::CUDAStreamGuard stream_guard(*stream_);
          ready->block(*stream_);
          run_allreduce(tensors, op, sel, timeout);
          work->record_done();
        },
        /*async_op=*/false);  // inline unless CPU work is queued: launching is quick
    return work;
  }

  void synchronize() override {
    if (!stream_) return;
    stream_->synchronize();
    const std::string failed = executor_ ? executor_->device_error() : std::string();
    if (!failed.empty()) throw transport::PeerError("xdev: " + failed);
  }

  void shutdown() noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stream_) return;
    try {
      c10::cuda::CUDAGuard guard(info_->device);
      stream_->synchronize();
      // Peers may still be reading our slots in their last phase: free the
      // buffer only once every rank's GPU work is done (bounded wait; a dead
      // peer reads nothing).
      if (channel_ && b_.channel_) {
        const auto wait =
            std::min<std::chrono::milliseconds>(b_.config_.timeout, std::chrono::seconds(30));
        b_.channel_->barrier(transport::Clock::now() + wait, "CUDA transport shutdown");
      }
    } catch (...) {
      // A peer gone, or the CUDA context already torn down at interpreter exit.
    }
    executor_.reset();
    channel_.reset();
    stream_.reset();
  }

 private:
  // Learns every rank's GPU, agrees on links and reachability, and opens the
  // IPC transport where every GPU reaches every other. Every rank derives the
  // same answer from the same Store values.
  CudaGroupInfo rendezvous(int device) {
    c10d::Store& store = *b_.store_;
    const int rank = b_.rank_, size = b_.size_;
    const std::string key = "xdev/cuda/";
    c10::cuda::CUDAGuard guard(device);
    CudaGroupInfo info;
    info.device = device;
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);

    char bus[64] = {};
    check_cuda(cudaDeviceGetPCIBusId(bus, sizeof bus, device), "cudaDeviceGetPCIBusId");
    store.set(key + "gpu/" + std::to_string(rank), b_.config_.hostname + "\n" + bus);
    std::vector<std::string> hosts;
    for (int r = 0; r < size; ++r) {
      const std::string v = store.get_to_str(key + "gpu/" + std::to_string(r));
      const size_t nl = v.find('\n');
      hosts.push_back(v.substr(0, nl));
      info.gpus.push_back(v.substr(nl + 1));
    }

    // My row of reachability: my GPU to each rank's.
    std::string row(static_cast<size_t>(size), '0');
    for (int r = 0; r < size; ++r) {
      if (hosts[r] != b_.config_.hostname) continue;
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
    for (int i = 0; i < size && !info.ranks_share_gpu; ++i) {
      for (int j = i + 1; j < size; ++j) {
        if (hosts[i] == hosts[j] && lower(info.gpus[i]) == lower(info.gpus[j])) {
          info.ranks_share_gpu = true;
        }
      }
    }

    // Links: an injected file, else NVML as rank 0 sees it (one answer for all).
    plan::LinkMatrix class_reach = info.reachable;
    if (!b_.config_.topo_nvlink.empty()) {
      TORCH_CHECK_VALUE(static_cast<int>(b_.config_.topo_nvlink.size()) == size,
                        "XDEV_TOPO_FILE=", b_.config_.topo_file, " describes ",
                        b_.config_.topo_nvlink.size(), " GPUs but the group has ", size,
                        " ranks; its rows are the GPUs of local ranks 0..N-1");
      info.nvlink = matrix_from_rows(b_.config_.topo_nvlink);
      class_reach = b_.config_.topo_reachable.empty() ? plan::reachable_from_links(info.nvlink)
                                                      : matrix_from_rows(b_.config_.topo_reachable);
      info.topology_source = "XDEV_TOPO_FILE=" + b_.config_.topo_file;
    } else {
      if (rank == 0) {
        const transport::NvlinkReport report = transport::probe_nvlinks(info.gpus);
        store.set(key + "nvlink", matrix_to_string(report.links));
        store.set(key + "nvlink_source", report.available ? "nvml" : report.note);
      }
      info.nvlink = matrix_from_string(store.get_to_str(key + "nvlink"));
      info.topology_source = store.get_to_str(key + "nvlink_source");
    }
    info.topology = plan::classify_gpus(info.nvlink, class_reach);

    if (b_.num_hosts_ > 1) {
      info.transport_note = "off: ranks span several hosts";
    } else if (size > plan::kMaxDeviceRanks) {
      info.transport_note = "off: more than " + std::to_string(plan::kMaxDeviceRanks) + " ranks";
    } else if (!all_reachable) {
      info.transport_note = "off: not every GPU can access every other (no peer access)";
    } else if (b_.executor_ == nullptr) {
      info.transport_note = "off: algorithm='fallback' or no shared memory for the host barrier";
    } else {
      open_transport(store, key, device, &info);
    }
    if (b_.config_.debug && rank == 0) {
      std::fprintf(stderr,
                   "[xdev] group '%s': CUDA topology %s (%s), ranks %s a GPU, transport %s\n",
                   b_.config_.group_name.c_str(), plan::to_string(info.topology),
                   info.topology_source.c_str(), info.ranks_share_gpu ? "share" : "do not share",
                   info.transport_note.c_str());
    }
    return info;
  }

  // Every rank opens its channel, then all vote: one failure anywhere turns
  // the transport off everywhere, so the ranks always choose alike.
  void open_transport(c10d::Store& store, const std::string& key, int device, CudaGroupInfo* info) {
    std::string why;
    try {
      channel_ = std::make_unique<transport::CudaIpcChannel>(
          b_.rank_, b_.size_, device, static_cast<size_t>(b_.config_.cuda_slot_bytes), key + "ipc/",
          [&store](const std::string& k, const std::string& v) { store.set(k, v); },
          [&store](const std::string& k) { return store.get_to_str(k); });
      executor_ = std::make_unique<transport::CudaExecutor>(*channel_, b_.config_.timeout);
    } catch (const std::exception& e) {
      why = e.what();
      executor_.reset();
      channel_.reset();
    }
    const int64_t failures = count_failures_across_ranks(store, key, !why.empty(), b_.size_);
    if (failures == 0) {
      info->transport = true;
      info->transport_note = "on: CUDA IPC staging buffers, " +
                             std::to_string(b_.config_.cuda_slot_bytes) + " bytes per slot";
      return;
    }
    executor_.reset();
    channel_.reset();
    info->transport_note = why.empty() ? "off: " + std::to_string(failures) +
                                             " rank(s) could not open CUDA IPC (see their log)"
                                       : "off: " + why;
    if (!why.empty()) {
      std::fprintf(stderr, "[xdev] group '%s' rank %d: CUDA IPC unavailable: %s\n",
                   b_.config_.group_name.c_str(), b_.rank_, why.c_str());
    }
  }

  // On the op's thread, with our stream current.
  void run_allreduce(const std::vector<at::Tensor>& tensors, kernels::ReduceOp op,
                     const plan::Selection& sel, std::chrono::milliseconds timeout) {
    const auto deadline = b_.deadline_for(timeout);
    const uint64_t hash = shape_hash(tensors);
    std::vector<plan::TensorDesc> descs;
    for (const at::Tensor& t : tensors) {
      descs.push_back({static_cast<int>(*native_dtype(t.scalar_type())),
                       static_cast<size_t>(t.element_size()), t.numel()});
    }
    for (const plan::DtypeGroup& group : plan::group_by_dtype(descs)) {
      const auto dtype = static_cast<kernels::DType>(group.dtype);
      const int64_t total = group.layout.total();
      // One contiguous buffer per dtype: the tensor itself when it is one
      // contiguous tensor, else a packed copy (copied back at the end).
      std::vector<at::Tensor> members;
      for (size_t idx : group.tensor_indices) members.push_back(tensors[idx]);
      const bool in_place = members.size() == 1 && members[0].is_contiguous();
      at::Tensor flat;
      if (in_place) {
        flat = members[0];
      } else {
        std::vector<at::Tensor> pieces;
        for (const at::Tensor& t : members) pieces.push_back(t.reshape({-1}));
        flat = at::cat(pieces);
      }
      const auto packs = plan::make_packs(group.layout, group.elem_size, b_.packing_for(sel));
      const int64_t window_elems =
          b_.config_.cuda_slot_bytes / static_cast<int64_t>(group.elem_size);
      const bool balanced = sel.algorithm == plan::Algorithm::kHierarchicalBalanced;
      const plan::CollectivePlan cp = plan::CollectivePlan::allreduce(
          sel.algorithm, b_.size_, static_cast<int>(b_.config_.reduce_to_rank), packs, total,
          window_elems,
          balanced ? pack_trees(static_cast<int64_t>(packs.size()))
                   : std::vector<plan::PackTree>{});

      transport::OpDescriptor desc =
          b_.allreduce_descriptor(op, group.dtype, sel, static_cast<int64_t>(packs.size()),
                                  static_cast<int64_t>(tensors.size()), total, hash);
      desc.device = 1;
      // The host barrier checks that every rank runs this very collective
      // before any GPU waits for a peer, and names a missing rank on timeout.
      b_.executor_->barrier(b_.make_context(desc, "allreduce", deadline));
      if (total == 0) continue;

      transport::CudaPlanKey key;
      key.algorithm = static_cast<int>(sel.algorithm);
      key.root = static_cast<int>(b_.config_.reduce_to_rank);
      key.total = total;
      key.window_elems = window_elems;
      for (const plan::Range& r : packs) {
        key.pack_bounds.push_back(r.begin);
        key.pack_bounds.push_back(r.end);
      }
      if (balanced) key.tree_ids.push_back(static_cast<int>(packs.size()));
      executor_->allreduce(key, cp, flat.data_ptr(), dtype, op, stream_->stream());
      if (in_place) continue;
      int64_t offset = 0;
      for (const at::Tensor& t : members) {
        const int64_t n = t.numel();
        // copy_ handles non-contiguous destinations.
        t.copy_(flat.narrow(0, offset, n).view(t.sizes()));
        offset += n;
      }
    }
  }

  // The balanced plan's trees follow the GPUs' NVLinks where any are known
  // (every pair counts as one link otherwise). Op thread only.
  const std::vector<plan::PackTree>& pack_trees(int64_t num_packs) {
    auto it = pack_trees_.find(num_packs);
    if (it != pack_trees_.end()) return it->second;
    plan::LinkMatrix links = info_->nvlink;
    bool any = false;
    for (int i = 0; i < links.size(); ++i) any = any || !links.neighbors(i).empty();
    const int64_t packs = std::max<int64_t>(1, num_packs);
    std::vector<plan::PackTree> trees;
    try {
      trees = plan::balanced_pack_trees(any ? links : plan::LinkMatrix::fully_connected(b_.size_),
                                        packs);
    } catch (const std::invalid_argument&) {
      // NVLinks too sparse for the two-level trees: weigh every pair alike.
      trees = plan::balanced_pack_trees(plan::LinkMatrix::fully_connected(b_.size_), packs);
    }
    return pack_trees_.emplace(num_packs, std::move(trees)).first->second;
  }

  XdevBackend& b_;
  std::map<int64_t, std::vector<plan::PackTree>> pack_trees_;
  mutable std::mutex mutex_;
  std::optional<CudaGroupInfo> info_;
  std::optional<c10::cuda::CUDAStream> stream_;
  std::unique_ptr<transport::CudaIpcChannel> channel_;
  std::unique_ptr<transport::CudaExecutor> executor_;
};

std::unique_ptr<CudaCollectives> make_cuda_collectives(XdevBackend& backend) {
  if (c10::cuda::device_count() == 0) return nullptr;
  return std::make_unique<CudaCollectivesImpl>(backend);
}

}  // namespace xdev::backend
