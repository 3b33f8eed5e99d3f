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
  uint64_t stopped_at = 0;  // the epoch where a peer differed; 0: passed every barrier
  int differing_peer = -1;
  bool timed_out = false;
};

class SimulatedRanks {
 public:
  // Every inbox holds what the barrier before first_epoch left there.
  SimulatedRanks(int world, uint64_t first_epoch)
      : world_(world), inbox_(new std::atomic<uint64_t>[world * world]) {
    for (int i = 0; i < world * world; ++i) inbox_[i].store(gb::announce(first_epoch - 1, 0));
  }

  // hashes[k]: the call hash rank announces at epoch first_epoch + k.
  Outcome run(int rank, uint64_t first_epoch, const std::vector<uint32_t>& hashes) {
    Outcome out;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (size_t k = 0; k < hashes.size(); ++k) {
      const uint64_t epoch = first_epoch + k;
      const uint64_t mine = gb::announce(epoch, hashes[k]);
      for (int r = 0; r < world_; ++r) word(r, rank).store(mine, std::memory_order_release);
      for (int r = 0; r < world_; ++r) {
        gb::Peer peer = gb::Peer::kNotYet;
        // Backs off to short sleeps: the ranks outnumber this machine's cores.
        for (int tries = 0; (peer = gb::judge(word(rank, r).load(std::memory_order_acquire), epoch,
                                              hashes[k])) == gb::Peer::kNotYet;
             ++tries) {
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
          out.stopped_at = epoch;
          out.differing_peer = r;
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
std::vector<Outcome> play(const std::vector<std::vector<uint32_t>>& calls, int phases,
                          uint64_t first_epoch) {
  const int world = static_cast<int>(calls.size());
  SimulatedRanks ranks(world, first_epoch);
  std::vector<Outcome> outcomes(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    std::vector<uint32_t> hashes;
    for (uint32_t h : calls[static_cast<size_t>(r)]) hashes.insert(hashes.end(), phases, h);
    threads.emplace_back([&ranks, &outcomes, r, first_epoch, hashes] {
      outcomes[static_cast<size_t>(r)] = ranks.run(r, first_epoch, hashes);
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
            CHECK(r == odd ? o.differing_peer != odd : o.differing_peer == odd);
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
    CHECK_EQ(o.differing_peer / 2, 1 - r / 2);
  }
}

TEST(call_hash_covers_exactly_the_compared_fields) {
  OpDescriptor a;
  a.seq = 12;
  a.collective = 1;
  a.reduce_op = 2;
  a.dtype = 3;
  a.total_elems = 1000;
  a.shape_hash = 0xfeedu;
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
  CHECK(differs([](OpDescriptor& d) { d.shape_hash += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.shared_buffer += 1; }));
  CHECK(differs([](OpDescriptor& d) { d.shared_offset += 1; }));
}

}  // namespace
