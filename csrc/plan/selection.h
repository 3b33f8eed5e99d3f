// Selection: which algorithm runs an allreduce, how, and why.
//
// TensorFlow's choose_the_best carried to one process per device, by
// predicted time: CPU tensors get the plan a machine model predicts fastest
// for the size; CUDA tensors, where the backend has a model of the GPUs, the
// fastest of xdev's plans and NCCL's own algorithms (NCCL's tuning model), and
// otherwise the fixed rule (a DGX-1-like 8-GPU host: the hierarchical plan
// with 8 packs; other single-host GPU jobs: reduce-to-one); several hosts, no native transport, or
// an op/dtype without a native kernel go to the fallback engine. A forced
// algorithm is honoured or refused with a reason; it is never silently
// replaced.
//
// select_allreduce is the one place that decides: the backend gathers the
// facts into a SelectionInput and follows the Selection, changing nothing.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "cost_model.h"
#include "gather_scatter_plan.h"
#include "gather_scatter_predict.h"
#include "schedule.h"
#include "topology.h"
#include "two_level.h"

namespace xdev::plan {

enum class DeviceKind { kCpu, kCuda };

const char* to_string(DeviceKind d);

// CPU allreduces of at least this many bytes, of one contiguous tensor, run
// single-copy (peers read each other's tensors in place) when the host
// allows it; smaller ones are staged, where fewer barriers win.
constexpr int64_t kCpuSingleCopyMinBytes = 256 * 1024;

// Why auto leaves a CUDA collective to the engine where ranks share a GPU
// without CUDA MPS: the driver runs one process's kernels at a time, so each
// GPU barrier waits for the other ranks' turns (2.3 ms a barrier measured on
// an H100 with two ranks), longer than the engine (Gloo) takes.
extern const char* const kGpuTimeSlicedReason;

// Whether a native CPU allreduce should run on the single-copy transport.
bool use_single_copy(Algorithm algorithm, int64_t payload_bytes, bool single_buffer,
                     bool available);

// A memo of a machine model's choices per power-of-two payload size class and
// pack count, so that selecting per collective costs a map lookup. For one
// model only (the first it is used with; another throws). Thread-safe.
class ModelChoiceCache {
 public:
  struct Choice {
    Algorithm algorithm = Algorithm::kFallback;  // kFallback: NCCL predicted fastest
    int64_t num_packs = 0;
    double predicted_s = 0;
    std::string reason;
  };
  // The model's choice for `bucket_bytes` (already a size class), among xdev's
  // plans and, with `with_nccl`, NCCL's.
  Choice get(const MachineModel& model, int64_t bucket_bytes, int64_t num_packs,
             bool with_nccl = false);

 private:
  std::mutex mutex_;
  const MachineModel* model_ = nullptr;
  std::map<std::tuple<int64_t, int64_t, bool>, Choice> choices_;
};

// The size class a model predicts an allreduce of `payload_bytes` at: the
// power of two at or above it, at least 4 bytes.
int64_t model_bucket_bytes(int64_t payload_bytes);

// Why the CUDA IPC transport cannot open for a group ("off: ..."), or "" when
// it can: every rank on one host, at most kMaxDeviceRanks of them, every GPU
// able to access every other, the host channel that carries the CUDA
// collectives' descriptor check, and GPUs of compute capability 7.0 or later
// (lowest_compute_capability: major x 10 + minor of the group's oldest GPU).
// The CUDA rendezvous asks this before opening it; whether it opened reaches
// select_allreduce as transport_available.
std::string cuda_transport_refusal(int num_hosts, int world_size, bool all_gpus_reach,
                                   bool host_channel, int lowest_compute_capability);

struct SelectionInput {
  Algorithm requested = Algorithm::kAuto;
  int world_size = 1;
  int num_hosts = 1;
  DeviceKind device = DeviceKind::kCpu;
  TopologyClass topology = TopologyClass::kFullyConnected;  // of the GPUs, for kCuda
  // A native transport runs on this device (the CPU shared-memory channel, or
  // CUDA IPC as the group's CUDA rendezvous decided); transport_note says why
  // not and ends up in the reason.
  bool transport_available = true;
  std::string transport_note;
  bool op_supported = true;  // the reduce op and every tensor's dtype have native kernels
  // Forms only the engine runs: sparse tensors (DDP's gradients of a sparse
  // embedding; Gloo sums them), and a list of tensors that c10d reduces into
  // one result every tensor receives (the native path reduces tensors one by
  // one, as allreduce_coalesced does).
  bool dense = true;
  bool reduces_list_into_one = false;
  int64_t payload_bytes = 0;
  int64_t num_tensors = 1;
  int64_t num_packs = -1;  // -1: not set by the user
  // >= 0: the one (CPU) tensor lies at the same offset of shared buffer #id,
  // which every rank maps (torch_xdev.shared_empty).
  int64_t shared_buffer_id = -1;
  // The one tensor lies in the group's symmetric heap on this rank (CPU; CUDA:
  // its CUDA heap), a DDP bucket from c10d's allocateTensor. It changes
  // nothing about the plan, as peers' tensors need not be there; when the
  // plan is staged flat (CUDA: also auto's native choice), it runs in place
  // once every rank finds all blocks at the same place.
  bool in_symmetric_heap = false;
  // The CPU single-copy transport is open on every rank.
  bool single_copy_available = false;
  // For the fallback engine: whether the op is AVG, and whether the engine has it.
  bool op_is_avg = false;
  bool fallback_has_avg = false;
  // For algorithm="auto" on more than one rank: the plan this model predicts
  // fastest (its device count must be world_size). Required for CPU tensors;
  // for CUDA tensors optional (without one, the fixed rule). model_cache, when
  // given, memoises its choices.
  const MachineModel* model = nullptr;
  // CUDA: the engine is NCCL (every rank has its own GPU; NCCL refuses ranks
  // that share one), so the model weighs NCCL's algorithms too.
  bool nccl_available = false;
  // CUDA: ranks share a GPU whose driver time-slices their kernels (no CUDA
  // MPS daemon): auto leaves the call to the engine (kGpuTimeSlicedReason).
  bool gpu_time_sliced = false;
  ModelChoiceCache* model_cache = nullptr;
  // Several hosts, CPU tensors: whether the two-level plan can run (every host
  // holds ranks_per_host > 1 ranks, each host's channel is open, the engine
  // can reduce each slice), else why not; and the models it is weighed by:
  // one host's shared-memory path and the network. Required when available.
  bool two_level_available = false;
  std::string two_level_note;
  int ranks_per_host = 1;
  const MachineModel* host_model = nullptr;
  const NetworkParams* network = nullptr;
  // A floating-point MIN or MAX: where the two-level plan can run it runs, as
  // the engine's ring can drop a NaN (keep_nan_across_hosts).
  bool engine_may_drop_nan = false;
  // The pieces the two-level allreduce is pipelined in (Options.two_level_pieces);
  // 0: the model's choice (schedule_two_level).
  int two_level_pieces = 0;
};

struct Selection {
  Algorithm algorithm = Algorithm::kFallback;
  int64_t num_packs = 0;  // hierarchical plans only; 0 = one pack per tensor
  std::string reason;
  double predicted_s = 0;  // by the model, when it chose; else 0
  // Reduce in place in the shared buffer or the symmetric heap (flat's
  // order, nothing staged); CUDA: in the CUDA heap.
  bool in_place_shared = false;
  // CPU: run on the single-copy transport (peers read the tensor in place).
  bool single_copy = false;
  // Fallback: run AVG as SUM through the engine, then divide by the world size.
  bool avg_as_sum_then_divide = false;
  // Several hosts: `algorithm` (flat) inside each host, the engine across
  // hosts (plan/two_level.h), pipelined in this many pieces, or in the leader
  // form (one rank per host crosses).
  bool two_level = false;
  int two_level_pieces = 1;
  bool two_level_leader = false;
};

// Throws std::invalid_argument when a forced algorithm cannot run on this job
// (odd world size for hierarchical copy, several hosts for a native plan).
void check_forced_algorithm(Algorithm requested, int world_size, int num_hosts);

// The decision, in order: algorithm='fallback'; a forced plan that cannot run
// (throws); several hosts, no transport, no kernel (fallback); a tensor in a
// shared buffer with auto or flat (in place); a world of one (nothing to
// exchange); a forced plan; the model's choice (CUDA: with NCCL's candidates
// where nccl_available; without a model, by topology).
// A tensor in the symmetric heap gets the plan of any tensor, in place when
// that is flat (in_place_shared); on CUDA also when auto chose a native plan.
Selection select_allreduce(const SelectionInput& in);

// ---- Reduce-scatter and all-gather ----

// What runs a reduce-scatter or all-gather (tensor, coalesced or list form).
enum class GatherScatterPath {
  kNative,    // over the host's shared-memory channel (GatherScatterPlan), in the selected form
  kOneRank,   // a world of one: the output is a copy of the input, whatever the op
  kFallback,  // the inner engine (Gloo for CPU, NCCL for CUDA)
  kTwoLevel,  // several hosts: shared memory inside each, the engine across (plan/two_level.h)
  kCuda,  // one host, CUDA IPC (GatherScatterPlan as device programs): one tensor or list a side
};

const char* to_string(GatherScatterPath p);

// The model's gather/scatter choice per collective, size class, element
// width and allowed direct forms: ModelChoiceCache's counterpart. For one
// model only (the first it is used with; another throws). Thread-safe.
class GatherScatterChoiceCache {
 public:
  struct Choice {
    GatherScatterForm form = GatherScatterForm::kStaged;
    bool nccl = false;  // NCCL's candidate won (only where opts.nccl)
    double predicted_s = 0;
    std::string reason;
  };
  Choice get(const MachineModel& model, GatherScatterKind kind, int64_t bucket_bytes,
             int64_t elem_bytes, const GatherScatterOptions& opts);

 private:
  std::mutex mutex_;
  const MachineModel* model_ = nullptr;
  std::map<std::tuple<int, int64_t, int64_t, bool, bool, bool>, Choice> choices_;
};

struct GatherScatterInput {
  // CPU: only 'fallback' matters (one native plan). CUDA: any native name
  // forces the native path where it can run (auto prefers NCCL, see below).
  Algorithm requested = Algorithm::kAuto;
  int world_size = 1;
  int num_hosts = 1;
  DeviceKind device = DeviceKind::kCpu;
  // The host's shared-memory channel is open (CPU), or the CUDA IPC transport (CUDA).
  bool transport_available = true;
  std::string transport_note;  // CUDA: why the transport is off
  // CUDA: the engine is NCCL (every rank has a GPU of its own).
  bool nccl_available = false;
  // CUDA: ranks share a GPU whose driver time-slices their kernels (no CUDA
  // MPS daemon): auto leaves the call to the engine (kGpuTimeSlicedReason).
  bool gpu_time_sliced = false;
  // Native kernels for the op and every dtype (a reduce-scatter), or dense
  // tensors whose bytes can move (an all-gather).
  bool op_supported = true;
  // A list form whose tensors differ in size (uneven blocks). One list of them
  // runs natively on one host's CPU ranks; several lists, CUDA and the
  // two-level form (whose engine step takes blocks of one size) refuse them.
  bool uneven_list_sizes = false;
  // The full tensor's bytes (all ranks' blocks), how many tensors, and whether
  // every rank may read its peers' memory (single copy).
  int64_t payload_bytes = 0;
  int64_t num_tensors = 1;
  // A list form of one list: num_tensors full tensors, one per rank, each of
  // the block's size (or uneven: uneven_list_sizes). The CUDA path packs them
  // into one.
  bool one_list = false;
  bool single_copy_available = false;
  // Which collective, and a reduce-scatter's element width: what the model predicts.
  GatherScatterKind kind = GatherScatterKind::kReduceScatter;
  int64_t elem_bytes = 4;
  // The one tensor peers would read (reduce-scatter input, all-gather input)
  // lies in the group's symmetric heap on this rank: the in-place form may run.
  bool in_symmetric_heap = false;
  // The machine model that chooses between staged and in place (its device
  // count must be world_size); without one, a heap tensor is staged. On CUDA
  // tensors, the GPUs' model: it weighs xdev's form against NCCL's for the
  // reason auto gives. model_cache, when given, memoises its choices per size
  // class.
  const MachineModel* model = nullptr;
  GatherScatterChoiceCache* model_cache = nullptr;
  // Several hosts, CPU tensors, as for the allreduce: whether the two-level
  // form can run (every host holds ranks_per_host > 1 ranks, each host's
  // channel is open, the engine can reduce the call's op and dtype), else
  // why not; one host's shared-memory model and the network model weigh it.
  // Required when available.
  bool two_level_available = false;
  std::string two_level_note;
  int ranks_per_host = 1;
  const MachineModel* host_model = nullptr;
  const NetworkParams* network = nullptr;
  // A floating-point MIN or MAX reduce-scatter: as SelectionInput's.
  bool engine_may_drop_nan = false;
};

struct GatherScatterSelection {
  GatherScatterPath path = GatherScatterPath::kFallback;
  // Native: peers read each other's inputs in place (process_vm_readv); else
  // staged (unless in_place).
  bool single_copy = false;
  // Native: peers read each other's inputs where every rank maps them (the
  // symmetric heap); nothing staged, no syscall. Only where in_symmetric_heap.
  bool in_place = false;
  // Two-level: in the leader form (one rank per host crosses; plan/two_level.h).
  bool two_level_leader = false;
  std::string reason;
  double predicted_s = 0;  // by the model, when it chose; else 0
};

// The decision, in order: algorithm='fallback'; several hosts (two-level
// where it can run and the model predicts it faster than the engine's ring
// over all ranks, else the engine); CUDA tensors (NCCL where it runs,
// else the native CUDA path); no kernel for the op/dtype; shapes the native
// path does not take; a world of one (a copy); no shared-memory channel;
// otherwise native: for one tensor in the symmetric heap, staged or in place
// as the model predicts faster at the payload's size class; where that is
// staged, single copy for one tensor of at least kCpuSingleCopyMinBytes
// where peers may read each other (Options.single_copy, as for the
// allreduce); staged otherwise. Throws std::invalid_argument for a model
// whose device count is not world_size.
GatherScatterSelection select_gather_scatter(const GatherScatterInput& in);

}  // namespace xdev::plan
