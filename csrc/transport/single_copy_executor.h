// Runs a schedule with no staging: rank r's "slot" is rank r's own tensor,
// and peers read it in place with process_vm_readv (cross-memory attach).
//
// Each byte then crosses memory once per reader instead of three times
// (copy in, reduce, copy out), which is what bounds the staged path at large
// sizes. The schedule must be the in-place variant (plan::in_place_variant):
// no rank writes a range a peer reads in the same phase. An extra barrier at
// the end keeps every tensor alive and unchanged until no peer reads it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/schedule.h"
#include "shm_channel.h"

namespace xdev::transport {

// Copies bytes [offset, offset + bytes) of the buffer rank lent for op seq
// (ShmChannel::publish_buffer) into dst, with process_vm_readv. Throws
// PeerError when that rank's process is gone.
void read_peer(const ShmChannel& channel, int rank, uint64_t seq, uint64_t offset, void* dst,
               uint64_t bytes);

struct SingleCopyRequest {
  const plan::Schedule* schedule = nullptr;  // in-place variant over [0, count)
  char* data = nullptr;                      // this rank's contiguous tensor
  int64_t count = 0;
  kernels::DType dtype = kernels::DType::kFloat32;
  kernels::ReduceOp op = kernels::ReduceOp::kSum;
  OpContext ctx;
};

class SingleCopyExecutor {
 public:
  // The channel must outlive the executor.
  explicit SingleCopyExecutor(ShmChannel& channel) : channel_(channel) {}

  void run(const SingleCopyRequest& req);

 private:
  void run_step(const SingleCopyRequest& req, const plan::Step& s);

  ShmChannel& channel_;
  std::vector<std::vector<char>> bounce_;  // one chunk per remote source of a reduce
};

}  // namespace xdev::transport
