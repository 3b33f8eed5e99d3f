#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda_heap.h"
#include "cuda_ipc_channel.h"

namespace xdev::transport {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == DeviceArenaAddress::kHandleBytes,
              "DeviceArenaAddress carries a CUDA IPC handle");

}  // namespace

CudaSymmetricHeap::CudaSymmetricHeap(int rank, int world_size, int device, size_t first_arena_bytes,
                                     cudaStream_t collective_stream, Publish publish)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      first_arena_bytes_(first_arena_bytes),
      collective_stream_(collective_stream),
      publish_(std::move(publish)),
      peers_(static_cast<size_t>(world_size), std::vector<char*>(kMaxArenas, nullptr)) {
  if (rank < 0 || rank >= world_size) throw std::invalid_argument("CudaSymmetricHeap: bad rank");
}

CudaSymmetricHeap::~CudaSymmetricHeap() {
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  // Work queued on the blocks, ours or peers', may still run: the GPU
  // finishes it first. (This may run in the deleter of the last tensor from
  // the heap, in the middle of training: a device-wide wait, once.)
  if (!own_.empty()) cudaDeviceSynchronize();
  for (auto& arenas : peers_) {
    for (char* data : arenas) {
      if (data != nullptr) cudaIpcCloseMemHandle(data);
    }
  }
  for (char* data : own_) cudaFree(data);
  pending_frees_.clear([](cudaEvent_t event) { cudaEventDestroy(event); });
  for (cudaEvent_t event : spare_events_) cudaEventDestroy(event);
  cudaGetLastError();
  if (previous >= 0) cudaSetDevice(previous);
}

int CudaSymmetricHeap::add_arena(size_t at_least) {
  const size_t bytes =
      placement_.next_arena_bytes(at_least, first_arena_bytes_, "xdev CUDA heap", rank_);
  CudaDeviceGuard guard(device_);
  void* data = nullptr;
  check_cuda(cudaMalloc(&data, bytes), "cudaMalloc (an arena of xdev's CUDA heap)");
  DeviceArenaAddress address;
  address.bytes = bytes;
  cudaIpcMemHandle_t handle;
  const cudaError_t status = cudaIpcGetMemHandle(&handle, data);
  if (status != cudaSuccess) {
    cudaFree(data);
    check_cuda(status, "cudaIpcGetMemHandle");
  }
  std::memcpy(address.handle, &handle, sizeof handle);
  own_.push_back(static_cast<char*>(data));
  const int index = placement_.add_arena(bytes);
  if (publish_) publish_(index, address);
  return index;
}

cudaEvent_t CudaSymmetricHeap::take_event() {
  cudaEvent_t event = nullptr;
  if (!spare_events_.empty()) {
    event = spare_events_.back();
    spare_events_.pop_back();
  } else if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    event = nullptr;
  }
  return event;
}

CudaSymmetricHeap::Block CudaSymmetricHeap::allocate(size_t bytes, cudaStream_t stream) {
  const int64_t need = HeapPlacement::block_bytes(bytes, "xdev CUDA heap");
  std::lock_guard<std::mutex> lock(mutex_);
  std::optional<HeapLocation> where = placement_.place(need);
  if (!where) {
    add_arena(static_cast<size_t>(need));
    where = placement_.place(need);  // the new arena holds it
  }
  try {
    if (!pending_frees_.empty()) {
      CudaDeviceGuard guard(device_);
      pending_frees_.wait_for(
          {where->arena, where->offset, need},
          [stream](cudaEvent_t e) {
            check_cuda(cudaStreamWaitEvent(stream, e, 0), "cudaStreamWaitEvent");
          },
          [](cudaEvent_t e) {
            if (cudaEventQuery(e) == cudaSuccess) return true;
            cudaGetLastError();  // cudaErrorNotReady
            return false;
          },
          [this](cudaEvent_t e) { spare_events_.push_back(e); });
    }
    blocks_[{where->arena, where->offset}] = LiveBlock{need, stream, {}};
  } catch (...) {
    // As if never placed. Peers whose allocation succeeded keep theirs, so
    // this rank's later places may differ from theirs: calls on those
    // tensors then stage (slower, never wrong) until the places agree again.
    placement_.free(*where);
    throw;
  }
  return Block{own_[static_cast<size_t>(where->arena)] + where->offset, *where};
}

void CudaSymmetricHeap::free(HeapLocation where) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = blocks_.find({where.arena, where.offset});
    if (it == blocks_.end()) return;
    const LiveBlock& block = it->second;
    std::vector<cudaStream_t> streams{block.allocated};
    if (collective_stream_ != block.allocated) streams.push_back(collective_stream_);
    streams.insert(streams.end(), block.also_used.begin(), block.also_used.end());
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    std::vector<cudaEvent_t> events;
    for (cudaStream_t stream : streams) {
      cudaEvent_t event = take_event();
      if (event != nullptr && cudaEventRecord(event, stream) == cudaSuccess) {
        events.push_back(event);
        continue;
      }
      // No event (CUDA shutting down at exit, or out of resources): wait here
      // instead, so that no later allocation can reuse memory still in use.
      cudaStreamSynchronize(stream);
      if (event != nullptr) spare_events_.push_back(event);
    }
    cudaGetLastError();
    if (previous >= 0) cudaSetDevice(previous);
    pending_frees_.add({where.arena, where.offset, block.bytes}, std::move(events));
    // Only once the free is noted: a block whose free could not be noted
    // stays placed, never reused.
    blocks_.erase(it);
    placement_.free(where);
  } catch (...) {
    // Out of memory for the bookkeeping: the block is lost to the heap, not reused early.
  }
}

bool CudaSymmetricHeap::note_use(const void* p, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const HeapLocation at = locate_in_arenas(placement_, own_, p, 1);
  if (at.arena < 0) return false;
  auto it = blocks_.upper_bound({at.arena, at.offset});
  if (it == blocks_.begin()) return true;
  --it;
  LiveBlock& block = it->second;
  const bool inside = it->first.first == at.arena && at.offset < it->first.second + block.bytes;
  if (!inside || stream == block.allocated || stream == collective_stream_) return true;
  if (std::find(block.also_used.begin(), block.also_used.end(), stream) == block.also_used.end()) {
    block.also_used.push_back(stream);
  }
  return true;
}

void CudaSymmetricHeap::close_peers() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  for (auto& arenas : peers_) {
    for (char*& data : arenas) {
      if (data != nullptr) cudaIpcCloseMemHandle(data);
      data = nullptr;
    }
  }
  cudaGetLastError();
  if (previous >= 0) cudaSetDevice(previous);
}

HeapLocation CudaSymmetricHeap::locate(const void* p, size_t n) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return locate_in_arenas(placement_, own_, p, n);
}

char* CudaSymmetricHeap::arena_of(int r, int arena, const DeviceArenaAddress& address) {
  if (arena < 0 || arena >= kMaxArenas || r < 0 || r >= world_size_) {
    throw std::out_of_range("CudaSymmetricHeap::arena_of: no arena " + std::to_string(arena) +
                            " of rank " + std::to_string(r));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (r == rank_) {
    if (arena >= static_cast<int>(own_.size())) {
      throw std::out_of_range("CudaSymmetricHeap::arena_of: this rank has no arena " +
                              std::to_string(arena));
    }
    return own_[static_cast<size_t>(arena)];
  }
  char*& slot = peers_[static_cast<size_t>(r)][static_cast<size_t>(arena)];
  if (slot == nullptr) {
    if (address.bytes == 0) {
      throw CudaError("xdev CUDA heap: rank " + std::to_string(r) + " has published no arena " +
                      std::to_string(arena));
    }
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, address.handle, sizeof handle);
    CudaDeviceGuard guard(device_);
    void* data = nullptr;
    check_cuda(cudaIpcOpenMemHandle(&data, handle, cudaIpcMemLazyEnablePeerAccess),
               ("cudaIpcOpenMemHandle (rank " + std::to_string(r) + "'s heap arena " +
                std::to_string(arena) + ")")
                   .c_str());
    slot = static_cast<char*>(data);
  }
  return slot;
}

size_t CudaSymmetricHeap::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_.bytes_in_use();
}

size_t CudaSymmetricHeap::bytes_reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_.bytes_reserved();
}

int64_t CudaSymmetricHeap::live_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_.live_blocks();
}

}  // namespace xdev::transport
