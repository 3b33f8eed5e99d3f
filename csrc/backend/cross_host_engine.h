// The engine (Gloo) of this rank's cross-host group: the ranks of its local
// index on every host. The two-level collectives share it.
//
// A rank whose group fails (a peer on its host died or timed out) may leave
// its partners on other hosts waiting inside the engine for a message it will
// never send: Gloo sees nothing wrong while this rank's sockets stay open, so
// they would wait out the group's timeout (30 minutes by default), while the
// failed rank's process lives on (catching the error, checkpointing). close()
// lets go of the engine once the group is unusable. Its destructor closes the
// sockets, and the partners' engine calls fail at once.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <stdexcept>
#include <utility>

#include "detached_teardown.h"

namespace xdev::backend {

class CrossHostEngine {
 public:
  explicit CrossHostEngine(c10::intrusive_ptr<c10d::Backend> engine) : engine_(std::move(engine)) {}
  CrossHostEngine(const CrossHostEngine&) = delete;
  CrossHostEngine& operator=(const CrossHostEngine&) = delete;

  // On the op thread, as every use of the engine.
  c10d::Backend& get() const {
    if (!engine_) {
      throw std::runtime_error(
          "xdev: this group's engine across hosts was closed after an earlier failure");
    }
    return *engine_;
  }

  // Lets go of the engine, on a thread of its own: its destructor joins its
  // threads, which may wait on a call still in flight until that call's
  // timeout. Once closed, every use throws. Idempotent. (Without close(),
  // the engine goes with the last holder, on its thread: the group's
  // ordinary destruction.)
  void close() {
    if (!engine_) return;
    run_detached_teardown([engine = std::move(engine_)]() mutable { engine.reset(); });
  }

 private:
  c10::intrusive_ptr<c10d::Backend> engine_;
};

}  // namespace xdev::backend
