// The Work of a native CUDA collective and the event it completes with.
// Built only when torch has CUDA.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "../../transport/cuda_ipc_channel.h"
#include "../group_context.h"

namespace xdev::backend {

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
      transport::check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming),
                            "cudaEventCreate");
    }
    transport::check_cuda(cudaEventRecord(event_, stream.stream()), "cudaEventRecord");
    recorded_.store(true, std::memory_order_release);
  }
  // Whether record() has run (on any thread).
  bool recorded() const { return recorded_.load(std::memory_order_acquire); }
  // Work queued on stream after this call starts once the event has passed.
  void block(const c10::cuda::CUDAStream& stream) const {
    if (event_ == nullptr) return;  // never recorded: nothing to wait for
    transport::check_cuda(cudaStreamWaitEvent(stream.stream(), event_, 0), "cudaStreamWaitEvent");
  }
  bool query() const {
    if (event_ == nullptr) return true;
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    transport::check_cuda(status, "cudaEventQuery");
    return true;
  }

 private:
  cudaEvent_t event_ = nullptr;
  std::atomic<bool> recorded_{false};
};

// Polls `stream` with a growing sleep (up to 10 ms) until its work is done
// (true), or until give_up() says to stop waiting (false).
inline bool wait_for_stream(cudaStream_t stream, const std::function<bool()>& give_up) {
  auto pause = std::chrono::microseconds(50);
  while (true) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status != cudaErrorNotReady) {
      transport::check_cuda(status, "cudaStreamQuery");
      return true;
    }
    cudaGetLastError();  // cudaErrorNotReady is not an error to keep
    if (give_up()) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10));
  }
}

// The Work of a native CUDA collective. The host part (the barrier that checks
// every rank runs the same collective, and the launches) completes it; the GPU
// part is done when done_ has passed on the internal stream.
class CudaWork : public XdevWork {
 public:
  CudaWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
           c10::cuda::CUDAStream stream)
      : XdevWork(rank, type, title, outputs, {c10::Device(c10::kCUDA, stream.device_index())}),
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

  // Work.block_current_stream(): the caller's current stream waits for the
  // GPU work, and the host does not (as ProcessGroupNCCL's). c10d's default
  // releases the stream once the future completes, which here is when the
  // kernels are launched, not when they are done. The kernels are launched
  // when the call returns, unless CPU work of the group was queued ahead of
  // it: then this waits for the launch. A failure is the Work's to report, as
  // c10d documents for this call: nothing is raised here.
  void blockCurrentStream() override {
    if (!done_.recorded()) {
      try {
        XdevWork::wait();  // blocks the current stream once launched (synchronize)
      } catch (const std::exception&) {
        // Failed before launching: no GPU work to wait for.
      }
      return;
    }
    done_.block(c10::cuda::getCurrentCUDAStream(stream_.device_index()));
  }

  bool isCompleted() override { return XdevWork::isCompleted() && done_.query(); }

 private:
  c10::cuda::CUDAStream stream_;
  StreamEvent done_;
};

}  // namespace xdev::backend
