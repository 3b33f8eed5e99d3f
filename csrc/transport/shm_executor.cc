#include "shm_executor.h"

#include <algorithm>
#include <cstring>

namespace xdev::transport {

void ShmExecutor::barrier(const OpContext& ctx) {
  channel_.publish(ctx.descriptor);
  channel_.next_slot_set();
  channel_.barrier(ctx.deadline, ctx.what);
  channel_.check_same_descriptor(ctx.descriptor, ctx.describe, ctx.what);
}

// Copies this rank's payload pieces of the window into its slot.
void ShmExecutor::stage(const CollectiveRequest& req, const plan::WindowPlan& w, char* slot) const {
  const size_t es = kernels::element_size(req.dtype);
  for (const plan::Segment& seg : w.segments) {
    int64_t slot_pos = seg.slot_begin;
    req.layout->for_each_piece({seg.payload_begin, seg.payload_begin + seg.count},
                               [&](size_t t, int64_t offset, int64_t count) {
                                 std::memcpy(slot + slot_pos * es, req.tensors[t] + offset * es,
                                             static_cast<size_t>(count) * es);
                                 slot_pos += count;
                               });
  }
}

void ShmExecutor::run_step(const CollectiveRequest& req, const plan::WindowPlan& w,
                           const plan::Step& s, int64_t parity) const {
  const size_t es = kernels::element_size(req.dtype);
  const int64_t divisor =
      (s.finalize && req.op == kernels::ReduceOp::kAvg) ? channel_.world_size() : 0;
  const int n = static_cast<int>(s.sources.size());
  std::vector<const void*> sources(static_cast<size_t>(n));
  // Applies the step to one contiguous piece [slot_lo, slot_lo + count) whose
  // destination is dst.
  auto apply = [&](char* dst, int64_t slot_lo, int64_t count) {
    for (int i = 0; i < n; ++i) {
      sources[i] = channel_.slot(parity, s.sources[i]) + slot_lo * static_cast<int64_t>(es);
    }
    if (s.kind == plan::StepKind::kCopy) {
      if (dst != sources[0]) std::memcpy(dst, sources[0], static_cast<size_t>(count) * es);
    } else {
      kernels::reduce(req.dtype, req.op, dst, sources.data(), n, count, divisor);
    }
  };
  if (s.target == plan::Target::kStaging) {
    apply(channel_.slot(parity, s.actor) + s.range.begin * static_cast<int64_t>(es), s.range.begin,
          s.range.size());
    return;
  }
  // Output: map the slot range back through the window's segments to tensors.
  for (const plan::Segment& seg : w.segments) {
    const int64_t lo = std::max(s.range.begin, seg.slot_begin);
    const int64_t hi = std::min(s.range.end, seg.slot_begin + seg.count);
    if (hi <= lo) continue;
    const int64_t payload_lo = seg.payload_begin + (lo - seg.slot_begin);
    int64_t slot_pos = lo;
    req.layout->for_each_piece(
        {payload_lo, payload_lo + (hi - lo)}, [&](size_t t, int64_t offset, int64_t count) {
          apply(req.tensors[t] + offset * static_cast<int64_t>(es), slot_pos, count);
          slot_pos += count;
        });
  }
}

void ShmExecutor::run(const CollectiveRequest& req) {
  const plan::CollectivePlan& plan = *req.plan;
  const int me = channel_.rank();
  if (plan.num_windows() == 0) {
    // Nothing to move, but peers may disagree (they might have data): take
    // part in one barrier and the descriptor check like everyone else.
    barrier(req.ctx);
    return;
  }
  channel_.publish(req.ctx.descriptor);
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    const plan::WindowPlan w = plan.window(k);
    const int64_t parity = channel_.next_slot_set();
    const auto& stagers = w.schedule.stagers;
    if (std::find(stagers.begin(), stagers.end(), me) != stagers.end()) {
      stage(req, w, channel_.slot(parity, me));
    }
    channel_.barrier(req.ctx.deadline, req.ctx.what);
    if (k == 0) channel_.check_same_descriptor(req.ctx.descriptor, req.ctx.describe, req.ctx.what);
    for (int phase = 1; phase <= w.schedule.num_phases; ++phase) {
      for (const plan::Step& s : w.schedule.steps) {
        if (s.actor == me && s.phase == phase) run_step(req, w, s, parity);
      }
      if (phase < w.schedule.num_phases) channel_.barrier(req.ctx.deadline, req.ctx.what);
    }
  }
}

}  // namespace xdev::transport
