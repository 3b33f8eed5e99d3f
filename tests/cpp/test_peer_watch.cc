// Tests of PeerWatch (csrc/transport/peer_watch.h), the host thread that stops a group's GPU
// kernels once a peer is gone. No GPU: find_gone is a counter the test controls, and report
// records what it was told. Waits are bounded by deadlines, so a watch that never reports fails
// instead of hanging the suite.

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "test_harness.h"
#include "transport/gpu_barrier_word.h"
#include "transport/peer_watch.h"

namespace {

using namespace std::chrono_literals;
using xdev::transport::PeerWatch;
namespace gb = xdev::transport::gpu_barrier;

// Polls `done` every millisecond until it holds or `limit` passes.
template <typename Done>
bool within(std::chrono::milliseconds limit, Done done) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(peer_watch_reports_the_first_gone_peer_once) {
  std::atomic<int> asked{0};
  std::atomic<int> reports{0};
  std::atomic<int> reported_rank{-1};
  {
    PeerWatch watch([&] { return ++asked >= 3 ? 2 : -1; },  // rank 2 is gone from the third look on
                    [&](int rank) {
                      reported_rank = rank;
                      ++reports;
                    },
                    5ms);
    CHECK(within(5s, [&] { return watch.reported() == 2; }));
    const int asked_when_reported = asked.load();
    std::this_thread::sleep_for(30ms);  // several periods: it asks no more
    CHECK_EQ(asked.load(), asked_when_reported);
  }
  CHECK_EQ(reports.load(), 1);
  CHECK_EQ(reported_rank.load(), 2);
}

TEST(peer_watch_stops_at_once_when_destroyed) {
  std::atomic<int> asked{0};
  const auto start = std::chrono::steady_clock::now();
  {
    // A period far longer than the test: destruction must not wait it out.
    PeerWatch watch([&] { return ++asked, -1; }, [](int) {}, std::chrono::hours(1));
    CHECK_EQ(watch.reported(), -1);
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK_EQ(asked.load(), 0);
}

TEST(peer_watch_with_no_one_gone_keeps_asking_and_reports_nothing) {
  std::atomic<int> asked{0};
  std::atomic<int> reports{0};
  {
    PeerWatch watch([&] { return ++asked, -1; }, [&](int) { ++reports; }, 2ms);
    CHECK(within(5s, [&] { return asked.load() >= 5; }));
    CHECK_EQ(watch.reported(), -1);
  }
  CHECK_EQ(reports.load(), 0);
}

TEST(peer_watch_that_cannot_look_gives_up_quietly) {
  std::atomic<int> asked{0};
  std::atomic<int> reports{0};
  {
    PeerWatch watch(
        [&]() -> int {
          ++asked;
          throw std::runtime_error("cannot read /proc");
        },
        [&](int) { ++reports; }, 2ms);
    CHECK(within(5s, [&] { return asked.load() == 1; }));
    std::this_thread::sleep_for(20ms);
    CHECK_EQ(asked.load(), 1);
    CHECK_EQ(watch.reported(), -1);
  }
  CHECK_EQ(reports.load(), 0);
}

TEST(peer_gone_code_names_the_peer_apart_from_the_kernels_codes) {
  const std::string gone = gb::describe_error(gb::peer_gone(5));
  CHECK(gone.find("rank 5 exited") != std::string::npos);
  CHECK(gb::peer_gone(4095) > gb::peer_differs(4095));
  CHECK(gb::describe_error(gb::peer_differs(4095)).find("different collective") !=
        std::string::npos);
}

}  // namespace
