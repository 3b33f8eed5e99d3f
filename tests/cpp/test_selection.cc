// Unit tests of select_allreduce (csrc/plan/selection.h): every input it weighs, one at a time,
// and the model-choice cache.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "plan/device_program.h"
#include "plan/machines.h"
#include "plan/predict.h"
#include "plan/selection.h"
#include "plan/shared_buffer_plan.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

const Algorithm kForcible[] = {Algorithm::kDirect, Algorithm::kReduceToOne, Algorithm::kFlat,
                               Algorithm::kHierarchicalCopy, Algorithm::kHierarchicalBalanced};

SelectionInput cuda_input(TopologyClass topology, int world_size) {
  SelectionInput in;
  in.device = DeviceKind::kCuda;
  in.topology = topology;
  in.world_size = world_size;
  in.payload_bytes = 1 << 20;
  return in;
}

// A CPU job of `world` ranks on one host with its model, as the backend describes it.
SelectionInput cpu_input(const MachineModel& model, int world, int64_t bytes) {
  SelectionInput in;
  in.world_size = world;
  in.payload_bytes = bytes;
  in.model = &model;
  return in;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST(selection_op_unsupported_falls_back_with_reason) {
  const MachineModel model = builtin_machine("cpu-4");
  for (DeviceKind dev : {DeviceKind::kCpu, DeviceKind::kCuda}) {
    SelectionInput in = cpu_input(model, 4, 1 << 20);
    in.device = dev;
    in.op_supported = false;
    const Selection s = select_allreduce(in);
    CHECK_EQ(s.algorithm, Algorithm::kFallback);
    CHECK_EQ(s.reason, std::string("no native kernel for this reduce op / dtype"));
    CHECK(!s.single_copy && !s.in_place_shared);
    // A forced native plan cannot run such an op either: the fallback, with the same reason.
    in.requested = Algorithm::kFlat;
    CHECK_EQ(select_allreduce(in).reason,
             std::string("no native kernel for this reduce op / dtype"));
  }
}

TEST(selection_shared_buffer_runs_in_place_for_auto_and_flat) {
  const MachineModel model = builtin_machine("cpu-4");
  for (Algorithm req : {Algorithm::kAuto, Algorithm::kFlat}) {
    SelectionInput in = cpu_input(model, 4, int64_t{64} << 20);
    in.requested = req;
    in.shared_buffer_id = 3;
    in.single_copy_available = true;  // in place needs no copy at all: not single copy
    const Selection s = select_allreduce(in);
    CHECK_EQ(s.algorithm, Algorithm::kFlat);
    CHECK(s.in_place_shared);
    CHECK(!s.single_copy);
    CHECK_EQ(s.num_packs, int64_t{0});
    CHECK(contains(s.reason, "tensor in shared buffer #3"));
  }
  for (Algorithm req : kForcible) {
    if (req == Algorithm::kFlat) continue;
    SelectionInput in = cpu_input(model, 4, 1 << 20);
    in.requested = req;
    in.shared_buffer_id = 0;
    const Selection s = select_allreduce(in);  // other forced plans keep their staged schedule
    CHECK_EQ(s.algorithm, req);
    CHECK(!s.in_place_shared);
    CHECK(!contains(s.reason, "shared buffer"));
  }
  // Not for several tensors, CUDA tensors, or an op without a kernel.
  SelectionInput in = cpu_input(model, 4, 1 << 20);
  in.shared_buffer_id = 1;
  in.num_tensors = 2;
  CHECK(!select_allreduce(in).in_place_shared);
  in.num_tensors = 1;
  in.op_supported = false;
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kFallback);
  SelectionInput cuda = cuda_input(TopologyClass::kFullyConnected, 4);
  cuda.shared_buffer_id = 1;
  CHECK_EQ(select_allreduce(cuda).algorithm, Algorithm::kReduceToOne);
  CHECK(!select_allreduce(cuda).in_place_shared);
}

TEST(selection_symmetric_heap_runs_in_place_only_where_the_plan_is_flat) {
  const MachineModel model = builtin_machine("cpu-4");
  SelectionInput in = cpu_input(model, 4, int64_t{25} << 20);
  in.in_symmetric_heap = true;
  Selection s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kFlat);
  CHECK(s.in_place_shared);
  CHECK(contains(s.reason, "symmetric heap"));
  // The plan is the one any tensor of the size gets (a peer's may not be in the heap).
  for (int64_t bytes = 4; bytes <= (int64_t{64} << 20); bytes *= 4) {
    SelectionInput heap = cpu_input(model, 4, bytes);
    heap.in_symmetric_heap = true;
    const Selection with = select_allreduce(heap);
    const Selection without = select_allreduce(cpu_input(model, 4, bytes));
    CHECK_EQ(with.algorithm, without.algorithm);
    CHECK_EQ(with.num_packs, without.num_packs);
    CHECK_EQ(with.in_place_shared, with.algorithm == Algorithm::kFlat);
  }
  in.single_copy_available = true;  // single copy (off by default) wins over in place
  s = select_allreduce(in);
  CHECK(s.single_copy);
  CHECK(!s.in_place_shared);
  in.single_copy_available = false;
  in.requested = Algorithm::kReduceToOne;  // a forced plan keeps its staged schedule
  s = select_allreduce(in);
  CHECK(!s.in_place_shared);
  CHECK_EQ(s.algorithm, Algorithm::kReduceToOne);
  in.requested = Algorithm::kAuto;
  in.num_hosts = 2;  // several hosts: the engine, whatever the tensor's memory
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kFallback);
}

TEST(selection_cuda_heap_runs_in_place_for_auto_and_flat_only) {
  SelectionInput in = cuda_input(TopologyClass::kFullyConnected, 4);
  in.in_symmetric_heap = true;
  Selection s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kReduceToOne);  // the plan any tensor gets
  CHECK(s.in_place_shared);
  CHECK(contains(s.reason, "CUDA heap"));
  in.requested = Algorithm::kFlat;
  CHECK(select_allreduce(in).in_place_shared);
  in.requested = Algorithm::kReduceToOne;  // forced by name: staged
  CHECK(!select_allreduce(in).in_place_shared);
  in.requested = Algorithm::kAuto;
  in.num_tensors = 2;  // a list is packed first: staged
  CHECK(!select_allreduce(in).in_place_shared);
  in.num_tensors = 1;
  in.transport_available = false;  // the engine: nothing in place
  s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kFallback);
  CHECK(!s.in_place_shared);
}

TEST(selection_without_transport_falls_back_with_the_note) {
  SelectionInput in = cuda_input(TopologyClass::kDgx1, 8);
  in.transport_available = false;
  in.transport_note = "off: not every GPU can access every other (no peer access)";
  Selection s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kFallback);
  CHECK_EQ(s.reason, std::string("no native transport for cuda tensors (off: not every GPU can "
                                 "access every other (no peer access))"));
  const MachineModel model = builtin_machine("cpu-2");
  SelectionInput cpu = cpu_input(model, 2, 4096);
  cpu.transport_available = false;
  s = select_allreduce(cpu);
  CHECK_EQ(s.algorithm, Algorithm::kFallback);
  CHECK_EQ(s.reason, std::string("no native transport for cpu tensors"));
  cpu.transport_note = "no shared memory";
  CHECK_EQ(select_allreduce(cpu).reason,
           std::string("no native transport for cpu tensors (no shared memory)"));
}

TEST(cuda_transport_opens_only_where_every_condition_holds) {
  CHECK_EQ(cuda_transport_refusal(1, 8, true, true, 90), std::string());
  CHECK_EQ(cuda_transport_refusal(1, kMaxDeviceRanks, true, true, 90), std::string());
  CHECK_EQ(cuda_transport_refusal(2, 8, true, true, 90),
           std::string("off: ranks span several hosts"));
  CHECK_EQ(cuda_transport_refusal(1, kMaxDeviceRanks + 1, true, true, 90),
           "off: more than " + std::to_string(kMaxDeviceRanks) + " ranks");
  CHECK_EQ(cuda_transport_refusal(1, 8, false, true, 90),
           std::string("off: not every GPU can access every other (no peer access)"));
  CHECK_EQ(cuda_transport_refusal(1, 8, true, false, 90),
           std::string("off: algorithm='fallback' or no shared memory for the host barrier"));
  // xdev's kernels need sm_70's scoped atomics: a P100 (6.0) takes the engine.
  CHECK_EQ(cuda_transport_refusal(1, 8, true, true, 60),
           std::string("off: a GPU of compute capability 6.0 (xdev's kernels need 7.0 or later)"));
  CHECK_EQ(cuda_transport_refusal(1, 8, true, true, 70), std::string());
  // Several hosts is named first: it is the reason the others follow from.
  CHECK_EQ(cuda_transport_refusal(2, 8, false, false, 90),
           std::string("off: ranks span several hosts"));
}

TEST(selection_avg_on_a_fallback_without_avg_is_sum_then_divide) {
  SelectionInput in = cuda_input(TopologyClass::kDgx1, 8);
  in.num_hosts = 2;
  for (bool avg : {false, true}) {
    for (bool has_avg : {false, true}) {
      in.op_is_avg = avg;
      in.fallback_has_avg = has_avg;
      const Selection s = select_allreduce(in);
      CHECK_EQ(s.algorithm, Algorithm::kFallback);
      CHECK_EQ(s.avg_as_sum_then_divide, avg && !has_avg);
    }
  }
  // A native plan has AVG itself.
  in.num_hosts = 1;
  in.op_is_avg = true;
  in.fallback_has_avg = false;
  CHECK(!select_allreduce(in).avg_as_sum_then_divide);
}

TEST(selection_single_copy_follows_use_single_copy) {
  const MachineModel model = builtin_machine("cpu-4");
  for (Algorithm req : kForcible) {
    for (int64_t bytes : {kCpuSingleCopyMinBytes - 4, kCpuSingleCopyMinBytes}) {
      for (int64_t tensors : {1, 2}) {
        for (bool available : {false, true}) {
          SelectionInput in = cpu_input(model, 4, bytes);
          in.requested = req;
          in.num_tensors = tensors;
          in.single_copy_available = available;
          const Selection s = select_allreduce(in);
          // Independently: an in-place plan (not direct), one buffer, large, transport open.
          const bool want = available && tensors == 1 && bytes >= 256 * 1024 &&
                            req != Algorithm::kDirect && req != Algorithm::kHierarchicalBalanced;
          CHECK_EQ(s.single_copy, want);
          CHECK_EQ(s.single_copy, use_single_copy(s.algorithm, bytes, tensors == 1, available));
        }
      }
    }
  }
  // Never for CUDA tensors or the fallback.
  SelectionInput cuda = cuda_input(TopologyClass::kFullyConnected, 4);
  cuda.payload_bytes = int64_t{64} << 20;
  cuda.single_copy_available = true;
  CHECK(!select_allreduce(cuda).single_copy);
  SelectionInput fb = cpu_input(model, 4, int64_t{64} << 20);
  fb.requested = Algorithm::kFallback;
  fb.single_copy_available = true;
  CHECK(!select_allreduce(fb).single_copy);
}

// Without the two-level plan (test_two_level.cc has it); CUDA tensors never take it.
TEST(selection_several_hosts_fall_back) {
  for (DeviceKind dev : {DeviceKind::kCpu, DeviceKind::kCuda}) {
    SelectionInput in = cuda_input(TopologyClass::kDgx1, 8);
    in.device = dev;
    in.num_hosts = 3;
    const Selection s = select_allreduce(in);  // no model needed: it never gets that far
    CHECK_EQ(s.algorithm, Algorithm::kFallback);
    CHECK_EQ(s.reason.rfind("ranks span 3 hosts", 0), size_t{0});
  }
}

TEST(selection_forced_algorithms) {
  SelectionInput in = cuda_input(TopologyClass::kPartial, 6);
  in.requested = Algorithm::kHierarchicalCopy;
  Selection s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kHierarchicalCopy);
  CHECK_EQ(s.num_packs, int64_t{6});  // default: one pack per rank
  CHECK_EQ(s.reason, std::string("algorithm='hierarchical_copy' requested"));
  in.num_packs = 5;
  CHECK_EQ(select_allreduce(in).num_packs, int64_t{5});
  in.world_size = 5;
  CHECK_THROWS(select_allreduce(in), std::invalid_argument, "even");
  CHECK_THROWS(check_forced_algorithm(Algorithm::kHierarchicalCopy, 7, 1), std::invalid_argument,
               "even");
  for (Algorithm a : {Algorithm::kHierarchicalCopy, Algorithm::kReduceToOne, Algorithm::kFlat}) {
    in = cuda_input(TopologyClass::kDgx1, 8);
    in.requested = a;
    CHECK_EQ(select_allreduce(in).algorithm, a);
    CHECK_EQ(select_allreduce(in).num_packs, a == Algorithm::kHierarchicalCopy ? 8 : 0);
    in.num_hosts = 2;
    // Forced means honoured or refused, never quietly replaced by the fallback.
    CHECK_THROWS(select_allreduce(in), std::invalid_argument, "hosts");
    CHECK_THROWS(check_forced_algorithm(a, 8, 2), std::invalid_argument, "hosts");
  }
  check_forced_algorithm(Algorithm::kAuto, 3, 2);  // auto and fallback are never refused
  check_forced_algorithm(Algorithm::kFallback, 3, 2);
  in = cuda_input(TopologyClass::kDgx1, 8);
  in.requested = Algorithm::kFallback;
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kFallback);
  CHECK_EQ(select_allreduce(in).reason, std::string("algorithm='fallback' requested"));
  // A forced CPU plan needs no model.
  SelectionInput cpu;
  cpu.world_size = 4;
  cpu.requested = Algorithm::kDirect;
  CHECK_EQ(select_allreduce(cpu).algorithm, Algorithm::kDirect);
}

TEST(selection_gives_the_engine_the_forms_only_it_runs) {
  // Sparse tensors and c10d's list form go to the engine whatever is forced, with a reason
  // describe() can show; only the list's AVG is the engine's SUM then a division (a sparse
  // AVG the engine refuses itself).
  for (Algorithm requested : {Algorithm::kAuto, Algorithm::kFlat}) {
    SelectionInput in;
    in.world_size = 2;
    in.requested = requested;
    in.op_is_avg = true;
    in.dense = false;
    Selection s = select_allreduce(in);
    CHECK_EQ(s.algorithm, Algorithm::kFallback);
    CHECK_EQ(s.reason, std::string("sparse tensors"));
    CHECK(!s.avg_as_sum_then_divide);
    in.dense = true;
    in.reduces_list_into_one = true;
    in.num_hosts = 2;  // before the hosts' rules too
    s = select_allreduce(in);
    CHECK_EQ(s.algorithm, Algorithm::kFallback);
    CHECK_EQ(s.reason, std::string("a list of tensors reduced into one result (c10d's list form)"));
    CHECK(s.avg_as_sum_then_divide);
  }
}

TEST(selection_cpu_auto_is_the_models_choice_at_the_size_class) {
  for (int world : {2, 3, 4, 8}) {
    const MachineModel model = builtin_machine("cpu-" + std::to_string(world));
    ModelChoiceCache cache;
    for (int64_t bytes : {int64_t{0}, int64_t{5}, int64_t{4096}, int64_t{100000}, int64_t{1} << 20,
                          int64_t{48} << 20}) {
      // Independently: the fastest prediction at the power of two at or above the payload.
      int64_t bucket = 4;
      while (bucket < bytes) bucket <<= 1;
      const ModelChoice want = choose_allreduce(model, bucket);
      for (ModelChoiceCache* c : {static_cast<ModelChoiceCache*>(nullptr), &cache, &cache}) {
        SelectionInput in = cpu_input(model, world, bytes);
        in.model_cache = c;
        const Selection s = select_allreduce(in);
        CHECK_EQ(s.algorithm, want.best.candidate.algorithm);
        CHECK_EQ(s.num_packs, want.best.candidate.num_packs);
        CHECK_EQ(s.predicted_s, want.best.seconds);
        CHECK(contains(s.reason, "model '" + model.name() + "': " + want.best.candidate.label()));
        CHECK(contains(s.reason, ", next "));
      }
    }
    CHECK_EQ(model_bucket_bytes(0), int64_t{4});
    CHECK_EQ(model_bucket_bytes(4097), int64_t{8192});
  }
  const MachineModel four = builtin_machine("cpu-4");
  SelectionInput in = cpu_input(four, 4, 1 << 20);
  in.model = nullptr;
  CHECK_THROWS(select_allreduce(in), std::invalid_argument, "needs a machine model");
  in.model = &four;
  in.world_size = 2;
  CHECK_THROWS(select_allreduce(in), std::invalid_argument, "model of 4 devices for 2 ranks");
}

TEST(model_choice_cache_is_per_model_and_thread_safe) {
  const MachineModel model = builtin_machine("cpu-4");
  const MachineModel other = builtin_machine("cpu-4");
  ModelChoiceCache cache;
  const ModelChoiceCache::Choice first = cache.get(model, 1 << 16, -1);
  CHECK_THROWS(cache.get(other, 1 << 16, -1), std::invalid_argument, "ModelChoiceCache");
  std::vector<std::thread> threads;
  std::vector<int> same(8, 0);
  for (size_t t = 0; t < same.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 50; ++k) {
        const auto c = cache.get(model, int64_t{1} << (10 + k % 12), -1);
        if (k % 12 == 6) same[t] += c.reason == first.reason ? 1 : 0;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int n : same) CHECK_EQ(n, 4);  // k = 6, 18, 30, 42: the 64 KiB class every time
}

TEST(selection_world_of_one) {
  SelectionInput in;  // world of one, CPU, auto, no model: nothing to exchange
  in.payload_bytes = int64_t{1} << 30;
  in.single_copy_available = true;
  Selection s = select_allreduce(in);
  CHECK(s.algorithm != Algorithm::kFallback);
  CHECK(!s.single_copy);  // direct never runs single copy
  CHECK_EQ(s.reason, std::string("one rank: the input is already the result"));
  // CUDA tensors of one rank have no native transport: the fallback (a no-op) runs them.
  SelectionInput cuda = cuda_input(TopologyClass::kFullyConnected, 1);
  cuda.transport_available = false;
  CHECK_EQ(select_allreduce(cuda).algorithm, Algorithm::kFallback);
  // A forced plan is honoured; hierarchical ones need an even world.
  in.requested = Algorithm::kFlat;
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kFlat);
  in.requested = Algorithm::kHierarchicalCopy;
  CHECK_THROWS(select_allreduce(in), std::invalid_argument, "even");
}

TEST(selection_cuda_by_topology) {
  Selection s = select_allreduce(cuda_input(TopologyClass::kDgx1, 8));
  CHECK_EQ(s.algorithm, Algorithm::kHierarchicalCopy);
  CHECK_EQ(s.num_packs, int64_t{8});
  CHECK_EQ(s.reason, std::string("8 GPUs wired like a DGX-1"));
  for (int64_t user : {0, 3, 16}) {
    SelectionInput in = cuda_input(TopologyClass::kDgx1, 8);
    in.num_packs = user;
    s = select_allreduce(in);
    CHECK_EQ(s.algorithm, Algorithm::kHierarchicalCopy);
    CHECK_EQ(s.num_packs, user);
  }
  for (int world : {2, 4, 8}) {
    s = select_allreduce(cuda_input(TopologyClass::kFullyConnected, world));
    CHECK_EQ(s.algorithm, Algorithm::kReduceToOne);
    CHECK_EQ(s.num_packs, int64_t{0});
  }
  // DGX-1 wiring with other than 8 ranks is not the DGX-1 plan.
  CHECK_EQ(select_allreduce(cuda_input(TopologyClass::kDgx1, 4)).algorithm, Algorithm::kFallback);
  CHECK_EQ(select_allreduce(cuda_input(TopologyClass::kPartial, 8)).algorithm,
           Algorithm::kFallback);
  s = select_allreduce(cuda_input(TopologyClass::kNone, 8));
  CHECK_EQ(s.algorithm, Algorithm::kFallback);
  CHECK_EQ(s.reason, std::string("GPU topology is none"));
}

TEST(selection_cuda_time_sliced_gpu_leaves_auto_to_the_engine) {
  // Ranks sharing a GPU without MPS: auto goes to the engine and says why; a forced plan runs.
  SelectionInput in = cuda_input(TopologyClass::kFullyConnected, 2);
  in.gpu_time_sliced = true;
  Selection s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kFallback);
  CHECK_EQ(s.reason, std::string(kGpuTimeSlicedReason));
  CHECK(contains(s.reason, "nvidia-cuda-mps-control -d"));
  in.requested = Algorithm::kFlat;
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kFlat);
  // A world of one has nothing to wait for; CPU tensors never share a GPU.
  in = cuda_input(TopologyClass::kFullyConnected, 1);
  in.gpu_time_sliced = true;
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kDirect);
  in = cuda_input(TopologyClass::kFullyConnected, 2);  // under MPS: the fixed rule
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kReduceToOne);
}

TEST(every_selection_has_a_reason) {
  int cases = 0;
  const Algorithm requests[] = {Algorithm::kAuto,        Algorithm::kHierarchicalCopy,
                                Algorithm::kReduceToOne, Algorithm::kFlat,
                                Algorithm::kDirect,      Algorithm::kFallback};
  for (Algorithm req : requests) {
    for (int world : {1, 2, 3, 8}) {
      const MachineModel model = builtin_machine("cpu-" + std::to_string(world));
      for (int hosts : {1, 2}) {
        for (DeviceKind dev : {DeviceKind::kCpu, DeviceKind::kCuda}) {
          for (TopologyClass topo : {TopologyClass::kNone, TopologyClass::kPartial,
                                     TopologyClass::kFullyConnected, TopologyClass::kDgx1}) {
            for (int flags = 0; flags < 16; ++flags) {
              SelectionInput in = cpu_input(model, world, (flags & 8) ? 1 << 20 : 0);
              in.requested = req;
              in.num_hosts = hosts;
              in.device = dev;
              in.topology = topo;
              in.transport_available = (flags & 1) != 0;
              in.op_supported = (flags & 2) != 0;
              in.shared_buffer_id = (flags & 4) ? 2 : -1;
              in.single_copy_available = true;
              in.op_is_avg = true;
              try {
                const Selection s = select_allreduce(in);
                CHECK(!s.reason.empty());
                // The flags only go with the path they belong to.
                CHECK(!s.in_place_shared || s.algorithm == Algorithm::kFlat);
                CHECK(!s.single_copy || (dev == DeviceKind::kCpu && !s.in_place_shared));
                CHECK_EQ(s.avg_as_sum_then_divide, s.algorithm == Algorithm::kFallback);
                ++cases;
              } catch (const std::invalid_argument&) {
                // A refused forced algorithm; covered by selection_forced_algorithms.
              }
            }
          }
        }
      }
    }
  }
  CHECK(cases > 2000);
}
