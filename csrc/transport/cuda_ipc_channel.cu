#include "cuda_ipc_channel.h"

#include <cuda_runtime.h>

#include <cstring>

namespace xdev::transport {
namespace {

std::string to_hex(const void* data, size_t n) {
  static const char digits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    s.push_back(digits[p[i] >> 4]);
    s.push_back(digits[p[i] & 15]);
  }
  return s;
}

void from_hex(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) throw CudaError("CUDA IPC: a peer published a malformed handle");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw CudaError("CUDA IPC: a peer published a malformed handle");
  };
  auto* p = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i) {
    p[i] = static_cast<unsigned char>(nibble(s[2 * i]) * 16 + nibble(s[2 * i + 1]));
  }
}

}  // namespace

void check_cuda(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear the (non-sticky) error so later calls are not blamed
  throw CudaError(std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                  cudaGetErrorString(status) + ")");
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t asked = cudaStreamIsCapturing(stream, &status);
  if (asked == cudaErrorStreamCaptureImplicit) {
    // The legacy default stream while another thread captures in global mode:
    // using it would spoil that capture, so it counts as capturing.
    cudaGetLastError();
    return true;
  }
  check_cuda(asked, "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

CudaDeviceGuard::CudaDeviceGuard(int device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
}

CudaDeviceGuard::~CudaDeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

CudaIpcChannel::CudaIpcChannel(int rank, int world_size, int device, size_t slot_bytes,
                               const std::string& key_prefix, const Publish& publish,
                               const Fetch& fetch)
    : rank_(rank), world_size_(world_size), device_(device), slot_bytes_(slot_bytes) {
  if (world_size < 1 || world_size > plan::kMaxDeviceRanks || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("CUDA IPC channel: " + std::to_string(world_size) +
                                " ranks; the GPU path supports 1.." +
                                std::to_string(plan::kMaxDeviceRanks));
  }
  if (slot_bytes == 0 || slot_bytes % 256 != 0) {
    throw std::invalid_argument("CUDA IPC channel: slot bytes must be a positive multiple of 256");
  }
  CudaDeviceGuard guard(device);
  const size_t bytes = kInboxBytes + 2 * slot_bytes;
  const std::string my_key = key_prefix + std::to_string(rank);
  std::string handle_hex;
  try {
    check_cuda(cudaMalloc(&local_, bytes), "cudaMalloc (xdev staging buffer)");
    // Inbox words start at 0 ("no barrier reached yet"), and must be 0 before
    // any peer can map the buffer and write them.
    check_cuda(cudaMemset(local_, 0, kInboxBytes), "cudaMemset");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cudaIpcMemHandle_t handle;
    check_cuda(cudaIpcGetMemHandle(&handle, local_), "cudaIpcGetMemHandle");
    handle_hex = to_hex(&handle, sizeof(handle));
  } catch (...) {
    release();            // first: publishing may throw too (a store gone)
    publish(my_key, "");  // peers waiting for our handle fail instead of hanging
    throw;
  }
  try {
    publish(my_key, handle_hex);
  } catch (...) {
    release();
    throw;
  }
  try {
    bases_.assign(static_cast<size_t>(world_size), nullptr);
    bases_[rank] = local_;
    for (int r = 0; r < world_size; ++r) {
      if (r == rank) continue;
      const std::string peer_hex = fetch(key_prefix + std::to_string(r));
      if (peer_hex.empty()) {
        throw CudaError("CUDA IPC: rank " + std::to_string(r) +
                        " could not allocate or export its staging buffer (see its log)");
      }
      cudaIpcMemHandle_t peer;
      from_hex(peer_hex, &peer, sizeof(peer));
      void* mapped = nullptr;
      check_cuda(cudaIpcOpenMemHandle(&mapped, peer, cudaIpcMemLazyEnablePeerAccess),
                 "cudaIpcOpenMemHandle (a peer's xdev staging buffer)");
      bases_[r] = static_cast<char*>(mapped);
    }
  } catch (...) {
    release();
    throw;
  }
}

CudaIpcChannel::~CudaIpcChannel() {
  release();
}

void CudaIpcChannel::release() noexcept {
  int previous = -1;
  const bool restore = cudaGetDevice(&previous) == cudaSuccess && previous != device_;
  if (restore) cudaSetDevice(device_);
  for (size_t r = 0; r < bases_.size(); ++r) {
    if (static_cast<int>(r) != rank_ && bases_[r] != nullptr) cudaIpcCloseMemHandle(bases_[r]);
  }
  bases_.clear();
  if (local_ != nullptr) cudaFree(local_);
  local_ = nullptr;
  cudaGetLastError();  // errors at teardown (e.g. the driver already gone) are not reported
  if (restore) cudaSetDevice(previous);
}

char* CudaIpcChannel::slot(int64_t parity, int r) const {
  return bases_[static_cast<size_t>(r)] + kInboxBytes +
         static_cast<size_t>(parity & 1) * slot_bytes_;
}

uint64_t* CudaIpcChannel::inbox(int r) const {
  return reinterpret_cast<uint64_t*>(bases_[static_cast<size_t>(r)]);
}

}  // namespace xdev::transport
