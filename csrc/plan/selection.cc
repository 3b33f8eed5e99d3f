#include "selection.h"

#include <cstdio>
#include <stdexcept>

#include "predict.h"

namespace xdev::plan {

const char* to_string(DeviceKind d) {
  return d == DeviceKind::kCpu ? "cpu" : "cuda";
}

bool use_single_copy(Algorithm algorithm, int64_t payload_bytes, bool single_buffer,
                     bool available) {
  // The direct plan writes outputs that peers are still reading: staged only.
  const bool in_place_plan = algorithm == Algorithm::kFlat ||
                             algorithm == Algorithm::kReduceToOne ||
                             algorithm == Algorithm::kHierarchicalCopy;
  return available && single_buffer && in_place_plan && payload_bytes >= kCpuSingleCopyMinBytes;
}

void check_forced_algorithm(Algorithm requested, int world_size, int num_hosts) {
  if (requested == Algorithm::kAuto || requested == Algorithm::kFallback) return;
  if (num_hosts > 1) {
    throw std::invalid_argument(std::string("algorithm='") + to_string(requested) +
                                "' needs all ranks on one host, but they span " +
                                std::to_string(num_hosts) +
                                " hosts; use algorithm='auto' or 'fallback'");
  }
  if ((requested == Algorithm::kHierarchicalCopy ||
       requested == Algorithm::kHierarchicalBalanced) &&
      world_size % 2 != 0) {
    throw std::invalid_argument(std::string("algorithm='") + to_string(requested) +
                                "' needs an even number of ranks (two groups of N/2); got " +
                                std::to_string(world_size));
  }
}

Selection select_allreduce(const SelectionInput& in) {
  Selection s;
  const int64_t hier_packs = in.num_packs >= 0 ? in.num_packs : in.world_size;
  if (in.requested == Algorithm::kFallback) {
    s.reason = "algorithm='fallback' requested";
    return s;
  }
  // Before the host check below: a forced native plan on several hosts is refused, not quietly
  // replaced by the fallback.
  check_forced_algorithm(in.requested, in.world_size, in.num_hosts);
  if (in.num_hosts > 1) {
    s.reason = "ranks span " + std::to_string(in.num_hosts) + " hosts";
    return s;
  }
  if (!in.transport_available) {
    s.reason = std::string("no native transport for ") + to_string(in.device) + " tensors";
    return s;
  }
  if (!in.op_supported) {
    s.reason = "no native kernel for this reduce op / dtype";
    return s;
  }
  if (in.requested != Algorithm::kAuto) {
    s.algorithm = in.requested;
    const bool hierarchical = in.requested == Algorithm::kHierarchicalCopy ||
                              in.requested == Algorithm::kHierarchicalBalanced;
    s.num_packs = hierarchical ? hier_packs : 0;
    s.reason = std::string("algorithm='") + to_string(in.requested) + "' requested";
    return s;
  }
  if (in.model != nullptr) {
    if (in.model->num_devices() != in.world_size) {
      throw std::invalid_argument("select_allreduce: model of " +
                                  std::to_string(in.model->num_devices()) + " devices for " +
                                  std::to_string(in.world_size) + " ranks");
    }
    const ModelChoice choice = choose_allreduce(*in.model, in.payload_bytes, in.num_packs);
    s.algorithm = choice.best.candidate.algorithm;
    s.num_packs = choice.best.candidate.num_packs;
    s.predicted_s = choice.best.seconds;
    // The runner-up says how close the call was.
    const Prediction* second = nullptr;
    for (const Prediction& p : choice.predictions) {
      if (p.candidate.label() == choice.best.candidate.label()) continue;
      if (second == nullptr || p.seconds < second->seconds) second = &p;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "model '%s': %s predicted %.1f us", in.model->name().c_str(),
                  choice.best.candidate.label().c_str(), choice.best.seconds * 1e6);
    s.reason = buf;
    if (second != nullptr) {
      std::snprintf(buf, sizeof buf, ", next %s %.1f us", second->candidate.label().c_str(),
                    second->seconds * 1e6);
      s.reason += buf;
    }
    return s;
  }
  if (in.device == DeviceKind::kCuda) {
    if (in.topology == TopologyClass::kDgx1 && in.world_size == 8) {
      s.algorithm = Algorithm::kHierarchicalCopy;
      s.num_packs = hier_packs;
      s.reason = "8 GPUs wired like a DGX-1";
    } else if (in.topology == TopologyClass::kFullyConnected) {
      s.algorithm = Algorithm::kReduceToOne;
      s.reason = "single host, every GPU reaches every other";
    } else {
      s.reason = std::string("GPU topology is ") + to_string(in.topology);
    }
    return s;
  }
  if (in.payload_bytes * in.world_size <= kCpuDirectMaxBytesTimesRanks) {
    s.algorithm = Algorithm::kDirect;
    s.reason =
        "single host, CPU, payload x ranks <= " + std::to_string(kCpuDirectMaxBytesTimesRanks) +
        " bytes";
  } else if (in.payload_bytes < kCpuReduceToOneMaxBytes) {
    s.algorithm = Algorithm::kReduceToOne;
    s.reason = "single host, CPU, payload < " + std::to_string(kCpuReduceToOneMaxBytes) + " bytes";
  } else {
    s.algorithm = Algorithm::kFlat;
    s.reason = "single host, CPU, payload >= " + std::to_string(kCpuReduceToOneMaxBytes) + " bytes";
  }
  return s;
}

}  // namespace xdev::plan
