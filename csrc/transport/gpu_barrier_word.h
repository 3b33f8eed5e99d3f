// What a rank announces at each GPU barrier of xdev's collective kernels
// (cuda_executor.cu): one 64-bit word, stored into every peer's inbox, that
// holds the barrier's epoch (its low 40 bits) and a 24-bit hash of the call the
// rank runs (call_hash in shm_channel.h). A rank waiting at a barrier compares
// each peer's hash with its own, so ranks that run different collectives stop
// at the call's first barrier, before any of them reads a peer's data, and
// report which peer differed instead of reading wrong bytes or waiting out
// the timeout.
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

XDEV_HOST_DEVICE constexpr uint64_t announce(uint64_t epoch, uint32_t call_hash) {
  return (epoch & kEpochMask) | (static_cast<uint64_t>(call_hash & kHashMask) << kEpochBits);
}

enum class Peer { kNotYet, kAgrees, kDiffers };

// What a peer's word tells a rank waiting at `epoch` of the call hashed
// call_hash. A peer is at most one barrier ahead (it passes a barrier only
// once this rank has announced it), so epochs compare modulo 2^40 by the sign
// of their difference: a 40-bit epoch wraps after days of barriers at the
// GPU's fastest pace, and the host's 64-bit count never does. A word ahead of
// `epoch` agrees: its rank passed this barrier, which it does only after
// judging this rank's word the same call.
XDEV_HOST_DEVICE constexpr Peer judge(uint64_t word, uint64_t epoch, uint32_t call_hash) {
  const uint64_t ahead = ((word & kEpochMask) - epoch) & kEpochMask;
  if ((ahead >> (kEpochBits - 1)) != 0) return Peer::kNotYet;  // negative: still behind
  if (ahead != 0) return Peer::kAgrees;
  return (word >> kEpochBits) == (call_hash & kHashMask) ? Peer::kAgrees : Peer::kDiffers;
}

// The codes a kernel that gives up leaves in the executor's error word (the
// first one wins; 0: none). The host leaves one of its own there, kPeerGone,
// when it sees a peer's process exit while kernels may wait for it
// (PeerWatch), and kLaunchFailed: kernels poll the word as they wait and stop.
constexpr unsigned int kOwnBlocksTimedOut = 1;
constexpr unsigned int kPeerTimedOutBase = 2;        // + the peer's rank
constexpr unsigned int kPeerDiffersBase = 1u << 16;  // + the peer's rank
constexpr unsigned int kPeerGoneBase = 1u << 17;     // + the peer's rank
// The host's too: one of this rank's kernels failed to launch, after the
// windows before it had spent their barriers.
constexpr unsigned int kLaunchFailed = 1u << 18;
static_assert(kPeerTimedOutBase + 4096 < kPeerDiffersBase, "codes overlap");
static_assert(kPeerDiffersBase + 4096 < kPeerGoneBase, "codes overlap");
static_assert(kPeerGoneBase + 4096 < kLaunchFailed, "codes overlap");

XDEV_HOST_DEVICE constexpr unsigned int peer_timed_out(int rank) {
  return kPeerTimedOutBase + static_cast<unsigned int>(rank);
}
XDEV_HOST_DEVICE constexpr unsigned int peer_differs(int rank) {
  return kPeerDiffersBase + static_cast<unsigned int>(rank);
}
constexpr unsigned int peer_gone(int rank) {
  return kPeerGoneBase + static_cast<unsigned int>(rank);
}

// The error word in words ("" for 0).
inline std::string describe_error(unsigned int code) {
  if (code == 0) return {};
  if (code == kOwnBlocksTimedOut) {
    return "a GPU barrier timed out waiting for this rank's own thread blocks";
  }
  if (code == kLaunchFailed) {
    return "one of this rank's collective kernels failed to launch; its peers wait for it at a "
           "GPU barrier until their timeout";
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
