#include "gather_scatter_predict.h"

#include <algorithm>
#include <stdexcept>

#include "predict.h"
#include "ring.h"

namespace xdev::plan {
namespace {

bool is_direct(GatherScatterForm f) {
  return f == GatherScatterForm::kSingleCopy || f == GatherScatterForm::kInPlace;
}

// The machine a single-copy read runs on: every read of a peer also crosses
// the reader's cross-process path and pays one call to start.
MachineModel with_cross_process_reads(const MachineModel& m) {
  if (!m.has_cross_process_read()) {
    throw std::invalid_argument("gather/scatter model: machine '" + m.name() +
                                "' has no cross-process read path for single copy");
  }
  MachineModel sc = m;
  for (int from = 0; from < m.num_devices(); ++from) {
    for (int to = 0; to < m.num_devices(); ++to) {
      if (from == to || !m.has_route(from, to)) continue;
      std::vector<int> route = m.route(from, to);
      route.push_back(m.cross_process_read(to));
      sc.set_route(from, to, std::move(route),
                   m.route_latency_s(from, to) + m.cross_process_call_s);
    }
  }
  return sc;
}

// The reduce-scatter (reduce phases and the totals' copy to the output) or
// all-gather half (forwarding phases and copies to the output) of the ring
// allreduce of `elems`. The all-gather half keeps the allreduce's stagers,
// which stage the whole range where it needs only the rank's block: on the
// GPU machines this reference is for, a copy within one GPU's memory.
Schedule ring_half(const MachineModel& m, GatherScatterKind kind, int64_t elems) {
  const int n = m.num_devices();
  Schedule full = ring_allreduce_schedule(n, reference_rings(m), {0, elems});
  Schedule half = full;
  half.steps.clear();
  for (const Step& s : full.steps) {
    const bool output = s.target == Target::kOutput;
    const bool reduce_half =
        s.phase <= n - 1 || (output && s.phase == n && s.sources[0] == s.actor &&
                             s.kind == StepKind::kCopy && s.finalize);
    if ((kind == GatherScatterKind::kReduceScatter) == reduce_half) half.steps.push_back(s);
  }
  return half;
}

// The ring reference's window in units: whole elements of every rank's
// block, so that predict_windowed_seconds can scale from a few windows (a
// window of no whole blocks was simulated in full, window by window: memory
// and time in proportion to the size).
int64_t ring_step_units(const MachineModel& m, int64_t unit, int64_t elem_bytes) {
  const int64_t granule = m.num_devices() * (elem_bytes / unit);  // one element per rank
  return std::max<int64_t>(granule, m.window_bytes / unit / granule * granule);
}

// One of xdev's forms (or the ring reference), simulated: the payload one
// window of the staged form (or of the ring) moves lets
// predict_windowed_seconds scale from a few windows (whole elements of every
// block, or no scaling).
double predict_form_seconds(const MachineModel& m, GatherScatterKind kind,
                            const GatherScatterCandidate& c, int64_t bytes, int64_t elem_bytes) {
  const int n = m.num_devices();
  const int64_t unit = kind == GatherScatterKind::kReduceScatter ? elem_bytes : 1;
  int64_t window = 0;
  if (c.ring_reference && m.window_bytes > 0) {
    window = ring_step_units(m, unit, elem_bytes) * unit;
  } else if (c.form == GatherScatterForm::kStaged && !c.ring_reference) {
    const int64_t slot = c.window_bytes > 0 ? c.window_bytes : m.window_bytes;
    if (slot > 0) {
      const int64_t per_rank = kind == GatherScatterKind::kReduceScatter
                                   ? std::max<int64_t>(1, slot / elem_bytes / n) * elem_bytes
                                   : std::max<int64_t>(n, slot);
      window = per_rank * n;
    }
  }
  if (window % elem_bytes != 0 || window / elem_bytes % n != 0) window = 0;
  return predict_windowed_seconds(m, bytes, window, [&](int64_t b) {
    return gather_scatter_program(m, kind, c, b, elem_bytes);
  });
}

}  // namespace

const char* to_string(GatherScatterForm f) {
  switch (f) {
    case GatherScatterForm::kStaged:
      return "staged";
    case GatherScatterForm::kSingleCopy:
      return "single_copy";
    case GatherScatterForm::kInPlace:
      return "in_place";
  }
  return "?";
}

std::string GatherScatterCandidate::label() const {
  if (ring_reference) return "ring (reference)";
  if (nccl) return nccl_candidate.label();
  std::string s = to_string(form);
  if (form == GatherScatterForm::kStaged && window_bytes > 0) {
    s += window_bytes % 1024 == 0 ? "/" + std::to_string(window_bytes / 1024) + "KiB"
                                  : "/" + std::to_string(window_bytes) + "B";
  }
  return s;
}

Program gather_scatter_program(const MachineModel& m, GatherScatterKind kind,
                               const GatherScatterCandidate& c, int64_t bytes, int64_t elem_bytes) {
  if (elem_bytes < 1) {
    throw std::invalid_argument("gather_scatter_program: elem_bytes must be >= 1");
  }
  if (bytes < 0) throw std::invalid_argument("gather_scatter_program: bytes must be >= 0");
  const int n = m.num_devices();
  // The executor reduces elements and moves bytes.
  const int64_t unit = kind == GatherScatterKind::kReduceScatter ? elem_bytes : 1;
  const int64_t block = bytes / elem_bytes / n * elem_bytes / unit;  // per rank, in units
  Program p;
  Task launch;
  launch.label = "launch";
  launch.latency_s = m.launch_latency_s;
  p.tasks.push_back(launch);
  if (block == 0) return p;

  std::vector<Schedule> windows;
  std::vector<int64_t> window_elems;
  if (c.ring_reference) {
    const int64_t total = block * n;
    const int64_t step = m.window_bytes > 0 ? ring_step_units(m, unit, elem_bytes) : total;
    for (int64_t lo = 0; lo < total; lo += step) {
      const int64_t len = std::min(step, total - lo);
      windows.push_back(ring_half(m, kind, len));
      window_elems.push_back(len);
    }
    append_windows(m, windows, window_elems, unit, p);
    return p;
  }
  int64_t slot_elems = block * n;  // direct forms: one window over the whole block
  if (c.form == GatherScatterForm::kStaged) {
    const int64_t window = c.window_bytes > 0 ? c.window_bytes : m.window_bytes;
    if (window > 0) slot_elems = std::max<int64_t>(n, window / unit);
  }
  const GatherScatterPlan plan(kind, n, block, slot_elems);
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    GatherScatterWindow w = plan.window(k);
    if (is_direct(c.form)) {
      // Peers read the inputs themselves: nothing is staged.
      w.schedule.stagers.clear();
      w.schedule.staged_ranges.clear();
    }
    window_elems.push_back(w.block.size() * n);
    windows.push_back(std::move(w.schedule));
  }
  if (!is_direct(c.form)) {
    append_windows(m, windows, window_elems, unit, p);
    return p;
  }
  const MachineModel sc =
      c.form == GatherScatterForm::kSingleCopy ? with_cross_process_reads(m) : MachineModel();
  const MachineModel& run_on = c.form == GatherScatterForm::kSingleCopy ? sc : m;
  const std::vector<std::vector<int>> ids = append_windows(run_on, windows, window_elems, unit, p);
  // Inputs stay lent until every peer has read them: one more barrier (a
  // flag hand-off on a machine without barriers).
  Task closing;
  closing.label = "closing barrier";
  closing.deps = ids.back();
  closing.latency_s = m.barrier_between_phases ? m.barrier_latency_s : m.step_latency_s;
  p.tasks.push_back(closing);
  return p;
}

GatherScatterPrediction predict_gather_scatter(const MachineModel& m, GatherScatterKind kind,
                                               const GatherScatterCandidate& c, int64_t bytes,
                                               int64_t elem_bytes) {
  GatherScatterPrediction pr;
  pr.candidate = c;
  pr.bytes = bytes;
  const int n = m.num_devices();
  pr.seconds = c.nccl ? predict_nccl_gather_scatter(m.nccl, c.nccl_candidate, n, bytes).seconds
                      : predict_form_seconds(m, kind, c, bytes, elem_bytes);
  pr.algbw = pr.seconds > 0 ? static_cast<double>(bytes) / pr.seconds : 0;
  pr.busbw = n > 1 ? pr.algbw * (n - 1) / n : pr.algbw;
  return pr;
}

std::vector<GatherScatterCandidate> gather_scatter_candidates(const MachineModel& m,
                                                              const GatherScatterOptions& opts) {
  std::vector<GatherScatterCandidate> out;
  const auto form = [](GatherScatterForm f, int64_t window_bytes) {
    GatherScatterCandidate c;
    c.form = f;
    c.window_bytes = window_bytes;
    return c;
  };
  out.push_back(form(GatherScatterForm::kStaged, m.window_bytes));
  if (opts.single_copy && m.has_cross_process_read()) {
    out.push_back(form(GatherScatterForm::kSingleCopy, 0));
  }
  if (opts.in_place) out.push_back(form(GatherScatterForm::kInPlace, 0));
  return out;
}

GatherScatterChoice choose_gather_scatter(const MachineModel& m, GatherScatterKind kind,
                                          int64_t bytes, const GatherScatterOptions& opts,
                                          bool with_ring_reference, int64_t elem_bytes) {
  GatherScatterChoice choice;
  for (const GatherScatterCandidate& c : gather_scatter_candidates(m, opts)) {
    choice.predictions.push_back(predict_gather_scatter(m, kind, c, bytes, elem_bytes));
    if (choice.predictions.size() == 1 || choice.predictions.back().seconds < choice.best.seconds) {
      choice.best = choice.predictions.back();
    }
  }
  choice.best_native = choice.best;
  if (opts.nccl && m.nccl.present && m.num_devices() > 1) {
    for (const NcclCandidate& nc : nccl_gather_scatter_candidates(m.nccl)) {
      GatherScatterCandidate c;
      c.nccl = true;
      c.nccl_candidate = nc;
      choice.predictions.push_back(predict_gather_scatter(m, kind, c, bytes, elem_bytes));
      const GatherScatterPrediction& p = choice.predictions.back();
      if (!choice.has_nccl || p.seconds < choice.best_nccl.seconds) choice.best_nccl = p;
      choice.has_nccl = true;
      if (p.seconds < choice.best.seconds) choice.best = p;
    }
  }
  if (with_ring_reference) {
    GatherScatterCandidate ring;
    ring.ring_reference = true;
    choice.predictions.push_back(predict_gather_scatter(m, kind, ring, bytes, elem_bytes));
  }
  return choice;
}

}  // namespace xdev::plan
