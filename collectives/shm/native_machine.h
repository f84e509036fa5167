// What the machine and the peers' processes are doing: collectives/machine.py and wait.py's
// readings in C++. Whether a peer's process runs, how many threads want a core against the cores
// the ranks may use (/proc/loadavg), and how long a peer has waited for a core (schedstat).

#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace shm_native {

// Whether a process runs: it exists and is neither a zombie nor dead (machine.py's alive; a
// stat that cannot be read for another reason counts as running).
inline bool process_alive(int pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return !(errno == ENOENT || errno == ESRCH);
  }
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) {
    return true;
  }
  buf[n] = 0;
  const char* close_paren = nullptr;
  for (const char* p = buf; *p; ++p) {
    if (*p == ')') close_paren = p;
  }
  if (!close_paren) {
    return true;
  }
  const char* s = close_paren + 1;
  while (*s == ' ') ++s;
  return !(*s == 'Z' || *s == 'X');
}

// Threads running or waiting for a core, against the cores the group's ranks may run on (the
// union of their affinities, fewer than the cores online where the ranks are pinned): whether a
// spinning waiter would take a core some runnable thread needs. Read from /proc/loadavg
// ("0.52 0.58 0.59 3/612 ...").
// The count is the machine's: on a machine whose other cores run other work, it also counts their
// threads, and the ranks stop spinning sooner than they need to (they yield, then sleep).
class MachineLoad {
 public:
  // cores: the CPUs the group's ranks may run on together (0: every core online); path: where the
  // machine's load is read (/proc/loadavg; a test hands a file of its own, to hold the reading still)
  explicit MachineLoad(int cores, const std::string& path = "/proc/loadavg") {
    const int online = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
    cores_ = cores > 0 && cores < online ? cores : online;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  ~MachineLoad() {
    if (fd_ >= 0) ::close(fd_);
  }
  // -1 when it cannot be read (the caller then keeps the rank-count rule)
  int runnable() const {
    if (fd_ < 0) return -1;
    char buf[128];
    ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    int fields = 0;
    for (char* p = buf; *p; ++p) {
      if (*p == ' ' && ++fields == 3) {
        return std::atoi(p + 1);
      }
    }
    return -1;
  }
  int cores() const { return cores_; }
  // some runnable thread has no core now
  bool oversubscribed() const {
    int r = runnable();
    return r >= 0 && r > cores_;
  }

 private:
  int fd_ = -1;
  int cores_;
};

// The time a peer's main thread has spent runnable but off a core, in ns (/proc/<pid>/schedstat's
// second field), or -1 when it cannot be read.
class PeerDelay {
 public:
  // where /<pid>/schedstat is read: /proc, or a test's own folder (to hold the reading still)
  explicit PeerDelay(const std::string& proc = "/proc") : proc_(proc) {}
  ~PeerDelay() {
    for (auto& [pid, fd] : fds_) ::close(fd);
  }
  int64_t run_delay(int pid) {
    int fd = -1;
    for (auto& [p, f] : fds_) {
      if (p == pid) fd = f;
    }
    if (fd < 0) {
      const std::string path = proc_ + "/" + std::to_string(pid) + "/schedstat";
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return -1;
      fds_.emplace_back(pid, fd);
    }
    char buf[96];
    ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    char* space = std::strchr(buf, ' ');
    return space ? std::atoll(space + 1) : -1;
  }

 private:
  std::string proc_;
  std::vector<std::pair<int, int>> fds_;
};

}  // namespace shm_native
