// Tests of the word ranks announce at the GPU barrier (csrc/transport/gpu_barrier_word.h) and of
// the descriptor hash it carries (call_hash in shm_channel.h). The kernel's barrier cannot run
// without a GPU, so its block-0 loop is played here by threads standing in for ranks, each with
// an inbox of atomic words, storing and judging exactly as the kernel does: ranks that run the
// same calls pass every barrier (also across the 40-bit epoch's wrap), and where one rank's call
// differs, every rank stops at that call's first barrier, none passes it, and each names a peer
// whose call differs from its own.
//
// Threads record what they saw; the checks run on the main thread (the harness is not
// thread-safe). A wait that outlives its deadline is recorded, so a protocol that deadlocks fails
// instead of hanging the suite.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "test_harness.h"
#include "transport/gpu_barrier_word.h"
#include "transport/shm_channel.h"

namespace {

namespace gb = xdev::transport::gpu_barrier;
using xdev::transport::call_hash;
using xdev::transport::OpDescriptor;

TEST(gpu_barrier_word_carries_epoch_and_hash) {
  const uint64_t word = gb::announce(7, 0xabcdefu);
  CHECK(gb::judge(word, 7, 0xabcdefu) == gb::Peer::kAgrees);
  CHECK(gb::judge(word, 7, 0xabcdeeu) == gb::Peer::kDiffers);
  CHECK(gb::judge(word, 8, 0xabcdefu) == gb::Peer::kNotYet);  // the peer is behind
  CHECK(gb::judge(word, 6, 0x123456u) == gb::Peer::kAgrees);  // ahead: it passed 6 with us
  // Only 24 bits of the hash travel: hashes equal in those bits agree.
  CHECK(gb::judge(word, 7, 0xffabcdefu) == gb::Peer::kAgrees);
  // An inbox nobody has written yet (zero) is behind the first barrier, epoch 1.
  CHECK(gb::judge(0, 1, 0) == gb::Peer::kNotYet);
  CHECK(gb::judge(0, 1, 0xffffffu) == gb::Peer::kNotYet);
}

TEST(gpu_barrier_epochs_compare_across_the_wrap) {
  const uint64_t wrap = uint64_t{1} << gb::kEpochBits;
  // The host's epochs run on past 2^40; the word keeps their low 40 bits.
  CHECK(gb::judge(gb::announce(wrap, 5), wrap, 5) == gb::Peer::kAgrees);
  CHECK(gb::judge(gb::announce(wrap - 1, 5), wrap, 5) == gb::Peer::kNotYet);
  CHECK(gb::judge(gb::announce(wrap, 9), wrap - 1, 5) == gb::Peer::kAgrees);
  CHECK(gb::judge(gb::announce(wrap + 3, 9), wrap + 3, 5) == gb::Peer::kDiffers);
  CHECK(gb::judge(gb::announce(3 * wrap + 1, 5), 3 * wrap, 5) == gb::Peer::kAgrees);
}

TEST(gpu_barrier_error_codes_name_the_cause) {
  CHECK_EQ(gb::describe_error(0), std::string());
  CHECK(gb::describe_error(gb::kOwnBlocksTimedOut).find("own thread blocks") != std::string::npos);
  CHECK(gb::describe_error(gb::peer_timed_out(3)).find("waiting for rank 3") != std::string::npos);
  const std::string differs = gb::describe_error(gb::peer_differs(15));
  CHECK(differs.find("rank 15 ran a different collective") != std::string::npos);
  CHECK(gb::describe_error(gb::peer_gone(2)).find("rank 2 exited") != std::string::npos);
  CHECK(gb::describe_error(gb::kLaunchFailed).find("failed to launch") != std::string::npos);
}

// One rank's block 0 at the barriers of a run of calls, as the kernel plays it.
struct Outcome {
  uint64_t stopped_at = 0;  // the epoch where it stopped; 0: passed every barrier
  unsigned int code = 0;    // what its error word would hold
  bool timed_out = false;
  int differing_peer() const {
    const bool differs = code >= gb::kPeerDiffersBase && code < gb::kPeerGoneBase;
    return differs ? static_cast<int>(code - gb::kPeerDiffersBase) : -1;
  }
};

class SimulatedRanks {
 public:
  // Every inbox holds what the barrier before first_epoch left there.
  SimulatedRanks(int world, uint64_t first_epoch)
      : world_(world), inbox_(new std::atomic<uint64_t>[world * world]) {
    for (int i = 0; i < world * world; ++i) inbox_[i].store(gb::announce(first_epoch - 1, 0));
  }

  // hashes[k]: the call hash rank announces at epoch first_epoch + k. At
  // epoch stop_at (0: never) the rank stops with stop_code right after
  // announcing it, as a rank whose wait there timed out.
  Outcome run(int rank, uint64_t first_epoch, const std::vector<uint32_t>& hashes,
              uint64_t stop_at = 0, unsigned int stop_code = 0) {
    Outcome out;
    const auto stop = [&](uint64_t epoch, unsigned int code) {
      out.stopped_at = epoch;
      out.code = code;
      if (!gb::tells_peers(code)) return;
      for (int r = 0; r < world_; ++r) {
        if (r != rank) word(r, rank).store(gb::stop_word(code), std::memory_order_release);
      }
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (size_t k = 0; k < hashes.size(); ++k) {
      const uint64_t epoch = first_epoch + k;
      const uint64_t mine = gb::announce(epoch, hashes[k]);
      for (int r = 0; r < world_; ++r) word(r, rank).store(mine, std::memory_order_release);
      if (epoch == stop_at) {
        stop(epoch, stop_code);
        return out;
      }
      for (int r = 0; r < world_; ++r) {
        gb::Peer peer = gb::Peer::kNotYet;
        uint64_t seen = 0;
        // Backs off to short sleeps: the ranks outnumber this machine's cores.
        for (int tries = 0;; ++tries) {
          seen = word(rank, r).load(std::memory_order_acquire);
          if ((peer = gb::judge(seen, epoch, hashes[k])) != gb::Peer::kNotYet) break;
          if (std::chrono::steady_clock::now() > deadline) {
            out.timed_out = true;
            return out;
          }
          if (tries < 16) {
            std::this_thread::yield();
          } else {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
          }
        }
        if (peer == gb::Peer::kDiffers) {
          stop(epoch, gb::peer_differs(r));
          return out;
        }
        if (peer == gb::Peer::kStopped) {
          stop(epoch, gb::adopt(seen, rank, r));
          return out;
        }
      }
    }
    return out;
  }

 private:
  // Rank `from`'s word in rank `owner`'s inbox.
  std::atomic<uint64_t>& word(int owner, int from) { return inbox_[owner * world_ + from]; }

  int world_;
  std::unique_ptr<std::atomic<uint64_t>[]> inbox_;
};

// Every rank's outcome for calls of `phases` barriers each; calls[r][c] is rank r's hash for call
// c.
// rank `stopper` (-1: none) stops at epoch stop_at with stop_code (SimulatedRanks::run).
std::vector<Outcome> play(const std::vector<std::vector<uint32_t>>& calls, int phases,
                          uint64_t first_epoch, int stopper = -1, uint64_t stop_at = 0,
                          unsigned int stop_code = 0) {
  const int world = static_cast<int>(calls.size());
  SimulatedRanks ranks(world, first_epoch);
  std::vector<Outcome> outcomes(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    std::vector<uint32_t> hashes;
    for (uint32_t h : calls[static_cast<size_t>(r)]) hashes.insert(hashes.end(), phases, h);
    threads.emplace_back([&, r, hashes] {
      outcomes[static_cast<size_t>(r)] = r == stopper
                                             ? ranks.run(r, first_epoch, hashes, stop_at, stop_code)
                                             : ranks.run(r, first_epoch, hashes);
    });
  }
  for (std::thread& t : threads) t.join();
  return outcomes;
}

std::vector<std::vector<uint32_t>> same_calls(int world, int num_calls) {
  std::vector<uint32_t> calls;
  for (int c = 0; c < num_calls; ++c) calls.push_back(0x9e3779u * static_cast<uint32_t>(c + 1));
  return std::vector<std::vector<uint32_t>>(static_cast<size_t>(world), calls);
}

TEST(gpu_barrier_ranks_running_the_same_calls_pass_every_barrier) {
  const uint64_t wrap = uint64_t{1} << gb::kEpochBits;
  for (const uint64_t first : {uint64_t{1}, wrap - 20}) {  // from the start, and across the wrap
    for (int world : {2, 3, 4}) {
      for (const Outcome& o : play(same_calls(world, 20), 2, first)) {
        CHECK(!o.timed_out);
        CHECK_EQ(o.stopped_at, uint64_t{0});
      }
    }
  }
}

TEST(gpu_barrier_a_differing_call_stops_every_rank_at_its_first_barrier) {
  constexpr int kPhases = 2, kCalls = 8, kDiffering = 5;
  const uint64_t wrap = uint64_t{1} << gb::kEpochBits;
  for (const uint64_t first : {uint64_t{1}, wrap - 7}) {  // the differing call past the wrap
    const uint64_t first_barrier = first + uint64_t{kDiffering} * kPhases;
    for (int world : {2, 3, 4}) {
      for (int odd : {0, world - 1}) {
        for (int round = 0; round < 3; ++round) {  // several interleavings
          auto calls = same_calls(world, kCalls);
          calls[static_cast<size_t>(odd)][kDiffering] ^= 0x5a5a5au;
          const std::vector<Outcome> outcomes = play(calls, kPhases, first);
          for (int r = 0; r < world; ++r) {
            const Outcome& o = outcomes[static_cast<size_t>(r)];
            CHECK(!o.timed_out);
            CHECK_EQ(o.stopped_at, first_barrier);
            // The odd rank finds any peer differing; every other rank finds the odd one.
            CHECK(r == odd ? o.differing_peer() >= 0 && o.differing_peer() != odd
                           : o.differing_peer() == odd);
          }
        }
      }
    }
  }
}

TEST(gpu_barrier_two_camps_of_calls_stop_every_rank) {
  // Ranks 0-1 run one call, ranks 2-3 another: every rank sees the other camp.
  auto calls = same_calls(4, 5);
  calls[2][3] = calls[3][3] = 0x111111u;
  const std::vector<Outcome> outcomes = play(calls, 2, 1);
  for (int r = 0; r < 4; ++r) {
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    CHECK(!o.timed_out);
    CHECK_EQ(o.stopped_at, uint64_t{1 + 3 * 2});
    CHECK_EQ(o.differing_peer() / 2, 1 - r / 2);
  }
}

TEST(gpu_barrier_a_stopped_rank_stops_its_peers_at_once) {
  // Rank 0 gives up at a barrier it has announced (its wait for the last rank timed out); the
  // others, running on, must not pass the barrier after it and wait out their own timeouts.
  const uint64_t wrap = uint64_t{1} << gb::kEpochBits;
  for (const uint64_t first : {uint64_t{1}, wrap - 3}) {
    for (int world : {2, 3, 4}) {
      const int last = world - 1;
      for (int round = 0; round < 3; ++round) {
        const uint64_t stop_at = first + 5;
        const std::vector<Outcome> outcomes =
            play(same_calls(world, 6), 2, first, 0, stop_at, gb::peer_timed_out(last));
        CHECK_EQ(outcomes[0].code, gb::peer_timed_out(last));
        for (int r = 1; r < world; ++r) {
          const Outcome& o = outcomes[static_cast<size_t>(r)];
          CHECK(!o.timed_out);
          // Rank 0 announced stop_at, so every rank had announced the barrier before; one
          // that was still judging it stops there.
          CHECK(o.stopped_at + 1 >= stop_at && o.stopped_at <= stop_at + 1);
          // Another rank's stop, but never one that names this rank as the cause.
          const bool stopped_by_peer =
              o.code >= gb::kPeerStoppedBase && o.code - gb::kPeerStoppedBase != unsigned(r);
          CHECK(r == last ? stopped_by_peer
                          : stopped_by_peer || o.code == gb::peer_timed_out(last));
          CHECK(!gb::describe_error(o.code).empty());
        }
      }
    }
  }
}

TEST(gpu_barrier_stop_words_and_the_causes_peers_adopt) {
  // No call's hash reads as a stop word: the reserved value folds onto its neighbour.
  CHECK_EQ(gb::hash_bits(gb::kStopHash), gb::kStopHash - 1);
  CHECK(!gb::is_stop_word(gb::announce(gb::kEpochMask, gb::kStopHash)));
  CHECK(gb::judge(gb::announce(7, gb::kStopHash), 7, gb::kStopHash) == gb::Peer::kAgrees);
  // A stop word stops a rank at whatever barrier it waits.
  for (uint64_t epoch : {uint64_t{1}, uint64_t{123456}, gb::kEpochMask}) {
    CHECK(gb::judge(gb::stop_word(gb::kOwnBlocksTimedOut), epoch, 5) == gb::Peer::kStopped);
    CHECK(gb::judge(gb::stop_word(0), epoch, 5) == gb::Peer::kStopped);
  }
  CHECK(gb::judge(0, 1, 5) == gb::Peer::kNotYet);  // an inbox no barrier has reached
  // Rank 1 adopts from rank 3: causes that read the same from rank 1 stay, others become
  // "rank 3 stopped".
  const auto adopt = [](unsigned int code) { return gb::adopt(gb::stop_word(code), 1, 3); };
  CHECK_EQ(adopt(gb::peer_timed_out(2)), gb::peer_timed_out(2));
  CHECK_EQ(adopt(gb::peer_timed_out(1)), gb::peer_stopped(3));  // it waited for this rank
  CHECK_EQ(adopt(gb::peer_gone(0)), gb::peer_gone(0));
  CHECK_EQ(adopt(gb::peer_stopped(0)), gb::peer_stopped(0));
  CHECK_EQ(adopt(gb::peer_stopped(1)), gb::peer_stopped(3));
  CHECK_EQ(adopt(gb::kOwnBlocksTimedOut), gb::peer_stopped(3));
  CHECK_EQ(adopt(gb::kLaunchFailed), gb::peer_stopped(3));
  CHECK_EQ(adopt(0), gb::peer_stopped(3));
  CHECK(gb::describe_error(gb::peer_stopped(3)).find("rank 3 stopped") != std::string::npos);
  // A rank stopped by a differing call says nothing: each finds the call itself.
  CHECK(!gb::tells_peers(gb::peer_differs(2)));
  CHECK(gb::tells_peers(gb::peer_timed_out(2)) && gb::tells_peers(gb::peer_gone(2)));
  CHECK(gb::tells_peers(gb::kLaunchFailed) && gb::tells_peers(gb::peer_stopped(2)));
  // The stop word skips an exited rank's inbox (memory its process no longer holds).
  CHECK(gb::gone_rank(gb::peer_gone(2)) == 2 && gb::gone_rank(gb::peer_gone(0)) == 0);
  CHECK(gb::gone_rank(gb::peer_timed_out(2)) == -1 && gb::gone_rank(gb::kLaunchFailed) == -1);
  CHECK(gb::gone_rank(gb::peer_stopped(2)) == -1 && gb::gone_rank(0) == -1);
}

TEST(call_hash_covers_exactly_the_compared_fields) {
  OpDescriptor a;
  a.seq = 12;
  a.collective = 1;
  a.reduce_op = 2;
  a.dtype = 3;
  a.total_elems = 1000;
  a.counts_hash = 0xfeedu;
  CHECK_EQ(call_hash(a), call_hash(a));
  // Where each rank's tensor lies in its heap is not compared (ranks may differ), nor hashed.
  OpDescriptor placed = a;
  placed.heap_arena = 2;
  placed.heap_offset = 4096;
  CHECK(placed == a);
  CHECK_EQ(call_hash(placed), call_hash(a));
  // Every compared field changes the hash (as the GPU barrier sees it: 24 bits).
  const auto differs = [&a](void (*change)(OpDescriptor&)) {
    OpDescriptor b = a;
    change(b);
    return !(b == a) && ((call_hash(b) ^ call_hash(a)) & gb::kHashMask) != 0;
  };
  CHECK(differs([](OpDescriptor& d) { d.seq += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.collective += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.reduce_op += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.dtype += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.algorithm += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.single_copy += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.device += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.root += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.num_packs += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.num_tensors += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.total_elems += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.counts_hash += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.shared_buffer += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.shared_offset += 1; }));
}

}  // namespace
