// Unit tests of shared_gpu_host (csrc/plan/machines.h): ranks sharing one GPU, every byte
// through its one memory. Expected times are worked out by hand next to each check.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/cost_model.h"
#include "plan/machines.h"
#include "plan/predict.h"
#include "plan/schedule.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

GpuHostParams shared_params(double memory_bytes_per_s, int64_t window_bytes) {
  GpuHostParams p;
  p.memory_bytes_per_s = memory_bytes_per_s;
  p.launch_latency_s = 5e-6;
  p.step_latency_s = 2e-6;
  p.barrier_per_phase = true;
  p.window_bytes = window_bytes;
  return p;
}

double predict_s(const MachineModel& m, Algorithm a, int64_t bytes) {
  const int64_t packs = a == Algorithm::kHierarchicalCopy || a == Algorithm::kHierarchicalBalanced
                            ? m.num_devices()
                            : 0;
  return predict_allreduce(m, Candidate::native(a, packs), bytes).seconds;
}

const Algorithm kPlans[] = {Algorithm::kDirect, Algorithm::kReduceToOne, Algorithm::kFlat,
                            Algorithm::kHierarchicalCopy, Algorithm::kHierarchicalBalanced};

}  // namespace

TEST(shared_gpu_every_byte_goes_through_one_memory) {
  const MachineModel m = shared_gpu_host(3, shared_params(2e12, kCudaWindowBytes));
  CHECK_EQ(m.name(), std::string("shared-gpu-3"));
  CHECK_EQ(m.num_devices(), 3);
  CHECK_EQ(m.resources().size(), size_t{1});
  CHECK_NEAR(m.resources().at(0).bytes_per_s, 2e12);
  CHECK(m.barrier_between_phases);
  CHECK_NEAR(m.barrier_latency_s, 2e-6);  // the barrier is one flag hand-off
  CHECK_EQ(m.step_latency_s, 0.0);
  CHECK_NEAR(m.launch_latency_s, 5e-6);
  CHECK_EQ(m.window_bytes, kCudaWindowBytes);
  CHECK(!m.nccl.present);  // NCCL refuses ranks sharing a GPU
  for (int a = 0; a < 3; ++a) {
    CHECK(m.local(a) == std::vector<int>{0});
    for (int b = 0; b < 3; ++b) {
      if (a == b) continue;
      CHECK(m.route(a, b) == std::vector<int>{0});
      CHECK_EQ(m.route_latency_s(a, b), 0.0);
      CHECK_EQ(m.links.links(a, b), 1);  // every plan can run
    }
  }
  CHECK_THROWS(shared_gpu_host(0, GpuHostParams{}), std::invalid_argument, "at least one rank");
}

TEST(shared_gpu_direct_on_two_ranks_by_hand) {
  // direct, 2 ranks, B bytes in one window. Staging: each rank copies its input to its slot,
  // 2B (read, write) each, 4B in all. Phase 1 (after one barrier): each rank reduces both
  // slots into its output: B of its own slot and B of the peer's (same memory) read, B
  // written, 3B each, 6B in all. Everything shares the one memory, which is busy throughout,
  // so the time is launch + barrier + 10B / rate.
  const int64_t bytes = int64_t{4} << 20;
  const MachineModel m = shared_gpu_host(2, shared_params(1e12, kCudaWindowBytes));
  CHECK_NEAR(predict_s(m, Algorithm::kDirect, bytes), 5e-6 + 2e-6 + 10.0 * bytes / 1e12);
}

TEST(shared_gpu_direct_windows_run_one_after_another) {
  // 64 MiB in windows of 32 MiB: two windows of launch-free barrier + 10W / rate each.
  const int64_t window = int64_t{32} << 20;
  const MachineModel m = shared_gpu_host(2, shared_params(1e12, window));
  CHECK_NEAR(predict_s(m, Algorithm::kDirect, 2 * window),
             5e-6 + 2 * (2e-6 + 10.0 * window / 1e12));
}

TEST(shared_gpu_predictions_grow_with_size_and_scale_with_the_memory) {
  for (int ranks : {2, 4}) {
    const MachineModel slow = shared_gpu_host(ranks, shared_params(1e12, kCudaWindowBytes));
    const MachineModel fast = shared_gpu_host(ranks, shared_params(2e12, kCudaWindowBytes));
    // Latencies only: a memory so fast its bytes cost nothing.
    const MachineModel latency = shared_gpu_host(ranks, shared_params(1e30, kCudaWindowBytes));
    for (Algorithm a : kPlans) {
      double previous = 0;
      for (int64_t bytes = int64_t{64} << 10; bytes <= int64_t{256} << 20; bytes *= 4) {
        const double t = predict_s(slow, a, bytes);
        CHECK(t > previous);
        previous = t;
        // The memory is the only bandwidth: doubling it halves the time beyond the latencies.
        const double fixed = predict_s(latency, a, bytes);
        CHECK(relatively_near(t - fixed, 2 * (predict_s(fast, a, bytes) - fixed), 1e-6));
      }
    }
  }
}
