#include "cuda_executor.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "../kernels/cuda_reduce.cuh"
#include "gpu_barrier_word.h"

namespace xdev::transport {
namespace {

constexpr int kThreads = 512;
// Half an H100 for one rank per GPU (plan::device_blocks_per_rank).
constexpr int kMaxBlocks = 64;

// This rank's own counters for the grid-wide part of the barrier; never
// shared with peers.
struct GridSync {
  unsigned long long arrived;   // blocks that reached a barrier, over all kernels
  unsigned long long released;  // the last epoch block 0 saw every rank reach
  unsigned int aborted;         // a wait timed out: every block leaves the kernel
};

struct WindowParams {
  const plan::DeviceOp* ops;
  int32_t phase_begin[plan::kMaxDevicePhases + 2];
  int32_t num_phases;
  int32_t rank;
  int32_t world_size;
  char* slots[plan::kMaxDeviceRanks];        // this window's slot of every rank
  char* copies[plan::kMaxDeviceRanks];       // every rank's copy of the tensor (in place)
  uint64_t* inboxes[plan::kMaxDeviceRanks];  // every rank's inbox, mapped here
  GridSync* grid;
  const char* input;  // what kOwnInput reads; an allreduce's is its output
  char* output;
  uint64_t epoch_base;  // this window's barriers are epoch_base + 1 .. + num_phases
  int64_t avg_divisor;  // world size for AVG, 0 otherwise
  uint64_t timeout_ns;
  unsigned int* error;  // host-mapped
  uint32_t call_hash;   // announced with every barrier's epoch (gpu_barrier_word.h)
};

// Scoped acquire/release accesses (PTX ISA 6.0, sm_70+).
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long load_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool aborted(const GridSync* g) {
  return *reinterpret_cast<const volatile unsigned int*>(&g->aborted) != 0u;
}

// Whether the error word (host memory) holds a cause: a kernel's, or the
// host's, which writes one when it sees a peer's process exit (PeerWatch).
__device__ __forceinline__ bool error_reported(const WindowParams& p) {
  return *reinterpret_cast<const volatile unsigned int*>(p.error) != 0u;
}

// Each read of the error word crosses the bus to host memory: waits read it
// once every this many polls (every 64 us or so at the longest sleep).
constexpr unsigned int kPollsPerErrorCheck = 64;

enum class Wait { kReady, kTimedOut, kAborted, kStopped };

// Spins (with a growing sleep, so ranks sharing a GPU leave it some issue
// slots) until ready(), the timeout, another block's abort (a kernel of this
// rank gave up: nothing it waits for may come any more), or a cause in the
// error word (the host saw a peer go: kStopped).
template <typename Ready>
__device__ Wait wait_until(Ready ready, const WindowParams& p, uint64_t timeout_ns) {
  if (ready()) return Wait::kReady;
  const uint64_t start = now_ns();
  unsigned int sleep_ns = 32;
  for (unsigned int polls = 1; !ready(); ++polls) {
    if (aborted(p.grid)) return Wait::kAborted;
    if (polls % kPollsPerErrorCheck == 0 && error_reported(p)) return Wait::kStopped;
    __nanosleep(sleep_ns);
    if (sleep_ns < 1024) sleep_ns *= 2;
    if (now_ns() - start > timeout_ns) return Wait::kTimedOut;
  }
  return Wait::kReady;
}

// Stops every block of this and every later kernel of the rank (they return
// at once: see window_kernel). The first report wins: it names the cause.
__device__ void abort_kernel(const WindowParams& p, unsigned int code) {
  atomicCAS_system(p.error, 0u, code);
  atomicExch(&p.grid->aborted, 1u);
  store_release_gpu(&p.grid->released, ~0ull);  // frees blocks waiting for block 0
}

// Leaves this rank's stop word, with the cause in its error word, in every
// peer's inbox (gpu_barrier_word.h), unless a peer differed: peers waiting at
// any barrier stop too. Block 0's thread 0 alone writes inbox words, so this
// comes after its last announcement.
__device__ void tell_peers_stopped(const WindowParams& p) {
  const unsigned int code = *reinterpret_cast<const volatile unsigned int*>(p.error);
  if (!gpu_barrier::tells_peers(code)) return;
  const uint64_t word = gpu_barrier::stop_word(code);
  // An exited rank's inbox is an IPC mapping of memory its process no longer
  // holds: a store there may fault, a sticky error for this rank's context.
  const int gone = gpu_barrier::gone_rank(code);
  for (int r = 0; r < p.world_size; ++r) {
    if (r != p.rank && r != gone) store_release_sys(p.inboxes[r] + p.rank, word);
  }
}

// After a wait that did not end ready: a timeout reports `code`; a cause
// already in the error word stays there, and the kernel stops all the same;
// another block's abort has done both.
__device__ void give_up(const WindowParams& p, Wait w, unsigned int code) {
  if (w == Wait::kTimedOut) abort_kernel(p, code);
  if (w == Wait::kStopped) abort_kernel(p, 0u);  // 0: leaves the cause there as it is
}

// Barrier of every block of every rank. Memory ordering:
//  1. __syncthreads orders every thread's writes of the phase before thread 0
//     of its block (CTA scope); thread 0's release add to `arrived` publishes
//     them at GPU scope (release is cumulative).
//  2. Block 0's thread 0 acquires `arrived` == all blocks, so every write of
//     this rank's phase happens-before its system-scope release stores of the
//     epoch into every rank's inbox (again cumulative).
//     The word stored carries the call's hash with the epoch
//     (gpu_barrier_word.h): a peer that runs another call is found here,
//     before any block reads its data, and every rank's kernel stops.
//  3. A peer's block 0 acquires that epoch at system scope, then releases
//     `released` at GPU scope; the peer's other blocks acquire it and
//     __syncthreads, so every peer thread's later reads of our slot happen
//     after our writes. Writes are only ever to a rank's own slot and tensor;
//     reads of peers only follow a barrier, which is what the plans promise.
//     (The in-place program reads peers' copies of the tensor the same way:
//     its phase 0 is empty, so its first reads follow a barrier too, and its
//     last barrier keeps each copy unchanged until every peer has read it.)
// Returns false when the kernel must stop (a wait timed out, a peer differed
// or stopped), having left this rank's stop word with its peers.
__device__ bool barrier_all_ranks(const WindowParams& p, uint64_t epoch) {
  __shared__ int keep_going;
  __syncthreads();
  if (threadIdx.x == 0) {
    GridSync* g = p.grid;
    add_release_gpu(&g->arrived, 1);
    bool ok = true;
    if (blockIdx.x == 0) {
      // One deadline for the whole barrier: a wait per peer does not restart it.
      const uint64_t deadline = now_ns() + p.timeout_ns;
      const auto time_left = [deadline] {
        const uint64_t now = now_ns();
        return now < deadline ? deadline - now : 0;
      };
      const unsigned long long all_blocks = epoch * gridDim.x;
      Wait w =
          wait_until([&] { return load_acquire_gpu(&g->arrived) >= all_blocks; }, p, time_left());
      give_up(p, w, gpu_barrier::kOwnBlocksTimedOut);
      ok = w == Wait::kReady;
      const uint64_t mine = gpu_barrier::announce(epoch, p.call_hash);
      for (int r = 0; ok && r < p.world_size; ++r) store_release_sys(p.inboxes[r] + p.rank, mine);
      for (int r = 0; ok && r < p.world_size; ++r) {
        const uint64_t* word = p.inboxes[p.rank] + r;
        uint64_t seen = 0;
        gpu_barrier::Peer peer = gpu_barrier::Peer::kNotYet;
        w = wait_until(
            [&] {
              seen = load_acquire_sys(word);
              peer = gpu_barrier::judge(seen, epoch, p.call_hash);
              return peer != gpu_barrier::Peer::kNotYet;
            },
            p, time_left());
        give_up(p, w, gpu_barrier::peer_timed_out(r));
        ok = w == Wait::kReady;
        if (ok && peer == gpu_barrier::Peer::kDiffers) {
          abort_kernel(p, gpu_barrier::peer_differs(r));
          ok = false;
        }
        if (ok && peer == gpu_barrier::Peer::kStopped) {
          abort_kernel(p, gpu_barrier::adopt(seen, p.rank, r));
          ok = false;
        }
      }
      if (ok) store_release_gpu(&g->released, epoch);
    } else {
      // Block 0 gives up on a peer within the timeout and aborts, which ends
      // this wait; twice the timeout only catches a block 0 that never ran,
      // so that the report names the missing peer where there is one.
      const Wait w =
          wait_until([&] { return load_acquire_gpu(&g->released) >= epoch; }, p, 2 * p.timeout_ns);
      give_up(p, w, gpu_barrier::kOwnBlocksTimedOut);
      ok = w == Wait::kReady;
    }
    keep_going = ok && atomicAdd(&g->aborted, 0u) == 0u;
    if (blockIdx.x == 0 && keep_going == 0) tell_peers_stopped(p);
  }
  __syncthreads();
  return keep_going != 0;
}

template <typename T, kernels::ReduceOp Op>
__global__ void __launch_bounds__(kThreads, 1) window_kernel(WindowParams p) {
  // A kernel of this rank gave up (a peer missing): the group is broken, and
  // the windows queued behind it do nothing rather than each wait out the timeout.
  // Thread 0 reads the flag for its block: every thread must return, or none
  // (the barrier's __syncthreads needs the whole block).
  __shared__ int stop;
  // (The error word is not read here: it lies across the bus, and a kernel
  // started after the host's report stops at its first barrier's wait.)
  if (threadIdx.x == 0) stop = aborted(p.grid) ? 1 : 0;
  __syncthreads();
  if (stop != 0) return;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const auto source = [&p](const plan::DeviceOp& op, int src) -> const char* {
    if (op.sources_are_copies) return p.copies[src];
    return src == plan::kOwnInput ? p.input : p.slots[src];
  };
  for (int phase = 0; phase <= p.num_phases; ++phase) {
    for (int i = p.phase_begin[phase]; i < p.phase_begin[phase + 1]; ++i) {
      const plan::DeviceOp& op = p.ops[i];
      T* dst = reinterpret_cast<T*>(op.dst_is_output ? p.output : p.slots[p.rank]) + op.dst_offset;
      if (!op.is_reduce) {
        const T* src = reinterpret_cast<const T*>(source(op, op.sources[0])) + op.src_offsets[0];
        // An all-gather whose input lies in its output has its own block in place already.
        if (src == dst) continue;
        kernels::cuda::copy_bytes(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src),
                                  op.count * static_cast<int64_t>(sizeof(T)), tid, nthreads);
        continue;
      }
      const T* srcs[plan::kMaxDeviceRanks];
      for (int s = 0; s < op.num_sources; ++s) {
        srcs[s] = reinterpret_cast<const T*>(source(op, op.sources[s])) + op.src_offsets[s];
      }
      kernels::cuda::reduce_elements<T, Op>(dst, srcs, op.num_sources, op.count,
                                            op.finalize ? p.avg_divisor : 0, tid, nthreads);
    }
    if (phase < p.num_phases && !barrier_all_ranks(p, p.epoch_base + phase + 1)) return;
  }
}

// After a window failed to launch: no kernel of this rank announces its
// barriers now, so the peers would wait for it until their timeout. This one
// leaves the rank's stop word in their inboxes instead (the error word holds
// kLaunchFailed), after the rank's kernels still on the stream.
__global__ void tell_peers_launch_failed(WindowParams p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) tell_peers_stopped(p);
}

// A kernel's wait for a peer, in the globaltimer's nanoseconds.
uint64_t kernel_timeout_ns(std::chrono::milliseconds timeout) {
  return static_cast<uint64_t>(std::max<int64_t>(1, bounded_timeout(timeout).count())) * 1000000ull;
}

}  // namespace

CudaExecutor::CudaExecutor(CudaIpcChannel& channel, int ranks_on_this_gpu) : channel_(channel) {
  CudaDeviceGuard guard(channel.device());
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, channel.device()),
             "cudaDeviceGetAttribute");
  num_blocks_ = plan::device_blocks_per_rank(sms, ranks_on_this_gpu, kMaxBlocks);
  try {
    check_cuda(cudaMalloc(&grid_sync_, sizeof(GridSync)), "cudaMalloc");
    check_cuda(cudaMemset(grid_sync_, 0, sizeof(GridSync)), "cudaMemset");
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(unsigned int),
                             cudaHostAllocMapped),
               "cudaHostAlloc");
    *error_host_ = 0;
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_host_, 0),
               "cudaHostGetDevicePointer");
    // A build without code for this GPU (TORCH_CUDA_ARCH_LIST) fails here, in
    // the group's vote on the transport, rather than at the first launch.
    cudaFuncAttributes kernel{};
    check_cuda(cudaFuncGetAttributes(&kernel, window_kernel<float, kernels::ReduceOp::kSum>),
               "looking up xdev's kernel for this GPU (is its architecture in "
               "TORCH_CUDA_ARCH_LIST?)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  } catch (...) {
    if (grid_sync_ != nullptr) cudaFree(grid_sync_);
    if (error_host_ != nullptr) cudaFreeHost(error_host_);
    throw;
  }
}

CudaExecutor::~CudaExecutor() {
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(channel_.device());
  release_cache();
  if (grid_sync_ != nullptr) cudaFree(grid_sync_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  cudaGetLastError();
  if (previous >= 0) cudaSetDevice(previous);
}

void CudaExecutor::stop_kernels(unsigned int code) {
  // Where the host and the GPU cannot make atomics on host memory atomic with
  // each other (hostNativeAtomicSupported 0, as on many PCIe hosts), this and
  // a kernel's report may overwrite each other: the word then names either
  // cause, but never reads 0, so the kernels stop all the same.
  unsigned int none = 0;
  __atomic_compare_exchange_n(error_host_, &none, code, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

std::string CudaExecutor::device_error() const {
  return gpu_barrier::describe_error(__atomic_load_n(error_host_, __ATOMIC_ACQUIRE));
}

std::vector<CudaExecutor::DeviceWindow> CudaExecutor::compile(const Program& program,
                                                              cudaStream_t stream) const {
  std::vector<DeviceWindow> windows;
  try {
    for (int64_t k = 0; k < program.num_windows; ++k) {
      const plan::DeviceProgram prog = program.compile(k);
      DeviceWindow w;
      w.num_phases = prog.num_phases;
      w.phase_begin = prog.phase_begin;
      const size_t bytes = std::max<size_t>(1, prog.ops.size()) * sizeof(plan::DeviceOp);
      check_cuda(cudaMalloc(reinterpret_cast<void**>(&w.ops), bytes), "cudaMalloc");
      windows.push_back(w);
      if (!prog.ops.empty()) {
        // On the kernels' stream: a plain cudaMemcpy from pageable memory may
        // return before the bytes land, and our non-blocking stream would not
        // wait for it. Pageable sources are staged before this call returns.
        check_cuda(cudaMemcpyAsync(w.ops, prog.ops.data(), prog.ops.size() * sizeof(plan::DeviceOp),
                                   cudaMemcpyHostToDevice, stream),
                   "cudaMemcpyAsync");
      }
    }
  } catch (...) {
    for (DeviceWindow& w : windows) cudaFree(w.ops);
    throw;
  }
  return windows;
}

void CudaExecutor::release_cache() noexcept {
  for (auto& entry : cache_) {
    for (DeviceWindow& w : entry.second) cudaFree(w.ops);
  }
  cache_.clear();
  cached_windows_ = 0;
}

CudaExecutor::Program CudaExecutor::allreduce_program(const CudaPlanKey& key,
                                                      const plan::CollectivePlan& plan) const {
  const int rank = channel_.rank();
  return {key, plan.num_windows(),
          [&plan, rank](int64_t k) { return plan::compile_device_program(plan.window(k), rank); }};
}

CudaExecutor::Program CudaExecutor::in_place_program(int64_t total, kernels::DType dtype) const {
  const int rank = channel_.rank(), world = channel_.world_size();
  const auto elem_bytes = static_cast<int64_t>(kernels::element_size(dtype));
  CudaPlanKey key;
  key.collective = CudaPlanKey::kAllreduceInPlace;
  key.total = total;
  key.window_elems = elem_bytes;
  return {key, 1,
          [=](int64_t) { return plan::compile_in_place_program(total, elem_bytes, world, rank); }};
}

CudaExecutor::Program CudaExecutor::gather_scatter_program(
    const CudaPlanKey& key, const plan::GatherScatterPlan& plan) const {
  const int rank = channel_.rank();
  return {key, plan.num_windows(),
          [&plan, rank](int64_t k) { return plan::compile_gather_scatter_program(plan, k, rank); }};
}

void CudaExecutor::prepare(const std::vector<const Program*>& programs, cudaStream_t stream) {
  const std::string failed = device_error();
  if (!failed.empty()) throw CudaError("an earlier xdev GPU collective failed: " + failed);
  // An error left pending by earlier work on this thread would otherwise be
  // read after this call's launch as the launch's own, past the host barrier.
  check_cuda(cudaGetLastError(), "a CUDA error pending before an xdev collective");
  CudaDeviceGuard guard(channel_.device());
  size_t missing = 0;
  for (const Program* p : programs) {
    if (cache_.count(p->key) == 0) missing += static_cast<size_t>(p->num_windows);
  }
  // Bounded: a job with ever-changing sizes rebuilds instead of growing.
  constexpr size_t kMaxCachedWindows = 4096;
  if (missing > 0 && cached_windows_ + missing > kMaxCachedWindows) {
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // kernels may still read them
    release_cache();
  }
  for (const Program* p : programs) {
    if (cache_.count(p->key) != 0) continue;
    std::vector<DeviceWindow> windows = compile(*p, stream);
    cached_windows_ += windows.size();
    cache_.emplace(p->key, std::move(windows));
  }
}

void CudaExecutor::launch(const Program& program, uint32_t call_hash, const void* input,
                          void* output, kernels::DType dtype, kernels::ReduceOp op,
                          std::chrono::milliseconds timeout, cudaStream_t stream,
                          const std::vector<char*>& copies) {
  const bool in_place = program.key.collective == CudaPlanKey::kAllreduceInPlace;
  if (static_cast<int>(copies.size()) != (in_place ? channel_.world_size() : 0)) {
    throw std::invalid_argument(
        "CudaExecutor::launch: one copy per rank for the in-place "
        "program, none otherwise");
  }
  const auto cached = cache_.find(program.key);
  if (cached == cache_.end()) {
    throw std::logic_error("CudaExecutor::launch: a program that prepare() did not make ready");
  }
  const std::vector<DeviceWindow>& windows = cached->second;
  CudaDeviceGuard guard(channel_.device());
  WindowParams p{};
  p.rank = channel_.rank();
  p.world_size = channel_.world_size();
  for (int r = 0; r < p.world_size; ++r) p.inboxes[r] = channel_.inbox(r);
  for (size_t r = 0; r < copies.size(); ++r) p.copies[r] = copies[r];
  p.grid = static_cast<GridSync*>(grid_sync_);
  p.input = static_cast<const char*>(input);
  p.output = static_cast<char*>(output);
  p.avg_divisor = op == kernels::ReduceOp::kAvg ? p.world_size : 0;
  p.timeout_ns = kernel_timeout_ns(timeout);
  p.error = error_device_;
  p.call_hash = call_hash;
  for (const DeviceWindow& w : windows) {
    p.ops = w.ops;
    p.num_phases = w.num_phases;
    std::copy(w.phase_begin.begin(), w.phase_begin.end(), p.phase_begin);
    const int64_t parity = windows_run_++ & 1;
    for (int r = 0; r < p.world_size; ++r) p.slots[r] = channel_.slot(parity, r);
    p.epoch_base = epoch_;
    epoch_ += static_cast<uint64_t>(w.num_phases);
    kernels::cuda::dispatch(dtype, op, [&](auto type_tag, auto op_tag) {
      using T = typename decltype(type_tag)::type;
      constexpr kernels::ReduceOp kOp = decltype(op_tag)::value;
      window_kernel<T, kOp><<<num_blocks_, kThreads, 0, stream>>>(p);
    });
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) {
      // This rank's epoch is now past a barrier its peers wait at, so no later
      // call could meet theirs: stop its queued kernels and refuse every later
      // call (prepare reads the word).
      stop_kernels(gpu_barrier::kLaunchFailed);
      // Best effort: where the context itself is broken this launches nothing either.
      tell_peers_launch_failed<<<1, 1, 0, stream>>>(p);
      (void)cudaGetLastError();
      check_cuda(launched, "launching the xdev collective kernel");
    }
  }
}

}  // namespace xdev::transport
