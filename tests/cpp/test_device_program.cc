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

using Values = std::vector<int64_t>;

// One rank's ops of one phase, as the kernel runs them: `input` holds what
// kOwnInput reads, `output` what dst_is_output writes (one vector for an
// allreduce). reversed runs them back to front, which must not change any result.
void run_phase(const DeviceProgram& p, int phase, int rank, std::vector<Values>& slots,
               const Values& input, Values& output, bool reversed) {
  std::vector<DeviceOp> ops(p.ops.begin() + p.phase_begin[phase],
                            p.ops.begin() + p.phase_begin[phase + 1]);
  if (reversed) std::reverse(ops.begin(), ops.end());
  for (const DeviceOp& op : ops) {
    CHECK_EQ(op.phase, phase);
    auto read = [&](int s, int64_t i) {
      const int64_t at = op.src_offsets[s] + i;
      return op.sources[s] == kOwnInput ? input.at(at) : slots[op.sources[s]].at(at);
    };
    Values& dst = op.dst_is_output ? output : slots[rank];
    for (int64_t i = 0; i < op.count; ++i) {
      int64_t v = read(0, i);
      if (op.is_reduce) {
        for (int s = 1; s < op.num_sources; ++s) v += read(s, i);
      }
      dst.at(op.dst_offset + i) = v;
    }
  }
}

// Runs every window of plan on world ranks whose tensors start as inputs; returns the tensors.
std::vector<Values> interpret(const CollectivePlan& plan, int world, std::vector<Values> tensors,
                              bool reversed) {
  std::vector<Values> slots(static_cast<size_t>(world));
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    const WindowPlan w = plan.window(k);
    std::vector<DeviceProgram> programs;
    for (int r = 0; r < world; ++r) {
      programs.push_back(compile_device_program(w, r));
      slots[r].assign(static_cast<size_t>(w.slot_elems), -1);
    }
    for (int phase = 0; phase <= w.schedule.num_phases; ++phase) {
      for (int r = 0; r < world; ++r) {
        run_phase(programs[r], phase, r, slots, tensors[r], tensors[r], reversed);
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

namespace {

// Runs every window of a gather/scatter plan through its device programs; returns each
// rank's output (sized as the kernel's caller sizes it).
std::vector<Values> interpret_gather_scatter(const GatherScatterPlan& plan, int64_t slot_elems,
                                             const std::vector<Values>& inputs,
                                             const std::vector<int64_t>& output_sizes,
                                             bool reversed) {
  const int world = plan.world_size();
  std::vector<Values> outputs;
  for (int64_t n : output_sizes) outputs.emplace_back(static_cast<size_t>(n), -7);
  std::vector<Values> slots(static_cast<size_t>(world));
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    std::vector<DeviceProgram> programs;
    for (int r = 0; r < world; ++r) {
      programs.push_back(compile_gather_scatter_program(plan, k, r));
      CHECK_EQ(programs[r].num_phases, 1);
      slots[r].assign(static_cast<size_t>(slot_elems), -1);
    }
    for (int phase = 0; phase <= 1; ++phase) {
      for (int r = 0; r < world; ++r) {
        run_phase(programs[r], phase, r, slots, inputs[r], outputs[r], reversed);
      }
    }
  }
  return outputs;
}

void check_gather_scatter(GatherScatterKind kind, const std::vector<int64_t>& blocks,
                          int64_t slot_elems, std::mt19937& rng) {
  const int world = static_cast<int>(blocks.size());
  int64_t full = 0;
  std::vector<int64_t> start;
  for (int64_t b : blocks) {
    start.push_back(full);
    full += b;
  }
  const bool reduce_scatter = kind == GatherScatterKind::kReduceScatter;
  std::vector<Values> inputs(static_cast<size_t>(world));
  std::vector<int64_t> output_sizes;
  for (int r = 0; r < world; ++r) {
    const int64_t n = reduce_scatter ? full : blocks[r];
    for (int64_t i = 0; i < n; ++i) inputs[r].push_back(xdev_test::uniform(rng, -1000, 1000));
    output_sizes.push_back(reduce_scatter ? blocks[r] : full);
  }
  // Reference: block r of every rank's full input summed; every rank's block, in rank order.
  std::vector<Values> expected(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    if (reduce_scatter) {
      for (int64_t i = 0; i < blocks[r]; ++i) {
        int64_t v = 0;
        for (int j = 0; j < world; ++j) v += inputs[j][start[r] + i];
        expected[r].push_back(v);
      }
    } else {
      for (int j = 0; j < world; ++j) {
        expected[r].insert(expected[r].end(), inputs[j].begin(), inputs[j].end());
      }
    }
  }
  const GatherScatterPlan plan(kind, blocks, slot_elems);
  for (bool reversed : {false, true}) {
    const auto out = interpret_gather_scatter(plan, slot_elems, inputs, output_sizes, reversed);
    for (int r = 0; r < world; ++r) {
      if (out[r] != expected[r]) {
        CHECK(false);
        std::cout << "  " << to_string(kind) << " world " << world << " slot " << slot_elems
                  << " rank " << r << (reversed ? " reversed" : "") << "\n";
        return;
      }
    }
  }
}

}  // namespace

TEST(device_programs_reduce_scatter_and_all_gather_even_and_uneven_blocks) {
  std::mt19937 rng(11);
  for (GatherScatterKind kind :
       {GatherScatterKind::kReduceScatter, GatherScatterKind::kAllGather}) {
    for (int world : {1, 2, 3, 5, 8}) {
      for (int64_t block : {int64_t{1}, int64_t{13}, int64_t{300}}) {
        for (int64_t slot : {int64_t{8}, int64_t{64}, int64_t{1} << 16}) {
          if (slot < world) continue;  // a window holds one element per rank
          check_gather_scatter(kind, std::vector<int64_t>(static_cast<size_t>(world), block), slot,
                               rng);
          std::vector<int64_t> uneven;
          for (int r = 0; r < world; ++r) uneven.push_back(xdev_test::uniform(rng, 0, block));
          check_gather_scatter(kind, uneven, slot, rng);
        }
      }
    }
  }
}

TEST(gather_scatter_device_program_reads_its_own_input_and_peers_slots) {
  // 3 ranks, 4 elements each, one window: rank 1 stages the pieces ranks 0 and 2 reduce
  // (packed: its own is never staged), then reduces its block from its input and both slots.
  const GatherScatterPlan plan(GatherScatterKind::kReduceScatter, 3, 4, 1 << 10);
  const DeviceProgram p = compile_gather_scatter_program(plan, 0, 1);
  CHECK_EQ(p.phase_begin[1], 2);
  CHECK_EQ(p.ops[0].src_offsets[0], 0);  // block 0 of its input, to its slot's start
  CHECK_EQ(p.ops[0].dst_offset, 0);
  CHECK_EQ(p.ops[1].src_offsets[0], 8);  // block 2, right after it
  CHECK_EQ(p.ops[1].dst_offset, 4);
  const DeviceOp& sum = p.ops[2];
  CHECK_EQ(sum.num_sources, 3);
  CHECK_EQ(sum.sources[1], kOwnInput);
  CHECK_EQ(sum.src_offsets[0], 0);  // rank 0 staged blocks 1 and 2: block 1 first
  CHECK_EQ(sum.src_offsets[1], 4);  // its own block 1, from its input
  CHECK_EQ(sum.src_offsets[2], 4);  // rank 2 staged blocks 0 and 1: block 1 second
  CHECK(sum.finalize == 1 && sum.dst_is_output == 1 && sum.dst_offset == 0);
}

namespace {

struct Access {
  int copy;  // whose copy of the tensor
  int64_t begin, end;
  size_t op;  // index among the phase's ops of every rank
};

bool overlap(const Access& a, const Access& b) {
  return a.copy == b.copy && a.begin < b.end && b.begin < a.end;
}

}  // namespace

TEST(in_place_programs_allreduce_heap_copies_without_races) {
  std::mt19937 rng(11);
  for (int world : {1, 2, 3, 5, 8, 16}) {
    for (int64_t total : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100}, int64_t{4099}}) {
      std::vector<Values> copies(static_cast<size_t>(world));
      Values expected(static_cast<size_t>(total), 0);
      for (int r = 0; r < world; ++r) {
        for (int64_t i = 0; i < total; ++i) {
          copies[r].push_back(xdev_test::uniform(rng, -1000, 1000));
          expected[i] += copies[r].back();
        }
      }
      std::vector<DeviceProgram> programs;
      for (int r = 0; r < world; ++r)
        programs.push_back(compile_in_place_program(total, 4, world, r));
      CHECK_EQ(programs[0].num_phases, 3);
      for (int phase = 0; phase <= 3; ++phase) {
        // What every op of every rank reads and writes in this phase: no op may
        // write what another op reads or writes (one op reading and writing the
        // same elements is an in-place reduce, one thread per element).
        std::vector<Access> reads, writes;
        std::vector<std::pair<int, DeviceOp>> ops;
        for (int r = 0; r < world; ++r) {
          const DeviceProgram& p = programs[r];
          for (int i = p.phase_begin[phase]; i < p.phase_begin[phase + 1]; ++i) {
            const DeviceOp& op = p.ops[static_cast<size_t>(i)];
            CHECK(op.sources_are_copies == 1 && op.dst_is_output == 1);
            CHECK(phase == 1 || phase == 2);
            writes.push_back({r, op.dst_offset, op.dst_offset + op.count, ops.size()});
            for (int s = 0; s < op.num_sources; ++s) {
              reads.push_back(
                  {op.sources[s], op.src_offsets[s], op.src_offsets[s] + op.count, ops.size()});
            }
            ops.emplace_back(r, op);
          }
        }
        for (const Access& w : writes) {
          for (const Access& x : reads) CHECK(x.op == w.op || !overlap(w, x));
          for (const Access& x : writes) CHECK(x.op == w.op || !overlap(w, x));
        }
        // With no races, any order gives the barrier-separated result.
        for (const auto& [r, op] : ops) {
          for (int64_t i = 0; i < op.count; ++i) {
            int64_t v = 0;
            for (int s = 0; s < op.num_sources; ++s) {
              v += copies[op.sources[s]].at(op.src_offsets[s] + i);
            }
            copies[r].at(op.dst_offset + i) = v;
          }
        }
      }
      for (int r = 0; r < world; ++r) CHECK(copies[r] == expected);
    }
  }
}
