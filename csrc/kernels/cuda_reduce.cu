// Standalone launches of the device code in cuda_reduce.cuh: one grid-stride
// kernel per (dtype, op) and one for copies, sized to fill the GPU once.
// Not part of torch_xdev._C, whose window kernel runs that device code inline;
// benchmarks/cuda_kernels.py (and its test) compile this file themselves.
#include "cuda_reduce.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda_reduce.cuh"

namespace xdev::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxDevices = 64;

// Sources by value in the parameter block: no device allocation per launch.
template <typename T>
struct Sources {
  const T* ptr[kMaxSources];
};

// minBlocksPerSM = 1 tells ptxas it may use the registers one block leaves:
// without it, it keeps fewer live and interleaves each source's loads with
// their adds, so a thread has 1 or 2 loads in flight instead of 2 x kUnroll.
template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kThreads, 1)
    reduce_kernel(T* dst, Sources<T> srcs, int n, int64_t count, int64_t divisor) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  reduce_elements<T, Op>(dst, srcs.ptr, n, count, divisor, tid, nthreads);
}

__global__ void __launch_bounds__(kThreads) copy_kernel(char* dst, const char* src, int64_t bytes) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  copy_bytes(dst, src, bytes, tid, nthreads);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("xdev cuda kernels: ") + what + " failed: " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// How many blocks of one kernel the current device runs at once (SMs x
// resident blocks per SM): a grid of that size streams through any size with
// no tail wave. Looked up once per kernel and device; these are fixed facts
// of the hardware and the compiled kernel, so the cache is never stale, and
// the occupancy query stays off the per-launch path.
class GridSize {
 public:
  explicit GridSize(const void* kernel) : kernel_(kernel) {}

  int64_t get() {
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    const bool cached = device >= 0 && device < kMaxDevices;
    if (cached) {
      const int known = blocks_[device].load(std::memory_order_relaxed);
      if (known > 0) return known;
    }
    int sms = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
          "cudaDeviceGetAttribute(MultiProcessorCount)");
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_, kThreads, 0),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    const int blocks = std::max(1, sms) * std::max(1, per_sm);
    if (cached) blocks_[device].store(blocks, std::memory_order_relaxed);
    return blocks;
  }

 private:
  const void* kernel_;
  std::atomic<int> blocks_[kMaxDevices] = {};  // 0: not looked up yet
};

// Blocks for `work` bytes: one 16-byte vector per thread, so that mid sizes
// spread over every SM rather than unrolling on a few, and no more than fit
// at once (larger sizes loop, unrolled, inside the kernel).
int grid_for(GridSize& grid, int64_t work) {
  constexpr int64_t kPerBlock = int64_t{kThreads} * detail::kVecBytes;
  const int64_t wanted = std::max<int64_t>(1, (work + kPerBlock - 1) / kPerBlock);
  return static_cast<int>(std::min(wanted, grid.get()));
}

template <typename T, ReduceOp Op>
void launch_reduce_typed(void* dst, const void* const* srcs, int n, int64_t count, int64_t divisor,
                         cudaStream_t stream) {
  static GridSize grid(reinterpret_cast<const void*>(&reduce_kernel<T, Op>));
  Sources<T> sources{};
  for (int k = 0; k < n; ++k) sources.ptr[k] = static_cast<const T*>(srcs[k]);
  const int blocks = grid_for(grid, count * static_cast<int64_t>(sizeof(T)));
  reduce_kernel<T, Op>
      <<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst), sources, n, count, divisor);
}

}  // namespace

void launch_reduce(DType dtype, ReduceOp op, void* dst, const void* const* srcs, int n,
                   int64_t count, int64_t divisor, cudaStream_t stream) {
  if (n < 1 || n > kMaxSources) {
    throw std::invalid_argument("launch_reduce: needs 1 to " + std::to_string(kMaxSources) +
                                " sources, got " + std::to_string(n));
  }
  if (count <= 0) return;
  if (dst == nullptr || srcs == nullptr) throw std::invalid_argument("launch_reduce: null pointer");
  for (int k = 0; k < n; ++k) {
    if (srcs[k] == nullptr) throw std::invalid_argument("launch_reduce: null source pointer");
  }
  if (op != ReduceOp::kAvg) divisor = 0;  // only AVG divides, as in cpu_reduce.cc
  dispatch(dtype, op, [&](auto type_tag, auto op_tag) {
    using T = typename decltype(type_tag)::type;
    launch_reduce_typed<T, decltype(op_tag)::value>(dst, srcs, n, count, divisor, stream);
  });
  check(cudaGetLastError(), "launching the reduce kernel");
}

void launch_copy(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return;
  if (dst == nullptr || src == nullptr) throw std::invalid_argument("launch_copy: null pointer");
  static GridSize grid(reinterpret_cast<const void*>(&copy_kernel));
  const int blocks = grid_for(grid, bytes);
  copy_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<char*>(dst),
                                               static_cast<const char*>(src), bytes);
  check(cudaGetLastError(), "launching the copy kernel");
}

}  // namespace xdev::kernels::cuda
