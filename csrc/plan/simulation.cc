// Runs a Program on a MachineModel: flows share the resources they cross by
// progressive filling, and tasks start when their dependencies end.
#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>

#include "cost_model.h"  // declares simulate()

namespace xdev::plan {

namespace {

struct ActiveFlow {
  int task = 0;
  const Flow* flow = nullptr;
  double remaining = 0;
  double rate = 0;
  double priority = 0;  // the class it is served in
};

// Progressive filling: every flow of a priority class grows its rate at the
// same pace until one of its resources is full; classes are served in order,
// and a flow that crosses a full resource gets nothing. Only the resources the
// flows touch are visited, so an event costs about the number of active flows.
//
// `flows` is ordered by priority class (kFairShare: all in one class).
// `moving` receives the indices of the flows given a rate above 0, in order:
// under kOldestFirst most flows wait behind older ones, and the caller need
// not visit them.
void assign_rates(const std::vector<Resource>& resources, std::vector<ActiveFlow>& flows,
                  std::vector<double>& capacity, std::vector<int>& users,
                  std::vector<size_t>& moving) {
  moving.clear();
  capacity.resize(resources.size());
  users.assign(resources.size(), 0);
  for (size_t r = 0; r < resources.size(); ++r) capacity[r] = resources[r].bytes_per_s;
  const auto full = [&](int r) {
    const auto ri = static_cast<size_t>(r);
    return capacity[ri] <= 1e-12 * resources[ri].bytes_per_s;
  };
  for (ActiveFlow& f : flows) f.rate = 0;

  std::vector<size_t> unfrozen, still;
  std::vector<int> touched;
  size_t begin = 0;
  while (begin < flows.size()) {
    size_t end = begin;
    while (end < flows.size() && flows[end].priority == flows[begin].priority) ++end;
    unfrozen.clear();
    for (size_t k = begin; k < end; ++k) {
      const auto& rs = flows[k].flow->resources;
      if (std::none_of(rs.begin(), rs.end(), full)) unfrozen.push_back(k);
    }
    while (!unfrozen.empty()) {
      touched.clear();
      for (size_t i : unfrozen) {
        for (int r : flows[i].flow->resources) {
          if (users[static_cast<size_t>(r)]++ == 0) touched.push_back(r);
        }
      }
      double step = std::numeric_limits<double>::infinity();
      for (int r : touched) {
        const auto ri = static_cast<size_t>(r);
        step = std::min(step, std::max(0.0, capacity[ri]) / users[ri]);
      }
      for (size_t i : unfrozen) {
        if (flows[i].rate == 0 && step > 0) moving.push_back(i);
        flows[i].rate += step;
      }
      for (int r : touched) {
        const auto ri = static_cast<size_t>(r);
        capacity[ri] -= step * users[ri];
        users[ri] = 0;
      }
      still.clear();
      for (size_t i : unfrozen) {
        const auto& rs = flows[i].flow->resources;
        if (std::none_of(rs.begin(), rs.end(), full)) still.push_back(i);
      }
      if (still.size() == unfrozen.size()) break;  // cannot happen with finite capacities
      unfrozen.swap(still);
    }
    begin = end;
  }
}

}  // namespace

namespace {

// Checks that every dependency points back and every flow crosses known
// resources with a bandwidth; fills each task's dependency count and dependents.
void link_tasks(const MachineModel& m, const Program& p, std::vector<int>& waiting_on,
                std::vector<std::vector<int>>& dependents) {
  const size_t n = p.tasks.size();
  waiting_on.assign(n, 0);
  dependents.assign(n, {});
  for (size_t t = 0; t < n; ++t) {
    for (int d : p.tasks[t].deps) {
      if (d < 0 || static_cast<size_t>(d) >= t) {
        throw std::invalid_argument("simulate: task " + std::to_string(t) +
                                    " depends on a task that is not earlier");
      }
      ++waiting_on[t];
      dependents[static_cast<size_t>(d)].push_back(static_cast<int>(t));
    }
    for (const Flow& f : p.tasks[t].flows) {
      if (f.bytes > 0 && f.resources.empty()) {
        throw std::invalid_argument("simulate: task '" + p.tasks[t].label +
                                    "' moves bytes over no resource");
      }
      for (int r : f.resources) {
        if (r < 0 || static_cast<size_t>(r) >= m.resources().size()) {
          throw std::invalid_argument("simulate: task '" + p.tasks[t].label +
                                      "' names an unknown resource");
        }
        if (!(m.resources()[static_cast<size_t>(r)].bytes_per_s > 0)) {
          throw std::invalid_argument("simulate: resource '" +
                                      m.resources()[static_cast<size_t>(r)].name +
                                      "' has no bandwidth");
        }
      }
    }
  }
}

// One run of a program: an event loop over task starts and flow ends, the
// rates of the flows in motion set anew by assign_rates at every event.
class Simulation {
 public:
  Simulation(const MachineModel& m, const Program& p, SharingPolicy policy)
      : m_(m), p_(p), policy_(policy), n_(p.tasks.size()) {
    link_tasks(m, p, waiting_on_, dependents_);
    result_.start_s.assign(n_, 0.0);
    result_.finish_s.assign(n_, -1.0);
    ready_at_.assign(n_, 0.0);
    flows_left_.assign(n_, 0);
    for (size_t t = 0; t < n_; ++t) {
      if (waiting_on_[t] == 0) starting_.emplace(p.tasks[t].latency_s, static_cast<int>(t));
    }
  }

  SimulationResult run() {
    while (done_ < n_) {
      start_due_tasks();
      if (done_ == n_) break;
      if (active_.empty()) {
        if (starting_.empty()) throw std::logic_error("simulate: stuck with tasks left");
        now_ = starting_.begin()->first;
        continue;
      }
      advance_to_next_event();
    }
    for (double f : result_.finish_s) result_.seconds = std::max(result_.seconds, f);
    return std::move(result_);
  }

 private:
  void finish(int t) {
    result_.finish_s[static_cast<size_t>(t)] = now_;
    ++done_;
    for (int d : dependents_[static_cast<size_t>(t)]) {
      const auto di = static_cast<size_t>(d);
      ready_at_[di] = std::max(ready_at_[di], now_);
      if (--waiting_on_[di] == 0) starting_.emplace(ready_at_[di] + p_.tasks[di].latency_s, d);
    }
  }

  // Starts everything due now; tasks without bytes end at once.
  void start_due_tasks() {
    while (!starting_.empty() && starting_.begin()->first <= now_) {
      const int t = starting_.begin()->second;
      starting_.erase(starting_.begin());
      result_.start_s[static_cast<size_t>(t)] = now_;
      const Task& task = p_.tasks[static_cast<size_t>(t)];
      const double priority = policy_ == SharingPolicy::kOldestFirst ? task.priority : 0.0;
      for (const Flow& f : task.flows) {
        if (f.bytes <= 0) continue;
        // Keep `active_` ordered by priority; equal ones in arrival order.
        const auto at =
            std::upper_bound(active_.begin(), active_.end(), priority,
                             [](double value, const ActiveFlow& a) { return value < a.priority; });
        active_.insert(at, {t, &f, f.bytes, 0, priority});
        ++flows_left_[static_cast<size_t>(t)];
      }
      if (flows_left_[static_cast<size_t>(t)] == 0) finish(t);
    }
  }

  // Moves the flows at their rates up to the next start or flow end.
  void advance_to_next_event() {
    assign_rates(m_.resources(), active_, capacity_, users_, moving_);
    double next =
        starting_.empty() ? std::numeric_limits<double>::infinity() : starting_.begin()->first;
    for (size_t i : moving_) {
      const ActiveFlow& f = active_[i];
      next = std::min(next, now_ + f.remaining / f.rate);
    }
    const double dt = next - now_;
    const double before = now_;
    now_ = next;
    // Only moving flows change; one that ends loses its flow, then its place.
    ended_.clear();
    bool any_ended = false;
    for (size_t i : moving_) {
      ActiveFlow& f = active_[i];
      // A flow due by `next` ends there even where now + remaining / rate
      // rounds to now (a few bytes late in a long program): else no time passes.
      const bool due = before + f.remaining / f.rate <= next;
      f.remaining -= f.rate * dt;
      // Relative tolerance: rates and sizes span many orders of magnitude.
      if (due || f.remaining <= 1e-9 * f.flow->bytes) {
        if (--flows_left_[static_cast<size_t>(f.task)] == 0) ended_.push_back(f.task);
        f.flow = nullptr;
        any_ended = true;
      }
    }
    if (any_ended) {  // the rest keep their (priority) order
      active_.erase(std::remove_if(active_.begin(), active_.end(),
                                   [](const ActiveFlow& f) { return f.flow == nullptr; }),
                    active_.end());
    }
    std::sort(ended_.begin(), ended_.end());
    for (int t : ended_) finish(t);
  }

  const MachineModel& m_;
  const Program& p_;
  const SharingPolicy policy_;
  const size_t n_;
  SimulationResult result_;
  std::vector<int> waiting_on_;
  std::vector<std::vector<int>> dependents_;
  // Tasks whose dependencies are done, keyed by the time they may start.
  std::multimap<double, int> starting_;
  std::vector<double> ready_at_;
  std::vector<ActiveFlow> active_;
  std::vector<double> capacity_;  // scratch for assign_rates
  std::vector<int> users_;
  std::vector<size_t> moving_;  // the active flows with a rate, from assign_rates
  std::vector<int> ended_;      // tasks whose last flow ended at this event
  std::vector<int> flows_left_;
  double now_ = 0;
  size_t done_ = 0;
};

}  // namespace

SimulationResult simulate(const MachineModel& m, const Program& p, SharingPolicy policy) {
  return Simulation(m, p, policy).run();
}

}  // namespace xdev::plan
