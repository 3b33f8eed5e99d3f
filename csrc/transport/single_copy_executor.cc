#include "single_copy_executor.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace xdev::transport {
namespace {

// Bytes a reduce pulls from each remote source per round: the bounce buffers
// and the destination chunk stay in L2 while they are combined.
constexpr uint64_t kReduceChunkBytes = 128 * 1024;

}  // namespace

void read_peer(const ShmChannel& channel, int rank, uint64_t seq, uint64_t offset, void* dst,
               uint64_t bytes) {
  const ShmChannel::PeerBuffer peer = channel.buffer_of(rank, seq);
  if (offset + bytes > peer.bytes) {
    throw std::runtime_error("xdev single-copy: read past " + channel.rank_name(rank) +
                             "'s buffer");
  }
  auto* out = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < bytes) {
    iovec local{out + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(peer.address + offset + done), bytes - done};
    const ssize_t n = ::process_vm_readv(peer.pid, &local, 1, &remote, 1, 0);
    if (n > 0) {
      done += static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == ESRCH) {
      throw PeerError("xdev: " + channel.rank_name(rank) + " (pid " + std::to_string(peer.pid) +
                      ") exited while its tensor was being read");
    }
    throw std::runtime_error("xdev single-copy: process_vm_readv from " + channel.rank_name(rank) +
                             ": " + (n < 0 ? std::strerror(errno) : "no progress"));
  }
}

void SingleCopyExecutor::run_step(const SingleCopyRequest& req, const plan::Step& s) {
  const int me = channel_.rank();
  const uint64_t es = kernels::element_size(req.dtype);
  const uint64_t seq = req.ctx.descriptor.seq;
  if (s.kind == plan::StepKind::kCopy) {
    read_peer(channel_, s.sources[0], seq, s.range.begin * es, req.data + s.range.begin * es,
              s.range.size() * es);
    return;
  }
  const int n = static_cast<int>(s.sources.size());
  if (bounce_.size() < s.sources.size()) bounce_.resize(s.sources.size());
  std::vector<const void*> ptrs(s.sources.size());
  const int64_t chunk = static_cast<int64_t>(kReduceChunkBytes / es);
  const int64_t divisor =
      (s.finalize && req.op == kernels::ReduceOp::kAvg) ? channel_.world_size() : 0;
  for (int64_t lo = s.range.begin; lo < s.range.end; lo += chunk) {
    const int64_t count = std::min(chunk, s.range.end - lo);
    for (int i = 0; i < n; ++i) {
      const int src = s.sources[i];
      if (src == me) {
        ptrs[i] = req.data + lo * es;
        continue;
      }
      auto& buf = bounce_[i];
      if (buf.size() < kReduceChunkBytes) buf.resize(kReduceChunkBytes);
      read_peer(channel_, src, seq, lo * es, buf.data(), count * es);
      ptrs[i] = buf.data();
    }
    kernels::reduce(req.dtype, req.op, req.data + lo * es, ptrs.data(), n, count, divisor);
  }
}

void SingleCopyExecutor::run(const SingleCopyRequest& req) {
  const int me = channel_.rank();
  const uint64_t es = kernels::element_size(req.dtype);
  // The first barrier: every tensor is ready and lent (its slot set goes unused).
  channel_.open_collective(req.ctx, [&](int64_t) {
    channel_.publish_buffer(req.ctx.descriptor.seq, req.data,
                            static_cast<uint64_t>(req.count) * es);
  });
  const plan::Schedule& sched = *req.schedule;
  for (int phase = 1; phase <= sched.num_phases; ++phase) {
    for (const plan::Step& s : sched.steps) {
      if (s.actor == me && s.phase == phase) run_step(req, s);
    }
    if (phase < sched.num_phases) channel_.barrier(req.ctx.deadline, req.ctx.what);
  }
  channel_.barrier(req.ctx.deadline, req.ctx.what);  // no peer reads our tensor any more
}

}  // namespace xdev::transport
