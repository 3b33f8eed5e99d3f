// A POSIX shared-memory segment shared by the ranks of one host.
//
// Lifecycle. The creator makes the segment with O_CREAT | O_EXCL and mode 0600
// under an unguessable name (128 random bits), sizes and pre-allocates it, and
// publishes the name (the backend does that through the c10d Store). Peers open
// and map it. Once every rank has mapped it, the creator unlinks the name: from
// then on the memory lives exactly as long as some rank maps it, so a normal
// exit, a crash or a kill -9 cannot leak it. The only window for a leak is a
// creator that dies between create and unlink; names carry the creator's pid
// and pid namespace so the next creator on the machine removes such orphans
// (and leaves alone those of processes it cannot see: containers sharing
// /dev/shm but not their pids).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace xdev::transport {

// Whether process `pid` of this pid namespace has exited: it no longer
// exists, or it is a zombie its parent has not reaped yet (kill(pid, 0) alone
// still succeeds on one, and a launcher that joins its ranks in order reaps a
// dead rank only after the live ones it waits for first).
bool process_exited(pid_t pid);

// The inode of this process's pid namespace (/proc/self/ns/pid), or 0 when it
// cannot be read. A pid means the same process only within one namespace.
uint64_t pid_namespace();

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // "/xdev-<pid>-<pid namespace>-<32 hex digits from the kernel's CSPRNG>".
  static std::string make_name();

  static ShmSegment create(const std::string& name, size_t bytes);
  static ShmSegment open(const std::string& name, size_t bytes);

  // Removes the name; the mapping stays valid. Idempotent.
  void unlink();

  // Unlinks /dev/shm/xdev-* segments of this user whose creator, in this pid
  // namespace, is gone. Returns how many were removed.
  static int remove_orphans();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void reset();

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_linked_ = false;  // this process created the name and has not unlinked it
};

// Fills `out` with `bytes` random bytes from the kernel (getrandom); throws
// std::runtime_error where it has none to give (e.g. a seccomp filter refuses the call).
void fill_random(void* out, size_t bytes);

}  // namespace xdev::transport
