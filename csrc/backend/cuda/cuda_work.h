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
#include <memory>
#include <mutex>
#include <string>
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

// Polls done() with a growing sleep (up to 10 ms) until it says the work is
// done (true), or until give_up() says to stop waiting (false).
inline bool poll_until_done(const std::function<bool()>& done,
                            const std::function<bool()>& give_up) {
  auto pause = std::chrono::microseconds(50);
  while (!done()) {
    if (give_up()) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10));
  }
  return true;
}

// The same for everything queued on `stream`.
inline bool wait_for_stream(cudaStream_t stream, const std::function<bool()>& give_up) {
  return poll_until_done(
      [stream] {
        const cudaError_t status = cudaStreamQuery(stream);
        if (status == cudaErrorNotReady) {
          cudaGetLastError();  // not an error to keep
          return false;
        }
        transport::check_cuda(status, "cudaStreamQuery");
        return true;
      },
      give_up);
}

// What a kernel of the group reported when it gave up
// (CudaExecutor::device_error), for Works that may outlive the group: it
// reports nothing once the group has shut down its executor.
class DeviceErrorProbe {
 public:
  void attach(std::function<std::string()> read) {
    std::lock_guard<std::mutex> lock(mutex_);
    read_ = std::move(read);
  }
  void detach() {
    std::lock_guard<std::mutex> lock(mutex_);
    read_ = nullptr;
  }
  std::string read() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return read_ ? read_() : std::string();
  }

 private:
  mutable std::mutex mutex_;
  std::function<std::string()> read_;
};

// The Work of a native CUDA collective. The host part (the barrier that checks
// every rank runs the same collective, and the launches) completes it; the GPU
// part is done when done_ has passed on the internal stream.
class CudaWork : public XdevWork {
 public:
  CudaWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
           c10::cuda::CUDAStream stream, std::shared_ptr<const DeviceErrorProbe> device_error)
      : XdevWork(rank, type, title, outputs, {c10::Device(c10::kCUDA, stream.device_index())}),
        stream_(stream),
        device_error_(std::move(device_error)) {}

  // Without a timeout, as ProcessGroupNCCL: the host part, then the caller's
  // stream waits for the GPU work (synchronize). With one
  // (work.wait(timeout=...)), as ProcessGroupNCCL and as c10d asks of a
  // backend: the host also waits until the GPU work is done, and raises here
  // if it is not done within the timeout or a kernel gave up, instead of
  // leaving that to the group's next call.
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override {
    const auto start = std::chrono::steady_clock::now();
    XdevWork::wait(timeout);
    if (timeout == ::kNoTimeout) return true;
    const bool done =
        poll_until_done([this] { return done_.query(); },
                        [&] { return std::chrono::steady_clock::now() - start > timeout; });
    if (!done) {
      C10_THROW_ERROR(DistBackendError,
                      "xdev: " + std::string(c10d::opTypeToString(retrieveOpType())) +
                          ": the GPU work was not done within the timeout given to wait() (" +
                          std::to_string(timeout.count()) + " ms); it goes on, and the group " +
                          "reports its outcome at its next call");
    }
    const std::string failed = device_error_ ? device_error_->read() : std::string();
    if (!failed.empty()) C10_THROW_ERROR(DistBackendError, "xdev: " + failed);
    return true;
  }

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
  std::shared_ptr<const DeviceErrorProbe> device_error_;
  StreamEvent done_;
};

}  // namespace xdev::backend
