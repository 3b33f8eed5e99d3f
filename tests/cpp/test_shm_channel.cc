// Tests of the shared-memory channel (csrc/transport/shm_channel.h), with one thread standing in
// for each rank: every thread holds its own ShmChannel on a segment with a unique name, exactly
// as separate processes would. The barrier and descriptor check are what every CPU executor
// relies on, so the tests pin their contract: nobody passes a barrier before everyone arrived,
// slot-set parities stay in step (double buffering needs no barrier at the end of a window), a
// mismatched collective fails on every rank and leaves the channel usable, and a rank that never
// arrives, or exits, makes the others fail with its name in bounded time.
//
// Threads record what they saw; the checks run on the main thread (the harness is not
// thread-safe). No test waits on a timer to order threads: a rank that "never arrives" simply
// does not call the barrier.

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "test_harness.h"
#include "transport/deadline.h"
#include "transport/shm_channel.h"
#include "transport/shm_segment.h"
#include "transport_test_util.h"

namespace {

using xdev::transport::Clock;
using xdev::transport::MismatchError;
using xdev::transport::OpContext;
using xdev::transport::OpDescriptor;
using xdev::transport::PeerError;
using xdev::transport::process_exited;
using xdev::transport::ShmChannel;
using xdev::transport::ShmSegment;

constexpr size_t kSlotBytes = 64 * 1024;

std::vector<ShmChannel> make_group(int world) {
  return xdev::transport::make_group(world, kSlotBytes);
}

// Runs fn(rank, channel) on one thread per rank. Returns what each rank threw, as
// "MismatchError: ...", "PeerError: ..." or "other: ...", or "" when it returned.
std::vector<std::string> on_ranks(std::vector<ShmChannel>& ranks,
                                  const std::function<void(int, ShmChannel&)>& fn) {
  std::vector<std::string> errors(ranks.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(static_cast<int>(r), ranks[r]);
      } catch (const MismatchError& e) {
        errors[r] = std::string("MismatchError: ") + e.what();
      } catch (const PeerError& e) {
        errors[r] = std::string("PeerError: ") + e.what();
      } catch (const std::exception& e) {
        errors[r] = std::string("other: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

OpContext make_ctx(uint64_t seq, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  OpContext ctx;
  ctx.descriptor.seq = seq;
  ctx.descriptor.collective = 1;
  ctx.descriptor.total_elems = 1000;
  ctx.deadline = Clock::now() + timeout;
  ctx.what = "test op #" + std::to_string(seq);
  ctx.describe = [](const OpDescriptor& d) {
    return "seq " + std::to_string(d.seq) + " elems " + std::to_string(d.total_elems);
  };
  return ctx;
}

// Each window, every rank writes a value unique to (window, rank) into its slot of the window's
// slot set, passes the window's first barrier, and reads every rank's slot. Any rank released
// before all had written, or slot sets out of step, shows up as a stale value. Collectives of
// one to three windows alternate, as staged collectives of several windows do; one rank per
// window fills its whole slot before writing its value, so it is the late one. Barriers spin
// for `spin` before they sleep.
void check_windows_exchange(int world, Clock::duration spin) {
  constexpr int kCollectives = 150;
  auto ranks = make_group(world);
  for (ShmChannel& ch : ranks) ch.set_spin_budget(spin);
  std::vector<std::string> wrong(static_cast<size_t>(world));
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    int64_t window = 0;
    for (int c = 0; c < kCollectives; ++c) {
      const OpContext ctx = make_ctx(static_cast<uint64_t>(c));
      for (int k = 0; k < 1 + c % 3; ++k, ++window) {
        const uint64_t value = static_cast<uint64_t>(window) * 64 + static_cast<uint64_t>(me);
        const auto prepare = [&](int64_t parity) {
          char* slot = ch.slot(parity, me);
          if (window % world == me) std::memset(slot, 0xee, ch.slot_bytes());
          std::memcpy(slot, &value, sizeof value);
        };
        const int64_t parity =
            k == 0 ? ch.open_collective(ctx, prepare) : ch.open_window(ctx, prepare);
        if (parity != window && wrong[static_cast<size_t>(me)].empty()) {
          wrong[static_cast<size_t>(me)] =
              "window " + std::to_string(window) + " got slot set " + std::to_string(parity);
        }
        for (int r = 0; r < world; ++r) {
          uint64_t seen = 0;
          std::memcpy(&seen, ch.slot(parity, r), sizeof seen);
          const uint64_t want = static_cast<uint64_t>(window) * 64 + static_cast<uint64_t>(r);
          if (seen != want && wrong[static_cast<size_t>(me)].empty()) {
            wrong[static_cast<size_t>(me)] = "window " + std::to_string(window) + ": rank " +
                                             std::to_string(r) + "'s slot holds " +
                                             std::to_string(seen) + ", not " + std::to_string(want);
          }
        }
      }
    }
  });
  for (int r = 0; r < world; ++r) {
    CHECK_EQ(errors[static_cast<size_t>(r)], "");
    CHECK_EQ(wrong[static_cast<size_t>(r)], "");
  }
}

// Every way a waiter gets out runs: world 2 spins (and mostly sees the others arrive while it
// spins), world 3 sleeps on the futex at once, world 4 spins too but has more threads than the
// CI machine's two cores, so spins often run out and the ranks sleep after all.
// A timeout past the clock's range (a huge timedelta: "never") waits the longest it can;
// unbounded, now + timeout overflowed into the past and every wait failed at once.
TEST(a_timeout_past_the_clock_is_a_deadline_far_ahead) {
  const auto never = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::hours(24) *
                                                                           200000);  // 200000 days
  const Clock::time_point now = Clock::now();
  const Clock::time_point deadline = now + xdev::transport::bounded_timeout(never);
  CHECK(deadline > now + std::chrono::hours(24 * 365 * 50));
  CHECK(xdev::transport::bounded_timeout(std::chrono::milliseconds(1500)).count() == 1500);
}

TEST(shm_barrier_releases_ranks_only_together_world_2) {
  check_windows_exchange(2, std::chrono::microseconds(20));
}
TEST(shm_barrier_releases_ranks_only_together_world_3) {
  check_windows_exchange(3, Clock::duration(0));
}
TEST(shm_barrier_releases_ranks_only_together_world_4) {
  check_windows_exchange(4, std::chrono::microseconds(20));
}

TEST(shm_barrier_counts_phase_barriers) {
  // Barriers after the first (a schedule's phases) keep ranks in step too: every rank bumps its
  // counter, passes a barrier, and must then see every counter bumped.
  constexpr int kWorld = 3, kRounds = 300;
  auto ranks = make_group(kWorld);
  std::vector<std::vector<int>> counters(kWorld, std::vector<int>(kRounds + 1, 0));
  std::vector<int> stale(kWorld, 0);
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    ch.open_collective(make_ctx(1));
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    for (int i = 1; i <= kRounds; ++i) {
      counters[static_cast<size_t>(me)][static_cast<size_t>(i)] = i;
      ch.barrier(deadline, "phase");
      for (int r = 0; r < kWorld; ++r) {
        if (counters[static_cast<size_t>(r)][static_cast<size_t>(i)] != i) ++stale[me];
      }
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    CHECK_EQ(errors[static_cast<size_t>(r)], "");
    CHECK_EQ(stale[static_cast<size_t>(r)], 0);
    CHECK_EQ(ranks[static_cast<size_t>(r)].barriers_passed(), static_cast<uint64_t>(kRounds + 1));
  }
}

// Every field of the descriptor takes part in the check.
const std::vector<std::function<void(OpDescriptor&)>>& field_changes() {
  static const std::vector<std::function<void(OpDescriptor&)>> changes = {
      [](OpDescriptor& d) { d.collective = 2; },     [](OpDescriptor& d) { d.reduce_op = 3; },
      [](OpDescriptor& d) { d.dtype = 4; },          [](OpDescriptor& d) { d.algorithm = 5; },
      [](OpDescriptor& d) { d.single_copy = 1; },    [](OpDescriptor& d) { d.device = 1; },
      [](OpDescriptor& d) { d.root = 1; },           [](OpDescriptor& d) { d.num_packs = 2; },
      [](OpDescriptor& d) { d.num_tensors = 2; },    [](OpDescriptor& d) { d.total_elems = 999; },
      [](OpDescriptor& d) { d.counts_hash = 77; },   [](OpDescriptor& d) { d.shared_buffer = 0; },
      [](OpDescriptor& d) { d.shared_offset = 64; },
  };
  return changes;
}

TEST(shm_mismatch_fails_on_every_rank_and_channel_stays_usable) {
  constexpr int kWorld = 3;
  auto ranks = make_group(kWorld);
  const auto& changes = field_changes();
  // Op 2i: rank 1 changes field i; op 2i + 1: all agree and exchange data through the slots.
  // outcome[i][r]: rank r's MismatchError message at op 2i, or "passed".
  std::vector<std::vector<std::string>> outcome(changes.size(), std::vector<std::string>(kWorld));
  std::vector<std::string> later(kWorld);
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    for (size_t i = 0; i < changes.size(); ++i) {
      OpContext bad = make_ctx(2 * i);
      if (me == 1) changes[i](bad.descriptor);
      try {
        ch.open_collective(bad);
        outcome[i][static_cast<size_t>(me)] = "passed";
      } catch (const MismatchError& e) {
        outcome[i][static_cast<size_t>(me)] = e.what();
      }
      const OpContext good = make_ctx(2 * i + 1);
      const uint64_t value = 1000 * i + static_cast<uint64_t>(me);
      const int64_t parity = ch.open_collective(
          good, [&](int64_t p) { std::memcpy(ch.slot(p, me), &value, sizeof value); });
      for (int r = 0; r < kWorld; ++r) {
        uint64_t seen = 0;
        std::memcpy(&seen, ch.slot(parity, r), sizeof seen);
        if (seen != 1000 * i + static_cast<uint64_t>(r) && later[static_cast<size_t>(me)].empty()) {
          later[static_cast<size_t>(me)] = "after mismatch " + std::to_string(i) + ": rank " +
                                           std::to_string(r) + "'s slot holds " +
                                           std::to_string(seen);
        }
      }
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    CHECK_EQ(errors[static_cast<size_t>(r)], "");
    CHECK_EQ(later[static_cast<size_t>(r)], "");
  }
  for (size_t i = 0; i < changes.size(); ++i) {
    // Every rank fails, with the same message, listing every rank's descriptor.
    const std::string& msg = outcome[i][0];
    CHECK(contains(msg, "mismatched collectives at test op #" + std::to_string(2 * i) + ":"));
    for (int r = 0; r < kWorld; ++r) {
      CHECK(contains(msg, "rank " + std::to_string(r) + ": seq " + std::to_string(2 * i)));
      CHECK_EQ(outcome[i][static_cast<size_t>(r)], msg);
    }
    CHECK(contains(msg, "The group is still usable."));
  }
  // Each descriptor is rendered by describe: the total that differs shows on rank 1's line.
  CHECK(contains(outcome[9][0], "rank 1: seq 18 elems 999\n  rank 2: seq 18 elems 1000"));
}

TEST(shm_barrier_times_out_naming_the_ranks_that_never_arrive) {
  // Ranks 1 and 3 of four never call the barrier: the others wait until a deadline, no less
  // (the first to reach its own fails the barrier for both), then fail naming exactly those two.
  constexpr int kWorld = 4;
  const auto timeout = std::chrono::milliseconds(200);
  auto ranks = make_group(kWorld);
  std::vector<double> waited_ms(kWorld, 0);
  std::vector<Clock::time_point> deadlines(kWorld);
  std::vector<Clock::time_point> woke(kWorld);
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    if (me == 1 || me == 3) return;
    const OpContext ctx = make_ctx(5, timeout);
    deadlines[static_cast<size_t>(me)] = ctx.deadline;
    const auto start = Clock::now();
    try {
      ch.open_collective(ctx);
    } catch (...) {
      woke[static_cast<size_t>(me)] = Clock::now();
      waited_ms[me] = std::chrono::duration<double, std::milli>(woke[me] - start).count();
      throw;
    }
  });
  const Clock::time_point first_deadline = std::min(deadlines[0], deadlines[2]);
  for (int r : {0, 2}) {
    const std::string& e = errors[static_cast<size_t>(r)];
    CHECK(contains(e, "PeerError: xdev: timed out in test op #5 waiting for rank(s) 1, 3 of"));
    CHECK(woke[static_cast<size_t>(r)] >= first_deadline);
    CHECK(waited_ms[r] < 3000.0);
  }
  CHECK_EQ(errors[1], "");
  CHECK_EQ(errors[3], "");
}

TEST(shm_barrier_a_rank_arriving_after_its_peers_gave_up_fails_too) {
  // Ranks 0 and 1 time out at the barrier and leave their arrivals behind; rank 2 arrives
  // afterwards and sees every arrival. The barrier settled as failed, so it must fail there
  // too, naming the rank that settled it, instead of passing a barrier its peers failed.
  constexpr int kWorld = 3;
  auto ranks = make_group(kWorld);
  std::atomic<int> gave_up{0};
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    if (me == 2) {
      while (gave_up.load() < 2) std::this_thread::yield();
      ch.barrier(Clock::now() + std::chrono::seconds(20), "allreduce (op #7)");
      return;
    }
    try {
      ch.barrier(Clock::now() + std::chrono::milliseconds(100), "allreduce (op #7)");
    } catch (...) {
      gave_up.fetch_add(1);
      throw;
    }
  });
  CHECK(contains(errors[0], "PeerError: xdev: timed out in allreduce (op #7)"));
  CHECK(contains(errors[1], "PeerError: xdev: timed out in allreduce (op #7)"));
  CHECK(contains(errors[2], "timed out in allreduce (op #7) before this rank arrived"));
  CHECK(contains(errors[2], "PeerError: xdev: rank 0 timed out") ||
        contains(errors[2], "PeerError: xdev: rank 1 timed out"));
}

TEST(shm_channel_over_part_of_a_group_names_the_group_ranks) {
  // One host's channel of a two-level group: channel ranks 0..2 are group ranks 4, 6 and 9.
  // A timeout and a mismatch must name those, the ranks the user knows.
  auto ranks = make_group(3);
  for (ShmChannel& ch : ranks) ch.name_ranks({4, 6, 9});
  CHECK_EQ(ranks[1].group_rank(1), 6);
  CHECK_EQ(ranks[1].rank_name(2), std::string("rank 9"));
  const auto timeouts = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    if (me != 2) ch.open_collective(make_ctx(7, std::chrono::milliseconds(100)));
  });
  CHECK(contains(timeouts[0], "waiting for rank(s) 9 of"));
  auto fresh = make_group(3);
  for (ShmChannel& ch : fresh) ch.name_ranks({4, 6, 9});
  const auto mismatches = on_ranks(fresh, [&](int me, ShmChannel& ch) {
    OpContext ctx = make_ctx(0);
    ctx.descriptor.total_elems = me == 1 ? 5 : 1000;
    ch.open_collective(ctx);
  });
  for (const std::string& e : mismatches) {
    CHECK(contains(e, "rank 4: seq 0 elems 1000\n  rank 6: seq 0 elems 5\n  rank 9: seq 0"));
  }
}

// A real process as rank 1 of the 2-rank channel `name`: it attaches and exits (status 0, or
// 2 if it could not attach) without ever reaching a barrier. Returns its pid.
pid_t fork_peer_that_attaches_and_exits(const std::string& name) {
  const pid_t child = ::fork();
  if (child == 0) {
    try {
      ShmChannel peer = ShmChannel::attach(name, 2, 1, 4096);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  return child;
}

TEST(shm_barrier_fails_soon_when_a_peer_process_exits) {
  // A real process as rank 1: it attaches and exits without ever reaching the barrier. Rank 0
  // must notice the exit (not wait out its 20 s deadline) and name the rank and its pid.
  const std::string name = ShmSegment::make_name();
  ShmChannel me = ShmChannel::create(name, 2, 0, 4096);
  const pid_t child = fork_peer_that_attaches_and_exits(name);
  CHECK(child > 0);
  if (child <= 0) return;
  int status = 0;
  ::waitpid(child, &status, 0);  // reaped: its pid no longer exists
  me.unlink_name();
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const auto start = Clock::now();
  CHECK_THROWS(me.barrier(start + std::chrono::seconds(20), "allreduce (op #3)"), PeerError,
               "xdev: rank 1 (pid " + std::to_string(child) + ") exited during allreduce (op #3)");
  CHECK(Clock::now() - start < std::chrono::seconds(5));
}

TEST(shm_barrier_sees_an_exited_peer_that_is_not_yet_reaped) {
  // The same, but rank 1's parent has not reaped it yet (a launcher joining its ranks in
  // order): a zombie, which kill(pid, 0) still finds. Rank 0 must still fail within seconds.
  const std::string name = ShmSegment::make_name();
  ShmChannel me = ShmChannel::create(name, 2, 0, 4096);
  const pid_t child = fork_peer_that_attaches_and_exits(name);
  CHECK(child > 0);
  if (child <= 0) return;
  siginfo_t info{};
  ::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT);  // exited, not reaped
  me.unlink_name();
  CHECK(!process_exited(::getpid()));
  CHECK(process_exited(child));
  const auto start = Clock::now();
  CHECK_THROWS(me.barrier(start + std::chrono::seconds(20), "allreduce (op #4)"), PeerError,
               "xdev: rank 1 (pid " + std::to_string(child) + ") exited during allreduce (op #4)");
  CHECK(Clock::now() - start < std::chrono::seconds(5));
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(process_exited(child));
}

TEST(shm_barrier_fails_soon_when_a_peer_leaves_the_group) {
  // Rank 1 closes its side (destroy_process_group) instead of reaching the barrier: rank 0 must
  // fail within about one liveness check, not at its 20 s deadline, and say the rank left.
  auto ranks = make_group(2);
  const auto start = Clock::now();
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    if (me == 1) {
      ch.mark_left();
      return;
    }
    ch.barrier(Clock::now() + std::chrono::seconds(20), "allreduce (op #4)");
  });
  CHECK(contains(errors[0], "rank 1 (pid "));
  CHECK(contains(errors[0], "has left the group"));
  CHECK(contains(errors[0], "during allreduce (op #4)"));
  CHECK_EQ(errors[1], "");
  CHECK(Clock::now() - start < std::chrono::seconds(5));
}

TEST(shm_barrier_quotes_the_error_a_peer_left_with) {
  // Rank 1's group failed elsewhere (on another host, say): rank 0 learns its error, cut to
  // the room the control block has, and later calls of mark_left change nothing.
  auto ranks = make_group(2);
  const std::string long_error = "xdev: rank 3 exited " + std::string(1000, 'x');
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    if (me == 1) {
      ch.mark_left(long_error);
      ch.mark_left();
      return;
    }
    ch.barrier(Clock::now() + std::chrono::seconds(20), "allreduce (op #4)");
  });
  CHECK(contains(errors[0], "rank 1 (pid "));
  CHECK(contains(errors[0], " failed during allreduce (op #4); its error: xdev: rank 3 exited x"));
  CHECK(!contains(errors[0], "has left the group"));
  // Cut to 511 bytes, marked: "xdev: rank 3 exited " and 488 x's, then "...".
  CHECK(contains(errors[0], std::string(488, 'x') + "..."));
  CHECK(!contains(errors[0], std::string(489, 'x')));
  CHECK_EQ(errors[1], "");
}

TEST(shm_barrier_cuts_a_quoted_error_between_utf8_characters) {
  // Gloo's messages end in an emoji: a cut inside it made Python refuse the whole message.
  auto ranks = make_group(2);
  const std::string emoji = "\xF0\x9F\x8F\x96";  // 4 bytes, from byte 507 to 510
  const auto errors = on_ranks(ranks, [&](int me, ShmChannel& ch) {
    if (me == 1) {
      ch.mark_left(std::string(507, 'a') + emoji + " GLHF");
      return;
    }
    ch.barrier(Clock::now() + std::chrono::seconds(20), "allreduce (op #1)");
  });
  CHECK(contains(errors[0], "its error: " + std::string(507, 'a') + "..."));
  CHECK(!contains(errors[0], "\xF0"));
}

}  // namespace
