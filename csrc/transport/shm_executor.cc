#include "shm_executor.h"

#include <algorithm>
#include <cstring>

namespace xdev::transport {

void ShmExecutor::barrier(const OpContext& ctx) {
  channel_.open_collective(ctx);
}

namespace {

// Calls fn(slot_offset, tensor_data, count) for every contiguous piece of the
// payload that slot range r of window w holds, in slot order.
template <typename Fn>
void for_each_payload_piece(const CollectiveRequest& req, const plan::WindowPlan& w, plan::Range r,
                            Fn&& fn) {
  const auto es = static_cast<int64_t>(kernels::element_size(req.dtype));
  for (const plan::Segment& seg : w.segments) {
    const int64_t lo = std::max(r.begin, seg.slot_begin);
    const int64_t hi = std::min(r.end, seg.slot_begin + seg.count);
    if (hi <= lo) continue;
    int64_t slot_pos = lo;
    const int64_t payload_lo = seg.payload_begin + (lo - seg.slot_begin);
    req.layout->for_each_piece({payload_lo, payload_lo + (hi - lo)},
                               [&](size_t t, int64_t offset, int64_t count) {
                                 fn(slot_pos, req.tensors[t] + offset * es, count);
                                 slot_pos += count;
                               });
  }
}

}  // namespace

const plan::Schedule& ShmExecutor::forwarded(const plan::Schedule& s) {
  // The empty initial last_schedule_ (world size 0) matches no real schedule.
  if (!(s == last_schedule_)) {
    last_schedule_ = s;
    last_forwarded_ = plan::hand_back_totals(plan::forward_own_input(s));
  }
  return last_forwarded_;
}

// Copies this rank's payload pieces of the window's staged ranges into its slot.
void ShmExecutor::stage(const CollectiveRequest& req, const plan::WindowPlan& w,
                        const plan::Schedule& sched, char* slot) const {
  const size_t es = kernels::element_size(req.dtype);
  const auto copy_in = [&](int64_t slot_pos, const char* data, int64_t count) {
    std::memcpy(slot + slot_pos * static_cast<int64_t>(es), data, static_cast<size_t>(count) * es);
  };
  if (sched.staged_ranges.empty()) {
    for_each_payload_piece(req, w, {0, w.slot_elems}, copy_in);
    return;
  }
  for (const plan::Range& r : sched.staged_ranges[static_cast<size_t>(channel_.rank())]) {
    for_each_payload_piece(req, w, r, copy_in);
  }
}

void ShmExecutor::run_step(const CollectiveRequest& req, const plan::WindowPlan& w,
                           const plan::Step& s, int64_t parity) const {
  const auto es = static_cast<int64_t>(kernels::element_size(req.dtype));
  const int64_t divisor =
      (s.finalize && req.op == kernels::ReduceOp::kAvg) ? channel_.world_size() : 0;
  const int n = static_cast<int>(s.sources.size());
  std::vector<const void*> sources(static_cast<size_t>(n));
  char* const target_slot = channel_.slot(parity, plan::written_slot(s));
  // A total handed back to a peer's slot overwrites the input the peer staged
  // there (hand_back_totals): those lines sit in the peer's cache.
  const kernels::DstLines dst_lines = s.target == plan::Target::kStaging && s.slot_owner >= 0
                                          ? kernels::DstLines::kPeerCache
                                          : kernels::DstLines::kLocal;
  // Applies the step to slot elements [slot_lo, slot_lo + count), whose payload
  // lives at tensor (null where the slot holds no payload).
  auto apply = [&](int64_t slot_lo, char* tensor, int64_t count) {
    for (int i = 0; i < n; ++i) {
      sources[i] = s.sources[i] == plan::kOwnInput
                       ? tensor
                       : channel_.slot(parity, s.sources[i]) + slot_lo * es;
    }
    char* dst = s.target == plan::Target::kOutput ? tensor : target_slot + slot_lo * es;
    char* also = s.also_output ? tensor : nullptr;
    const auto bytes = static_cast<size_t>(count * es);
    if (s.kind == plan::StepKind::kCopy) {
      if (s.sources[0] == s.actor && dst != sources[0]) {
        // Left in forwarded form, a copy out of one's own slot reads a total a
        // peer handed back there; this rank stages into those lines next.
        kernels::copy_taking_source(dst, sources[0], bytes);
      } else if (dst != sources[0]) {
        std::memcpy(dst, sources[0], bytes);
      }
      if (also != nullptr) std::memcpy(also, dst, bytes);
    } else {
      kernels::reduce(req.dtype, req.op, dst, sources.data(), n, count, divisor, also, dst_lines);
    }
  };
  if (s.target == plan::Target::kStaging && !s.also_output && !plan::reads_own_input(s)) {
    // Slot to slot: the whole range, payload or not.
    apply(s.range.begin, nullptr, s.range.size());
    return;
  }
  for_each_payload_piece(req, w, s.range, apply);
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
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    const plan::WindowPlan w = plan.window(k);
    const plan::Schedule& sched = forwarded(w.schedule);
    const auto stage_mine = [&](int64_t parity) {
      const auto& stagers = sched.stagers;
      if (std::find(stagers.begin(), stagers.end(), me) != stagers.end()) {
        stage(req, w, sched, channel_.slot(parity, me));
      }
    };
    // The first window's barrier also checks every rank's descriptor.
    const int64_t parity = k == 0 ? channel_.open_collective(req.ctx, stage_mine)
                                  : channel_.open_window(req.ctx, stage_mine);
    if (k == 0 && req.after_first_barrier && req.after_first_barrier()) return;
    for (int phase = 1; phase <= sched.num_phases; ++phase) {
      for (const plan::Step& s : sched.steps) {
        if (s.actor == me && s.phase == phase) run_step(req, w, s, parity);
      }
      if (phase < sched.num_phases) channel_.barrier(req.ctx.deadline, req.ctx.what);
    }
  }
}

}  // namespace xdev::transport
