// GroupContext: what every part of one xdev process group shares.
//
// Rank, size, Store and resolved options; which ranks share this host (learnt
// through the Store); the host's shared-memory channel (its control block and
// slots, opened when every rank is on one host); the Store barrier and vote
// that setup steps use to agree; and the sequencing of native collectives:
// one FIFO of work, run by one worker thread or inline, each op numbered and
// described the same way on every rank so that a mismatch is caught at its
// first barrier. The CPU, CUDA and shared-buffer parts each take a reference
// to the context; none of them reaches into another.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "../plan/schedule.h"
#include "../transport/shm_channel.h"
#include "backend_config.h"
#include "work_queue.h"
#include "xdev_work.h"

namespace xdev::backend {

// Which native collective an OpDescriptor describes (its `collective` field).
enum class Collective : int32_t {
  kAllreduce = 1,
  kBroadcast = 2,
  kBarrier = 3,
  kReduceScatter = 4,
  kAllGather = 5,
  kSharedEmpty = 6,  // torch_xdev.shared_empty's meeting (GroupContext::meet_peers)
  // Before the engine runs them (GroupContext::check_engine_call):
  kReduce = 7,
  kGather = 8,
  kScatter = 9,
  kAllToAll = 10,  // dtype only: its sizes may differ between ranks by design
};

// OpDescriptor::num_tensors of a call its rank refused for its own arguments
// (it still meets its peers at the descriptor check, which then fails on
// every rank that called validly). CrossHostCheck's refusal is -1.
constexpr int64_t kRefusedCall = -2;
// OpDescriptor::num_tensors of a call its rank could not make ready before
// meeting its peers (out of memory, a CUDA error): met like a refusal.
constexpr int64_t kFailedBeforePeers = -3;

// Fails one call and leaves the group usable (an engine's error on a call xdev
// only finishes, e.g. the SUM before an emulated AVG's division), where any
// other error of a native collective makes the group unusable.
class CallError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class GroupContext {
 public:
  // Learns which ranks share this host and, when all do (and the fallback is
  // not forced), opens the host's shared-memory channel. Throws
  // std::invalid_argument for options this job cannot honour.
  GroupContext(c10::intrusive_ptr<c10d::Store> store, int rank, int size, BackendConfig config);
  ~GroupContext();

  int rank() const { return rank_; }
  int size() const { return size_; }
  c10d::Store& store() const { return *store_; }
  const c10::intrusive_ptr<c10d::Store>& store_ref() const { return store_; }
  const BackendConfig& config() const { return config_; }
  plan::Algorithm requested() const { return requested_; }
  // Which options set by XDEV_* variables this group could not use, and what it uses instead
  // (empty: none).
  const std::string& options_note() const { return options_note_; }
  int num_hosts() const { return num_hosts_; }
  int local_world_size() const { return local_world_size_; }

  // The host's channel; null when the ranks span hosts, in a world of one,
  // or with algorithm="fallback".
  transport::ShmChannel* channel() const { return channel_.get(); }

  // Where this rank sits when the ranks span hosts (hosts are numbered by
  // their lowest rank; a host's ranks are ordered by rank).
  int host_index() const { return host_index_; }
  int local_rank() const { return local_rank_; }
  // The group ranks of this host's ranks, in order: local rank l is host_ranks()[l].
  const std::vector<int>& host_ranks() const { return host_ranks_; }
  // The host index of every group rank, by rank.
  const std::vector<int>& rank_hosts() const { return rank_hosts_; }
  // The cores a host's ranks run on, for the network model: a machine's cores,
  // shared in proportion to their ranks by the hosts (as named) whose ranks
  // run on it (XDEV_HOSTNAME splitting one box, or containers on one kernel);
  // the least over the group's hosts, so that every rank weighs plans alike.
  // At least 1.
  int host_cores() const { return host_cores_; }
  // Whether a collective on the worker thread has a core of its own while its
  // caller computes (every rank of the host has two). Where it has not, the
  // two take turns on one core: a rank's worker may be off its core while a
  // peer's waits for it at a barrier, so waiting for the collective beats
  // overlapping it (torch_xdev.avg_comm_hook does).
  bool worker_has_own_core() const { return 2 * local_world_size_ <= host_cores_; }
  // The fewest cores of any machine of the group's ranks, for the model of
  // the shared-memory path inside a host: alike on every rank.
  int machine_cores() const { return machine_cores_; }
  // The channel of this host's ranks in a group that spans hosts (for the
  // two-level collectives, plan/two_level.h): open when every host holds the
  // same number of ranks, more than one, and the fallback is not forced;
  // null otherwise. Its ranks are the local ranks.
  transport::ShmChannel* host_channel() const { return host_channel_.get(); }
  // Why this rank has no shared-memory channel to share tensors over (the
  // group's on one host, its host's on several), alike on every rank; "" where
  // it has one.
  std::string no_channel_reason() const;

  // ---- Native collectives: numbering, description, deadlines, order ----

  // A descriptor of the next native collective (takes its sequence number; op
  // thread only).
  transport::OpDescriptor next_descriptor(Collective collective);
  // Gives d the next sequence number (op thread only). Take it just before the
  // channel opens the collective, never ahead for several: a mismatch stops
  // every rank at the first one it opens, and numbers taken for later ones
  // would leave the ranks' counts apart for good.
  void number(transport::OpDescriptor& d) { d.seq = ++next_seq_; }
  transport::OpContext make_context(const transport::OpDescriptor& desc, const char* name,
                                    transport::Clock::time_point deadline) const;
  // A call's timeout: the group's where the call sets none (kUnsetTimeout).
  std::chrono::milliseconds timeout_for(std::chrono::milliseconds timeout) const {
    return timeout == c10d::kUnsetTimeout ? config_.timeout : timeout;
  }
  transport::Clock::time_point deadline_for(std::chrono::milliseconds timeout) const;
  // How errors and logs name a collective: "allreduce sum float32 via flat (staged), ...
  // (op #12)", the number counting this group's calls on this host's channel.
  std::string describe_op(const transport::OpDescriptor& d) const;
  // The same without the number: a call on another host, whose count may differ.
  std::string describe_call(const transport::OpDescriptor& d) const;

  // Runs fn after every earlier collective of this group and completes the
  // returned Work with its outcome: on the worker thread, or inline when the
  // caller waits anyway (async_op false) and nothing is queued. Errors become
  // DistBackendError; a peer failure poisons the group. Once it is poisoned,
  // fn fails at once without running, unless `runs_when_unusable` (a task
  // that only finishes an engine's call, and so never uses the channel: such
  // calls go on as they do where the engine finishes them itself).
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title,
                                         std::vector<at::Tensor> outputs, std::function<void()> fn,
                                         bool async_op, bool runs_when_unusable = false);
  // Runs `check` (this rank's own checks of its arguments). When it throws,
  // this rank still meets its peers at the collective's descriptor check
  // (single-host groups) before the error goes up: a refused call takes its
  // sequence number like any other, so peers that called validly fail at this
  // same call (a mismatch that names this rank's refusal) and the calls after
  // it stay paired; ranks that all refused pass the check alike and each
  // raises its own error. Only for a call its peers run natively.
  void check_with_peers(Collective collective, const char* name, std::chrono::milliseconds timeout,
                        const std::function<void()>& check);
  // Takes the sequence number of a call this rank refused, in order with its
  // other collectives, without meeting anyone: its next call then carries
  // the number after the one its peers run.
  void pass_turn(Collective collective, const char* name);
  // A collective that moves nothing through the host's channel (single-host
  // groups): returns once every rank has made the same call, in order with
  // this rank's other collectives. A peer that is gone or in another call
  // raises as in any collective: within 200 ms of a death, or at the timeout
  // naming the missing ranks. `refused`: this rank refused its own arguments;
  // `call`: what the peers must agree on (all but the sequence number and the
  // collective, which the meeting sets).
  void meet_peers(Collective collective, const char* name, std::chrono::milliseconds timeout,
                  bool refused = false, const transport::OpDescriptor& call = {});
  // A collective the engine runs, checked first with the peers of this host
  // (single-host groups): every rank meets with `call` (its fields but the
  // sequence number and the collective), or as a refused call where `check`
  // throws, so that a refusal or a call unlike its peers' (op, root, dtype,
  // sizes) fails on every rank at once and the group stays usable, where the
  // engine would wait out its timeout, abort, or mix the calls. An
  // asynchronous call (async_op) does not wait for its peers: it meets them on
  // the worker while the engine runs it. Without the host's channel (ranks on
  // several hosts), or for CUDA tensors with cuda_host_check off, only
  // `check` runs.
  void check_engine_call(Collective collective, const char* name, std::chrono::milliseconds timeout,
                         const transport::OpDescriptor& call, const std::function<void()>& check,
                         bool async_op);
  // The same for a Work the caller made (the CUDA side's, which knows streams).
  void enqueue_work(const c10::intrusive_ptr<XdevWork>& work, std::function<void()> fn,
                    bool async_op, bool runs_when_unusable = false);
  // The backend that owns this context, set at the end of its constructor
  // (a task enqueued before then holds no reference: nothing owns the backend
  // yet). Every task enqueued after holds one while it runs (enqueue_work).
  void set_owner(c10d::Backend* owner) { owner_ = owner; }
  // Runs what is queued, then joins the worker; later enqueues throw. Returns
  // false when it had already stopped. Throws on the worker itself (a Work's
  // callback), unless `last_reference`: the backend's destructor, there at
  // the end of a task that held the last reference.
  bool stop_queue(bool last_reference = false);
  // Frees the shared-memory channel (after stop_queue and after every user of it).
  void close_channel() {
    mark_left();
    channel_.reset();
    host_channel_.reset();
  }

  // Tells peers on the shared-memory channels that this rank runs no more
  // barriers (a peer waiting for it fails at its next liveness check), and
  // why, where a failure is the reason.
  void mark_left(const std::string& failure = "") {
    if (channel_) channel_->mark_left(failure);
    if (host_channel_) host_channel_->mark_left(failure);
  }

  // With Options.debug, prints message once per key (stderr, tagged with group and rank).
  void log_once(const std::string& key, const std::string& message);
  // Whether a failure has made the group unusable (set before the failed
  // call's Work completes, so a caller told of the failure sees it).
  bool poisoned() const { return poisoned_flag_.load(); }
  // Runs `hook` on the op thread when a failure poisons the group, after the
  // failed call's body has unwound and before its Work completes. Set before
  // the first collective (the backend's constructor).
  void on_poison(std::function<void()> hook) { on_poison_ = std::move(hook); }

 private:
  // The task of meet_peers: numbers `call` and meets this host's ranks with it.
  std::function<void()> meeting(Collective collective, const char* name,
                                std::chrono::milliseconds timeout, bool refused,
                                const transport::OpDescriptor& call);
  void rendezvous_hosts();
  void add_options_note(const std::string& note);
  // A channel of `ranks` ranks (this one is `rank` among them), agreed on
  // through Store keys under `prefix`. Errors name index r as group rank
  // group_ranks[r] (empty: the same numbers).
  std::unique_ptr<transport::ShmChannel> open_shared_memory(const std::string& prefix, int ranks,
                                                            int rank,
                                                            const std::vector<int>& group_ranks);
  void choose_spin_budgets();

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  BackendConfig config_;
  plan::Algorithm requested_ = plan::Algorithm::kAuto;
  std::string options_note_;
  int num_hosts_ = 1;
  int local_world_size_ = 1;
  int host_index_ = 0;
  int local_rank_ = 0;
  std::vector<int> host_ranks_;
  std::vector<int> rank_hosts_;
  bool hosts_even_ = true;
  int host_cores_ = 1;
  int machine_cores_ = 1;
  std::unique_ptr<transport::ShmChannel> channel_;
  std::unique_ptr<transport::ShmChannel> host_channel_;

  // How long a barrier spins before it sleeps, for a collective whose caller
  // waits for it (its thread is blocked, so the spinner takes no core it
  // needs) and for one that runs on the worker while the caller goes on.
  transport::Clock::duration spin_while_caller_waits_{0};
  transport::Clock::duration spin_while_caller_runs_{0};
  // Collectives enqueued with async_op false and not yet finished: while
  // there is one, its caller is blocked, also during the work queued ahead.
  std::atomic<int> callers_waiting_{0};

  uint64_t next_seq_ = 0;                   // op thread only
  std::string poisoned_;                    // op thread only
  std::atomic<bool> poisoned_flag_{false};  // the same, for any thread

  // After an error that leaves the channels out of step (a peer missing, a
  // failure mid-collective): every later call fails at once, and peers waiting
  // for this rank learn it has left instead of waiting out their deadline.
  void poison(const std::string& why) {
    poisoned_ = why;
    poisoned_flag_.store(true);
    mark_left(why);
    if (on_poison_) on_poison_();
  }
  std::function<void()> on_poison_;

  std::mutex log_mutex_;
  std::set<std::string> logged_;

  std::mutex queue_mutex_;            // guards queue_ against stop_queue()
  std::unique_ptr<WorkQueue> queue_;  // joined in stop_queue(), before anything it uses goes
  // queue_ as it was made, only compared with WorkQueue::running_on_this_thread()
  // (non-const: run_nested, which only a task of that queue calls); null once the queue is
  // gone, so that another group's queue made at the same address is not taken for it.
  std::atomic<WorkQueue*> queue_address_{nullptr};
  c10d::Backend* owner_ = nullptr;  // see set_owner
};

}  // namespace xdev::backend
