#include "group_context.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "../kernels/cpu_reduce.h"
#include "../plan/collective_plan.h"
#include "../plan/packing.h"
#include "../plan/selection.h"
#include "allreduce_call.h"
#include "detached_teardown.h"
#include "setup_waits.h"

namespace xdev::backend {
namespace {

// "Float tensors on CUDA": the dtype and device of an engine's call.
std::string engine_tensors(const transport::OpDescriptor& d) {
  return std::string(c10::toString(static_cast<at::ScalarType>(d.dtype))) + " tensors" +
         (d.device == 1 ? " on CUDA" : "");
}

// c10d's name of a ReduceOp (the RedOpType a descriptor of an engine's call carries).
std::string reduce_op_name(int32_t op) {
  switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "op " + std::to_string(op);
  }
}

// How long a rank waiting at a barrier spins before it sleeps (see choose_spin_budgets).
constexpr auto kBarrierSpin = std::chrono::microseconds(20);

std::exception_ptr as_dist_error(const std::string& msg) {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

// What ranks on the same machine share, whatever host name they give: the
// kernel's boot id (also shared by containers on one kernel, which then count
// as sharing its cores). Without one, `fallback`: each host its own machine.
std::string machine_identity(const std::string& fallback) {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (in >> id && !id.empty()) return id;
  return "host:" + fallback;
}

// Options are checked where they are declared (validate); these need the group's size too.
void check_options(const BackendConfig& config, int size) {
  packing_options(config).validate();
  plan::check_root("reduce_to_rank", config.reduce_to_rank, size);
  validate(config);
}

// Throws std::invalid_argument naming every setting (plan_settings) in which
// a rank differs from rank 0. Each rank picks its plans by them: ranks that
// pick differently for one call would wait for each other until the timeout.
template <typename SettingsOf>
void check_same_settings(int size, SettingsOf settings_of) {
  const std::vector<std::string>& first = settings_of(0);
  std::string differences;
  for (int r = 1; r < size; ++r) {
    const std::vector<std::string>& other = settings_of(r);
    for (size_t i = 0; i < std::max(first.size(), other.size()); ++i) {
      const std::string a = i < first.size() ? first[i] : "(none)";
      const std::string b = i < other.size() ? other[i] : "(none)";
      if (a != b) differences += "\n  rank 0: " + a + ", rank " + std::to_string(r) + ": " + b;
    }
  }
  if (differences.empty()) return;
  throw std::invalid_argument(
      "xdev: the ranks of this group were given different settings:" + differences +
      "\nEvery rank must have the same torch_xdev.Options, XDEV_* variables and XDEV_CPU_MODEL "
      "file (the timeout and debug aside): each rank picks its plans by them, and ranks that "
      "picked differently for one call would wait for each other until the timeout.");
}

}  // namespace

GroupContext::GroupContext(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                           BackendConfig config)
    : store_(std::move(store)), rank_(rank), size_(size), config_(std::move(config)) {
  requested_ = plan::algorithm_from_string(config_.algorithm);
  // XDEV_* variables apply to every group the process makes (DeviceMesh's, new_group's), where
  // a root or an algorithm set for the world may not fit: such a group uses the default and
  // says so, as one given the same through its pg_options fails.
  if (config_.reduce_to_rank_from_environment &&
      (config_.reduce_to_rank < 0 || config_.reduce_to_rank >= size_)) {
    add_options_note("XDEV_REDUCE_TO_RANK=" + std::to_string(config_.reduce_to_rank) +
                     " is not a rank of this group of " + std::to_string(size_) +
                     ": it uses reduce_to_rank=0");
    config_.reduce_to_rank = 0;
  }
  check_options(config_, size_);
  rendezvous_hosts();
  try {
    plan::check_forced_algorithm(requested_, size_, num_hosts_);
  } catch (const std::invalid_argument& e) {
    if (!config_.algorithm_from_environment) throw;
    add_options_note("XDEV_ALGO=" + config_.algorithm + " cannot run on this group (" + e.what() +
                     "): it uses algorithm='auto'");
    config_.algorithm = plan::to_string(plan::Algorithm::kAuto);
    requested_ = plan::Algorithm::kAuto;
  }
  if (requested_ != plan::Algorithm::kFallback) {
    if (num_hosts_ == 1 && size_ > 1) {
      channel_ = open_shared_memory("xdev/shm/", size_, rank_, {});
      channel_->name_ranks({}, config_.global_ranks);
    } else if (num_hosts_ > 1 && hosts_even_ && local_world_size_ > 1) {
      host_channel_ = open_shared_memory("xdev/host_shm/" + std::to_string(host_index_) + "/",
                                         local_world_size_, local_rank_, host_ranks_);
      host_channel_->name_ranks(host_ranks_, config_.global_ranks);
    }
  }
  choose_spin_budgets();
  queue_ = std::make_unique<WorkQueue>();
  queue_address_ = queue_.get();
}

std::string GroupContext::no_channel_reason() const {
  if (size_ == 1) return "a world of one";
  if (requested_ == plan::Algorithm::kFallback) return "algorithm='fallback' requested";
  if (num_hosts_ == 1) return "";
  if (!hosts_even_) return "hosts hold different numbers of ranks";
  if (local_world_size_ == 1) return "one rank per host: nothing to share inside a host";
  return "";
}

GroupContext::~GroupContext() {
  stop_queue();
}

void GroupContext::rendezvous_hosts() {
  // One key per rank, a line each: its machine, that machine's cores, its host
  // identity, then the settings it picks plans by.
  struct Entry {
    std::string machine;
    int cores = 1;
    std::string host;
    std::vector<std::string> settings;
  };
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string mine =
      machine_identity(config_.hostname) + "\n" + std::to_string(cores) + "\n" + config_.hostname;
  for (const std::string& setting : plan_settings(config_)) mine += "\n" + setting;
  store_->set("xdev/host/" + std::to_string(rank_), mine);
  wait_for_ranks(*store_, "xdev/host/", size_, config_.timeout, "creating the group");
  std::vector<Entry> entries;
  for (int r = 0; r < size_; ++r) {
    std::vector<std::string> lines;
    std::istringstream value(store_->get_to_str("xdev/host/" + std::to_string(r)));
    for (std::string line; std::getline(value, line);) lines.push_back(line);
    TORCH_CHECK(lines.size() >= 3, "xdev: rank ", r, "'s host entry is malformed");
    entries.push_back({lines[0], std::max(1, std::atoi(lines[1].c_str())), lines[2],
                       std::vector<std::string>(lines.begin() + 3, lines.end())});
  }
  try {
    check_same_settings(size_, [&](int r) -> const std::vector<std::string>& {
      return entries[static_cast<size_t>(r)].settings;
    });
    // Ranks that give one host name share its memory: on two machines (containers started
    // with the same --hostname) opening it would fail on one side only.
    std::map<std::string, int> first_on_host;
    for (int r = 0; r < size_; ++r) {
      const Entry& e = entries[static_cast<size_t>(r)];
      const int first = first_on_host.emplace(e.host, r).first->second;
      if (entries[static_cast<size_t>(first)].machine != e.machine) {
        throw std::invalid_argument(
            "xdev: ranks " + std::to_string(first) + " and " + std::to_string(r) +
            " name the same host '" + e.host +
            "' but run on different machines (their kernels' boot ids differ). Give each "
            "machine its own host name, or set XDEV_HOSTNAME to tell them apart.");
      }
    }
  } catch (const std::invalid_argument&) {
    // Every rank finds the same difference: none leaves (rank 0's process
    // holds the Store) before all have read every entry, so each raises this
    // error rather than a peer's broken connection.
    store_barrier(*store_, "xdev/host/read/", rank_, size_, config_.timeout,
                  "comparing the ranks' settings");
    throw;
  }

  std::vector<std::string> hosts;  // by lowest rank
  std::vector<int> ranks_on_host;
  for (int r = 0; r < size_; ++r) {
    const std::string& host = entries[static_cast<size_t>(r)].host;
    const auto it = std::find(hosts.begin(), hosts.end(), host);
    const auto index = static_cast<size_t>(it - hosts.begin());
    if (it == hosts.end()) {
      hosts.push_back(host);
      ranks_on_host.push_back(0);
    }
    if (host == config_.hostname) {
      host_index_ = static_cast<int>(index);
      if (r == rank_) local_rank_ = ranks_on_host[index];
      host_ranks_.push_back(r);
    }
    ++ranks_on_host[index];
    rank_hosts_.push_back(static_cast<int>(index));
  }
  num_hosts_ = static_cast<int>(hosts.size());
  local_world_size_ = ranks_on_host[static_cast<size_t>(host_index_)];
  hosts_even_ = std::all_of(ranks_on_host.begin(), ranks_on_host.end(),
                            [&](int n) { return n == ranks_on_host[0]; });

  // A machine whose cores run several hosts' ranks gives each host its share.
  // The cost model takes the least share of any host, so that every rank
  // weighs plans alike and all hosts pick the same one.
  std::map<std::string, int> ranks_on_machine;
  for (const Entry& e : entries) ++ranks_on_machine[e.machine];
  host_cores_ = cores;
  machine_cores_ = cores;
  for (int r = 0; r < size_; ++r) {
    const Entry& e = entries[static_cast<size_t>(r)];
    machine_cores_ = std::min(machine_cores_, e.cores);
    const int on_host = ranks_on_host[static_cast<size_t>(rank_hosts_[static_cast<size_t>(r)])];
    host_cores_ =
        std::min(host_cores_, std::max(1, e.cores * on_host / ranks_on_machine[e.machine]));
  }
}

// The channel's first rank creates the segment and publishes its name; once
// every rank has mapped it (counted through the store), it unlinks the name,
// so the memory disappears with the last process that maps it, crash or not.
std::unique_ptr<transport::ShmChannel> GroupContext::open_shared_memory(
    const std::string& prefix, int ranks, int rank, const std::vector<int>& group_ranks) {
  const auto slot_bytes = static_cast<size_t>(config_.shm_slot_bytes);
  // A rank that cannot create or map the segment says so at once: its peers would otherwise
  // wait for its key or its arrival until the timeout, then fail without the reason.
  constexpr char kFailed = '!';
  transport::ShmChannel channel;
  std::exception_ptr failure;
  if (rank == 0) {
    std::string name;
    try {
      transport::ShmSegment::remove_orphans();
      name = transport::ShmSegment::make_name();
      channel = transport::ShmChannel::create(name, ranks, rank, slot_bytes);
    } catch (const std::exception& e) {
      store_->set(prefix + "name/0", std::string(1, kFailed) + e.what());
      throw;
    }
    store_->set(prefix + "name/0", name);
  } else {
    // Rank 0 may have died with its segment linked.
    wait_for_peers([&] {
      wait_for_ranks(*store_, prefix + "name/", 1, config_.timeout,
                     "opening this host's shared memory", group_ranks);
    });
    const std::string name = store_->get_to_str(prefix + "name/0");
    if (!name.empty() && name[0] == kFailed) {
      throw std::runtime_error(
          "xdev: the first rank of this host could not create the shared memory its ranks "
          "share: " +
          name.substr(1));
    }
    try {
      channel = transport::ShmChannel::attach(name, ranks, rank, slot_bytes);
    } catch (const std::exception&) {
      failure = std::current_exception();
    }
  }
  const int64_t failed = wait_for_peers([&] {
    return count_failures_across_ranks(*store_, prefix + "attached/", failure != nullptr, rank,
                                       ranks, config_.timeout, "mapping this host's shared memory",
                                       group_ranks);
  });
  if (rank == 0) channel.unlink_name();  // every rank that could has mapped it
  if (failure) std::rethrow_exception(failure);
  if (failed > 0) {
    throw std::runtime_error("xdev: " + std::to_string(failed) +
                             " rank(s) of this host could not map the shared memory its ranks "
                             "share (their own errors say why)");
  }
  return std::make_unique<transport::ShmChannel>(std::move(channel));
}

// A rank that reaches a barrier before the others spins for a while, then
// sleeps on a futex until the last one wakes it. Measured with 2 ranks on the
// 2-core development VM: waking a rank that went to sleep at once takes about
// 5 us, but a rank that spun first is woken later by about as long as it spun
// (the scheduler has charged it the spin: after 100 us of spinning the wake-up
// took about 100 us). Allreduces of 4-64 KiB measured the same with spins of
// 15 to 30 us, back to back and with the ranks arriving tens of microseconds
// apart (benchmarks/allreduce.py --arrival skewed); with 5 or 10 us back-to-
// back calls were slower, with 40 us or more skewed ones (with 100 us by about
// a third). Nobody spins where it would take a core that another busy thread
// of this job needs: a caller that waits for its collective spins only when
// every rank of the host has a core; a collective on the worker while its
// caller computes (DDP's backward) spins only when every rank has two. The
// host's cores are its share of the machine's (hosts faked on one machine
// share its cores).
void GroupContext::choose_spin_budgets() {
  const transport::Clock::duration none(0);
  spin_while_caller_waits_ = local_world_size_ <= host_cores_ ? kBarrierSpin : none;
  spin_while_caller_runs_ = worker_has_own_core() ? kBarrierSpin : none;
}

void GroupContext::check_with_peers(Collective collective, const char* name,
                                    std::chrono::milliseconds timeout,
                                    const std::function<void()>& check) {
  try {
    check();
  } catch (const std::exception&) {
    if (channel_ != nullptr) {
      try {
        meet_peers(collective, name, timeout, /*refused=*/true);
      } catch (const std::exception&) {
        // The peers' mismatch: this rank's own error says more.
      }
    }
    throw;
  }
}

void GroupContext::pass_turn(Collective collective, const char* name) {
  enqueue(
      c10d::OpType::UNKNOWN, name, {}, [this, collective] { next_descriptor(collective); },
      /*async_op=*/false)
      ->wait();
}

std::function<void()> GroupContext::meeting(Collective collective, const char* name,
                                            std::chrono::milliseconds timeout, bool refused,
                                            const transport::OpDescriptor& call) {
  return [this, collective, name, timeout, refused, call] {
    transport::OpDescriptor d = call;
    number(d);
    d.collective = static_cast<int32_t>(collective);
    if (refused) d.num_tensors = kRefusedCall;
    channel_->open_collective(make_context(d, name, deadline_for(timeout)));
  };
}

void GroupContext::meet_peers(Collective collective, const char* name,
                              std::chrono::milliseconds timeout, bool refused,
                              const transport::OpDescriptor& call) {
  enqueue(c10d::OpType::UNKNOWN, name, {}, meeting(collective, name, timeout, refused, call),
          /*async_op=*/false)
      ->wait();
}

void GroupContext::check_engine_call(Collective collective, const char* name,
                                     std::chrono::milliseconds timeout,
                                     const transport::OpDescriptor& call,
                                     const std::function<void()>& check, bool async_op) {
  // CUDA calls without the host's check (cuda_host_check off) meet nobody.
  if (channel_ == nullptr || (call.device == 1 && !config_.cuda_host_check)) {
    check();
    return;
  }
  if (!async_op) {
    check_with_peers(collective, name, timeout, check);
    meet_peers(collective, name, timeout, /*refused=*/false, call);
    return;
  }
  // An asynchronous call returns at once, as the engine's does (a rank may
  // issue it before its peers can make theirs): the meeting runs on the
  // worker, in order with this rank's other collectives, so the ranks' turns
  // stay paired whatever each passes as async_op, and peers that wait for
  // the call fail there at a mismatch. The engine runs it meanwhile, so this
  // rank's own side of a mismatch can only be reported, not prevented.
  std::exception_ptr refusal;
  try {
    check();
  } catch (const std::exception&) {
    refusal = std::current_exception();
  }
  const bool refused = refusal != nullptr;
  std::function<void()> meet = meeting(collective, name, timeout, refused, call);
  enqueue(
      c10d::OpType::UNKNOWN, name, {},
      [this, meet, refused] {
        try {
          meet();
        } catch (const transport::MismatchError& e) {
          if (!refused) std::fprintf(stderr, "[xdev] rank %d: %s\n", rank_, e.what());
          throw;
        }
      },
      /*async_op=*/true);
  if (refusal) std::rethrow_exception(refusal);
}

transport::OpDescriptor GroupContext::next_descriptor(Collective collective) {
  transport::OpDescriptor desc;
  number(desc);
  desc.collective = static_cast<int32_t>(collective);
  return desc;
}

transport::Clock::time_point GroupContext::deadline_for(std::chrono::milliseconds timeout) const {
  return transport::Clock::now() + transport::bounded_timeout(timeout_for(timeout));
}

std::string GroupContext::describe_call(const transport::OpDescriptor& d) const {
  if (d.num_tensors == kRefusedCall) {
    return "nothing: it refused its own arguments (see its error)";
  }
  if (d.num_tensors == kFailedBeforePeers) {
    return "nothing: it failed before it met its peers (see its error)";
  }
  if (d.num_tensors < 0) {  // CrossHostCheck's refusal
    return "nothing: its call differs from a rank's on another host";
  }
  std::string s;
  switch (static_cast<Collective>(d.collective)) {
    case Collective::kAllreduce:
      s = std::string("allreduce ") +
          kernels::to_string(static_cast<kernels::ReduceOp>(d.reduce_op)) + " " +
          kernels::to_string(static_cast<kernels::DType>(d.dtype)) + " via " +
          plan::to_string(static_cast<plan::Algorithm>(d.algorithm)) +
          (d.device == 1 ? " on CUDA tensors"
           : d.shared_buffer >= 0
               ? " in place in shared buffer #" + std::to_string(d.shared_buffer) + " at byte " +
                     std::to_string(d.shared_offset)
           : d.heap_arena >= 0
               ? " in place in the symmetric heap (arena " + std::to_string(d.heap_arena) +
                     ", byte " + std::to_string(d.heap_offset) + ")"
           : d.single_copy ? " (single copy)"
                           : " (staged)");
      break;
    case Collective::kBroadcast:
      s = "broadcast from rank " + std::to_string(d.root) + " (elements are bytes)";
      break;
    case Collective::kReduceScatter:
      s = std::string("reduce_scatter ") +
          kernels::to_string(static_cast<kernels::ReduceOp>(d.reduce_op)) + " " +
          kernels::to_string(static_cast<kernels::DType>(d.dtype)) + " (staged, elements per rank)";
      break;
    case Collective::kAllGather:
      s = "all_gather (staged, elements are bytes per rank)";
      break;
    case Collective::kBarrier:
      return "barrier";
    case Collective::kSharedEmpty:
      return "torch_xdev.shared_empty";
    case Collective::kReduce:
      s = "reduce " + reduce_op_name(d.reduce_op) + " to rank " + std::to_string(d.root) + " of " +
          engine_tensors(d);
      break;
    case Collective::kGather:
      s = "gather to rank " + std::to_string(d.root) + " of " + engine_tensors(d);
      break;
    case Collective::kScatter:
      s = "scatter from rank " + std::to_string(d.root) + " of " + engine_tensors(d);
      break;
    case Collective::kAllToAll:
      return "all_to_all of " + engine_tensors(d) + " (sizes not compared)";
    default:
      s = "unknown collective";
  }
  return s + ", " + std::to_string(d.num_tensors) + " tensor(s), " + std::to_string(d.total_elems) +
         " element(s), hash of the tensors' dtypes and sizes " +
         std::to_string(d.counts_hash % 100000);
}

std::string GroupContext::describe_op(const transport::OpDescriptor& d) const {
  return describe_call(d) + " (op #" + std::to_string(d.seq) + ")";
}

transport::OpContext GroupContext::make_context(const transport::OpDescriptor& desc,
                                                const char* name,
                                                transport::Clock::time_point deadline) const {
  transport::OpContext ctx;
  ctx.descriptor = desc;
  ctx.deadline = deadline;
  ctx.what = std::string(name) + " (op #" + std::to_string(desc.seq) + ")";
  ctx.describe = [this](const transport::OpDescriptor& d) { return describe_op(d); };
  return ctx;
}

c10::intrusive_ptr<c10d::Work> GroupContext::enqueue(c10d::OpType type, const char* title,
                                                     std::vector<at::Tensor> outputs,
                                                     std::function<void()> fn, bool async_op,
                                                     bool runs_when_unusable) {
  auto work = c10::make_intrusive<XdevWork>(rank_, type, title, std::move(outputs));
  enqueue_work(work, std::move(fn), async_op, runs_when_unusable);
  return work;
}

void GroupContext::enqueue_work(const c10::intrusive_ptr<XdevWork>& work, std::function<void()> fn,
                                bool async_op, bool runs_when_unusable) {
  // Inside one of this group's tasks (a Work's callback): the queue lives
  // until that task ends, and this thread may hold queue_mutex_ already. (A
  // thread running no queue reads null, as does a stopped group's address:
  // that is no task of ours.)
  WorkQueue* const running_here = queue_address_.load();
  const bool nested =
      running_here != nullptr && WorkQueue::running_on_this_thread() == running_here;
  std::unique_lock<std::mutex> lock(queue_mutex_, std::defer_lock);
  // Where a collective issued from this Work's own callbacks will run.
  const uint64_t place = nested ? XdevWork::callbacks_place_here() : WorkQueue::kEverything;
  if (nested) {
    work->place_callbacks_at(place);
  } else {
    lock.lock();
    TORCH_CHECK(queue_ != nullptr, "xdev: this process group has been destroyed");
    work->place_callbacks_at_get_future(queue_->submitted_count());
  }
  if (!async_op) ++callers_waiting_;
  // The task holds the backend while it runs, and drops it as the last thing
  // it does: a callback of its Work may drop every other reference, and the
  // backend must not go in the middle of the task. Where the task's is the
  // last, the destructor runs there, on the worker (see stop_queue). The
  // caller holds a reference (c10d calls through one, and a nested call's
  // task holds one), so the backend is alive here.
  c10::intrusive_ptr<c10d::Backend> owner;
  if (owner_ != nullptr)
    owner = c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(owner_);
  // `work` is copied into a member of its own, not captured as the const
  // reference it is here: a const member cannot be moved out below, and a
  // copy left in the lambda would outlive the waiters' release.
  auto task = [this, work = c10::intrusive_ptr<XdevWork>(work), fn = std::move(fn), async_op,
               runs_when_unusable, owner = std::move(owner)]() mutable {
    const c10::intrusive_ptr<c10d::Backend> held = std::move(owner);  // destroyed last
    auto done = c10::make_scope_exit([this, async_op] {
      if (!async_op) --callers_waiting_;
    });
    // The Work's waiters return once this task has let go of the call (see
    // TaskRelease): its tensors, in the body, and its Work, moved out of the
    // lambda so that they go before the waiters hear of it.
    const std::shared_ptr<TaskRelease> release = work->task_release();
    release->running_on_this_thread();
    auto tell_waiters = c10::make_scope_exit([&release] { release->released(); });
    const c10::intrusive_ptr<XdevWork> this_work = std::move(work);
    const std::function<void()> body = std::move(fn);
    // Whoever waits behind this collective is blocked, so its core is free.
    const bool a_caller_waits = !async_op || callers_waiting_.load() > 0;
    for (transport::ShmChannel* channel : {channel_.get(), host_channel_.get()}) {
      if (channel != nullptr) {
        channel->set_spin_budget(a_caller_waits ? spin_while_caller_waits_
                                                : spin_while_caller_runs_);
      }
    }
    std::exception_ptr error;  // the body's failure, as the Work reports it
    try {
      if (!poisoned_.empty() && !runs_when_unusable) {
        throw CallError("xdev: this group is unusable after an earlier failure (" + poisoned_ +
                        "); destroy it and create a new one");
      }
      // The body writes the caller's tensors with ATen ops (a staged result
      // copied back, a division), where the engines write raw memory.
      // Autograd refuses those on a view of a leaf that requires grad, and
      // inference mode on a tensor made under it: that would fail this rank
      // after its peers have moved the data. Writes still bump the tensors'
      // version counters. Only the body: callbacks run by complete() are the
      // user's code, in the user's modes.
      c10::InferenceMode writes_as_the_engines_do;
      body();
    } catch (const transport::MismatchError& e) {
      error = as_dist_error(e.what());  // every rank stopped at the same barrier
    } catch (const CallError& e) {
      error = as_dist_error(e.what());
    } catch (const transport::PeerError& e) {
      poison(e.what());
      error = as_dist_error(e.what());
    } catch (const std::exception& e) {
      poison(e.what());
      error = as_dist_error(std::string("xdev: ") + e.what());
    }
    // Completing runs the Work's callbacks. One added through the future's
    // addCallback (C++) may throw once the Work is settled: it must not end
    // the worker thread (std::terminate) or pass for the call's failure.
    try {
      if (error) {
        this_work->fail(error);
      } else {
        this_work->complete();
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[xdev] group '%s' rank %d: a callback of a Work raised: %s\n",
                   config_.group_name.c_str(), rank_, e.what());
    }
  };
  if (nested) {
    running_here->run_nested(std::move(task), place);
  } else if (async_op) {
    queue_->submit(std::move(task));
  } else {
    queue_->run_inline_or_submit(std::move(task));
  }
}

bool GroupContext::stop_queue(bool last_reference) {
  const bool on_worker =
      queue_address_ != nullptr && WorkQueue::running_on_this_thread() == queue_address_;
  std::unique_ptr<WorkQueue> queue;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (!queue_) return false;
    if (on_worker && !last_reference) {
      throw std::runtime_error(
          "xdev: a process group cannot be destroyed from a callback of its own Work (callbacks "
          "run on the group's worker thread, which destroying the group must join): destroy it "
          "from another thread, once its Works are done");
    }
    queue = std::move(queue_);
  }
  if (on_worker) {
    // The task that held the last reference is ending on this thread (see
    // enqueue_work), and nothing is queued behind it: every queued task holds
    // a reference. A thread of its own joins this one once the task returns.
    queue_address_ = nullptr;  // this group makes no more calls: its last reference is gone
    run_detached_teardown([done = std::move(queue)]() mutable { done.reset(); });
    return true;
  }
  queue.reset();  // runs what is queued (whose callbacks may still call nested), joins the worker
  queue_address_ = nullptr;
  return true;
}

void GroupContext::add_options_note(const std::string& note) {
  options_note_ += (options_note_.empty() ? "" : "; ") + note;
}

void GroupContext::log_once(const std::string& key, const std::string& message) {
  std::lock_guard<std::mutex> lock(log_mutex_);
  if (!config_.debug || !logged_.insert(key).second) return;
  std::fprintf(stderr, "[xdev] group '%s' rank %d: %s\n", config_.group_name.c_str(), rank_,
               message.c_str());
}

}  // namespace xdev::backend
