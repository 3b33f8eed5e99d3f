#include "gather_scatter_executor.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "shared_buffer.h"
#include "single_copy_executor.h"

namespace xdev::transport {
namespace {

// Bytes a single-copy reduce pulls from each remote source per round: the
// bounce buffers and the output chunk stay in L2 while they are combined.
constexpr int64_t kReduceChunkBytes = 128 * 1024;

// What an AVG of req divides its results by (0: not an AVG).
int64_t avg_divisor(const GatherScatterRequest& req, int64_t world) {
  if (req.op != kernels::ReduceOp::kAvg) return 0;
  return req.avg_divisor > 0 ? req.avg_divisor : world;
}

// Where the slot coordinates of one window land in the tensors.
class WindowMap {
 public:
  WindowMap(const GatherScatterRequest& req, plan::Range block, int me)
      : req_(req),
        block_(block),
        me_(me),
        es_(static_cast<int64_t>(kernels::element_size(req.dtype))),
        reduce_scatter_(req.plan->kind() == plan::GatherScatterKind::kReduceScatter) {}

  // Calls fn(slot_offset, input, output, count) for every contiguous piece of
  // slot range r, in slot order. input/output point at the rank's own tensors
  // where the piece is in them, else null: the full tensor holds every rank's
  // piece, the block tensor only this rank's.
  template <typename Fn>
  void for_each_piece(plan::Range r, Fn&& fn) const {
    const int64_t p = block_.size();
    for (int64_t j = r.begin / p; j * p < r.end; ++j) {
      const int64_t lo = std::max(r.begin, j * p);
      const int64_t hi = std::min(r.end, (j + 1) * p);
      int64_t slot_pos = lo;
      const int64_t first = block_.begin + (lo - j * p);
      req_.block_layout->for_each_piece({first, first + (hi - lo)}, [&](size_t t, int64_t offset,
                                                                        int64_t count) {
        const int64_t start = req_.block_starts.empty() ? j * req_.block_layout->numel(t)
                                                        : req_.block_starts[static_cast<size_t>(j)];
        char* full = req_.full[t] + (start + offset) * es_;
        char* mine = j == me_ ? req_.block[t] + offset * es_ : nullptr;
        fn(slot_pos, reduce_scatter_ ? full : mine, reduce_scatter_ ? mine : full, count);
        slot_pos += count;
      });
    }
  }

 private:
  const GatherScatterRequest& req_;
  plan::Range block_;
  int me_;
  int64_t es_;
  bool reduce_scatter_;
};

// Where rank j's block of tensor t starts in the tensor's full tensor, and
// how many elements it holds.
int64_t block_start(const GatherScatterRequest& req, size_t t, int j) {
  return req.block_starts.empty() ? j * req.block_layout->numel(t)
                                  : req.block_starts[static_cast<size_t>(j)];
}
int64_t block_count(const GatherScatterRequest& req, size_t t, int j) {
  return req.block_starts.empty() ? req.block_layout->numel(t) : req.plan->block_elems(j);
}

// An all-gather's own piece, read once: into its slot for the peers and into
// its own output, a chunk at a time so that the second copy reads the chunk
// from L1 rather than from memory. Skips the output where the input already
// lies in it (FSDP's in-place all-gather).
void copy_to_slot_and_output(char* slot, char* output, const char* input, size_t bytes) {
  constexpr size_t kChunk = 16 * 1024;
  for (size_t at = 0; at < bytes; at += kChunk) {
    const size_t n = std::min(kChunk, bytes - at);
    std::memcpy(slot + at, input + at, n);
    if (output != input) std::memcpy(output + at, input + at, n);
  }
}

}  // namespace

bool GatherScatterExecutor::run(const GatherScatterRequest& req) {
  const plan::GatherScatterPlan& plan = *req.plan;
  const int me = channel_.rank();
  const auto es = static_cast<int64_t>(kernels::element_size(req.dtype));
  if (req.single_copy && plan.num_windows() > 0) {
    run_single_copy(req);
    return false;
  }
  if (plan.num_windows() == 0) {
    // Nothing to move, but peers may disagree: take part in the descriptor check.
    channel_.open_collective(req.ctx);
    if (req.after_check) req.after_check();
    return false;
  }
  const bool in_heap = static_cast<bool>(req.full_copies);
  const bool all_gather = plan.kind() == plan::GatherScatterKind::kAllGather;
  std::vector<const void*> sources;
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    const plan::GatherScatterWindow w = plan.window(k);
    const plan::Schedule& sched = w.schedule;
    const WindowMap map(req, w.block, me);
    const int64_t p = w.block.size();
    const auto stage_mine = [&](int64_t parity) {
      if (k == 0 && in_heap && all_gather) {
        // Should this run in place, peers read this rank's blocks from its
        // output: put them there before the barrier (FSDP's input already is).
        for (size_t t = 0; t < req.full.size(); ++t) {
          char* mine = req.full[t] + block_start(req, t, me) * es;
          if (mine != req.block[t]) {
            std::memmove(mine, req.block[t], static_cast<size_t>(block_count(req, t, me) * es));
          }
        }
      }
      char* slot = channel_.slot(parity, me);
      for (const plan::Range& r : sched.staged_ranges[static_cast<size_t>(me)]) {
        map.for_each_piece(r, [&](int64_t slot_pos, char* input, char* output, int64_t count) {
          char* staged = slot + plan.slot_memory_offset(me, slot_pos, p) * es;
          const auto bytes = static_cast<size_t>(count * es);
          if (all_gather && !in_heap) {
            copy_to_slot_and_output(staged, output, input, bytes);
          } else {  // a reduce-scatter; or the heap's output got the whole own block above
            std::memcpy(staged, input, bytes);
          }
        });
      }
    };
    // The first window's barrier also checks every rank's descriptor.
    const int64_t parity = k == 0 ? channel_.open_collective(req.ctx, stage_mine)
                                  : channel_.open_window(req.ctx, stage_mine);
    if (k == 0 && req.after_check) req.after_check();
    // Every rank has passed the first barrier and published where its full
    // tensor lies; all reach the same answer here (window 0's staging, done
    // in case, goes unused).
    if (k == 0 && in_heap && same_heap_place_on_every_rank(channel_, req.ctx.descriptor)) {
      run_in_place(req, req.full_copies());
      return true;
    }
    // One phase: every step reads slots staged before the barrier and writes
    // only this rank's output.
    for (const plan::Step& s : sched.steps) {
      if (s.actor != me) continue;
      // An all-gather's own piece went to its output while it was staged, or
      // before the first barrier in the heap (alone, a rank stages nothing
      // and copies it here).
      if (all_gather && s.sources[0] == plan::kOwnInput && channel_.world_size() > 1) continue;
      const int64_t divisor = s.finalize ? avg_divisor(req, channel_.world_size()) : 0;
      sources.resize(s.sources.size());
      map.for_each_piece(s.range, [&](int64_t slot_pos, char* input, char* output, int64_t count) {
        for (size_t i = 0; i < s.sources.size(); ++i) {
          sources[i] = s.sources[i] == plan::kOwnInput
                           ? input
                           : channel_.slot(parity, s.sources[i]) +
                                 plan.slot_memory_offset(s.sources[i], slot_pos, p) * es;
        }
        const auto bytes = static_cast<size_t>(count * es);
        if (s.kind == plan::StepKind::kReduce) {
          kernels::reduce(req.dtype, req.op, output, sources.data(),
                          static_cast<int>(sources.size()), count, divisor);
        } else if (output != sources[0]) {  // alone, FSDP's input already lies in its output
          std::memmove(output, sources[0], bytes);
        }
      });
    }
  }
  return false;
}

// Peers' inputs are ready (the first barrier). Each rank reads only what it
// keeps: a reduce-scatter its block of every rank's input, in rank order, so
// the sum is the staged one bit for bit; an all-gather each peer's block of
// the peer's output. Both read every source byte once and write each output
// byte once, so there is nothing a cache-sized window would reuse. The
// closing barrier keeps every full tensor alive and unchanged until no peer
// reads it: FSDP frees an all-gather output, or refills a reduce-scatter
// input, as soon as the call returns.
void GatherScatterExecutor::run_in_place(const GatherScatterRequest& req,
                                         const std::vector<char*>& full) {
  const int me = channel_.rank();
  const int world = channel_.world_size();
  const auto es = static_cast<int64_t>(kernels::element_size(req.dtype));
  const bool all_gather = req.plan->kind() == plan::GatherScatterKind::kAllGather;
  std::vector<const void*> sources(static_cast<size_t>(world));
  for (size_t t = 0; t < req.full.size(); ++t) {
    // Tensor t lies this far from tensor 0 in every rank's copy.
    const std::ptrdiff_t from_first = req.full[t] - req.full[0];
    const auto peer = [&](int r, int64_t elem) {
      return full[static_cast<size_t>(r)] + from_first + elem * es;
    };
    if (all_gather) {
      // Starting at the next rank spreads the readers over the owners.
      for (int step = 1; step < world; ++step) {
        const int owner = (me + step) % world;
        const int64_t at = block_start(req, t, owner);
        std::memcpy(req.full[t] + at * es, peer(owner, at),
                    static_cast<size_t>(block_count(req, t, owner) * es));
      }
    } else {
      const int64_t at = block_start(req, t, me);
      for (int r = 0; r < world; ++r) sources[static_cast<size_t>(r)] = peer(r, at);
      const int64_t divisor = avg_divisor(req, world);
      kernels::reduce(req.dtype, req.op, req.block[t], sources.data(), world,
                      block_count(req, t, me), divisor);
    }
  }
  channel_.barrier(req.ctx.deadline, req.ctx.what);  // no peer reads this rank's tensors any more
}

void GatherScatterExecutor::run_single_copy(const GatherScatterRequest& req) {
  const plan::GatherScatterPlan& plan = *req.plan;
  if (plan.num_windows() != 1 || req.full.size() != 1 || !req.block_starts.empty()) {
    throw std::invalid_argument(
        "single-copy gather/scatter needs one tensor, even blocks and one window");
  }
  const int me = channel_.rank();
  const int world = channel_.world_size();
  const auto es = static_cast<int64_t>(kernels::element_size(req.dtype));
  const uint64_t seq = req.ctx.descriptor.seq;
  const plan::GatherScatterWindow w = plan.window(0);
  const int64_t piece = w.block.size();  // the whole block
  const bool reduce_scatter = plan.kind() == plan::GatherScatterKind::kReduceScatter;
  // The buffer peers read and where slot offset x of rank j's slot lies in it:
  // the reduce-scatter input holds every piece at its slot offset, the
  // all-gather input only its owner's.
  char* const lent = reduce_scatter ? req.full[0] : req.block[0];
  const int64_t lent_elems = reduce_scatter ? world * piece : piece;
  const auto lent_offset = [&](int owner, int64_t x) {
    return static_cast<uint64_t>((reduce_scatter ? x : x - owner * piece) * es);
  };
  // The first barrier: every input is ready and lent (its slot set goes unused).
  channel_.open_collective(req.ctx, [&](int64_t) {
    channel_.publish_buffer(seq, lent, static_cast<uint64_t>(lent_elems * es));
  });
  if (req.after_check) req.after_check();
  const WindowMap map(req, w.block, me);
  const int64_t chunk = std::max<int64_t>(1, kReduceChunkBytes / es);
  std::vector<const void*> sources;
  for (const plan::Step& s : w.schedule.steps) {
    if (s.actor != me) continue;
    if (s.kind == plan::StepKind::kCopy) {
      map.for_each_piece(s.range, [&](int64_t x, char* input, char* output, int64_t count) {
        const auto bytes = static_cast<uint64_t>(count * es);
        if (s.sources[0] != plan::kOwnInput) {
          read_peer(channel_, s.sources[0], seq, lent_offset(s.sources[0], x), output, bytes);
        } else if (output != input) {
          std::memmove(output, input, bytes);
        }
      });
      continue;
    }
    const int64_t divisor = s.finalize ? avg_divisor(req, channel_.world_size()) : 0;
    if (bounce_.size() < s.sources.size()) bounce_.resize(s.sources.size());
    sources.resize(s.sources.size());
    for (int64_t lo = s.range.begin; lo < s.range.end; lo += chunk) {
      const plan::Range part{lo, std::min(s.range.end, lo + chunk)};
      map.for_each_piece(part, [&](int64_t x, char* input, char* output, int64_t count) {
        for (size_t i = 0; i < s.sources.size(); ++i) {
          const int src = s.sources[i];
          if (src == plan::kOwnInput) {
            sources[i] = input;
            continue;
          }
          std::vector<char>& buf = bounce_[i];
          if (buf.size() < static_cast<size_t>(kReduceChunkBytes)) buf.resize(kReduceChunkBytes);
          read_peer(channel_, src, seq, lent_offset(src, x), buf.data(),
                    static_cast<uint64_t>(count * es));
          sources[i] = buf.data();
        }
        kernels::reduce(req.dtype, req.op, output, sources.data(), static_cast<int>(sources.size()),
                        count, divisor);
      });
    }
  }
  channel_.barrier(req.ctx.deadline, req.ctx.what);  // no peer reads our input any more
}

}  // namespace xdev::transport
