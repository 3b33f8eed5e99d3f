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
  for (auto& [stream, event] : frees_) cudaEventDestroy(event);
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

void CudaSymmetricHeap::wait_for_frees(cudaStream_t stream) {
  for (auto it = frees_.begin(); it != frees_.end();) {
    check_cuda(cudaStreamWaitEvent(stream, it->second, 0), "cudaStreamWaitEvent");
    // Kept until it has passed: a later allocation on another stream may
    // land on the same freed bytes, and must wait too.
    if (cudaEventQuery(it->second) == cudaSuccess) {
      spare_events_.push_back(it->second);
      it = frees_.erase(it);
    } else {
      cudaGetLastError();  // cudaErrorNotReady
      ++it;
    }
  }
}

void CudaSymmetricHeap::record_free(cudaStream_t stream) {
  const auto pending = frees_.find(stream);
  cudaEvent_t event = pending != frees_.end() ? pending->second : nullptr;
  if (event == nullptr && !spare_events_.empty()) {
    event = spare_events_.back();
    spare_events_.pop_back();
  } else if (event == nullptr &&
             cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) {
    event = nullptr;
  }
  if (event == nullptr || cudaEventRecord(event, stream) != cudaSuccess) {
    // No event (CUDA shutting down at exit, or out of resources): wait here
    // instead, so that no later allocation can reuse memory still in use.
    cudaStreamSynchronize(stream);
    cudaGetLastError();
    if (event != nullptr && pending == frees_.end()) cudaEventDestroy(event);
    return;
  }
  // A later record on the same stream covers the earlier frees too.
  if (pending == frees_.end()) frees_.emplace(stream, event);
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
    if (!frees_.empty()) {
      CudaDeviceGuard guard(device_);
      wait_for_frees(stream);
    }
    block_stream_[{where->arena, where->offset}] = stream;
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
    const auto it = block_stream_.find({where.arena, where.offset});
    if (it == block_stream_.end()) return;
    const cudaStream_t stream = it->second;
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    record_free(stream);
    if (collective_stream_ != stream) record_free(collective_stream_);
    cudaGetLastError();
    if (previous >= 0) cudaSetDevice(previous);
    // Only once the events are recorded: a block whose free could not be
    // noted stays placed, never reused.
    block_stream_.erase(it);
    placement_.free(where);
  } catch (...) {
    // Out of memory for the bookkeeping: the block is lost to the heap, not reused early.
  }
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
