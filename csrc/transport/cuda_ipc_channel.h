// The CUDA transport of one process group on one host: every rank allocates a
// device buffer (an inbox of barrier words, then two sets of staging slots),
// exports it with a CUDA IPC handle through the Store, and maps every peer's
// buffer once. Ranks on the same GPU work too: IPC maps the peer's allocation
// into this process's address space on that device.
//
// Torch-free: the Store is reached through two callbacks, so this file
// compiles (and is compile-checked in CI) with nvcc alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../plan/device_program.h"

namespace xdev::transport {

// A CUDA runtime call failed; the message names the call and CUDA's reason.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws CudaError for anything but cudaSuccess (and clears the error state).
void check_cuda(cudaError_t status, const char* call);

// Whether `stream` is capturing a CUDA graph (a capture forbids allocating,
// synchronizing and waiting on the host for it).
bool stream_is_capturing(cudaStream_t stream);

// Makes `device` current for its lifetime and restores the previous one.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

class CudaIpcChannel {
 public:
  using Publish = std::function<void(const std::string& key, const std::string& value)>;
  using Fetch = std::function<std::string(const std::string& key)>;  // blocks until set

  // The inbox: one 64-bit word per source rank, written by that rank's kernel
  // (the barrier epoch it reached) and polled by this rank's kernel.
  static constexpr size_t kInboxBytes = 4096;

  // Collective: every rank of the group calls it with the same world_size and
  // slot_bytes (a multiple of 256). Keys are "<prefix><rank>".
  CudaIpcChannel(int rank, int world_size, int device, size_t slot_bytes,
                 const std::string& key_prefix, const Publish& publish, const Fetch& fetch);
  ~CudaIpcChannel();  // unmaps peers, frees the buffer; never throws
  CudaIpcChannel(const CudaIpcChannel&) = delete;
  CudaIpcChannel& operator=(const CudaIpcChannel&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  size_t slot_bytes() const { return slot_bytes_; }

  // Device pointers, valid in this process: rank r's slot in set `parity`
  // (0 or 1) and rank r's inbox.
  char* slot(int64_t parity, int r) const;
  uint64_t* inbox(int r) const;

 private:
  void release() noexcept;

  int rank_ = 0;
  int world_size_ = 0;
  int device_ = 0;
  size_t slot_bytes_ = 0;
  char* local_ = nullptr;     // this rank's buffer (cudaMalloc)
  std::vector<char*> bases_;  // every rank's buffer as mapped here (local_ for this rank)
};

}  // namespace xdev::transport
