// What a rank announces at each GPU barrier of xdev's collective kernels
// (cuda_executor.cu): one 64-bit word, stored into every peer's inbox, that
// holds the barrier's epoch (its low 40 bits) and a 24-bit hash of the call the
// rank runs (call_hash in shm_channel.h). A rank waiting at a barrier compares
// each peer's hash with its own, so ranks that run different collectives stop
// at the call's first barrier, before any of them reads a peer's data, and
// report which peer differed instead of reading wrong bytes or waiting out
// the timeout. A rank whose kernels stop for another cause leaves a stop word
// in its place, which stops its peers at their next wait.
//
// Pure C++ for host and device, so that the protocol is unit-tested on the
// CPU with threads standing in for ranks (tests/cpp/test_gpu_barrier_word.cc).
#pragma once

#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define XDEV_HOST_DEVICE __host__ __device__
#else
#define XDEV_HOST_DEVICE
#endif

namespace xdev::transport::gpu_barrier {

constexpr int kEpochBits = 40;
constexpr uint64_t kEpochMask = (uint64_t{1} << kEpochBits) - 1;
constexpr uint32_t kHashMask = (1u << (64 - kEpochBits)) - 1;

// The hash field's largest value marks a stop word (below), so a call's hash
// never takes it: it folds onto its neighbour.
constexpr uint32_t kStopHash = kHashMask;
XDEV_HOST_DEVICE constexpr uint32_t hash_bits(uint32_t call_hash) {
  return (call_hash & kHashMask) == kStopHash ? kStopHash - 1 : call_hash & kHashMask;
}

XDEV_HOST_DEVICE constexpr uint64_t announce(uint64_t epoch, uint32_t call_hash) {
  return (epoch & kEpochMask) | (static_cast<uint64_t>(hash_bits(call_hash)) << kEpochBits);
}

// What a rank whose kernels stopped (a wait timed out, a peer differed or
// exited, a launch failed) leaves in every peer's inbox in place of its
// epoch: a peer waiting at any barrier then stops too, at once, instead of
// passing the last barrier this rank announced and waiting out its own
// timeout at the next. It carries the rank's error code (below), so that the
// peers can say why.
XDEV_HOST_DEVICE constexpr uint64_t stop_word(unsigned int code) {
  return (static_cast<uint64_t>(kStopHash) << kEpochBits) | code;
}
XDEV_HOST_DEVICE constexpr bool is_stop_word(uint64_t word) {
  return (word >> kEpochBits) == kStopHash;
}

enum class Peer { kNotYet, kAgrees, kDiffers, kStopped };

// What a peer's word tells a rank waiting at `epoch` of the call hashed
// call_hash. A peer is at most one barrier ahead (it passes a barrier only
// once this rank has announced it), so epochs compare modulo 2^40 by the sign
// of their difference: a 40-bit epoch wraps after days of barriers at the
// GPU's fastest pace, and the host's 64-bit count never does. A word ahead of
// `epoch` agrees: its rank passed this barrier, which it does only after
// judging this rank's word the same call. A stop word stops the rank,
// whatever barrier it waits at.
XDEV_HOST_DEVICE constexpr Peer judge(uint64_t word, uint64_t epoch, uint32_t call_hash) {
  if (is_stop_word(word)) return Peer::kStopped;
  const uint64_t ahead = ((word & kEpochMask) - epoch) & kEpochMask;
  if ((ahead >> (kEpochBits - 1)) != 0) return Peer::kNotYet;  // negative: still behind
  if (ahead != 0) return Peer::kAgrees;
  return (word >> kEpochBits) == hash_bits(call_hash) ? Peer::kAgrees : Peer::kDiffers;
}

// The codes a kernel that gives up leaves in the executor's error word (the
// first one wins; 0: none). The host leaves one of its own there, kPeerGone,
// when it sees a peer's process exit while kernels may wait for it
// (PeerWatch), and kLaunchFailed: kernels poll the word as they wait and stop.
// The codes name ranks as the group numbers them, so that a peer can adopt
// one from a stop word (adopt).
constexpr unsigned int kOwnBlocksTimedOut = 1;
constexpr unsigned int kPeerTimedOutBase = 2;        // + the peer's rank
constexpr unsigned int kPeerDiffersBase = 1u << 16;  // + the peer's rank
constexpr unsigned int kPeerGoneBase = 1u << 17;     // + the peer's rank
// The host's too: one of this rank's kernels failed to launch, after the
// windows before it had spent their barriers.
constexpr unsigned int kLaunchFailed = 1u << 18;
// A peer's stop word stopped this rank's kernels.
constexpr unsigned int kPeerStoppedBase = 1u << 19;  // + the peer's rank
static_assert(kPeerTimedOutBase + 4096 < kPeerDiffersBase, "codes overlap");
static_assert(kPeerDiffersBase + 4096 < kPeerGoneBase, "codes overlap");
static_assert(kPeerGoneBase + 4096 < kLaunchFailed, "codes overlap");
static_assert(kLaunchFailed < kPeerStoppedBase, "codes overlap");

XDEV_HOST_DEVICE constexpr unsigned int peer_timed_out(int rank) {
  return kPeerTimedOutBase + static_cast<unsigned int>(rank);
}
XDEV_HOST_DEVICE constexpr unsigned int peer_differs(int rank) {
  return kPeerDiffersBase + static_cast<unsigned int>(rank);
}
XDEV_HOST_DEVICE constexpr unsigned int peer_gone(int rank) {
  return kPeerGoneBase + static_cast<unsigned int>(rank);
}
XDEV_HOST_DEVICE constexpr unsigned int peer_stopped(int rank) {
  return kPeerStoppedBase + static_cast<unsigned int>(rank);
}

// The rank whose process exited, for a kPeerGone code (this rank's own or one
// adopted from a peer's stop word); -1 for any other code.
XDEV_HOST_DEVICE constexpr int gone_rank(unsigned int code) {
  return code >= kPeerGoneBase && code < kLaunchFailed ? static_cast<int>(code - kPeerGoneBase)
                                                       : -1;
}

// Whether a rank whose kernels stopped with `code` tells its peers (a stop
// word). Not where a peer differed: every rank finds the differing call at
// the same barrier by itself, and names whom it differs from, which only it
// can say.
XDEV_HOST_DEVICE constexpr bool tells_peers(unsigned int code) {
  return code < kPeerDiffersBase || code >= kPeerGoneBase;
}

// The code `self` records for a stop word from peer `from`: the peer's own
// cause where it reads the same from here (a rank other than `self` timed
// out, exited, or stopped first), else that `from` stopped.
XDEV_HOST_DEVICE constexpr unsigned int adopt(uint64_t word, int self, int from) {
  const auto code = static_cast<unsigned int>(word);
  const auto self_code = static_cast<unsigned int>(self);
  if (code >= kPeerStoppedBase && code - kPeerStoppedBase != self_code) return code;
  if (code >= kPeerGoneBase && code < kLaunchFailed) return code;  // not this rank: it runs
  const bool timed_out_on_another =
      code >= kPeerTimedOutBase && code < kPeerDiffersBase && code - kPeerTimedOutBase != self_code;
  // Else: its own blocks or launch, a wait for this rank, or no cause read.
  return timed_out_on_another ? code : peer_stopped(from);
}

// The error word in words ("" for 0).
inline std::string describe_error(unsigned int code) {
  if (code == 0) return {};
  if (code == kOwnBlocksTimedOut) {
    return "a GPU barrier timed out waiting for this rank's own thread blocks";
  }
  if (code == kLaunchFailed) {
    return "one of this rank's collective kernels failed to launch after earlier windows of "
           "its call, which its peers' kernels met";
  }
  if (code >= kPeerStoppedBase) {
    return "rank " + std::to_string(code - kPeerStoppedBase) +
           " stopped its GPU collectives (its own error says why), and this rank's stopped "
           "with them";
  }
  if (code >= kPeerGoneBase) {
    return "rank " + std::to_string(code - kPeerGoneBase) +
           " exited while this rank's GPU collectives could wait for it; they stopped";
  }
  if (code >= kPeerDiffersBase) {
    return "rank " + std::to_string(code - kPeerDiffersBase) +
           " ran a different collective than this rank (its op, dtype, size, shape or place in "
           "the sequence of the group's collectives differs), seen at a GPU barrier";
  }
  return "a GPU barrier timed out waiting for rank " + std::to_string(code - kPeerTimedOutBase) +
         " (did it exit, or run a different collective?)";
}

}  // namespace xdev::transport::gpu_barrier
