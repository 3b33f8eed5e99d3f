// Schedules: which rank reads which byte ranges from whom, in which phase.
//
// Words used here. Every rank owns a *staging slot* (shared memory on the CPU,
// an IPC-shared device buffer on GPUs) and an *output* (its result tensor).
// Execution of one window: every stager copies its input into its slot (phase
// 0), then phases 1..num_phases run in order, separated by a barrier of all
// ranks. A Step is executed by its actor; it reads the same element range
// from the slots of its sources, in the listed order, and writes the actor's
// own slot or output. Steps only ever *pull*: data moves from a source slot to
// the actor, so a transfer crosses the link (source -> actor).
//
// Determinism: every total is produced by exactly one reduce step (the one
// marked finalize) and then only copied, so every rank ends with the same
// bits, and the fixed source order gives the same bits run after run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "packing.h"

namespace xdev::plan {

enum class Algorithm {
  kAuto,
  kHierarchicalCopy,      // TensorFlow's DGX-1 plan: two groups of N/2, rotating mains per pack
  kHierarchicalBalanced,  // the same two levels with trees weighted by link capacity (below)
  kReduceToOne,           // sum on one root, everyone copies the result back
  kFlat,                  // reduce-scatter then allgather: rank r reduces slice r of each window
  kDirect,    // every rank reduces the whole window itself: one barrier, for small payloads
  kFallback,  // the inner engine (Gloo for CPU, NCCL for CUDA)
};

const char* to_string(Algorithm a);
// Accepts the names to_string gives; throws std::invalid_argument listing them.
Algorithm algorithm_from_string(const std::string& name);

enum class StepKind { kReduce, kCopy };

// A Step source that is the actor's own tensor rather than a slot. Only
// forward_own_input introduces it; the builders below never do.
constexpr int kOwnInput = -1;
enum class Target { kStaging, kOutput };

struct Step {
  StepKind kind = StepKind::kCopy;
  int phase = 1;
  int actor = 0;
  std::vector<int> sources;  // slots read, in reduction order (one for a copy)
  Target target = Target::kOutput;
  Range range;            // element offsets within the window
  bool finalize = false;  // produces a total: AVG divides here
  // A staging step whose values also go to the actor's output (forward_own_input
  // folds the copy that followed it into it).
  bool also_output = false;
  // A staging step writes this rank's slot; -1 means the actor's own. Only
  // hand_back_totals sets it.
  int slot_owner = -1;
};

bool operator==(const Step& a, const Step& b);

// Whether one of the step's sources is rank's slot (or, for kOwnInput, the
// actor's tensor).
bool reads_slot(const Step& s, int rank);
// Whether one of the step's sources is kOwnInput (the actor's tensor).
bool reads_own_input(const Step& s);

// The rank whose slot a Target::kStaging step writes.
int written_slot(const Step& s);

struct Schedule {
  int world_size = 0;
  int num_phases = 0;
  std::vector<int> stagers;  // ranks that copy their input in during phase 0
  // Empty: every stager stages the whole window. Otherwise one entry per rank:
  // the slot ranges (ascending, disjoint) it stages; stagers are the ranks with any.
  std::vector<std::vector<Range>> staged_ranges;
  std::vector<Step> steps;
};

bool operator==(const Schedule& a, const Schedule& b);

// A reduce of `sources` (in this order) over r, and a copy from one source.
Step reduce_step(int phase, int actor, std::vector<int> sources, Target target, Range r,
                 bool finalize);
Step copy_step(int phase, int actor, int source, Target target, Range r);

// Throws std::invalid_argument unless 0 <= root < world_size; `what` names
// the option or argument in the message (e.g. "reduce_to_rank").
void check_root(const char* what, int64_t root, int world_size);

// One pack's part of the current window, with its global pack index (which
// decides the hierarchical plan's lead ranks).
struct PackSlice {
  int64_t pack_id = 0;
  Range range;
};

// Hierarchical copy over N = world_size ranks (N even, g = N/2, groups [0,g)
// and [g,N)). For pack i: main0 = i mod N and main1 = (main0 + g) mod N.
//   phase 1: each main sums the pack over its own group (intra-group links);
//   phase 2: main0 adds main1's group sum: the total (one crossing of the
//            main0 <-> main1 link);
//   phase 3: main1 copies the total from main0; main0's group copies it out;
//   phase 4: main1's group copies it out from main1.
Schedule hierarchical_copy_schedule(int world_size, const std::vector<PackSlice>& packs);

// Root sums the range over all slots (phase 1); every rank copies it out
// (phase 2).
Schedule reduce_to_one_schedule(int world_size, int root, Range range);

// Rank r reduces slice r of the range over all slots (phase 1); every rank then
// copies every slice out (phase 2). Spreads the reduction over all ranks.
Schedule flat_schedule(int world_size, Range range);

// Every rank reduces the whole range over all slots, in rank order, straight
// into its output (phase 1). One barrier per window instead of two; each rank
// reads N times the payload, which only pays for small payloads. Every rank
// runs the same operations in the same order on the same bits, so the results
// are bitwise identical without a copy.
Schedule direct_schedule(int world_size, Range range);

// Root stages alone; every rank copies root's slot out (phase 1).
Schedule broadcast_schedule(int world_size, int root, Range range);

// The schedule for a transport without staging slots, where rank r's "slot"
// is rank r's own tensor and peers read it in place (single-copy CPU path):
// outputs become slot writes and copies of a rank onto itself disappear.
// Throws std::invalid_argument when that aliasing would let a rank overwrite
// data a peer still reads in the same phase (the direct plan does).
Schedule in_place_variant(const Schedule& s);

// The schedule for an executor that allreduces in place (each rank's output is
// its input tensor) and can read that tensor directly, as the staged CPU
// executor does. Three rewrites, each removing a pass over memory:
//   - a step that reads the actor's own slot while it still holds the staged
//     input reads the tensor instead (kOwnInput);
//   - a copy of the actor's own slot into its output is folded into the step
//     that last wrote that slot range (also_output), when nothing reads the
//     tensor in between;
//   - each rank stages only the slot ranges that are read before it overwrites
//     them (staged_ranges).
// A rank whose staging would shrink below half of the busiest stager's (the
// reduce-to-one root) keeps staging and reading its slot: staging runs on all
// ranks at once, so it would save nothing there and pay later.
// Every sum keeps its sources in the same order, so results are bitwise those
// of s.
Schedule forward_own_input(const Schedule& s);

// For an executor on cache-coherent shared memory, applied after
// forward_own_input. A total that exactly one other rank copies out, and that
// was summed from that rank's slot over the same range, is written back over
// that slot, and the copier copies from its own slot. The same bytes cross
// between the same ranks, but each slot line goes to the reducer and comes
// back, instead of being read in one slot and written in another: a window
// touches half the slot memory, and a core that reads a line it writes next
// can fetch it for ownership (kernels::DstLines). Applies to flat and
// reduce-to-one on two ranks; a total that several ranks copy keeps its slot.
// Sums are unchanged.
// Throws std::invalid_argument if a step already writes another rank's slot.
Schedule hand_back_totals(const Schedule& s);

// Empty when the schedule is well formed: ranks in range, every step's target
// written by no other step of its phase, no slot range both written and read
// by different actors in one phase. Otherwise a description of the problem.
std::string find_schedule_hazard(const Schedule& s);

}  // namespace xdev::plan
