// The clock of every wait in the transports, and the bound on how long a wait
// may be asked to last.
#pragma once

#include <chrono>

namespace xdev::transport {

using Clock = std::chrono::steady_clock;

// The longest wait honoured. A longer timeout (a huge timedelta is the usual
// way to say "never") waits this long instead, so that now + timeout cannot
// overflow the clock, here or in the engines the deadline is handed to.
inline constexpr std::chrono::milliseconds kLongestTimeout = std::chrono::hours(24 * 365 * 100);
inline std::chrono::milliseconds bounded_timeout(std::chrono::milliseconds t) {
  return t < kLongestTimeout ? t : kLongestTimeout;
}

}  // namespace xdev::transport
