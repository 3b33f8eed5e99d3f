#include "shared_buffer.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "../plan/shared_buffer_plan.h"

namespace xdev::transport {
namespace {

// A slice is reduced in pieces of this size, so the total written to the
// first copy is still in L1/L2 when it is copied to the others (3+ ranks).
constexpr int64_t kPieceBytes = 64 * 1024;

}  // namespace

SharedBuffer::SharedBuffer(int64_t id, int rank, std::vector<ShmSegment> segments)
    : id_(id), rank_(rank), segments_(std::move(segments)) {
  if (rank < 0 || rank >= static_cast<int>(segments_.size())) {
    throw std::invalid_argument("SharedBuffer: rank out of range");
  }
}

int64_t SharedBuffer::offset_of(const void* p, size_t n) const {
  const auto begin = reinterpret_cast<uintptr_t>(data(rank_));
  const auto at = reinterpret_cast<uintptr_t>(p);
  if (at < begin || at - begin > bytes() || n > bytes() - (at - begin)) return -1;
  return static_cast<int64_t>(at - begin);
}

bool same_heap_place_on_every_rank(const ShmChannel& channel, const OpDescriptor& mine) {
  if (mine.heap_arena < 0) return false;
  for (int r = 0; r < channel.world_size(); ++r) {
    const OpDescriptor peer = channel.descriptor_of(r, mine.seq);
    if (peer.heap_arena != mine.heap_arena || peer.heap_offset != mine.heap_offset) return false;
  }
  return true;
}

bool SharedBufferExecutor::run(const SharedBufferRequest& req) {
  channel_.open_collective(req.ctx);  // every rank's input is ready (its slot set goes unused)
  return run_opened(req);
}

bool SharedBufferExecutor::run_opened(const SharedBufferRequest& req) {
  const int me = channel_.rank();
  const int world = channel_.world_size();
  const auto es = static_cast<int64_t>(kernels::element_size(req.dtype));
  const OpDescriptor& mine = req.ctx.descriptor;
  if (mine.heap_arena >= 0 && !same_heap_place_on_every_rank(channel_, mine)) return false;
  const std::vector<char*> copies = req.copies();

  const plan::Range slice =
      plan::shared_buffer_slices(req.count, es, world)[static_cast<size_t>(me)];
  const int64_t divisor = req.op == kernels::ReduceOp::kAvg ? world : 0;
  const int first_peer = (me + 1) % world;
  std::vector<const void*> sources(static_cast<size_t>(world));
  for (int64_t lo = slice.begin; lo < slice.end; lo += kPieceBytes / es) {
    const int64_t n = std::min(kPieceBytes / es, slice.end - lo);
    const int64_t at = lo * es;
    for (int r = 0; r < world; ++r)
      sources[static_cast<size_t>(r)] = copies[static_cast<size_t>(r)] + at;
    // The sum goes to this rank's copy and one peer's in the same pass (both
    // are sources at the same address, which reduce allows), then to the rest.
    char* const total = copies[static_cast<size_t>(me)] + at;
    kernels::reduce(req.dtype, req.op, total, sources.data(), world, n, divisor,
                    copies[static_cast<size_t>(first_peer)] + at);
    for (int r = 0; r < world; ++r) {
      if (r != me && r != first_peer) {
        std::memcpy(copies[static_cast<size_t>(r)] + at, total, static_cast<size_t>(n * es));
      }
    }
  }
  channel_.barrier(req.ctx.deadline, req.ctx.what);  // every total is in every copy
  return true;
}

}  // namespace xdev::transport
