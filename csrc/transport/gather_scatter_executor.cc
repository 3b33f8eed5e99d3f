#include "gather_scatter_executor.h"

#include <algorithm>
#include <cstring>

namespace xdev::transport {
namespace {

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
      req_.block_layout->for_each_piece(
          {first, first + (hi - lo)}, [&](size_t t, int64_t offset, int64_t count) {
            char* full = req_.full[t] + (j * req_.block_layout->numel(t) + offset) * es_;
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

}  // namespace

void GatherScatterExecutor::run(const GatherScatterRequest& req) {
  const plan::GatherScatterPlan& plan = *req.plan;
  const int me = channel_.rank();
  const auto es = static_cast<int64_t>(kernels::element_size(req.dtype));
  if (plan.num_windows() == 0) {
    // Nothing to move, but peers may disagree: take part in the descriptor check.
    channel_.open_collective(req.ctx);
    return;
  }
  std::vector<const void*> sources;
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    const plan::GatherScatterWindow w = plan.window(k);
    const plan::Schedule& sched = w.schedule;
    const WindowMap map(req, w.block, me);
    const auto stage_mine = [&](int64_t parity) {
      char* slot = channel_.slot(parity, me);
      for (const plan::Range& r : sched.staged_ranges[static_cast<size_t>(me)]) {
        map.for_each_piece(r, [&](int64_t slot_pos, char* input, char*, int64_t count) {
          std::memcpy(slot + slot_pos * es, input, static_cast<size_t>(count * es));
        });
      }
    };
    // The first window's barrier also checks every rank's descriptor.
    const int64_t parity = k == 0 ? channel_.open_collective(req.ctx, stage_mine)
                                  : channel_.open_window(req.ctx, stage_mine);
    // One phase: every step reads slots staged before the barrier and writes
    // only this rank's output.
    for (const plan::Step& s : sched.steps) {
      if (s.actor != me) continue;
      const int64_t divisor =
          (s.finalize && req.op == kernels::ReduceOp::kAvg) ? channel_.world_size() : 0;
      sources.resize(s.sources.size());
      map.for_each_piece(s.range, [&](int64_t slot_pos, char* input, char* output, int64_t count) {
        for (size_t i = 0; i < s.sources.size(); ++i) {
          sources[i] = s.sources[i] == plan::kOwnInput
                           ? input
                           : channel_.slot(parity, s.sources[i]) + slot_pos * es;
        }
        const auto bytes = static_cast<size_t>(count * es);
        if (s.kind == plan::StepKind::kReduce) {
          kernels::reduce(req.dtype, req.op, output, sources.data(),
                          static_cast<int>(sources.size()), count, divisor);
        } else if (output != sources[0]) {
          // An all-gather's input may lie inside its output (FSDP's in-place
          // all-gather): then its own piece is already in place.
          std::memmove(output, sources[0], bytes);
        }
      });
    }
  }
}

}  // namespace xdev::transport
