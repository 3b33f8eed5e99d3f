// Cost model: what a schedule costs on a machine, predicted from its links.
//
// Pure C++17, no torch or CUDA. A MachineModel describes one host as
// *resources* with a bandwidth (one direction of an NVLink bundle, a PCIe
// lane, a GPU's memory, a CPU core) and, for every ordered pair of devices,
// the route a transfer takes (the resources it crosses) and its latency.
//
// A schedule becomes a Program of tasks: each Step (and each staging copy) is
// one task whose *flows* are the bytes it moves: one flow per remote source
// over that source's route, one flow for its local reads and writes over the
// device's memory. A task starts when the tasks it depends on have finished
// (data dependences over slot ranges, or a barrier of all ranks where the
// executor has one) plus its latency; it ends when all its flows have moved
// their bytes. Flows that share a resource share its bandwidth; the
// simulation is a fluid one (progressive filling, i.e. max-min fairness),
// advanced from one flow completion to the next.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nccl_model.h"
#include "schedule.h"
#include "topology.h"

namespace xdev::plan {

struct Resource {
  std::string name;
  double bytes_per_s = 0;
};

// How bandwidth is shared between the flows active at one moment.
enum class SharingPolicy {
  kFairShare,    // max-min fair over all active flows
  kOldestFirst,  // tasks of lower priority value take what they can first, later ones the
                 // rest (equal values share fairly): an in-order pipeline that hands idle
                 // bandwidth to younger work
};

class MachineModel {
 public:
  MachineModel() = default;
  MachineModel(std::string name, int num_devices);

  const std::string& name() const { return name_; }
  int num_devices() const { return n_; }

  // Returns the new resource's id.
  int add_resource(std::string name, double bytes_per_s);
  const std::vector<Resource>& resources() const { return resources_; }
  Resource& resource(int id);

  // The resources a transfer from device `from`'s memory to device `to`
  // crosses, and its latency. Throws if none was set for a pair that needs one.
  void set_route(int from, int to, std::vector<int> resources, double latency_s);
  const std::vector<int>& route(int from, int to) const;
  double route_latency_s(int from, int to) const;
  bool has_route(int from, int to) const;

  // The resources a device's own reads and writes use (its memory).
  void set_local(int device, std::vector<int> resources);
  const std::vector<int>& local(int device) const;

  // Single copy: where a device reads a peer's private memory through the
  // kernel (process_vm_readv), the read also crosses this resource of the
  // reader (the kernel's copy rate) and costs cross_process_call_s more to
  // start. -1 (the default): the machine has no such path.
  void set_cross_process_read(int device, int resource);
  int cross_process_read(int device) const;
  bool has_cross_process_read() const;
  double cross_process_call_s = 0;

  // Direct links (NVLink counts; 1 per pair for a CPU host). Schedules are
  // checked against these; the ring search walks them.
  LinkMatrix links;

  double launch_latency_s = 0;          // once per collective (kernel launch, call overhead)
  double step_latency_s = 0;            // to start one task (flag wait, loop overhead)
  bool barrier_between_phases = false;  // the executor separates phases by a barrier of all ranks
  double barrier_latency_s = 0;         // one such barrier
  SharingPolicy policy = SharingPolicy::kFairShare;
  int64_t window_bytes = 0;  // staging capacity per rank and window; 0 = unlimited
  // The executor runs schedules in their forward_own_input form (the staged CPU
  // executor does), so predictions model that form. Its hand_back_totals on top
  // moves the same bytes between the same ranks and is not modelled: the model
  // does not price cache-line ownership.
  bool forwards_own_input = false;
  std::string source;  // where the numbers come from, for the CLI and docs
  // What NCCL's tuning model sees on this machine (GPU hosts); the NCCL
  // candidates are predicted from it (nccl_model.h).
  NcclHost nccl;

 private:
  std::string name_;
  int n_ = 0;
  std::vector<Resource> resources_;
  std::vector<std::vector<int>> routes_;  // n*n
  std::vector<double> latencies_;         // n*n
  std::vector<bool> has_route_;           // n*n
  std::vector<std::vector<int>> local_;   // n
  std::vector<int> cross_process_;        // n
};

struct Flow {
  std::vector<int> resources;
  double bytes = 0;
};

struct Task {
  std::string label;  // for traces and test messages
  int device = 0;     // who runs it
  std::vector<Flow> flows;
  std::vector<int> deps;  // indices of earlier tasks
  double latency_s = 0;   // after the last dependency finished
  double priority = 0;    // kOldestFirst: lower goes first
};

struct Program {
  std::vector<Task> tasks;
};

struct SimulationResult {
  double seconds = 0;            // the last task's end
  std::vector<double> start_s;   // per task, when its flows began
  std::vector<double> finish_s;  // per task
};

// Runs the program through the machine's resources. Throws std::invalid_argument
// on a dependency that is not an earlier task, or on a flow through a resource
// of zero bandwidth.
SimulationResult simulate(const MachineModel& m, const Program& p, SharingPolicy policy);

// Appends to `p` the tasks of one window of `s` (window_elems elements of
// elem_bytes each): the stagers' copies in, then every step. Tasks wait for
// the data they read (or, where the machine's executor has barriers, for the
// whole previous phase: a task without bytes labelled "barrier after phase q"
// follows each phase that has tasks, and the last returned is the one after
// all the window's work); tasks that read nothing staged in this window wait
// for `after` (e.g. the previous window that used the same staging buffers).
//
// Priorities model a pipelined executor that works through the packs in
// order: a step of the k-th of `packs` (the pack whose range holds the step's
// first element; 0 when `packs` is empty) in phase t gets priority
// priority_base + k + t, so one pack's phase t + 1 and the next pack's phase
// t are served alike, both before later work. Returns the indices of the
// window's tasks.
std::vector<int> append_window(const MachineModel& m, const Schedule& s, int64_t window_elems,
                               int64_t elem_bytes, const std::vector<int>& after, Program& p,
                               const std::vector<Range>& packs = {}, double priority_base = 0);

// Appends the windows of one collective (task 0 of `p` is its launch), each
// with append_window, in the order the machine's executor runs them: where it
// has a barrier per phase, a window starts after the previous one; otherwise
// after the window two before it, whose staging buffers it reuses (two sets).
// windows[k] covers window_elems[k] slot elements; packs, when not empty, are
// each window's packs in pipeline order. Returns each window's task indices.
std::vector<std::vector<int>> append_windows(const MachineModel& m,
                                             const std::vector<Schedule>& windows,
                                             const std::vector<int64_t>& window_elems,
                                             int64_t elem_bytes, Program& p,
                                             const std::vector<std::vector<Range>>& packs = {});

// The predicted seconds of a windowed collective of `bytes`, `window_bytes`
// of which each window moves (0: one window), whose program `program(b)`
// builds for any multiple b of window_bytes. Where the machine's executor has
// a barrier per phase, windows run one after another and all but the first
// and last are alike: a large payload is predicted from two short runs (the
// cost of the windows in between, extrapolated), so it costs no more to
// predict than a small one.
double predict_windowed_seconds(const MachineModel& m, int64_t bytes, int64_t window_bytes,
                                const std::function<Program(int64_t)>& program);

}  // namespace xdev::plan
