// Unit tests of NCCL as a modelled candidate (csrc/plan/nccl_model.h), of the GPU machines it is
// weighed on, and of algorithm="auto" on CUDA tensors choosing between xdev's plans and NCCL
// (for the allreduce) or quoting both (reduce-scatter and all-gather).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "plan/gather_scatter_predict.h"
#include "plan/machines.h"
#include "plan/nccl_model.h"
#include "plan/predict.h"
#include "plan/ring.h"
#include "plan/selection.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

bool has(const std::vector<NcclCandidate>& cs, NcclAlgo a, NcclProto p) {
  for (const NcclCandidate& c : cs) {
    if (c.algo == a && c.proto == p) return true;
  }
  return false;
}

const char* const kGpuMachines[] = {"hgx-h100",    "hgx-a100",    "dgx1-v100", "dgx1-p100",
                                    "nvlink-2gpu", "nvlink-4gpu", "pcie-8gpu"};

}  // namespace

TEST(nccl_ring_ll_on_hgx_h100_by_hand) {
  // NCCL 2.20.3's model on 8 H100s: ring LL latency 6.6 + 2 (8 - 1) x 0.6 us = 15.0 us;
  // busBw = min(87.7, 16 channels x 23.175 GB/s / 4) = 87.7 GB/s, algbw = 87.7 x 8 / 14.
  const MachineModel m = hgx_h100();
  const NcclPrediction p =
      predict_nccl_allreduce(m.nccl, {NcclAlgo::kRing, NcclProto::kLL}, 8, 1 << 20);
  CHECK_NEAR(p.latency_s, 15.0e-6);
  CHECK_NEAR(p.algbw, 87.7e9 * 8 / 14);
  CHECK_NEAR(p.seconds, 15.0e-6 + (1 << 20) / (87.7e9 * 8 / 14));
  // Ring Simple on the same machine: 8.4 + 14 x 3.4 us, the whole 370.8 GB/s of NVLink as busBw.
  const NcclPrediction simple =
      predict_nccl_allreduce(m.nccl, {NcclAlgo::kRing, NcclProto::kSimple}, 8, 0);
  CHECK_NEAR(simple.latency_s, (8.4 + 14 * 3.4) * 1e-6);
  CHECK_NEAR(simple.algbw, 18 * 20.6e9 * 8 / 14);
  // NVLS: 23 us, 16 channels x 20.6 GB/s x 5/6.
  const NcclPrediction nvls =
      predict_nccl_allreduce(m.nccl, {NcclAlgo::kNvls, NcclProto::kSimple}, 8, 0);
  CHECK_NEAR(nvls.latency_s, 23e-6);
  CHECK_NEAR(nvls.algbw, 16 * 20.6e9 * 5 / 6);
}

TEST(nccl_tree_applies_its_size_correction) {
  // Tree LL at 256 KiB (64 B << 12): the correction factor 0.4 scales its bandwidth.
  const MachineModel m = hgx_h100();
  const NcclPrediction p =
      predict_nccl_allreduce(m.nccl, {NcclAlgo::kTree, NcclProto::kLL}, 8, 256 * 1024);
  const double bus = std::min(std::min(370.8 * 0.92, 16 * 38.7) / 3.8, 87.7);
  CHECK_NEAR(p.algbw, bus * 0.5 * 0.4 * 1e9);
  CHECK_NEAR(p.latency_s, (6.8 + 2 * 7 * 0.6) * 1e-6);
}

TEST(nccl_candidates_follow_what_nccl_enables) {
  const std::vector<NcclCandidate> h100 = nccl_candidates(hgx_h100().nccl);
  CHECK_EQ(h100.size(), size_t{7});
  CHECK(has(h100, NcclAlgo::kNvls, NcclProto::kSimple));
  CHECK(has(h100, NcclAlgo::kRing, NcclProto::kLL128));
  CHECK(!has(nccl_candidates(hgx_a100().nccl), NcclAlgo::kNvls, NcclProto::kSimple));
  // LL128 only over NVLink on Volta, Ampere and Hopper.
  CHECK(!has(nccl_candidates(pcie_8gpu().nccl), NcclAlgo::kRing, NcclProto::kLL128));
  CHECK(!has(nccl_candidates(dgx1_p100().nccl), NcclAlgo::kTree, NcclProto::kLL128));
  CHECK(has(nccl_candidates(dgx1_v100().nccl), NcclAlgo::kTree, NcclProto::kLL128));
  CHECK(nccl_candidates(cpu_host(4, CpuHostParams{}).nccl).empty());
  CHECK_EQ((NcclCandidate{NcclAlgo::kRing, NcclProto::kLL128}).label(),
           std::string("nccl_ring/LL128"));
  CHECK_THROWS(predict_nccl_allreduce(NcclHost{}, {}, 8, 0), std::invalid_argument, "no NCCL");
  CHECK_THROWS(predict_nccl_allreduce(hgx_h100().nccl, {}, 1, 0), std::invalid_argument, "two");
}

TEST(nccl_model_against_published_nccl_tests_on_8xh100) {
  // nccl-tests all_reduce_perf on 8 H100 SXM (NVSwitch): about 19 us at 128 B and 32 us at
  // 1 MB. NCCL's own model, which leaves out the host's share of a call, comes within 25%.
  const MachineModel m = hgx_h100();
  const double small = best_nccl_allreduce(m.nccl, 8, 128).seconds;
  const double mb = best_nccl_allreduce(m.nccl, 8, 1000000).seconds;
  CHECK(small > 19e-6 * 0.75 && small < 19e-6 * 1.25);
  CHECK(mb > 32e-6 * 0.75 && mb < 32e-6 * 1.25);
}

TEST(nccl_auto_never_slower_than_nccl_and_ahead_on_nvswitch_when_small) {
  // The targets, by the model: on every built-in GPU machine and size, auto's choice is
  // at most NCCL's best; on the H100 NVSwitch box xdev's own plans are >= 1.5x faster than
  // NCCL up to 256 KiB.
  for (const char* name : kGpuMachines) {
    const MachineModel m = builtin_machine(name);
    for (int64_t bytes = 4096; bytes <= (int64_t{1} << 30); bytes *= 4) {
      const ModelChoice c = choose_allreduce(m, bytes);
      CHECK(c.has_nccl);
      CHECK(c.best.seconds <= c.best_nccl.seconds);
      CHECK(c.best.seconds <= c.best_native.seconds);
      if (std::string(name) == "hgx-h100" && bytes <= 256 * 1024) {
        CHECK(c.best_native.seconds * 1.5 <= c.best_nccl.seconds);
        CHECK(!c.best.candidate.nccl);
      }
    }
  }
}

TEST(nccl_detected_hosts_match_the_built_in_ones) {
  const MachineModel detected =
      detected_gpu_host("detected", LinkMatrix(8), std::vector<int>(8, 18), 90);
  const MachineModel builtin = hgx_h100();
  CHECK_EQ(detected.nccl.nvls_channels, 16);
  for (int64_t bytes : {int64_t{4096}, int64_t{1} << 20, int64_t{64} << 20}) {
    const ModelChoice a = choose_allreduce(detected, bytes), b = choose_allreduce(builtin, bytes);
    CHECK_EQ(a.best.candidate.label(), b.best.candidate.label());
    CHECK_NEAR(a.best.seconds, b.best.seconds);
  }
  // Without NVLinks: PCIe, and NCCL without LL128.
  const MachineModel pcie = detected_gpu_host("pcie", LinkMatrix(4), {}, 80);
  CHECK(!pcie.nccl.nvlink);
  CHECK_EQ(pcie.route(0, 1).size(), size_t{2});
}

TEST(selection_cuda_auto_weighs_nccl_where_it_runs) {
  const MachineModel m = hgx_h100();
  SelectionInput in;
  in.device = DeviceKind::kCuda;
  in.world_size = 8;
  in.topology = TopologyClass::kFullyConnected;
  in.model = &m;
  in.nccl_available = true;
  // Large: NVLS (the switch reduces) beats any plan xdev can run.
  in.payload_bytes = int64_t{256} << 20;
  Selection s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kFallback);
  CHECK(s.reason.find("nccl_nvls/Simple predicted") != std::string::npos);
  CHECK(s.reason.find("best native") != std::string::npos);
  CHECK(s.predicted_s > 0);
  // Small: xdev's one-shot, with NCCL's best named.
  in.payload_bytes = 4096;
  s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kDirect);
  CHECK(s.reason.find("NCCL's best nccl_ring/LL") != std::string::npos);
  // Ranks sharing a GPU: NCCL cannot run, so only native plans.
  in.nccl_available = false;
  in.payload_bytes = int64_t{256} << 20;
  s = select_allreduce(in);
  CHECK(s.algorithm != Algorithm::kFallback);
  CHECK(s.reason.find("NCCL") == std::string::npos);
  // The cache keeps the two apart.
  ModelChoiceCache cache;
  in.model_cache = &cache;
  CHECK(select_allreduce(in).algorithm != Algorithm::kFallback);
  in.nccl_available = true;
  CHECK_EQ(select_allreduce(in).algorithm, Algorithm::kFallback);
  // A forced plan is honoured whatever the model says.
  in.requested = Algorithm::kHierarchicalCopy;
  s = select_allreduce(in);
  CHECK_EQ(s.algorithm, Algorithm::kHierarchicalCopy);
  CHECK_EQ(s.num_packs, int64_t{8});
}

TEST(the_ring_reference_opens_at_most_one_ring_per_nccl_channel) {
  // Through the switch the link search finds 63 cycles on an HGX H100, each used both ways;
  // NCCL opens 16 channels. Where the links allow fewer rings than channels, all stay.
  for (const char* name : kGpuMachines) {
    const MachineModel m = builtin_machine(name);
    const std::vector<std::vector<int>> rings = reference_rings(m), found = find_rings(m.links);
    CHECK(!rings.empty());
    CHECK(rings.size() <= std::max<size_t>(found.size(), 2));
    if (found.size() > static_cast<size_t>(m.nccl.channels)) {
      CHECK_EQ(rings.size(), static_cast<size_t>(m.nccl.channels) / 2 * 2);
    } else {
      CHECK_EQ(rings.size(), found.size());
    }
  }
  CHECK_EQ(reference_rings(hgx_h100()).size(), size_t{16});
  CHECK_EQ(reference_rings(dgx1_v100()).size(), size_t{6});
}

TEST(nccl_gather_scatter_by_hand_on_hgx_h100) {
  // NCCL 2.20.3's model of a reduce-scatter or all-gather on 8 H100s (size: the whole tensor):
  // a ring of 7 steps, latency 6.6 + 7 x 0.6 us with LL, whose busBw keeps a third of the
  // channels' (16 x 23.175 GB/s / 3, capped at 87.7), algbw = busBw x 8 / 7.
  const MachineModel m = hgx_h100();
  const NcclPrediction ll =
      predict_nccl_gather_scatter(m.nccl, {NcclAlgo::kRing, NcclProto::kLL}, 8, 1 << 20);
  CHECK_NEAR(ll.latency_s, (6.6 + 7 * 0.6) * 1e-6);
  CHECK_NEAR(ll.algbw, 87.7e9 * 8 / 7);
  // Ring Simple: 8.4 + 7 x 3.4 us, the whole NVLink busBw; half the allreduce's steps and time
  // per byte.
  const NcclPrediction simple =
      predict_nccl_gather_scatter(m.nccl, {NcclAlgo::kRing, NcclProto::kSimple}, 8, 0);
  CHECK_NEAR(simple.latency_s, (8.4 + 7 * 3.4) * 1e-6);
  CHECK_NEAR(simple.algbw, 18 * 20.6e9 * 8 / 7);
  const NcclPrediction simple_allreduce =
      predict_nccl_allreduce(m.nccl, {NcclAlgo::kRing, NcclProto::kSimple}, 8, 0);
  CHECK_NEAR(simple.algbw, 2 * simple_allreduce.algbw);
  // NVLS as for the allreduce: 23 us, 16 channels x 20.6 GB/s x 5/6.
  const NcclPrediction nvls =
      predict_nccl_gather_scatter(m.nccl, {NcclAlgo::kNvls, NcclProto::kSimple}, 8, 0);
  CHECK_NEAR(nvls.latency_s, 23e-6);
  CHECK_NEAR(nvls.algbw, 16 * 20.6e9 * 5 / 6);
  // On 2 PCIe GPUs LL's third is not capped: 2 channels' worth / 3, x 2 / 1.
  const MachineModel pcie = pcie_8gpu();
  const NcclPrediction pcie_ll =
      predict_nccl_gather_scatter(pcie.nccl, {NcclAlgo::kRing, NcclProto::kLL}, 2, 0);
  CHECK_NEAR(pcie_ll.algbw,
             std::min(87.7e9, pcie.nccl.channels * pcie.nccl.channel_gbps * 1e9 / 3) * 2);
}

TEST(nccl_gather_scatter_candidates_have_no_tree) {
  const std::vector<NcclCandidate> h100 = nccl_gather_scatter_candidates(hgx_h100().nccl);
  CHECK_EQ(h100.size(), size_t{4});  // ring LL, LL128, Simple; NVLS
  CHECK(has(h100, NcclAlgo::kNvls, NcclProto::kSimple));
  CHECK(!has(h100, NcclAlgo::kTree, NcclProto::kSimple));
  CHECK(!has(nccl_gather_scatter_candidates(pcie_8gpu().nccl), NcclAlgo::kRing, NcclProto::kLL128));
  CHECK(nccl_gather_scatter_candidates(NcclHost{}).empty());
  CHECK_THROWS(
      predict_nccl_gather_scatter(hgx_h100().nccl, {NcclAlgo::kTree, NcclProto::kLL}, 8, 0),
      std::invalid_argument, "no tree");
  CHECK_THROWS(best_nccl_gather_scatter(NcclHost{}, 8, 0), std::invalid_argument, "no NCCL");
  // NCCL's choice is the fastest of them: LL when small, Simple or NVLS when large.
  const MachineModel m = hgx_h100();
  CHECK(best_nccl_gather_scatter(m.nccl, 8, 4096).candidate.proto == NcclProto::kLL);
  CHECK(best_nccl_gather_scatter(m.nccl, 8, int64_t{1} << 30).candidate.proto ==
        NcclProto::kSimple);
}

TEST(gather_scatter_choice_weighs_nccl_on_gpu_machines) {
  for (const char* name : kGpuMachines) {
    const MachineModel m = builtin_machine(name);
    for (GatherScatterKind kind :
         {GatherScatterKind::kReduceScatter, GatherScatterKind::kAllGather}) {
      for (int64_t bytes = 4096; bytes <= (int64_t{1} << 28); bytes *= 16) {
        GatherScatterOptions opts;
        opts.in_place = true;
        const GatherScatterChoice without = choose_gather_scatter(m, kind, bytes, opts);
        CHECK(!without.has_nccl);
        opts.nccl = true;
        const GatherScatterChoice c = choose_gather_scatter(m, kind, bytes, opts);
        CHECK(c.has_nccl);
        CHECK(c.best_nccl.candidate.nccl);
        CHECK_NEAR(c.best_nccl.seconds,
                   best_nccl_gather_scatter(m.nccl, m.num_devices(), bytes).seconds);
        // The forms' choice is the one without NCCL; the overall one the faster of the two.
        CHECK_EQ(c.best_native.candidate.label(), without.best.candidate.label());
        CHECK_NEAR(c.best.seconds, std::min(c.best_native.seconds, c.best_nccl.seconds));
      }
    }
  }
  // CPU hosts have no NCCL rows, whatever the options say.
  GatherScatterOptions opts;
  opts.nccl = true;
  CHECK(!choose_gather_scatter(cpu_host(4, CpuHostParams{}), GatherScatterKind::kAllGather, 4096,
                               opts)
             .has_nccl);
}

TEST(selection_cuda_gather_scatter_keeps_nccl_and_quotes_the_model) {
  // auto keeps NCCL where it runs (xdev's CUDA form is not yet measured against it), and
  // says what the GPUs' model predicts for both.
  const MachineModel m = hgx_h100();
  GatherScatterInput in;
  in.world_size = 8;
  in.device = DeviceKind::kCuda;
  in.nccl_available = true;
  in.kind = GatherScatterKind::kAllGather;
  in.payload_bytes = 4096;
  in.model = &m;
  GatherScatterSelection s = select_gather_scatter(in);
  CHECK(s.path == GatherScatterPath::kFallback);
  CHECK(s.reason.find("NCCL (model 'hgx-h100': staged") == 0);
  CHECK(s.reason.find("nccl_ring/LL") != std::string::npos);
  CHECK(s.reason.find("not yet measured") != std::string::npos);
  // Where ranks share a GPU there is no NCCL: the native path.
  in.nccl_available = false;
  s = select_gather_scatter(in);
  CHECK(s.path == GatherScatterPath::kCuda);
}
