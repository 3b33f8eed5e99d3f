// Device programs (plan/device_program.h) run by a host interpreter that follows the GPU
// kernel's contract: ops of one phase in any order, a barrier of all ranks between phases.
#include <random>
#include <vector>

#include "plan/balanced_plan.h"
#include "plan/device_program.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;

namespace {

// Runs every window of plan on world ranks whose tensors start as inputs; returns the tensors.
// reversed runs the ops of each phase back to front, which must not change any result.
std::vector<std::vector<int64_t>> interpret(const CollectivePlan& plan, int world,
                                            std::vector<std::vector<int64_t>> tensors,
                                            bool reversed) {
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(world));
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    const WindowPlan w = plan.window(k);
    std::vector<DeviceProgram> programs;
    for (int r = 0; r < world; ++r) {
      programs.push_back(compile_device_program(w, r));
      slots[r].assign(static_cast<size_t>(w.slot_elems), -1);
    }
    for (int phase = 0; phase <= w.schedule.num_phases; ++phase) {
      for (int r = 0; r < world; ++r) {
        const DeviceProgram& p = programs[r];
        std::vector<DeviceOp> ops(p.ops.begin() + p.phase_begin[phase],
                                  p.ops.begin() + p.phase_begin[phase + 1]);
        if (reversed) std::reverse(ops.begin(), ops.end());
        for (const DeviceOp& op : ops) {
          CHECK_EQ(op.phase, phase);
          auto source = [&](int s) -> const std::vector<int64_t>& {
            return op.sources[s] == kOwnInput ? tensors[r] : slots[op.sources[s]];
          };
          std::vector<int64_t>& dst = op.dst_is_output ? tensors[r] : slots[r];
          for (int64_t i = 0; i < op.count; ++i) {
            int64_t v = source(0)[op.src_offset + i];
            if (op.is_reduce) {
              for (int s = 1; s < op.num_sources; ++s) v += source(s)[op.src_offset + i];
            }
            dst[op.dst_offset + i] = v;
          }
        }
      }
    }
  }
  return tensors;
}

void check_allreduce(Algorithm algorithm, int world, int64_t total, int64_t window, int num_packs,
                     std::mt19937& rng) {
  std::vector<std::vector<int64_t>> inputs(static_cast<size_t>(world));
  std::vector<int64_t> expected(static_cast<size_t>(total), 0);
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < total; ++i) {
      inputs[r].push_back(xdev_test::uniform(rng, -1000, 1000));
      expected[i] += inputs[r].back();
    }
  }
  const auto packs = xdev_test::random_tiling(rng, total, num_packs);
  std::vector<PackTree> trees;
  if (algorithm == Algorithm::kHierarchicalBalanced) {
    trees = balanced_pack_trees(LinkMatrix::fully_connected(world), num_packs);
  }
  const int root = static_cast<int>(xdev_test::uniform(rng, 0, world - 1));
  const CollectivePlan plan =
      CollectivePlan::allreduce(algorithm, world, root, packs, total, window, trees);
  for (bool reversed : {false, true}) {
    const auto out = interpret(plan, world, inputs, reversed);
    for (int r = 0; r < world; ++r) {
      if (out[r] != expected) {
        CHECK(false);
        std::cout << "  " << to_string(algorithm) << " world " << world << " total " << total
                  << " window " << window << " packs " << num_packs << " rank " << r
                  << (reversed ? " reversed" : "") << "\n";
        return;
      }
    }
  }
}

}  // namespace

TEST(device_programs_allreduce_every_native_plan) {
  std::mt19937 rng(7);
  const Algorithm algorithms[] = {Algorithm::kHierarchicalCopy, Algorithm::kHierarchicalBalanced,
                                  Algorithm::kReduceToOne, Algorithm::kFlat, Algorithm::kDirect};
  for (Algorithm a : algorithms) {
    const bool hierarchical =
        a == Algorithm::kHierarchicalCopy || a == Algorithm::kHierarchicalBalanced;
    for (int world : {2, 3, 4, 8}) {
      if (hierarchical && world % 2 != 0) continue;
      for (int64_t total : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{97}, int64_t{1000}}) {
        for (int64_t window : {int64_t{5}, int64_t{64}, int64_t{4096}}) {
          for (int packs : {1, world, 3 * world})
            check_allreduce(a, world, total, window, packs, rng);
        }
      }
    }
  }
}

TEST(device_program_stages_then_writes_only_its_own_memory) {
  const CollectivePlan plan = CollectivePlan::allreduce(Algorithm::kHierarchicalCopy, 8, 0,
                                                        {{0, 40}, {40, 80}}, 80, 1 << 20);
  const WindowPlan w = plan.window(0);
  for (int r = 0; r < 8; ++r) {
    const DeviceProgram p = compile_device_program(w, r);
    CHECK_EQ(p.num_phases, 4);
    CHECK_EQ(static_cast<int>(p.phase_begin.size()), p.num_phases + 2);
    CHECK(p.phase_begin[1] > 0);  // every rank stages
    for (const DeviceOp& op : p.ops) {
      CHECK((op.phase == 0) == (op.sources[0] == kOwnInput));
      CHECK(op.count > 0);
    }
  }
}

TEST(device_program_rejects_too_many_ranks) {
  const CollectivePlan plan =
      CollectivePlan::allreduce(Algorithm::kFlat, kMaxDeviceRanks + 2, 0, {}, 100, 1 << 20);
  CHECK_THROWS(compile_device_program(plan.window(0), 0), std::invalid_argument, "at most");
}

TEST(device_program_rejects_cpu_only_forwarded_schedules) {
  const CollectivePlan plan = CollectivePlan::allreduce(Algorithm::kFlat, 2, 0, {}, 100, 1 << 20);
  WindowPlan w = plan.window(0);
  const Schedule original = w.schedule;
  w.schedule = forward_own_input(original);
  CHECK_THROWS(compile_device_program(w, 0), std::invalid_argument, "CPU executor only");
  // A total written to another rank's slot alone is refused too.
  w.schedule = original;
  for (Step& s : w.schedule.steps) {
    if (s.kind == StepKind::kReduce) s.slot_owner = 1 - s.actor;
  }
  CHECK_THROWS(compile_device_program(w, 0), std::invalid_argument, "CPU executor only");
}

TEST(device_blocks_leave_every_rank_sharing_a_gpu_resident_at_once) {
  // One rank per H100 (132 SMs): half of them, capped.
  CHECK_EQ(device_blocks_per_rank(132, 1, 64), 64);
  CHECK_EQ(device_blocks_per_rank(100, 1, 64), 50);
  // Ranks sharing it split that half: 4 x 64 blocks on 132 SMs hung under MPS.
  for (int ranks = 1; ranks <= kMaxDeviceRanks; ++ranks) {
    const int blocks = device_blocks_per_rank(132, ranks, 64);
    CHECK(blocks >= 1);
    CHECK(blocks * ranks <= 132 / 2 || blocks == 1);
  }
  CHECK_EQ(device_blocks_per_rank(132, 4, 64), 16);
  CHECK_EQ(device_blocks_per_rank(132, 8, 64), 8);
  // A GPU too small to halve, or more ranks than SMs: one block each.
  CHECK_EQ(device_blocks_per_rank(1, 1, 64), 1);
  CHECK_EQ(device_blocks_per_rank(8, 16, 64), 1);
  CHECK_EQ(device_blocks_per_rank(132, 0, 64), 64);
}
