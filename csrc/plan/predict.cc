#include "predict.h"

#include <algorithm>
#include <stdexcept>

#include "balanced_plan.h"
#include "collective_plan.h"
#include "packing.h"
#include "ring.h"

namespace xdev::plan {

std::string Candidate::label() const {
  if (ring_reference) return "ring (reference)";
  if (nccl) return nccl_candidate.label();
  std::string s = to_string(algorithm);
  if (algorithm == Algorithm::kHierarchicalCopy || algorithm == Algorithm::kHierarchicalBalanced) {
    s += "/" + std::to_string(num_packs);
  }
  return s;
}

namespace {

bool same_slices(const std::vector<PackSlice>& a, const std::vector<PackSlice>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const PackSlice& x, const PackSlice& y) {
                      return x.pack_id == y.pack_id && x.range == y.range;
                    });
}

}  // namespace

std::vector<std::vector<int>> reference_rings(const MachineModel& m) {
  std::vector<std::vector<int>> rings = find_rings(m.links);
  // Through a switch every pair counts as joined by all of a GPU's links, so
  // the search finds far more link-disjoint rings (126 on an HGX H100) than
  // NCCL opens, one per channel. As many rings carry the same bytes through
  // the same ports at a fraction of the simulation's work. The rings come in
  // (cycle, reverse) pairs; an even count keeps the pairs whole.
  const size_t channels = static_cast<size_t>(m.nccl.channels);
  if (m.nccl.present && channels >= 2 && rings.size() > channels) rings.resize(channels / 2 * 2);
  return rings;
}

Program allreduce_program(const MachineModel& m, const Candidate& c, int64_t bytes,
                          int64_t elem_bytes) {
  if (elem_bytes < 1) throw std::invalid_argument("allreduce_program: elem_bytes must be >= 1");
  if (bytes < 0) throw std::invalid_argument("allreduce_program: bytes must be >= 0");
  const int n = m.num_devices();
  const int64_t total = bytes / elem_bytes;
  Program p;
  Task launch;
  launch.label = "launch";
  launch.latency_s = m.launch_latency_s;
  p.tasks.push_back(launch);
  if (total == 0) return p;
  const int64_t window_elems =
      m.window_bytes > 0 ? std::max<int64_t>(1, m.window_bytes / elem_bytes) : total;

  std::vector<Schedule> windows;
  std::vector<int64_t> window_sizes;
  std::vector<std::vector<Range>> window_packs;  // pipeline order of each window's packs
  if (c.ring_reference) {
    const auto rings = reference_rings(m);
    for (int64_t lo = 0; lo < total; lo += window_elems) {
      const int64_t len = std::min(window_elems, total - lo);
      windows.push_back(ring_allreduce_schedule(n, rings, {0, len}));
      window_sizes.push_back(len);
      window_packs.push_back({});
    }
  } else {
    std::vector<PackTree> trees;
    if (c.algorithm == Algorithm::kHierarchicalBalanced) {
      trees = balanced_pack_trees(m.links, std::max<int64_t>(1, c.num_packs));
    }
    const CollectivePlan plan = CollectivePlan::allreduce(
        c.algorithm, n, 0, concat_and_split(total, c.num_packs), total, window_elems, trees);
    // A window's schedule is a function of its size and pack slices; consecutive windows
    // often share them (every full window of the flat, direct and reduce-to-one plans), and
    // then the rewritten schedule of the one before serves (forward_own_input is the costly
    // part of a prediction with many ranks).
    std::vector<PackSlice> previous_slices;
    for (int64_t k = 0; k < plan.num_windows(); ++k) {
      WindowPlan w = plan.window(k);
      const bool as_before =
          k > 0 && w.slot_elems == window_sizes.back() && same_slices(w.packs, previous_slices);
      window_sizes.push_back(w.slot_elems);
      std::vector<Range> packs;
      for (const PackSlice& slice : w.packs) packs.push_back(slice.range);
      window_packs.push_back(std::move(packs));
      previous_slices = std::move(w.packs);
      if (as_before) {
        windows.push_back(windows.back());
      } else {
        windows.push_back(m.forwards_own_input ? forward_own_input(w.schedule)
                                               : std::move(w.schedule));
      }
    }
  }

  append_windows(m, windows, window_sizes, elem_bytes, p, window_packs);
  return p;
}

Prediction predict_allreduce(const MachineModel& m, const Candidate& c, int64_t bytes,
                             int64_t elem_bytes) {
  Prediction pr;
  pr.candidate = c;
  pr.bytes = bytes;
  const int n = m.num_devices();
  if (c.nccl) {
    pr.seconds = predict_nccl_allreduce(m.nccl, c.nccl_candidate, n, bytes).seconds;
  } else {
    const int64_t window = m.window_bytes > 0 ? m.window_bytes / elem_bytes * elem_bytes : 0;
    pr.seconds = predict_windowed_seconds(
        m, bytes, window, [&](int64_t b) { return allreduce_program(m, c, b, elem_bytes); });
  }
  pr.algbw = pr.seconds > 0 ? static_cast<double>(bytes) / pr.seconds : 0;
  pr.busbw = n > 1 ? pr.algbw * 2.0 * (n - 1) / n : pr.algbw;
  return pr;
}

std::vector<Candidate> nccl_candidates(const MachineModel& m) {
  std::vector<Candidate> out;
  if (m.num_devices() < 2) return out;
  for (const NcclCandidate& nc : nccl_candidates(m.nccl)) {
    Candidate c;
    c.algorithm = Algorithm::kFallback;
    c.nccl = true;
    c.nccl_candidate = nc;
    out.push_back(c);
  }
  return out;
}

std::vector<Candidate> runnable_candidates(const MachineModel& m) {
  const int n = m.num_devices();
  std::vector<Candidate> out;
  out.push_back(Candidate::native(Algorithm::kDirect, 0));
  out.push_back(Candidate::native(Algorithm::kReduceToOne, 0));
  out.push_back(Candidate::native(Algorithm::kFlat, 0));
  if (n >= 2 && n % 2 == 0) {
    for (int64_t packs : {int64_t{n}, int64_t{4} * n, int64_t{16} * n}) {
      out.push_back(Candidate::native(Algorithm::kHierarchicalCopy, packs));
    }
    bool balanced_ok = true;
    try {
      balanced_pack_trees(m.links, 1);
    } catch (const std::invalid_argument&) {
      balanced_ok = false;  // a rank without a direct link to its partner
    }
    if (balanced_ok) {
      // Many small packs keep a pipeline full; few packs mean fewer steps for small payloads.
      for (int64_t packs : {int64_t{n}, int64_t{3} * n, int64_t{12} * n, int64_t{48} * n}) {
        out.push_back(Candidate::native(Algorithm::kHierarchicalBalanced, packs));
      }
    }
    if (m.barrier_between_phases) {
      // An executor with a barrier per phase does not pipeline packs: one pack per rank.
      out.erase(std::remove_if(out.begin(), out.end(),
                               [n](const Candidate& c) { return c.num_packs > n; }),
                out.end());
    }
  }
  return out;
}

ModelChoice choose_allreduce(const MachineModel& m, int64_t bytes, int64_t num_packs,
                             bool with_ring_reference, bool with_nccl) {
  std::vector<Candidate> candidates = runnable_candidates(m);
  if (num_packs >= 0) {
    std::vector<Candidate> kept;
    for (Candidate c : candidates) {
      const bool hierarchical = c.algorithm == Algorithm::kHierarchicalCopy ||
                                c.algorithm == Algorithm::kHierarchicalBalanced;
      if (!hierarchical) {
        kept.push_back(c);
        continue;
      }
      c.num_packs = std::max<int64_t>(1, num_packs);
      const bool seen = std::any_of(kept.begin(), kept.end(), [&](const Candidate& k) {
        return k.algorithm == c.algorithm && k.num_packs == c.num_packs;
      });
      if (!seen) kept.push_back(c);
    }
    candidates = kept;
  }
  ModelChoice choice;
  for (const Candidate& c : candidates) {
    choice.predictions.push_back(predict_allreduce(m, c, bytes));
    if (choice.predictions.size() == 1 || choice.predictions.back().seconds < choice.best.seconds) {
      choice.best = choice.predictions.back();
    }
  }
  choice.best_native = choice.best;
  for (const Candidate& c : with_nccl ? nccl_candidates(m) : std::vector<Candidate>{}) {
    choice.predictions.push_back(predict_allreduce(m, c, bytes));
    const Prediction& p = choice.predictions.back();
    if (!choice.has_nccl || p.seconds < choice.best_nccl.seconds) choice.best_nccl = p;
    choice.has_nccl = true;
    if (p.seconds < choice.best.seconds) choice.best = p;
  }
  if (with_ring_reference) {
    Candidate ring;
    ring.ring_reference = true;
    choice.predictions.push_back(predict_allreduce(m, ring, bytes));
  }
  return choice;
}

}  // namespace xdev::plan
