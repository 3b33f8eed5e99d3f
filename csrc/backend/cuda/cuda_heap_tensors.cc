#include "cuda_heap_tensors.h"

#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>

#include "../../transport/cuda_ipc_channel.h"
#include "../tensor_helpers.h"

namespace xdev::backend {
namespace {

// Every CUDA heap of this process, for heaps_on. Never destroyed: a tensor may
// outlive static destruction at exit.
std::mutex& heaps_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::vector<std::weak_ptr<transport::CudaSymmetricHeap>>& live_heaps() {
  static auto* heaps = new std::vector<std::weak_ptr<transport::CudaSymmetricHeap>>;
  return *heaps;
}

}  // namespace

CudaHeapTensors::CudaHeapTensors(GroupContext& group, int device, cudaStream_t collective_stream)
    : g_(group) {
  transport::ShmChannel* channel = group.channel();
  if (channel == nullptr) throw std::logic_error("CudaHeapTensors: the group has no channel");
  heap_ = std::make_shared<transport::CudaSymmetricHeap>(
      group.rank(), group.size(), device, transport::HeapPlacement::kFirstArenaBytes,
      collective_stream, [channel](int arena, const transport::DeviceArenaAddress& address) {
        channel->publish_device_arena(arena, address);
      });
  std::lock_guard<std::mutex> lock(heaps_mutex());
  auto& heaps = live_heaps();
  heaps.erase(
      std::remove_if(heaps.begin(), heaps.end(), [](const auto& heap) { return heap.expired(); }),
      heaps.end());
  heaps.push_back(heap_);
}

CudaHeapTensors::~CudaHeapTensors() {
  heap_->close_peers();
}

at::Tensor CudaHeapTensors::allocate(int64_t numel, at::ScalarType dtype) {
  const size_t bytes = heap_block_bytes("allocateTensor", numel, dtype);
  const int device = heap_->device();
  const auto index = static_cast<c10::DeviceIndex>(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
  const auto ordinary = [&] {
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCUDA, index));
  };
  if (transport::stream_is_capturing(stream)) {
    // The heap waits on events and may cudaMalloc an arena, which a capture
    // forbids; the caching allocator serves captures from the graph's pool.
    // Captured collectives go to NCCL anyway, which reads no heap in place.
    return ordinary();
  }
  if (g_.poisoned()) {
    // The group runs no collective again, so heap memory gains nothing, and
    // a peer's kernel that outlived the failed call may still read this
    // rank's blocks: a block handed out again would be read by a call whose
    // result is already an error, and the heap would grow for nothing.
    g_.log_once("cuda-heap-poisoned",
                "allocateTensor gives ordinary tensors: the group is unusable after a failure");
    return ordinary();
  }
  transport::CudaSymmetricHeap::Block block;
  try {
    block = heap_->allocate(bytes, stream);
  } catch (const std::runtime_error& e) {  // cudaMalloc failed, or all arenas exist
    g_.log_once("cuda-heap-full", std::string("CUDA heap: ") + e.what() +
                                      "; allocateTensor gives ordinary tensors, which stage");
    return ordinary();
  }
  if (g_.config().debug) {
    std::fprintf(stderr,
                 "[xdev] group '%s' rank %d: allocateTensor %" PRId64
                 " x %s (%zu bytes) on cuda:%d at CUDA heap arena %d offset %" PRId64
                 " (%zu bytes in use)\n",
                 g_.config().group_name.c_str(), g_.rank(), numel, c10::toString(dtype), bytes,
                 device, block.where.arena, block.where.offset, heap_->bytes_in_use());
  }
  // The tensor's storage returns the block; it holds the heap, which may so outlive the group.
  return at::from_blob(
      block.data, {numel}, [heap = heap_, where = block.where](void*) { heap->free(where); },
      at::TensorOptions().dtype(dtype).device(
          at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
}

CudaHeapTensors::Heaps CudaHeapTensors::heaps_on(int device) {
  Heaps heaps;
  std::lock_guard<std::mutex> lock(heaps_mutex());
  for (const auto& weak : live_heaps()) {
    auto heap = weak.lock();
    if (heap && heap->device() == device) heaps.push_back(std::move(heap));
  }
  return heaps;
}

bool CudaHeapTensors::note_use(const Heaps& heaps, const at::Tensor& t, cudaStream_t stream) {
  const void* data = t.is_cuda() ? t.storage().data_ptr().get() : nullptr;
  if (data == nullptr) return false;
  for (const auto& heap : heaps) {
    if (heap->device() == t.get_device() && heap->note_use(data, stream)) return true;
  }
  return false;
}

transport::HeapLocation CudaHeapTensors::locate(const at::Tensor& t) const {
  if (!t.is_cuda() || t.get_device() != heap_->device() || !t.is_contiguous()) return {};
  return heap_->locate(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
}

bool CudaHeapTensors::open_peers(transport::HeapLocation where) {
  const transport::ShmChannel& channel = *g_.channel();
  for (int r = 0; r < g_.size(); ++r) {
    if (r == g_.rank()) continue;
    const transport::DeviceArenaAddress address = channel.device_arena_of(r, where.arena);
    if (address.bytes == 0) return false;
    try {
      heap_->arena_of(r, where.arena, address);
    } catch (const std::exception& e) {
      g_.log_once("cuda-heap-open-" + std::to_string(r),
                  std::string("CUDA heap: ") + e.what() + "; its tensors' allreduces stage");
      return false;
    }
  }
  return true;
}

std::vector<char*> CudaHeapTensors::copies(transport::HeapLocation where) {
  std::vector<char*> out;
  const transport::ShmChannel& channel = *g_.channel();
  for (int r = 0; r < g_.size(); ++r) {
    out.push_back(heap_->arena_of(r, where.arena, channel.device_arena_of(r, where.arena)) +
                  where.offset);
  }
  return out;
}

}  // namespace xdev::backend
