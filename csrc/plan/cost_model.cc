#include "cost_model.h"

#include <algorithm>
#include <limits>
#include <set>
#include <stdexcept>

namespace xdev::plan {

MachineModel::MachineModel(std::string name, int num_devices)
    : links(num_devices), name_(std::move(name)), n_(num_devices) {
  if (num_devices < 1) throw std::invalid_argument("MachineModel: needs at least one device");
  const auto pairs = static_cast<size_t>(n_) * n_;
  routes_.assign(pairs, {});
  latencies_.assign(pairs, 0.0);
  has_route_.assign(pairs, false);
  local_.assign(static_cast<size_t>(n_), {});
  cross_process_.assign(static_cast<size_t>(n_), -1);
}

int MachineModel::add_resource(std::string name, double bytes_per_s) {
  if (!(bytes_per_s > 0)) {
    throw std::invalid_argument("MachineModel: resource '" + name + "' needs a bandwidth > 0");
  }
  resources_.push_back({std::move(name), bytes_per_s});
  return static_cast<int>(resources_.size()) - 1;
}

Resource& MachineModel::resource(int id) {
  if (id < 0 || id >= static_cast<int>(resources_.size())) {
    throw std::out_of_range("MachineModel: resource id");
  }
  return resources_[static_cast<size_t>(id)];
}

namespace {

size_t pair_index(int n, int from, int to) {
  if (from < 0 || to < 0 || from >= n || to >= n) {
    throw std::out_of_range("MachineModel: device index");
  }
  return static_cast<size_t>(from) * static_cast<size_t>(n) + static_cast<size_t>(to);
}

}  // namespace

void MachineModel::set_route(int from, int to, std::vector<int> resources, double latency_s) {
  const size_t i = pair_index(n_, from, to);
  for (int r : resources) {
    if (r < 0 || r >= static_cast<int>(resources_.size())) {
      throw std::out_of_range("MachineModel: route names an unknown resource");
    }
  }
  routes_[i] = std::move(resources);
  latencies_[i] = latency_s;
  has_route_[i] = true;
}

const std::vector<int>& MachineModel::route(int from, int to) const {
  const size_t i = pair_index(n_, from, to);
  if (!has_route_[i]) {
    throw std::invalid_argument("MachineModel '" + name_ + "': no route from device " +
                                std::to_string(from) + " to " + std::to_string(to));
  }
  return routes_[i];
}

double MachineModel::route_latency_s(int from, int to) const {
  route(from, to);  // checks
  return latencies_[pair_index(n_, from, to)];
}

bool MachineModel::has_route(int from, int to) const {
  return has_route_[pair_index(n_, from, to)];
}

void MachineModel::set_local(int device, std::vector<int> resources) {
  pair_index(n_, device, device);  // checks the index
  local_[static_cast<size_t>(device)] = std::move(resources);
}

const std::vector<int>& MachineModel::local(int device) const {
  pair_index(n_, device, device);
  return local_[static_cast<size_t>(device)];
}

void MachineModel::set_cross_process_read(int device, int resource) {
  pair_index(n_, device, device);
  if (resource < 0 || resource >= static_cast<int>(resources_.size())) {
    throw std::out_of_range("MachineModel: resource id");
  }
  cross_process_[static_cast<size_t>(device)] = resource;
}

int MachineModel::cross_process_read(int device) const {
  pair_index(n_, device, device);
  return cross_process_[static_cast<size_t>(device)];
}

bool MachineModel::has_cross_process_read() const {
  return std::all_of(cross_process_.begin(), cross_process_.end(), [](int r) { return r >= 0; });
}

// ---------------------------------------------------------------------------
// Schedules as programs

namespace {

bool overlaps(const Range& a, const Range& b) {
  return a.begin < b.end && b.begin < a.end;
}

struct SlotAccess {
  int task = 0;
  int phase = 0;
  Range range;
  bool write = false;
};

}  // namespace

std::vector<int> append_window(const MachineModel& m, const Schedule& s, int64_t window_elems,
                               int64_t elem_bytes, const std::vector<int>& after, Program& p,
                               const std::vector<Range>& packs, double priority_base) {
  if (s.world_size != m.num_devices()) {
    throw std::invalid_argument("append_window: schedule for " + std::to_string(s.world_size) +
                                " ranks on a machine of " + std::to_string(m.num_devices()));
  }
  const int n = s.world_size;
  const auto bytes = [&](const Range& r) { return static_cast<double>(r.size() * elem_bytes); };

  // Local task numbers: stagers first, then steps in schedule order. Dependences are found in
  // phase order (a step depends on earlier phases only) and may point at a later local number,
  // so tasks are emitted afterwards in a topological order that keeps schedule order where it
  // can: earlier in the schedule means earlier in the pipeline.
  std::vector<Task> tasks;
  std::vector<int> phase_of;
  std::vector<std::vector<SlotAccess>> slot(static_cast<size_t>(n));
  // A stager copies its input in piece by piece, cut where the steps' ranges
  // begin and end, so that a pipelined executor can start on the first piece
  // while later ones are still being copied.
  std::vector<int64_t> cuts{0, window_elems};
  for (const Step& step : s.steps) {
    cuts.push_back(std::clamp<int64_t>(step.range.begin, 0, window_elems));
    cuts.push_back(std::clamp<int64_t>(step.range.end, 0, window_elems));
  }
  for (const auto& ranges : s.staged_ranges) {
    for (const Range& r : ranges) {
      cuts.push_back(std::clamp<int64_t>(r.begin, 0, window_elems));
      cuts.push_back(std::clamp<int64_t>(r.end, 0, window_elems));
    }
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (int r : s.stagers) {
    // With staged_ranges a rank stages only the pieces inside its ranges (ascending and
    // disjoint, as the pieces are: the one that could hold a piece is the first that ends
    // at or after it).
    const std::vector<Range>* ranges =
        s.staged_ranges.empty() ? nullptr : &s.staged_ranges[static_cast<size_t>(r)];
    size_t holder = 0;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const Range piece{cuts[i], cuts[i + 1]};
      if (ranges != nullptr) {
        while (holder < ranges->size() && (*ranges)[holder].end < piece.end) ++holder;
        if (holder == ranges->size() || (*ranges)[holder].begin > piece.begin) continue;
      }
      Task t;
      t.label = "stage r" + std::to_string(r) + " [" + std::to_string(piece.begin) + "," +
                std::to_string(piece.end) + ")";
      t.device = r;
      t.flows.push_back({m.local(r), 2 * bytes(piece)});  // read the input, write the slot
      t.latency_s = m.step_latency_s;
      t.priority = std::numeric_limits<double>::infinity();  // lowered to its first reader's
      slot[static_cast<size_t>(r)].push_back({static_cast<int>(tasks.size()), 0, piece, true});
      tasks.push_back(std::move(t));
      phase_of.push_back(0);
    }
  }
  const auto first_step = static_cast<int>(tasks.size());
  for (const Step& step : s.steps) {
    Task t;
    t.device = step.actor;
    t.label = std::string(step.kind == StepKind::kReduce ? "reduce" : "copy") + " p" +
              std::to_string(step.phase) + " r" + std::to_string(step.actor) + " [" +
              std::to_string(step.range.begin) + "," + std::to_string(step.range.end) + ")";
    const double b = bytes(step.range);
    double local_bytes = step.also_output ? 2 * b : b;  // the writes
    double hop_latency = 0;
    for (int src : step.sources) {
      if (src == step.actor || src == kOwnInput) {
        local_bytes += b;
      } else {
        t.flows.push_back({m.route(src, step.actor), b});
        hop_latency = std::max(hop_latency, m.route_latency_s(src, step.actor));
      }
    }
    t.flows.push_back({m.local(step.actor), local_bytes});
    t.latency_s = m.step_latency_s + hop_latency;
    if (m.barrier_between_phases) t.latency_s += m.barrier_latency_s;
    // The first pack that ends after the step begins (packs are in slot order), or the last.
    size_t ordinal = 0;
    if (!packs.empty()) {
      ordinal = static_cast<size_t>(
          std::partition_point(packs.begin(), packs.end() - 1,
                               [&](const Range& x) { return x.end <= step.range.begin; }) -
          packs.begin());
    }
    t.priority = priority_base + static_cast<double>(ordinal) + step.phase;
    tasks.push_back(std::move(t));
    phase_of.push_back(step.phase);
  }

  std::vector<size_t> step_order(s.steps.size());
  for (size_t i = 0; i < step_order.size(); ++i) step_order[i] = i;
  std::sort(step_order.begin(), step_order.end(), [&](size_t a, size_t b) {
    return std::pair(s.steps[a].phase, a) < std::pair(s.steps[b].phase, b);
  });
  std::vector<std::vector<int>> local_deps(tasks.size());
  // Where the executor has a barrier per phase, a step waits for the whole latest earlier
  // phase that has tasks. A task without bytes after each such phase stands for the barrier,
  // so that a phase of P tasks followed by one of Q costs P + Q dependences rather than P * Q
  // (thousands of packs make both thousands). The last one follows all of the window's work.
  std::vector<int> barrier_before;  // per phase: the barrier its steps wait for, or -1
  if (m.barrier_between_phases && !tasks.empty()) {
    const int last_phase = *std::max_element(phase_of.begin(), phase_of.end());
    std::vector<std::vector<int>> in_phase(static_cast<size_t>(last_phase) + 1);
    for (size_t t = 0; t < tasks.size(); ++t) {
      in_phase[static_cast<size_t>(phase_of[t])].push_back(static_cast<int>(t));
    }
    int latest = -1;
    for (int q = 0; q <= last_phase; ++q) {
      barrier_before.push_back(latest);
      if (in_phase[static_cast<size_t>(q)].empty()) continue;
      Task barrier;
      barrier.label = "barrier after phase " + std::to_string(q);
      barrier.priority = std::numeric_limits<double>::infinity();  // lowered to its readers'
      latest = static_cast<int>(tasks.size());
      tasks.push_back(std::move(barrier));
      phase_of.push_back(-1);
      local_deps.push_back(std::move(in_phase[static_cast<size_t>(q)]));
    }
  }
  for (size_t k : step_order) {
    const Step& step = s.steps[k];
    const int id = first_step + static_cast<int>(k);
    std::vector<int>& deps = local_deps[static_cast<size_t>(id)];
    if (m.barrier_between_phases) {
      const int barrier = barrier_before[static_cast<size_t>(step.phase)];
      if (barrier >= 0) {
        deps.push_back(barrier);
        Task& b = tasks[static_cast<size_t>(barrier)];
        b.priority = std::min(b.priority, tasks[static_cast<size_t>(id)].priority);
      }
    } else {
      for (int src : step.sources) {
        if (src == kOwnInput) continue;  // the actor's tensor: ready from the start
        for (const SlotAccess& a : slot[static_cast<size_t>(src)]) {
          if (a.write && a.phase < step.phase && overlaps(a.range, step.range)) {
            deps.push_back(a.task);
          }
        }
      }
      if (step.target == Target::kStaging) {
        for (const SlotAccess& a : slot[static_cast<size_t>(written_slot(step))]) {
          if (a.phase < step.phase && overlaps(a.range, step.range)) deps.push_back(a.task);
        }
      }
    }
    for (int src : step.sources) {
      if (src != kOwnInput) {
        slot[static_cast<size_t>(src)].push_back({id, step.phase, step.range, false});
      }
    }
    if (step.target == Target::kStaging) {
      slot[static_cast<size_t>(written_slot(step))].push_back({id, step.phase, step.range, true});
    }
  }

  // Kahn's algorithm in schedule order, a staging piece just before the first
  // step that reads it.
  std::vector<double> key(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    key[t] = static_cast<int>(t) < first_step ? std::numeric_limits<double>::infinity()
                                              : static_cast<double>(t);
  }
  for (size_t t = static_cast<size_t>(first_step); t < tasks.size(); ++t) {
    for (int d : local_deps[t]) {
      if (d >= first_step) continue;
      const auto di = static_cast<size_t>(d);
      key[di] = std::min(key[di], t - 0.5);
      tasks[di].priority = std::min(tasks[di].priority, tasks[t].priority - 0.5);
    }
  }
  std::vector<int> indegree(tasks.size(), 0);
  std::vector<std::vector<int>> users(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    auto& deps = local_deps[t];
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    indegree[t] = static_cast<int>(deps.size());
    for (int d : deps) users[static_cast<size_t>(d)].push_back(static_cast<int>(t));
  }
  std::set<std::pair<double, int>> ready;
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (indegree[t] == 0) ready.insert({key[t], static_cast<int>(t)});
  }
  std::vector<int> global(tasks.size(), -1);
  std::vector<int> ids;
  while (!ready.empty()) {
    const int t = ready.begin()->second;
    ready.erase(ready.begin());
    Task task = std::move(tasks[static_cast<size_t>(t)]);
    for (int d : local_deps[static_cast<size_t>(t)]) {
      task.deps.push_back(global[static_cast<size_t>(d)]);
    }
    if (task.deps.empty()) task.deps = after;
    global[static_cast<size_t>(t)] = static_cast<int>(p.tasks.size());
    ids.push_back(global[static_cast<size_t>(t)]);
    p.tasks.push_back(std::move(task));
    for (int u : users[static_cast<size_t>(t)]) {
      if (--indegree[static_cast<size_t>(u)] == 0) ready.insert({key[static_cast<size_t>(u)], u});
    }
  }
  if (ids.size() != tasks.size()) throw std::logic_error("append_window: dependence cycle");
  return ids;
}

std::vector<std::vector<int>> append_windows(const MachineModel& m,
                                             const std::vector<Schedule>& windows,
                                             const std::vector<int64_t>& window_elems,
                                             int64_t elem_bytes, Program& p,
                                             const std::vector<std::vector<Range>>& packs) {
  if (window_elems.size() != windows.size() || (!packs.empty() && packs.size() != windows.size())) {
    throw std::invalid_argument("append_windows: one size (and pack list) per window");
  }
  std::vector<std::vector<int>> ids;
  double priority = 0;
  for (size_t k = 0; k < windows.size(); ++k) {
    std::vector<int> after{0};
    // The previous window's last task is the barrier after all its work (append_window).
    if (m.barrier_between_phases && k >= 1) {
      after = ids[k - 1].empty() ? std::vector<int>{} : std::vector<int>{ids[k - 1].back()};
    }
    if (!m.barrier_between_phases && k >= 2) after = ids[k - 2];
    const std::vector<Range> none;
    const std::vector<Range>& window_packs = packs.empty() ? none : packs[k];
    ids.push_back(append_window(m, windows[k], window_elems[k], elem_bytes, after, p, window_packs,
                                priority));
    priority += static_cast<double>(std::max<size_t>(1, window_packs.size()));
  }
  return ids;
}

double predict_windowed_seconds(const MachineModel& m, int64_t bytes, int64_t window_bytes,
                                const std::function<Program(int64_t)>& program) {
  constexpr int64_t kSimulatedWindows = 8;
  const int64_t some = kSimulatedWindows * window_bytes;
  if (!m.barrier_between_phases || window_bytes <= 0 || bytes <= 2 * some) {
    return simulate(m, program(bytes), m.policy).seconds;
  }
  // Two payloads, of 8 and 16 windows' bytes, differ by 8 windows in the
  // middle of the run, whatever share of a window the plan fills (a plan may
  // cut them into more, smaller windows): the bytes beyond the second are
  // charged at that difference's rate.
  const double first = simulate(m, program(some), m.policy).seconds;
  const double second = simulate(m, program(2 * some), m.policy).seconds;
  return second +
         (second - first) * static_cast<double>(bytes - 2 * some) / static_cast<double>(some);
}

}  // namespace xdev::plan
