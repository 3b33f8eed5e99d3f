#include "selection.h"

#include <cstdio>
#include <limits>
#include <stdexcept>

#include "device_program.h"
#include "predict.h"
#include "shared_buffer_plan.h"

namespace xdev::plan {
namespace {

bool is_hierarchical(Algorithm a) {
  return a == Algorithm::kHierarchicalCopy || a == Algorithm::kHierarchicalBalanced;
}

// Reasons the allreduce and the gather/scatter selections share, worded once.
constexpr const char* kFallbackRequested = "algorithm='fallback' requested";
constexpr const char* kNoNativeKernel = "no native kernel for this reduce op / dtype";

std::string spans_hosts(int num_hosts) {
  return "ranks span " + std::to_string(num_hosts) + " hosts";
}

std::string no_transport(DeviceKind device, const std::string& note) {
  std::string reason = std::string("no native transport for ") + to_string(device) + " tensors";
  if (!note.empty()) reason += " (" + note + ")";
  return reason;
}

// `caller` names the selection in the message; `model` may be null (no model given).
void check_model_size(const MachineModel* model, int world_size, const char* caller) {
  if (model == nullptr || model->num_devices() == world_size) return;
  throw std::invalid_argument(std::string(caller) + ": model of " +
                              std::to_string(model->num_devices()) + " devices for " +
                              std::to_string(world_size) + " ranks");
}

void check_across_hosts_models(const MachineModel* host_model, const NetworkParams* network,
                               const char* caller, const char* plan) {
  if (host_model != nullptr && network != nullptr) return;
  throw std::invalid_argument(std::string(caller) + ": the two-level " + plan +
                              " needs a host and a network model");
}

// The model's fastest candidate for `bytes`, with the runner-up in the reason
// to say how close the call was, and where NCCL was weighed, its best.
ModelChoiceCache::Choice model_choice(const MachineModel& model, int64_t bytes, int64_t num_packs,
                                      bool with_nccl) {
  const ModelChoice choice = choose_allreduce(model, bytes, num_packs, false, with_nccl);
  ModelChoiceCache::Choice c;
  c.algorithm = choice.best.candidate.algorithm;
  c.num_packs = choice.best.candidate.num_packs;
  c.predicted_s = choice.best.seconds;
  char buf[200];
  if (choice.best.candidate.nccl) {
    std::snprintf(buf, sizeof buf, "model '%s': %s predicted %.1f us, best native %s %.1f us",
                  model.name().c_str(), choice.best.candidate.label().c_str(),
                  choice.best.seconds * 1e6, choice.best_native.candidate.label().c_str(),
                  choice.best_native.seconds * 1e6);
    c.reason = buf;
    return c;
  }
  const Prediction* second = nullptr;
  for (const Prediction& p : choice.predictions) {
    if (p.candidate.nccl || p.candidate.label() == choice.best.candidate.label()) continue;
    if (second == nullptr || p.seconds < second->seconds) second = &p;
  }
  std::snprintf(buf, sizeof buf, "model '%s': %s predicted %.1f us", model.name().c_str(),
                choice.best.candidate.label().c_str(), choice.best.seconds * 1e6);
  c.reason = buf;
  if (second != nullptr) {
    std::snprintf(buf, sizeof buf, ", next %s %.1f us", second->candidate.label().c_str(),
                  second->seconds * 1e6);
    c.reason += buf;
  }
  if (choice.has_nccl) {
    std::snprintf(buf, sizeof buf, "; NCCL's best %s %.1f us",
                  choice.best_nccl.candidate.label().c_str(), choice.best_nccl.seconds * 1e6);
    c.reason += buf;
  }
  return c;
}

// Ranks on several hosts: the two-level plan where it can run and the model
// predicts it faster than the engine's ring over all ranks; the engine otherwise.
Selection across_hosts(const SelectionInput& in) {
  Selection s;
  s.reason = spans_hosts(in.num_hosts);
  if (in.device == DeviceKind::kCuda) {
    // A two-level CUDA plan is predicted (cuda_across_hosts.h), not built: its
    // window (64 KiB - 1 MiB on H100 and A100 hosts) rests on xdev's
    // uncalibrated GPU latencies, and testing it needs several GPUs per host.
    s.reason +=
        "; CUDA tensors go to NCCL, which already runs trees across hosts (xdev has no "
        "two-level CUDA plan; python -m torch_xdev.plan --hosts predicts both)";
    return s;
  }
  if (!in.two_level_available) {
    if (!in.two_level_note.empty()) s.reason += "; no two-level plan: " + in.two_level_note;
    return s;
  }
  if (!in.op_supported) {
    s.reason += std::string("; ") + kNoNativeKernel;
    return s;
  }
  check_across_hosts_models(in.host_model, in.network, "select_allreduce", "plan");
  AcrossHostsChoice c =
      choose_across_hosts({in.num_hosts, in.ranks_per_host}, model_bucket_bytes(in.payload_bytes),
                          *in.network, *in.host_model, in.two_level_pieces);
  if (in.engine_may_drop_nan) keep_nan_across_hosts(c);
  s.reason = c.reason;
  s.predicted_s = c.predicted_s;
  if (c.two_level) {
    s.algorithm = Algorithm::kFlat;
    s.two_level = true;
    s.two_level_pieces = c.pieces;
    s.two_level_leader = c.leader;
    if (in.in_symmetric_heap && in.num_tensors == 1) {
      s.reason +=
          "; inside each host in place where staging would take several windows and every "
          "local rank's tensor is at the same place of the host's symmetric heap (e.g. DDP's "
          "buckets)";
    }
  }
  return s;
}

// The plan itself, before the transport details (single copy) are settled.
Selection choose_plan(const SelectionInput& in) {
  Selection s;
  const int64_t hier_packs = in.num_packs >= 0 ? in.num_packs : in.world_size;
  if (in.requested == Algorithm::kFallback) {
    s.reason = kFallbackRequested;
    return s;
  }
  if (!in.dense) {
    s.reason = "sparse tensors";
    return s;
  }
  if (in.reduces_list_into_one) {
    s.reason = "a list of tensors reduced into one result (c10d's list form)";
    return s;
  }
  // Before the host check below: a forced native plan on several hosts is refused, not quietly
  // replaced by the fallback.
  check_forced_algorithm(in.requested, in.world_size, in.num_hosts);
  if (in.num_hosts > 1) return across_hosts(in);
  if (!in.transport_available) {
    s.reason = no_transport(in.device, in.transport_note);
    return s;
  }
  if (!in.op_supported) {
    s.reason = kNoNativeKernel;
    return s;
  }
  if (in.device == DeviceKind::kCpu && in.shared_buffer_id >= 0 && in.num_tensors == 1 &&
      use_shared_buffer(in.requested)) {
    s.algorithm = Algorithm::kFlat;
    s.in_place_shared = true;
    s.reason = "tensor in shared buffer #" + std::to_string(in.shared_buffer_id) +
               " (torch_xdev.shared_empty): reduced in place, nothing staged";
    return s;
  }
  if (in.requested != Algorithm::kAuto) {
    s.algorithm = in.requested;
    s.num_packs = is_hierarchical(in.requested) ? hier_packs : 0;
    s.reason = std::string("algorithm='") + to_string(in.requested) + "' requested";
    return s;
  }
  if (in.world_size == 1) {
    // Any native plan would do: the backend has nothing to run.
    s.algorithm = Algorithm::kDirect;
    s.reason = "one rank: the input is already the result";
    return s;
  }
  if (in.device == DeviceKind::kCuda && in.gpu_time_sliced) {
    s.reason = kGpuTimeSlicedReason;
    return s;
  }
  if (in.device == DeviceKind::kCuda && in.model == nullptr) {
    if (in.topology == TopologyClass::kDgx1 && in.world_size == 8) {
      s.algorithm = Algorithm::kHierarchicalCopy;
      s.num_packs = hier_packs;
      s.reason = "8 GPUs wired like a DGX-1";
    } else if (in.topology == TopologyClass::kFullyConnected ||
               in.topology == TopologyClass::kNvSwitch) {
      s.algorithm = Algorithm::kReduceToOne;
      s.reason = "single host, every GPU reaches every other";
    } else {
      s.reason = std::string("GPU topology is ") + to_string(in.topology);
    }
    return s;
  }
  if (in.model == nullptr) {
    throw std::invalid_argument("select_allreduce: algorithm='auto' on CPU tensors of " +
                                std::to_string(in.world_size) + " ranks needs a machine model");
  }
  check_model_size(in.model, in.world_size, "select_allreduce");
  const int64_t bucket = model_bucket_bytes(in.payload_bytes);
  const bool with_nccl = in.device == DeviceKind::kCuda && in.nccl_available;
  const ModelChoiceCache::Choice c =
      in.model_cache != nullptr ? in.model_cache->get(*in.model, bucket, in.num_packs, with_nccl)
                                : model_choice(*in.model, bucket, in.num_packs, with_nccl);
  s.algorithm = c.algorithm;
  s.num_packs = c.num_packs;
  s.predicted_s = c.predicted_s;
  s.reason = c.reason;
  return s;
}

}  // namespace

const char* const kGpuTimeSlicedReason =
    "ranks share a GPU without CUDA MPS: the driver time-slices their kernels, so every GPU "
    "barrier waits for the other ranks' turns (about 2.3 ms on an H100) and the engine is "
    "faster; start the MPS daemon (nvidia-cuda-mps-control -d) before the job for the native "
    "path, or force an algorithm";

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

std::string cuda_transport_refusal(int num_hosts, int world_size, bool all_gpus_reach,
                                   bool host_channel, int lowest_compute_capability) {
  if (num_hosts > 1) return "off: ranks span several hosts";
  if (world_size > kMaxDeviceRanks) {
    return "off: more than " + std::to_string(kMaxDeviceRanks) + " ranks";
  }
  if (!all_gpus_reach) return "off: not every GPU can access every other (no peer access)";
  if (!host_channel) return "off: algorithm='fallback' or no shared memory for the host barrier";
  // The kernels' barrier uses sm_70's scoped acquire/release atomics.
  if (lowest_compute_capability < 70) {
    return "off: a GPU of compute capability " + std::to_string(lowest_compute_capability / 10) +
           "." + std::to_string(lowest_compute_capability % 10) +
           " (xdev's kernels need 7.0 or later)";
  }
  return "";
}

int64_t model_bucket_bytes(int64_t payload_bytes) {
  int64_t bucket = 4;
  // 2^62 at most: doubling past it overflows (no tensor comes near).
  while (bucket < payload_bytes && bucket <= std::numeric_limits<int64_t>::max() / 2) bucket *= 2;
  return bucket;
}

ModelChoiceCache::Choice ModelChoiceCache::get(const MachineModel& model, int64_t bucket_bytes,
                                               int64_t num_packs, bool with_nccl) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (model_ == nullptr) model_ = &model;
  if (model_ != &model) {
    throw std::invalid_argument("ModelChoiceCache: used with model '" + model.name() +
                                "' after model '" + model_->name() + "'");
  }
  const auto key = std::make_tuple(bucket_bytes, num_packs, with_nccl);
  auto it = choices_.find(key);
  if (it == choices_.end()) {
    it = choices_.emplace(key, model_choice(model, bucket_bytes, num_packs, with_nccl)).first;
  }
  return it->second;
}

void check_forced_algorithm(Algorithm requested, int world_size, int num_hosts) {
  if (requested == Algorithm::kAuto || requested == Algorithm::kFallback) return;
  if (num_hosts > 1) {
    throw std::invalid_argument(std::string("algorithm='") + to_string(requested) +
                                "' needs all ranks on one host, but they span " +
                                std::to_string(num_hosts) +
                                " hosts; use algorithm='auto' or 'fallback'");
  }
  if (is_hierarchical(requested) && world_size % 2 != 0) {
    throw std::invalid_argument(std::string("algorithm='") + to_string(requested) +
                                "' needs an even number of ranks (two groups of N/2); got " +
                                std::to_string(world_size));
  }
}

Selection select_allreduce(const SelectionInput& in) {
  Selection s = choose_plan(in);
  if (s.algorithm == Algorithm::kFallback) {
    // Sparse tensors: the engine refuses an AVG itself.
    s.avg_as_sum_then_divide = in.op_is_avg && !in.fallback_has_avg && in.dense;
  } else if (in.device == DeviceKind::kCpu && !s.in_place_shared && !s.two_level) {
    s.single_copy = use_single_copy(s.algorithm, in.payload_bytes, in.num_tensors == 1,
                                    in.single_copy_available);
    // A heap tensor takes the plan any tensor of its size would, so that a
    // peer whose tensor is not in the heap (DDP's Join hands zeros_like
    // buckets) runs the same collective; staged flat then turns in place
    // after its first barrier when every rank's block is at the same place.
    if (in.in_symmetric_heap && in.num_tensors == 1 && s.algorithm == Algorithm::kFlat &&
        !s.single_copy) {
      s.in_place_shared = true;
      s.reason +=
          "; in place when every rank's tensor is at the same place of the group's "
          "symmetric heap (e.g. DDP's buckets)";
    }
  } else if (in.device == DeviceKind::kCuda && in.in_symmetric_heap && in.num_tensors == 1 &&
             (in.requested == Algorithm::kAuto || s.algorithm == Algorithm::kFlat)) {
    // The in-place program is flat's reduce-scatter and all-gather reading
    // the peers' copies: auto's native choice or flat gives way to it, a
    // plan forced by name keeps its staged schedule.
    s.in_place_shared = true;
    s.reason +=
        "; in place when every rank's tensor is at the same place of the group's CUDA heap "
        "(e.g. DDP's buckets): one kernel reduces each rank's slice from the peers' copies";
  }
  return s;
}

const char* to_string(GatherScatterPath p) {
  switch (p) {
    case GatherScatterPath::kNative:
      return "native";
    case GatherScatterPath::kOneRank:
      return "one_rank";
    case GatherScatterPath::kFallback:
      return "fallback";
    case GatherScatterPath::kTwoLevel:
      return "two_level";
    case GatherScatterPath::kCuda:
      return "cuda";
  }
  return "?";
}

namespace {

const char* describe(GatherScatterForm f) {
  switch (f) {
    case GatherScatterForm::kStaged:
      return "staged through shared memory, one barrier per window";
    case GatherScatterForm::kSingleCopy:
      return "single copy: peers read each other's inputs in place";
    case GatherScatterForm::kInPlace:
      return "in place: peers read each other's inputs in the symmetric heap";
  }
  return "?";
}

// The model's fastest form, with the runner-up in the reason, as for the allreduce.
GatherScatterChoiceCache::Choice gather_scatter_model_choice(const MachineModel& model,
                                                             GatherScatterKind kind, int64_t bytes,
                                                             int64_t elem_bytes,
                                                             const GatherScatterOptions& opts) {
  const GatherScatterChoice choice =
      choose_gather_scatter(model, kind, bytes, opts, false, elem_bytes);
  GatherScatterChoiceCache::Choice c;
  c.form = choice.best.candidate.form;
  c.nccl = choice.best.candidate.nccl;
  c.predicted_s = choice.best.seconds;
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s; model '%s': %s predicted %.1f us",
                c.nccl ? "NCCL" : describe(c.form), model.name().c_str(),
                choice.best.candidate.label().c_str(), choice.best.seconds * 1e6);
  c.reason = buf;
  const GatherScatterPrediction* second = nullptr;
  for (const GatherScatterPrediction& p : choice.predictions) {
    if (p.candidate.label() == choice.best.candidate.label()) continue;
    if (second == nullptr || p.seconds < second->seconds) second = &p;
  }
  if (second != nullptr) {
    std::snprintf(buf, sizeof buf, ", next %s %.1f us", second->candidate.label().c_str(),
                  second->seconds * 1e6);
    c.reason += buf;
  }
  return c;
}

// in.model's choice for this call's size class (an all-gather moves bytes; a
// reduce-scatter reduces its dtype), through in.model_cache where given.
GatherScatterChoiceCache::Choice model_choice_for(const GatherScatterInput& in,
                                                  const GatherScatterOptions& opts) {
  const int64_t bucket = model_bucket_bytes(in.payload_bytes);
  const int64_t elem_bytes = in.kind == GatherScatterKind::kAllGather ? 1 : in.elem_bytes;
  return in.model_cache != nullptr
             ? in.model_cache->get(*in.model, in.kind, bucket, elem_bytes, opts)
             : gather_scatter_model_choice(*in.model, in.kind, bucket, elem_bytes, opts);
}

// Why no native path takes these tensor shapes, or null.
const char* shape_refusal(const GatherScatterInput& in) {
  if (!in.uneven_list_sizes) return nullptr;
  if (in.device == DeviceKind::kCuda) return "uneven list sizes";
  // Across hosts the engine gathers blocks of one size among the ranks of a local index.
  if (in.num_hosts > 1) return "uneven list sizes (the two-level form needs one size)";
  return in.one_list ? nullptr : "uneven sizes in several lists";
}

// Ranks on several hosts: the two-level form where it can run and the model
// predicts it faster than the engine's ring over all ranks; the engine otherwise.
GatherScatterSelection gather_scatter_across_hosts(const GatherScatterInput& in) {
  GatherScatterSelection s;
  s.reason = spans_hosts(in.num_hosts);
  if (in.device == DeviceKind::kCuda) {
    s.reason += "; CUDA tensors go to NCCL";
  } else if (!in.two_level_available) {
    if (!in.two_level_note.empty()) s.reason += "; no two-level form: " + in.two_level_note;
  } else if (!in.op_supported) {
    s.reason += std::string("; ") + kNoNativeKernel;
  } else if (const char* refusal = shape_refusal(in)) {
    s.reason += std::string("; ") + refusal;
  } else {
    check_across_hosts_models(in.host_model, in.network, "select_gather_scatter", "form");
    AcrossHostsChoice c = choose_gather_scatter_across_hosts(
        in.kind, {in.num_hosts, in.ranks_per_host}, model_bucket_bytes(in.payload_bytes),
        in.elem_bytes, *in.network, *in.host_model);
    if (in.engine_may_drop_nan) keep_nan_across_hosts(c);
    s.reason = c.reason;
    s.predicted_s = c.predicted_s;
    if (c.two_level) {
      s.path = GatherScatterPath::kTwoLevel;
      s.two_level_leader = c.leader;
    }
  }
  return s;
}

// One host, CUDA tensors. xdev's CUDA all-gather and reduce-scatter have not
// been measured against NCCL's, so auto keeps NCCL where it can run, and
// says what the model predicts for both; where NCCL cannot run (ranks
// sharing a GPU), the engine is Gloo through host memory, and the native
// path runs.
GatherScatterSelection cuda_gather_scatter(const GatherScatterInput& in) {
  GatherScatterSelection s;
  if (!in.transport_available) {
    s.reason = no_transport(DeviceKind::kCuda, in.transport_note);
  } else if (!in.op_supported) {
    s.reason = kNoNativeKernel;
  } else if (const char* refusal = shape_refusal(in);
             (in.num_tensors != 1 && !in.one_list) || refusal != nullptr) {
    s.reason = "CUDA: the native path takes one tensor per side, or one list of one size";
    if (refusal != nullptr) s.reason += std::string(" (") + refusal + ")";
  } else if (in.requested == Algorithm::kAuto && in.nccl_available) {
    s.reason = "NCCL (";
    if (in.model != nullptr && in.model->num_devices() == in.world_size) {
      GatherScatterOptions opts;
      opts.nccl = true;
      const GatherScatterChoiceCache::Choice c = model_choice_for(in, opts);
      // The predictions only: the form's description speaks of shared memory.
      const size_t predictions = c.reason.find("model '");
      if (predictions != std::string::npos) s.reason += c.reason.substr(predictions) + "; ";
    }
    s.reason +=
        "xdev's CUDA all-gather and reduce-scatter are not yet measured against NCCL; "
        "a native algorithm, e.g. algorithm='flat', forces them)";
  } else if (in.requested == Algorithm::kAuto && in.gpu_time_sliced) {
    s.reason = kGpuTimeSlicedReason;
  } else {
    s.path = GatherScatterPath::kCuda;
    s.reason = in.requested == Algorithm::kAuto
                   ? "CUDA IPC, one barrier per window (ranks share a GPU under MPS: no NCCL)"
                   : std::string("CUDA IPC, one barrier per window (algorithm='") +
                         to_string(in.requested) + "' requested)";
  }
  return s;
}

}  // namespace

GatherScatterChoiceCache::Choice GatherScatterChoiceCache::get(const MachineModel& model,
                                                               GatherScatterKind kind,
                                                               int64_t bucket_bytes,
                                                               int64_t elem_bytes,
                                                               const GatherScatterOptions& opts) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (model_ == nullptr) model_ = &model;
  if (model_ != &model) {
    throw std::invalid_argument("GatherScatterChoiceCache: used with model '" + model.name() +
                                "' after model '" + model_->name() + "'");
  }
  const auto key = std::make_tuple(static_cast<int>(kind), bucket_bytes, elem_bytes,
                                   opts.single_copy, opts.in_place, opts.nccl);
  auto it = choices_.find(key);
  if (it == choices_.end()) {
    it = choices_
             .emplace(key, gather_scatter_model_choice(model, kind, bucket_bytes, elem_bytes, opts))
             .first;
  }
  return it->second;
}

GatherScatterSelection select_gather_scatter(const GatherScatterInput& in) {
  GatherScatterSelection s;
  if (in.requested == Algorithm::kFallback) {
    s.reason = kFallbackRequested;
  } else if (in.num_hosts > 1) {
    s = gather_scatter_across_hosts(in);
  } else if (in.device == DeviceKind::kCuda) {
    s = cuda_gather_scatter(in);
  } else if (!in.op_supported) {
    s.reason = kNoNativeKernel;
  } else if (const char* refusal = shape_refusal(in)) {
    s.reason = refusal;
  } else if (in.world_size == 1) {
    s.path = GatherScatterPath::kOneRank;
    s.reason = "one rank: the output is a copy of the input";
  } else if (!in.transport_available) {
    s.reason = "no shared-memory channel";
  } else {
    s.path = GatherScatterPath::kNative;
    // The model chooses between staged and reading in place from the heap.
    // Single copy follows Options.single_copy as the allreduce's does: the
    // user turns it on where the kernel's cross-process copy is fast, a rate
    // the model only knows for the machine it was measured on.
    GatherScatterOptions opts;
    opts.in_place = in.in_symmetric_heap && in.num_tensors == 1;
    GatherScatterForm form = GatherScatterForm::kStaged;
    check_model_size(in.model, in.world_size, "select_gather_scatter");
    // Single copy is decided by the size and options alone, alike on every
    // rank; whether this rank's tensor lies in the heap is not, and ranks of
    // one call must not differ in it (in place only ever replaces the staged
    // form, once the first barrier shows every rank's block at one place).
    const bool single_copy = in.single_copy_available && in.num_tensors == 1 &&
                             in.payload_bytes >= kCpuSingleCopyMinBytes;
    if (!single_copy && in.model != nullptr && opts.in_place) {
      const GatherScatterChoiceCache::Choice c = model_choice_for(in, opts);
      form = c.form;
      s.predicted_s = c.predicted_s;
      s.reason = c.reason;
    }
    if (single_copy) {
      form = GatherScatterForm::kSingleCopy;
      s.reason = std::string(describe(form)) + " (Options.single_copy, one tensor of at least " +
                 std::to_string(kCpuSingleCopyMinBytes / 1024) + " KiB)";
      s.predicted_s = 0;
    } else if (s.reason.empty()) {
      s.reason = describe(form);
      if (in.num_tensors != 1) s.reason += " (several tensors)";
    }
    s.single_copy = form == GatherScatterForm::kSingleCopy;
    s.in_place = form == GatherScatterForm::kInPlace;
  }
  return s;
}

}  // namespace xdev::plan
