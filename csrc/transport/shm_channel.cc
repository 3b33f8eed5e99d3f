#include "shm_channel.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace xdev::transport {
namespace {

constexpr uint64_t kMagic = 0x7864657673686d31ull;  // "xdevshm1"
constexpr uint32_t kVersion = 7;
constexpr size_t kCacheLine = 64;
// RankControl::left: whether and how a rank left the group.
constexpr int32_t kStillHere = 0;
constexpr int32_t kDestroyed = 1;      // its group was destroyed
constexpr int32_t kAfterFailure = 2;   // a failure made its group unusable: left_reason says which
constexpr int32_t kWritingReason = 3;  // on its way to kAfterFailure: still here for a reader
constexpr size_t kLeftReasonBytes = 512;

// `text` in at most `bytes` bytes: whole, or cut where a UTF-8 character
// starts (Python refuses an error message cut inside one) and marked "...".
std::string cut_to(const std::string& text, size_t bytes) {
  if (text.size() <= bytes) return text;
  const std::string mark = "...";
  size_t n = bytes - mark.size();
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  return text.substr(0, n) + mark;
}
constexpr size_t kPage = 4096;
constexpr int kPausesPerClockRead = 16;
// Header::outcome's radix: it names a rank r as r + 1, below it.
constexpr uint64_t kOutcomeRanks = 1 << 16;

size_t round_up(size_t v, size_t to) {
  return (v + to - 1) / to * to;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Process-shared futex (no FUTEX_PRIVATE_FLAG): the word lives in a MAP_SHARED
// mapping that every rank maps at its own address.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex word must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "epoch word must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word layout");

struct alignas(kCacheLine) ShmChannel::RankControl {
  std::atomic<uint64_t> arrived;  // number of barriers this rank has reached
  std::atomic<int32_t> pid;
  std::atomic<int32_t> left;  // a LeftHow once this rank has left the group (mark_left)
  uint64_t pid_namespace;     // where pid means this rank's process (pid_namespace())
  char pad[kCacheLine - 2 * sizeof(uint64_t) - 2 * sizeof(std::atomic<int32_t>)];
  OpDescriptor desc[2];        // indexed by op seq parity
  uint64_t buffer_address[2];  // likewise: the buffer lent to peers
  uint64_t buffer_bytes[2];
  uint64_t probe_address;  // where this rank's probe token lives
  uint64_t probe_token;
  // This rank's symmetric-heap arenas: bytes is written last (release), 0 until published.
  std::atomic<uint64_t> arena_bytes[SymmetricHeap::kMaxArenas];
  int32_t arena_fd[SymmetricHeap::kMaxArenas];
  // Its device-memory heap's arenas, the same way (handle first, bytes last).
  std::atomic<uint64_t> device_arena_bytes[SymmetricHeap::kMaxArenas];
  unsigned char device_arena_handle[SymmetricHeap::kMaxArenas][DeviceArenaAddress::kHandleBytes];
  // Why it left after a failure (kAfterFailure), NUL-terminated; written before `left`.
  char left_reason[kLeftReasonBytes];
};

struct alignas(kCacheLine) ShmChannel::Header {
  uint64_t magic;
  uint32_t version;
  int32_t world_size;
  uint64_t slot_bytes;
  uint64_t data_offset;
  alignas(kCacheLine) std::atomic<uint32_t> wake_word;  // bumped whenever a barrier completes
  std::atomic<uint32_t> sleepers;  // ranks inside futex_wait's loop: only then is a wake needed
  // How the latest barrier settled (settle_barrier): its epoch times kOutcomeRanks, plus 0 if
  // every rank arrived, or 1 + the rank that gave up on it at its deadline.
  alignas(kCacheLine) std::atomic<uint64_t> outcome;
};

bool OpDescriptor::operator==(const OpDescriptor& o) const {
  return seq == o.seq && collective == o.collective && reduce_op == o.reduce_op &&
         dtype == o.dtype && algorithm == o.algorithm && single_copy == o.single_copy &&
         device == o.device && root == o.root && num_packs == o.num_packs &&
         num_tensors == o.num_tensors && total_elems == o.total_elems &&
         counts_hash == o.counts_hash && shared_buffer == o.shared_buffer &&
         shared_offset == o.shared_offset;
}

uint32_t call_hash(const OpDescriptor& d) {
  // FNV-1a over each field's value (not the struct's bytes: padding), folded to 32 bits.
  uint64_t h = 14695981039346656037ull;
  const auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  };
  for (const int64_t v : {static_cast<int64_t>(d.seq), int64_t{d.collective}, int64_t{d.reduce_op},
                          int64_t{d.dtype}, int64_t{d.algorithm}, int64_t{d.single_copy},
                          int64_t{d.device}, d.root, d.num_packs, d.num_tensors, d.total_elems,
                          static_cast<int64_t>(d.counts_hash), d.shared_buffer, d.shared_offset}) {
    mix(static_cast<uint64_t>(v));
  }
  return static_cast<uint32_t>(h ^ (h >> 32));
}

size_t ShmChannel::segment_bytes(int world_size, size_t slot_bytes) {
  const size_t control = sizeof(Header) + sizeof(RankControl) * static_cast<size_t>(world_size);
  return round_up(control, kPage) +
         2 * static_cast<size_t>(world_size) * round_up(slot_bytes, kPage);
}

ShmChannel ShmChannel::create(const std::string& name, int world_size, int rank,
                              size_t slot_bytes) {
  ShmChannel ch;
  ch.segment_ = ShmSegment::create(name, segment_bytes(world_size, slot_bytes));
  auto* h = new (ch.segment_.data()) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->world_size = world_size;
  h->slot_bytes = slot_bytes;
  h->data_offset = round_up(sizeof(Header) + sizeof(RankControl) * world_size, kPage);
  h->wake_word.store(0);
  h->sleepers.store(0);
  h->outcome.store(0);
  auto* ranks = reinterpret_cast<RankControl*>(h + 1);
  for (int r = 0; r < world_size; ++r) {
    auto* rc = new (&ranks[r]) RankControl();
    rc->arrived.store(0);
    rc->pid.store(0);
    rc->left.store(kStillHere);
    rc->left_reason[0] = '\0';
    for (auto& bytes : rc->arena_bytes) bytes.store(0);
    for (auto& bytes : rc->device_arena_bytes) bytes.store(0);
  }
  ch.init_local_rank(world_size, rank, slot_bytes);
  return ch;
}

ShmChannel ShmChannel::attach(const std::string& name, int world_size, int rank,
                              size_t slot_bytes) {
  ShmChannel ch;
  ch.segment_ = ShmSegment::open(name, segment_bytes(world_size, slot_bytes));
  const Header* h = ch.header();
  if (h->magic != kMagic || h->version != kVersion || h->world_size != world_size ||
      h->slot_bytes != slot_bytes) {
    throw std::runtime_error("xdev shared memory: " + name +
                             " was made for another group shape or xdev version");
  }
  ch.init_local_rank(world_size, rank, slot_bytes);
  return ch;
}

void ShmChannel::init_local_rank(int world_size, int rank, size_t slot_bytes) {
  if (static_cast<uint64_t>(world_size) >= kOutcomeRanks - 1) {
    throw std::invalid_argument("xdev shared memory: " + std::to_string(world_size) +
                                " ranks on one host; at most " + std::to_string(kOutcomeRanks - 2) +
                                " share a channel");
  }
  world_size_ = world_size;
  rank_ = rank;
  slot_bytes_ = slot_bytes;
  data_offset_ = header()->data_offset;
  RankControl* me = control(rank_);
  me->pid_namespace = pid_namespace();
  me->pid.store(static_cast<int32_t>(::getpid()));
  // A random token, so a successful read proves we reached the right process.
  probe_token_ = std::make_unique<uint64_t>(0);
  fill_random(probe_token_.get(), sizeof(uint64_t));
  *probe_token_ |= 1;  // never zero
  me->probe_token = *probe_token_;
  me->probe_address = reinterpret_cast<uint64_t>(probe_token_.get());
}

ShmChannel::Header* ShmChannel::header() const {
  return static_cast<Header*>(segment_.data());
}

ShmChannel::RankControl* ShmChannel::control(int rank) const {
  return reinterpret_cast<RankControl*>(header() + 1) + rank;
}

char* ShmChannel::slot(int64_t window_parity, int rank) const {
  const size_t stride = round_up(slot_bytes_, kPage);
  const size_t index = static_cast<size_t>(window_parity & 1) * world_size_ + rank;
  return static_cast<char*>(segment_.data()) + data_offset_ + index * stride;
}

bool ShmChannel::all_arrived(uint64_t epoch) const {
  for (int r = 0; r < world_size_; ++r) {
    if (control(r)->arrived.load(std::memory_order_seq_cst) < epoch) return false;
  }
  return true;
}

int ShmChannel::group_rank(int r) const {
  const bool named = r >= 0 && static_cast<size_t>(r) < group_ranks_.size();
  return named ? group_ranks_[static_cast<size_t>(r)] : r;
}

std::string ShmChannel::rank_name(int r) const {
  const int g = group_rank(r);
  std::string name = "rank " + std::to_string(g);
  if (g >= 0 && static_cast<size_t>(g) < global_ranks_.size() && global_ranks_[g] != g) {
    name += " (global rank " + std::to_string(global_ranks_[g]) + ")";
  }
  return name;
}

std::string ShmChannel::missing_ranks(uint64_t epoch) const {
  std::string out;
  for (int r = 0; r < world_size_; ++r) {
    if (control(r)->arrived.load() < epoch)
      out += (out.empty() ? "" : ", ") + std::to_string(group_rank(r));
  }
  return out;
}

std::string ShmChannel::gone(int r, const std::string& what) const {
  const pid_t pid = control(r)->pid.load();
  const std::string who = rank_name(r) + " (pid " + std::to_string(pid) + ")";
  const std::string during = what.empty() ? "" : " during " + what;
  const int32_t left = control(r)->left.load();
  if (left == kAfterFailure) {
    // The peer's own error, so that a failure elsewhere (a rank dead on
    // another host) reaches its host-mates with its cause.
    return who + " failed" + during + "; its error: " + control(r)->left_reason;
  }
  if (left == kDestroyed) return who + " has left the group (destroy_process_group)" + during;
  if (exited(r)) return who + " exited" + during;
  return "";
}

bool ShmChannel::exited(int r) const {
  const pid_t pid = control(r)->pid.load();
  return pid > 0 && shares_pid_namespace(r) && process_exited(pid);
}

std::string ShmChannel::gone_rank(uint64_t epoch, const std::string& what) const {
  for (int r = 0; r < world_size_; ++r) {
    if (control(r)->arrived.load() >= epoch) continue;
    std::string why = gone(r, what);
    if (!why.empty()) return why;
  }
  return "";
}

std::string ShmChannel::gone_peer() const {
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    std::string why = gone(r);
    if (!why.empty()) return why;
  }
  return "";
}

int ShmChannel::exited_peer_rank() const {
  for (int r = 0; r < world_size_; ++r) {
    if (r != rank_ && exited(r)) return r;
  }
  return -1;
}

bool ShmChannel::shares_pid_namespace(int rank) const {
  return control(rank)->pid_namespace == control(rank_)->pid_namespace;
}

void ShmChannel::mark_left(const std::string& failure) {
  RankControl* mine = control(rank_);
  // Said once, by whichever thread comes first (a failure on the op thread,
  // the group's destruction on another): a reader may be reading the text.
  int32_t still_here = kStillHere;
  if (!mine->left.compare_exchange_strong(still_here,
                                          failure.empty() ? kDestroyed : kWritingReason)) {
    return;
  }
  if (!failure.empty()) {
    const std::string cut = cut_to(failure, sizeof(mine->left_reason) - 1);
    std::memcpy(mine->left_reason, cut.c_str(), cut.size() + 1);
    mine->left.store(kAfterFailure, std::memory_order_seq_cst);  // after the text
  }
  // Peers asleep in a barrier wake up and find it at their next liveness check.
  header()->wake_word.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&header()->wake_word);
}

// A barrier settles once, for every rank alike: the first rank to see every
// arrival, or the first to reach its deadline without seeing them, writes the
// outcome, and the others read it. Without that, a rank that gave up at its
// deadline leaves its arrival behind, and a peer arriving later would find
// every rank there and finish a collective the others had failed. Returns
// whether the barrier passed.
bool ShmChannel::settle_barrier(uint64_t epoch, bool every_rank_arrived) {
  std::atomic<uint64_t>& outcome = header()->outcome;
  const uint64_t mine =
      epoch * kOutcomeRanks + (every_rank_arrived ? 0 : 1 + static_cast<uint64_t>(rank_));
  uint64_t seen = outcome.load(std::memory_order_seq_cst);
  // No rank passes this epoch before it settles, so the word holds an earlier
  // epoch until then.
  while (seen / kOutcomeRanks < epoch) {
    if (outcome.compare_exchange_weak(seen, mine, std::memory_order_seq_cst)) {
      return every_rank_arrived;
    }
  }
  // A later epoch: the others passed this one and went on while this rank
  // stalled after seeing every arrival (a failed barrier leaves the group
  // unusable, so none goes on past one).
  return seen / kOutcomeRanks > epoch || seen % kOutcomeRanks == 0;
}

void ShmChannel::pass_barrier(uint64_t epoch, const std::string& what) {
  if (settle_barrier(epoch, true)) return;
  const uint64_t outcome = header()->outcome.load(std::memory_order_seq_cst);
  const int gave_up = static_cast<int>(outcome % kOutcomeRanks) - 1;
  throw PeerError("xdev: " + rank_name(gave_up) + " timed out in " + what +
                  " before this rank arrived, and that call failed there, so it fails here too");
}

// Barrier. Each rank stores its own arrival count, then reads everyone's.
// Both are seq_cst, so of any two ranks at least one sees the other's store
// (store->load ordering, as in Dekker's algorithm): the last rank to arrive
// always sees the set complete, bumps wake_word and wakes the sleepers. A
// sleeper reads wake_word *before* re-checking the arrivals and passes that
// value to FUTEX_WAIT, which returns at once if the word has moved since: a
// wake between the check and the sleep cannot be lost. The seq_cst loads that
// observe every arrival also order this rank's later reads of peers' slots
// after the peers' writes before they arrived (release/acquire on arrived).
void ShmChannel::barrier(Clock::time_point deadline, const std::string& what) {
  const uint64_t epoch = ++epoch_;
  std::atomic<uint32_t>* wake = &header()->wake_word;
  control(rank_)->arrived.store(epoch, std::memory_order_seq_cst);
  if (all_arrived(epoch)) {
    wake->fetch_add(1, std::memory_order_seq_cst);
    // A rank that registers as a sleeper after this load sees every arrival
    // (all seq_cst) before it waits, so skipping the system call is safe.
    if (header()->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(wake);
    pass_barrier(epoch, what);  // the woken settle it alike, whoever writes first
    return;
  }
  if (spin_budget_ > Clock::duration::zero()) {
    // Timed, not counted: a pause takes from a few to tens of nanoseconds
    // depending on the CPU (4000 took 25 us on one development VM and 100 us
    // on another). The clock is read once per round of pauses.
    const auto spin_end = Clock::now() + spin_budget_;
    do {
      for (int i = 0; i < kPausesPerClockRead; ++i) {
        cpu_relax();
        if (!all_arrived(epoch)) continue;
        pass_barrier(epoch, what);
        return;
      }
    } while (Clock::now() < spin_end);
  }
  std::atomic<uint32_t>* sleepers = &header()->sleepers;
  sleepers->fetch_add(1, std::memory_order_seq_cst);
  struct Unregister {
    std::atomic<uint32_t>* sleepers;
    ~Unregister() { sleepers->fetch_sub(1, std::memory_order_seq_cst); }
  } unregister{sleepers};
  auto next_liveness_check = Clock::now() + kLivenessCheckPeriod;
  for (;;) {
    const uint32_t seen = wake->load(std::memory_order_seq_cst);
    if (all_arrived(epoch)) {
      pass_barrier(epoch, what);
      return;
    }
    // A peer that reached its deadline first has failed this barrier for every rank (its
    // timeout may be shorter, or its call began earlier): no need to wait out this one's.
    const uint64_t settled = header()->outcome.load(std::memory_order_seq_cst);
    if (settled / kOutcomeRanks == epoch && settled % kOutcomeRanks != 0) {
      const int gave_up = static_cast<int>(settled % kOutcomeRanks) - 1;
      throw PeerError("xdev: timed out in " + what + " waiting for rank(s) " +
                      missing_ranks(epoch) + " of this group: " + rank_name(gave_up) +
                      " reached its deadline first, which fails the call on every rank");
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      // The last peer may have arrived since the check above and settled it.
      if (settle_barrier(epoch, false)) return;
      // The peers asleep here learn of the failure now rather than at their own deadlines.
      wake->fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(wake);
      throw PeerError("xdev: timed out in " + what + " waiting for rank(s) " +
                      missing_ranks(epoch) +
                      " of this group; a peer is stuck, slow, or called a different collective");
    }
    if (now >= next_liveness_check) {
      const std::string gone = gone_rank(epoch, what);
      if (!gone.empty()) throw PeerError("xdev: " + gone);
      next_liveness_check = now + kLivenessCheckPeriod;
    }
    const auto slice = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(100));
    futex_wait(wake, seen, std::chrono::duration_cast<std::chrono::nanoseconds>(slice));
  }
}

void ShmChannel::publish(const OpDescriptor& d) {
  control(rank_)->desc[d.seq & 1] = d;
}

OpDescriptor ShmChannel::descriptor_of(int rank, uint64_t seq) const {
  return control(rank)->desc[seq & 1];
}

void ShmChannel::check_same_descriptor(
    const OpDescriptor& mine, const std::function<std::string(const OpDescriptor&)>& describe,
    const std::string& what) const {
  bool same = true;
  for (int r = 0; r < world_size_ && same; ++r) same = descriptor_of(r, mine.seq) == mine;
  if (same) return;
  std::string msg = "xdev: ranks called mismatched collectives at " + what + ":";
  for (int r = 0; r < world_size_; ++r) {
    msg += "\n  " + rank_name(r) + ": " + describe(descriptor_of(r, mine.seq));
  }
  msg +=
      "\nEvery rank must pass tensors of the same shapes and dtypes, in the same order, "
      "with the same op and options. The group is still usable.";
  throw MismatchError(msg);
}

void ShmChannel::publish_buffer(uint64_t seq, const void* address, uint64_t bytes) {
  RankControl* me = control(rank_);
  me->buffer_address[seq & 1] = reinterpret_cast<uint64_t>(address);
  me->buffer_bytes[seq & 1] = bytes;
}

void ShmChannel::publish_arena(int index, const ArenaAddress& address) {
  if (index < 0 || index >= SymmetricHeap::kMaxArenas) {
    throw std::out_of_range("ShmChannel::publish_arena: index " + std::to_string(index));
  }
  RankControl* me = control(rank_);
  me->arena_fd[index] = address.fd;
  me->arena_bytes[index].store(address.bytes, std::memory_order_release);
}

ArenaAddress ShmChannel::arena_of(int rank, int index) const {
  if (index < 0 || index >= SymmetricHeap::kMaxArenas) return {};
  const RankControl* rc = control(rank);
  ArenaAddress a;
  a.bytes = rc->arena_bytes[index].load(std::memory_order_acquire);
  a.fd = rc->arena_fd[index];
  a.pid = rc->pid.load();
  return a;
}

void ShmChannel::publish_device_arena(int index, const DeviceArenaAddress& address) {
  if (index < 0 || index >= SymmetricHeap::kMaxArenas) {
    throw std::out_of_range("ShmChannel::publish_device_arena: index " + std::to_string(index));
  }
  RankControl* me = control(rank_);
  std::memcpy(me->device_arena_handle[index], address.handle, sizeof address.handle);
  me->device_arena_bytes[index].store(address.bytes, std::memory_order_release);
}

DeviceArenaAddress ShmChannel::device_arena_of(int rank, int index) const {
  DeviceArenaAddress a;
  if (index < 0 || index >= SymmetricHeap::kMaxArenas) return a;
  const RankControl* rc = control(rank);
  a.bytes = rc->device_arena_bytes[index].load(std::memory_order_acquire);
  std::memcpy(a.handle, rc->device_arena_handle[index], sizeof a.handle);
  return a;
}

ShmChannel::PeerBuffer ShmChannel::buffer_of(int rank, uint64_t seq) const {
  const RankControl* rc = control(rank);
  return PeerBuffer{rc->pid.load(), rc->buffer_address[seq & 1], rc->buffer_bytes[seq & 1]};
}

bool ShmChannel::can_read_peers(std::string* why) const {
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const RankControl* rc = control(r);
    uint64_t got = 0;
    iovec local{&got, sizeof got};
    iovec remote{reinterpret_cast<void*>(rc->probe_address), sizeof got};
    const ssize_t n = ::process_vm_readv(rc->pid.load(), &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(sizeof got) || got != rc->probe_token) {
      const int err = errno;
      *why = "process_vm_readv of " + rank_name(r) +
             " failed: " + (n < 0 ? std::string(std::strerror(err)) : std::string("wrong data"));
      return false;
    }
  }
  return true;
}

}  // namespace xdev::transport
