// Unit tests of the cost model (csrc/plan/cost_model.h): the flow simulation and its errors; the
// programs of windows are tested in test_cost_model_windows.cc, the built-in machines in
// test_machines.cc. Every expected time is computed by
// hand in the test, with the arithmetic in a comment next to it; doubles are compared with a
// relative tolerance.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan/cost_model.h"
#include "plan/machines.h"
#include "plan/schedule.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

// A machine of `num_devices` devices whose memories are far faster than anything under test
// (1e18 B/s), with no routes: tests add the resources and routes they need.
MachineModel bare_machine(int num_devices) {
  MachineModel m("bare", num_devices);
  for (int d = 0; d < num_devices; ++d) {
    m.set_local(d, {m.add_resource("mem" + std::to_string(d), 1e18)});
  }
  return m;
}

Task task(std::string label, std::vector<Flow> flows, std::vector<int> deps, double latency_s,
          double priority = 0) {
  Task t;
  t.label = std::move(label);
  t.flows = std::move(flows);
  t.deps = std::move(deps);
  t.latency_s = latency_s;
  t.priority = priority;
  return t;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// simulate

TEST(simulate_ends_a_flow_too_small_to_advance_the_clock) {
  // A byte at 1e18 B/s after a second: 1 s + 1e-18 s rounds to 1 s. The flow still ends.
  MachineModel m = bare_machine(1);
  Program p;
  p.tasks.push_back(task("wait", {}, {}, 1.0));
  p.tasks.push_back(task("byte", {{m.local(0), 1.0}}, {0}, 0.0));
  const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
  CHECK_NEAR(r.seconds, 1.0);
  CHECK_NEAR(r.finish_s[1], 1.0);
}

TEST(cost_one_transfer_is_latency_plus_bytes_over_bandwidth) {
  MachineModel m = bare_machine(2);
  const int link = m.add_resource("link 0->1", 10e9);
  m.set_route(0, 1, {link}, 2e-6);
  CHECK_EQ(m.route(0, 1), std::vector<int>{link});
  CHECK_NEAR(m.route_latency_s(0, 1), 2e-6);
  CHECK(m.has_route(0, 1));
  CHECK(!m.has_route(1, 0));

  Program p;
  p.tasks.push_back(task("send", {{m.route(0, 1), 1e6}}, {}, m.route_latency_s(0, 1)));
  for (SharingPolicy policy : {SharingPolicy::kFairShare, SharingPolicy::kOldestFirst}) {
    const SimulationResult r = simulate(m, p, policy);
    // 2e-6 + 1e6 / 10e9 = 2e-6 + 1e-4 = 1.02e-4
    CHECK_NEAR(r.start_s[0], 2e-6);
    CHECK_NEAR(r.finish_s[0], 1.02e-4);
    CHECK_NEAR(r.seconds, 1.02e-4);
  }
}

TEST(cost_tasks_without_bytes_end_when_they_start) {
  MachineModel m = bare_machine(1);
  Program p;
  p.tasks.push_back(task("a", {}, {}, 3e-6));
  p.tasks.push_back(task("b", {{m.local(0), 0}}, {0}, 4e-6));
  const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
  CHECK_NEAR(r.finish_s[0], 3e-6);
  CHECK_NEAR(r.start_s[1], 7e-6);  // 3e-6 + 4e-6
  CHECK_NEAR(r.finish_s[1], 7e-6);
  CHECK_NEAR(r.seconds, 7e-6);

  const SimulationResult empty = simulate(m, Program{}, SharingPolicy::kFairShare);
  CHECK_EQ(empty.seconds, 0.0);
  CHECK(empty.finish_s.empty());
}

TEST(cost_two_equal_transfers_share_a_link_fairly) {
  MachineModel m = bare_machine(2);
  const int link = m.add_resource("link 0->1", 10e9);
  const double L = 2e-6, b = 1e6, bw = 10e9;
  Program p;
  p.tasks.push_back(task("x", {{{link}, b}}, {}, L));
  p.tasks.push_back(task("y", {{{link}, b}}, {}, L));
  const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
  // Each at bw/2: L + b / (bw/2) = 2e-6 + 2e6 / 10e9 = 2e-6 + 2e-4 = 2.02e-4.
  CHECK_NEAR(r.finish_s[0], L + 2 * b / bw);
  CHECK_NEAR(r.finish_s[1], 2.02e-4);
  CHECK_NEAR(r.seconds, 2.02e-4);
}

TEST(cost_unequal_transfers_share_then_the_big_one_takes_the_link) {
  MachineModel m = bare_machine(2);
  const int link = m.add_resource("link 0->1", 10e9);
  const double L = 2e-6, bw = 10e9;
  Program p;
  p.tasks.push_back(task("small", {{{link}, 1e6}}, {}, L));
  p.tasks.push_back(task("big", {{{link}, 3e6}}, {}, L));
  const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
  // Both at bw/2 until the small one is done: 1e6 / 5e9 = 2e-4 (= 2e6/bw).
  CHECK_NEAR(r.finish_s[0], L + 2e6 / bw);  // 2.02e-4
  CHECK_NEAR(r.finish_s[0], 2.02e-4);
  // By then the big one moved 1e6; its other 2e6 go at bw: 2e-4 more, 4e-4 = 4e6/bw in all.
  CHECK_NEAR(r.finish_s[1], L + 4e6 / bw);  // 4.02e-4
  CHECK_NEAR(r.finish_s[1], 4.02e-4);
  CHECK_NEAR(r.seconds, 4.02e-4);
}

TEST(cost_oldest_first_serves_lower_priority_values_first) {
  MachineModel m = bare_machine(2);
  const int link = m.add_resource("link 0->1", 10e9);
  const double L = 2e-6, b = 1e6, bw = 10e9;
  {
    Program p;
    p.tasks.push_back(task("first", {{{link}, b}}, {}, L, 0));
    p.tasks.push_back(task("second", {{{link}, b}}, {}, L, 1));
    const SimulationResult r = simulate(m, p, SharingPolicy::kOldestFirst);
    // first at bw: L + b/bw = 2e-6 + 1e-4; second waits for it, then b/bw more.
    CHECK_NEAR(r.finish_s[0], L + b / bw);      // 1.02e-4
    CHECK_NEAR(r.finish_s[1], L + 2 * b / bw);  // 2.02e-4
    CHECK_NEAR(r.start_s[1], L);                // started (flows active) even while starved
    // Fair share ignores priorities: both at bw/2, L + 2b/bw = 2.02e-4.
    const SimulationResult fair = simulate(m, p, SharingPolicy::kFairShare);
    CHECK_NEAR(fair.finish_s[0], L + 2 * b / bw);
    CHECK_NEAR(fair.finish_s[1], L + 2 * b / bw);
  }
  {
    // The first is the big one: it goes first whatever its size.
    Program p;
    p.tasks.push_back(task("big", {{{link}, 3e6}}, {}, L, 0));
    p.tasks.push_back(task("small", {{{link}, 1e6}}, {}, L, 1));
    const SimulationResult r = simulate(m, p, SharingPolicy::kOldestFirst);
    CHECK_NEAR(r.finish_s[0], L + 3e6 / bw);  // 3.02e-4
    CHECK_NEAR(r.finish_s[1], L + 4e6 / bw);  // 4.02e-4
  }
  {
    // The priority decides, not the program order: the later task has the lower value.
    Program p;
    p.tasks.push_back(task("late", {{{link}, b}}, {}, L, 5));
    p.tasks.push_back(task("early", {{{link}, b}}, {}, L, 2));
    const SimulationResult r = simulate(m, p, SharingPolicy::kOldestFirst);
    CHECK_NEAR(r.finish_s[1], L + b / bw);      // 1.02e-4
    CHECK_NEAR(r.finish_s[0], L + 2 * b / bw);  // 2.02e-4
  }
  {
    // Equal priorities share fairly: L + 2b/bw = 2.02e-4 for both.
    Program p;
    p.tasks.push_back(task("x", {{{link}, b}}, {}, L, 1));
    p.tasks.push_back(task("y", {{{link}, b}}, {}, L, 1));
    const SimulationResult r = simulate(m, p, SharingPolicy::kOldestFirst);
    CHECK_NEAR(r.finish_s[0], L + 2 * b / bw);
    CHECK_NEAR(r.finish_s[1], L + 2 * b / bw);
  }
  {
    // An older task bottlenecked elsewhere leaves the rest to a younger one: "old" crosses the
    // shared link (10e9) and a slow one (2e9), so it runs at 2e9; "young" gets 10e9 - 2e9 = 8e9.
    const int slow = m.add_resource("slow", 2e9);
    Program p;
    p.tasks.push_back(task("old", {{{link, slow}, 2e6}}, {}, 0, 0));
    p.tasks.push_back(task("young", {{{link}, 8e6}}, {}, 0, 1));
    const SimulationResult r = simulate(m, p, SharingPolicy::kOldestFirst);
    CHECK_NEAR(r.finish_s[0], 1e-3);  // 2e6 / 2e9
    CHECK_NEAR(r.finish_s[1], 1e-3);  // 8e6 / 8e9
  }
}

TEST(cost_chain_of_dependent_tasks_adds_up) {
  MachineModel m = bare_machine(4);
  const double L = 1e-6, b = 1e6, bw = 10e9;
  const int l0 = m.add_resource("l0", bw), l1 = m.add_resource("l1", bw),
            l2 = m.add_resource("l2", bw);
  Program p;
  p.tasks.push_back(task("A", {{{l0}, b}}, {}, L));
  p.tasks.push_back(task("B", {{{l1}, b}}, {0}, L));
  p.tasks.push_back(task("C", {{{l2}, b}}, {1}, L));
  for (SharingPolicy policy : {SharingPolicy::kFairShare, SharingPolicy::kOldestFirst}) {
    const SimulationResult r = simulate(m, p, policy);
    // Each stage: L + b/bw = 1e-6 + 1e-4 = 1.01e-4.
    CHECK_NEAR(r.start_s[0], 1e-6);
    CHECK_NEAR(r.finish_s[0], 1.01e-4);
    CHECK_NEAR(r.start_s[1], 1.02e-4);  // 1.01e-4 + L
    CHECK_NEAR(r.finish_s[1], 2.02e-4);
    CHECK_NEAR(r.start_s[2], 2.03e-4);
    CHECK_NEAR(r.finish_s[2], 3.03e-4);
    CHECK_NEAR(r.seconds, 3 * (L + b / bw));  // 3.03e-4
  }
}

TEST(cost_diamond_waits_for_the_slower_branch) {
  MachineModel m = bare_machine(4);
  const double L = 1e-6, b = 1e6, bw = 10e9;  // b/bw = 1e-4
  const int l0 = m.add_resource("l0", bw), l1 = m.add_resource("l1", bw),
            l2 = m.add_resource("l2", bw), l3 = m.add_resource("l3", bw);
  {
    // B and C on their own links; C moves 2b.
    Program p;
    p.tasks.push_back(task("A", {{{l0}, b}}, {}, L));
    p.tasks.push_back(task("B", {{{l1}, b}}, {0}, L));
    p.tasks.push_back(task("C", {{{l2}, 2 * b}}, {0}, L));
    p.tasks.push_back(task("D", {{{l3}, b}}, {1, 2}, L));
    const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
    CHECK_NEAR(r.finish_s[0], L + b / bw);          // 1.01e-4
    CHECK_NEAR(r.finish_s[1], 2 * L + 2 * b / bw);  // 2.02e-4
    CHECK_NEAR(r.finish_s[2], 2 * L + 3 * b / bw);  // 3.02e-4
    CHECK_NEAR(r.start_s[3], 3 * L + 3 * b / bw);   // 3.03e-4: after C, the later one
    CHECK_NEAR(r.finish_s[3], 3 * L + 4 * b / bw);  // 4.03e-4
    CHECK_NEAR(r.seconds, 4.03e-4);
  }
  {
    // B and C share one link: both at bw/2 until B's b is done (2b/bw), C has b left at bw.
    Program p;
    p.tasks.push_back(task("A", {{{l0}, b}}, {}, L));
    p.tasks.push_back(task("B", {{{l1}, b}}, {0}, L));
    p.tasks.push_back(task("C", {{{l1}, 2 * b}}, {0}, L));
    p.tasks.push_back(task("D", {{{l3}, b}}, {1, 2}, L));
    const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
    CHECK_NEAR(r.finish_s[1], 2 * L + 3 * b / bw);  // 1.01e-4 + 1e-6 + 2e-4 = 3.02e-4
    CHECK_NEAR(r.finish_s[2], 2 * L + 4 * b / bw);  // 3.02e-4 + 1e-4 = 4.02e-4
    CHECK_NEAR(r.finish_s[3], 3 * L + 5 * b / bw);  // 4.02e-4 + 1e-6 + 1e-4 = 5.03e-4
  }
}

TEST(cost_flow_over_two_resources_goes_at_the_slower) {
  MachineModel m = bare_machine(2);
  const int fast = m.add_resource("fast", 10e9), slow = m.add_resource("slow", 4e9);
  m.set_route(0, 1, {fast, slow}, 0);
  Program p;
  p.tasks.push_back(task("x", {{m.route(0, 1), 2e6}}, {}, 1e-6));
  const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
  CHECK_NEAR(r.seconds, 1e-6 + 2e6 / 4e9);  // 1e-6 + 5e-4 = 5.01e-4
}

TEST(cost_max_min_gives_the_unbottlenecked_flow_the_rest) {
  // f1 crosses X (10e9) and Y (4e9); f2 crosses X only. Progressive filling: both grow to
  // min(10e9 / 2, 4e9 / 1) = 4e9, Y is full and f1 stops; X has 10e9 - 8e9 = 2e9 left, all f2's:
  // f1 = 4e9, f2 = 6e9.
  MachineModel m = bare_machine(2);
  const int x = m.add_resource("X", 10e9), y = m.add_resource("Y", 4e9);
  Program p;
  p.tasks.push_back(task("f1", {{{x, y}, 2e6}}, {}, 0));
  p.tasks.push_back(task("f2", {{{x}, 8e6}}, {}, 0));
  const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
  // f1: 2e6 / 4e9 = 5e-4. By then f2 moved 6e9 * 5e-4 = 3e6; its 5e6 left go at 10e9: 5e-4.
  CHECK_NEAR(r.finish_s[0], 5e-4);
  CHECK_NEAR(r.finish_s[1], 1e-3);

  // The same rates with both flows in one task: it ends with the later one.
  Program one;
  one.tasks.push_back(task("both", {{{x, y}, 2e6}, {{x}, 8e6}}, {}, 0));
  CHECK_NEAR(simulate(m, one, SharingPolicy::kFairShare).seconds, 1e-3);

  // Three flows, two bottlenecks: g1 over {X}, g2 over {X, Y}, g3 over {Y}.
  // Filling: min(10e9 / 2, 4e9 / 2) = 2e9 each; Y full, g2 and g3 stop at 2e9. X has 6e9 left:
  // g1 = 8e9. Sizes so that all end together at 1e-3: 8e6, 2e6, 2e6.
  Program three;
  three.tasks.push_back(task("g1", {{{x}, 8e6}}, {}, 0));
  three.tasks.push_back(task("g2", {{{x, y}, 2e6}}, {}, 0));
  three.tasks.push_back(task("g3", {{{y}, 2e6}}, {}, 0));
  const SimulationResult t = simulate(m, three, SharingPolicy::kFairShare);
  for (int i = 0; i < 3; ++i) CHECK_NEAR(t.finish_s[static_cast<size_t>(i)], 1e-3);
}

TEST(cost_a_later_task_joins_the_sharing_when_it_starts) {
  // x (2e6 bytes) starts at 0; y (1e6 bytes) at 1e-4, both on one 10e9 link, fair share.
  // [0, 1e-4): x alone at 10e9 moves 1e6. Then both at 5e9: y's 1e6 and x's remaining 1e6
  // both take 2e-4: both end at 3e-4.
  MachineModel m = bare_machine(1);
  const int link = m.add_resource("link", 10e9);
  Program p;
  p.tasks.push_back(task("x", {{{link}, 2e6}}, {}, 0));
  p.tasks.push_back(task("y", {{{link}, 1e6}}, {}, 1e-4));
  const SimulationResult r = simulate(m, p, SharingPolicy::kFairShare);
  CHECK_NEAR(r.start_s[1], 1e-4);
  CHECK_NEAR(r.finish_s[0], 3e-4);
  CHECK_NEAR(r.finish_s[1], 3e-4);
}

// ---------------------------------------------------------------------------------------------
// Errors

TEST(cost_errors_are_reported) {
  MachineModel m = bare_machine(2);
  const int link = m.add_resource("link", 10e9);

  Program later;
  later.tasks.push_back(task("a", {{{link}, 1e6}}, {1}, 0));
  later.tasks.push_back(task("b", {{{link}, 1e6}}, {}, 0));
  CHECK_THROWS(simulate(m, later, SharingPolicy::kFairShare), std::invalid_argument, "not earlier");
  Program self;
  self.tasks.push_back(task("a", {{{link}, 1e6}}, {0}, 0));
  CHECK_THROWS(simulate(m, self, SharingPolicy::kFairShare), std::invalid_argument, "not earlier");
  Program negative;
  negative.tasks.push_back(task("a", {{{link}, 1e6}}, {-1}, 0));
  CHECK_THROWS(simulate(m, negative, SharingPolicy::kOldestFirst), std::invalid_argument,
               "not earlier");
  Program nowhere;
  nowhere.tasks.push_back(task("lost", {{{}, 1e6}}, {}, 0));
  CHECK_THROWS(simulate(m, nowhere, SharingPolicy::kFairShare), std::invalid_argument, "lost");

  CHECK_THROWS(m.set_route(0, 1, {link, 99}, 0), std::out_of_range, "unknown resource");
  CHECK_THROWS(m.set_route(0, 1, {-1}, 0), std::out_of_range, "unknown resource");
  CHECK(!m.has_route(0, 1));  // the failed calls set nothing
  CHECK_THROWS(m.set_route(0, 2, {link}, 0), std::out_of_range, "device");
  CHECK_THROWS(m.route(1, 0), std::invalid_argument, "no route");
  CHECK_THROWS(m.route_latency_s(1, 0), std::invalid_argument, "no route");
  CHECK_THROWS(m.local(2), std::out_of_range, "");
  CHECK_THROWS(m.resource(99), std::out_of_range, "");

  CHECK_THROWS(m.add_resource("zero", 0), std::invalid_argument, "zero");
  CHECK_THROWS(m.add_resource("negative", -1e9), std::invalid_argument, "bandwidth");
  CHECK_THROWS(m.add_resource("nan", std::numeric_limits<double>::quiet_NaN()),
               std::invalid_argument, "bandwidth");
  CHECK_THROWS(MachineModel("none", 0), std::invalid_argument, "");

  // A schedule for another world size.
  Program p;
  CHECK_THROWS(append_window(bare_machine(2), reduce_to_one_schedule(4, 0, {0, 10}), 10, 4, {}, p),
               std::invalid_argument, "4 ranks");
  // A schedule that needs a route the machine lacks.
  MachineModel no_routes = bare_machine(2);
  CHECK_THROWS(append_window(no_routes, reduce_to_one_schedule(2, 0, {0, 10}), 10, 4, {}, p),
               std::invalid_argument, "no route");

  CHECK_THROWS(builtin_machine("nope"), std::invalid_argument, "dgx1-v100");
  CHECK_THROWS(builtin_machine("cpu-0"), std::invalid_argument, "cpu-<N>");
  CHECK_THROWS(builtin_machine("cpu-"), std::invalid_argument, "dgx1-p100");
  CHECK_THROWS(builtin_machine("cpu-x2"), std::invalid_argument, "pcie-8gpu");
  CHECK_THROWS(builtin_machine("cpu-10000"), std::invalid_argument, "cpu-<N>");
  CHECK_THROWS(cpu_host(0, CpuHostParams{}), std::invalid_argument, "");
}
