// The three CPU executors end to end, with one thread per rank over a real ShmChannel: staged
// (ShmExecutor, several windows and tensors), single-copy (SingleCopyExecutor, peers read each
// other's tensors with process_vm_readv, here within one process) and in place in memory every
// rank maps (SharedBufferExecutor). Each allreduce is compared with a sum computed here. Inputs
// are small integers held in float32, so every order of summation gives the same exact total.

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "plan/collective_plan.h"
#include "plan/schedule.h"
#include "test_harness.h"
#include "transport/shared_buffer.h"
#include "transport/shm_channel.h"
#include "transport/shm_executor.h"
#include "transport/shm_segment.h"
#include "transport/single_copy_executor.h"
#include "transport_test_util.h"

namespace {

using namespace xdev;
using transport::make_ctx;
using transport::make_group;
using transport::on_threads;
using transport::ShmChannel;
using transport::ShmSegment;

// inputs[r][i]: rank r's element i, a small integer; the returned totals (or averages) are exact.
std::vector<std::vector<float>> make_inputs(int world, int64_t total, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> in(static_cast<size_t>(world));
  for (auto& v : in) {
    for (int64_t i = 0; i < total; ++i) v.push_back(static_cast<float>(rng() % 2001) - 1000.0f);
  }
  return in;
}

std::vector<float> totals(const std::vector<std::vector<float>>& in) {
  std::vector<float> sum(in[0].size(), 0.0f);
  for (const auto& v : in) {
    for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  return sum;
}

TEST(shm_executor_allreduces_over_several_windows) {
  constexpr int kWorld = 3;
  constexpr int64_t kWindow = 1000;
  const std::vector<int64_t> numels = {4000, 1, 6006};  // 11 windows, tensors split across them
  const int64_t total = 4000 + 1 + 6006;
  const plan::FlatLayout layout(numels);
  for (const plan::Algorithm alg :
       {plan::Algorithm::kFlat, plan::Algorithm::kReduceToOne, plan::Algorithm::kDirect}) {
    const auto plan = plan::CollectivePlan::allreduce(alg, kWorld, 1, {}, total, kWindow);
    auto channels = make_group(kWorld, kWindow * sizeof(float));
    auto data = make_inputs(kWorld, total, 11);
    const auto expected = totals(data);
    const auto errors = on_threads(kWorld, [&](int r) {
      transport::ShmExecutor exec(channels[static_cast<size_t>(r)]);
      transport::CollectiveRequest req;
      req.plan = &plan;
      req.layout = &layout;
      for (size_t t = 0; t < numels.size(); ++t) {
        req.tensors.push_back(
            reinterpret_cast<char*>(data[static_cast<size_t>(r)].data() + layout.offset(t)));
      }
      req.ctx = make_ctx(1, total);
      exec.run(req);
      exec.barrier(make_ctx(2, 0));  // a bare barrier after it stays in step
    });
    for (int r = 0; r < kWorld; ++r) {
      CHECK_EQ(errors[static_cast<size_t>(r)], "");
      CHECK(data[static_cast<size_t>(r)] == expected);
    }
  }
}

TEST(single_copy_executor_allreduces_in_place) {
  constexpr int kWorld = 3;
  constexpr int64_t kCount = 100003;  // several of the executor's reduce chunks, ragged slices
  const auto sched = plan::in_place_variant(plan::flat_schedule(kWorld, {0, kCount}));
  auto channels = make_group(kWorld, 4096);
  std::string why;
  if (!channels[0].can_read_peers(&why)) {
    std::cout << "  (skipped: " << why << ")\n";  // e.g. ptrace restricted in a container
    return;
  }
  auto data = make_inputs(kWorld, kCount, 12);
  const auto expected = totals(data);
  const auto errors = on_threads(kWorld, [&](int r) {
    transport::SingleCopyExecutor exec(channels[static_cast<size_t>(r)]);
    transport::SingleCopyRequest req;
    req.schedule = &sched;
    req.data = reinterpret_cast<char*>(data[static_cast<size_t>(r)].data());
    req.count = kCount;
    req.ctx = make_ctx(1, kCount);
    exec.run(req);
  });
  for (int r = 0; r < kWorld; ++r) {
    CHECK_EQ(errors[static_cast<size_t>(r)], "");
    CHECK(data[static_cast<size_t>(r)] == expected);
  }
}

TEST(shared_buffer_executor_allreduces_every_copy) {
  constexpr int kWorld = 3;
  constexpr int64_t kCount = 50001, kOffset = 4096;  // bytes before the tensor in every copy
  const size_t bytes = kOffset + kCount * sizeof(float);
  // Rank r's segment, mapped once per rank as separate processes would.
  std::vector<std::string> names;
  std::vector<ShmSegment> owners;
  for (int r = 0; r < kWorld; ++r) {
    names.push_back(ShmSegment::make_name());
    owners.push_back(ShmSegment::create(names.back(), bytes));
  }
  std::vector<transport::SharedBuffer> buffers;
  for (int me = 0; me < kWorld; ++me) {
    std::vector<ShmSegment> view;
    for (int r = 0; r < kWorld; ++r) view.push_back(ShmSegment::open(names[r], bytes));
    buffers.emplace_back(7, me, std::move(view));
  }
  for (auto& s : owners) s.unlink();
  auto channels = make_group(kWorld, 4096);
  for (const kernels::ReduceOp op : {kernels::ReduceOp::kSum, kernels::ReduceOp::kAvg}) {
    auto in = make_inputs(kWorld, kCount, 13);
    auto expected = totals(in);
    if (op == kernels::ReduceOp::kAvg) {
      for (float& v : expected) v /= kWorld;
    }
    for (int r = 0; r < kWorld; ++r) {
      std::memcpy(buffers[0].data(r) + kOffset, in[static_cast<size_t>(r)].data(),
                  kCount * sizeof(float));
    }
    const uint64_t seq = op == kernels::ReduceOp::kSum ? 1 : 2;
    const auto errors = on_threads(kWorld, [&](int r) {
      transport::SharedBufferExecutor exec(channels[static_cast<size_t>(r)]);
      transport::SharedBufferRequest req;
      req.count = kCount;
      req.op = op;
      req.ctx = make_ctx(seq, kCount);
      const transport::SharedBuffer& mine = buffers[static_cast<size_t>(r)];
      req.copies = [&mine] {
        std::vector<char*> copies;
        for (int peer = 0; peer < kWorld; ++peer) copies.push_back(mine.data(peer) + kOffset);
        return copies;
      };
      CHECK(exec.run(req));
    });
    for (int r = 0; r < kWorld; ++r) {
      CHECK_EQ(errors[static_cast<size_t>(r)], "");
      std::vector<float> got(kCount);
      std::memcpy(got.data(), buffers[static_cast<size_t>(r)].data(r) + kOffset,
                  kCount * sizeof(float));
      CHECK(got == expected);
    }
  }
}

}  // namespace
