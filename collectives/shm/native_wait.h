// The native path's barrier: wait.py in C++, on the same words of the same segment, so a rank on
// the Python path and a rank on the native path meet at the same barriers.
//
// Rank r announces step k by storing k in its own word, then waits until every rank's word is at
// least k (in the order of `behind`: the words wrap). How it waits (COLLECTIVES_SHM_WAIT): spin,
// yield, sleep (50 us), or futex: spin while the machine has a core for every runnable thread, then
// yield for 2 ms, then sleep in the kernel on the first missing rank's word until that rank writes
// it and wakes it.
//
// "While ... a core": a waiting rank reads the machine while it spins, every 20 us. It stops
// spinning (yields, then sleeps on the futex) once (a) /proc/loadavg has counted more runnable
// threads than the cores the ranks may run on (the union of their affinities, so ranks pinned to
// 2 of 16 cores count 2) at 3 checks in a row (a thread, perhaps the rank it waits for, has been
// kept off a core for 40 us or more; a moment's extra thread on a full machine, which the
// spinners themselves fill, does not stop them), or (b) the rank it waits for has waited for a
// core: the time its main thread spent runnable but off a core (/proc/<pid>/schedstat's second
// field) has grown, which the kernel counts each time that thread gets a core back.
// A worker thread's call (the caller computes, DDP's backward) spins only while a caller waits
// on a Work of the group (callers_waiting).
//
// Faults, as in wait.py: every 50 ms of waiting a rank checks the abort word, that every peer's
// process runs (/proc/<pid>/stat, as machine.py reads it: native_machine.h) and its timeout; it then raises
// the same errors with the same words.


#pragma once

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "native_errors.h"
#include "native_futex.h"
#include "native_machine.h"

namespace shm_native {

enum Strategy { FUTEX = 0, SPIN = 1, YIELD = 2, SLEEP = 3 };
constexpr int DIED = 0, FAILED = 1, LATE = 2;  // the ABORT_WHY word's values (wait.py)

struct Words {  // the segment's control words this rank reads and writes (segment.py's layout)
  volatile int32_t* control = nullptr;
  int step0 = 0, pid0 = 0, sleep0 = 0, call0 = 0, call_words = 4;
  int abort_word = 0, abort_seen_by = 1, abort_why = 2;
  volatile int32_t* step(int r) const { return control + step0 + r; }
  volatile int32_t* sleeping(int r) const { return control + sleep0 + r; }
  int32_t pid(int r) const { return load(control + pid0 + r); }
};

class Waiter {
 public:
  Waiter(Words words, int rank, int size, Strategy strategy, double timeout_s, double spin_s_idle, int cores,
         const std::string& loadavg = "/proc/loadavg", const std::string& proc = "/proc")
      : w_(words), rank_(rank), size_(size), strategy_(strategy), load_(cores, loadavg), peers_(proc), timeout_s(timeout_s),
        spin_s_idle(spin_s_idle), spin_s(spin_s_idle) {}

  int32_t step = 0;         // this rank's last announced step (the segment's word, mirrored)
  std::string what;         // the collective under way, for the errors
  double timeout_s;
  double spin_s_idle;       // how long to spin when the caller waits anyway
  double spin_s;            // 0 while the caller computes (the worker thread's calls)
  bool read_machine = true; // stop spinning when the peer waited for a core (or, failing that, the machine is full)
  const std::atomic<int>* callers_waiting = nullptr;  // callers blocked in a Work's wait on this group
  std::atomic<int64_t> slept{0}, woken{0};  // futex sleeps, and those a peer's wake ended (wait.py's Waiter.slept, .woken)
  // waits that spun (past the first reads), and those whose spin the machine reading cut short
  std::atomic<int64_t> spun{0}, spins_cut{0};

  void barrier() {
    step = after(step);
    store(w_.step(rank_), step);
    if (strategy_ == FUTEX) {
      // A full fence between storing the word and reading the flags. Without it the CPU may read the
      // flags before the word is seen by the others (x86 lets a load pass an earlier store), so a
      // peer could set its flag and sleep on the old word in between, unwoken until its timeout.
      // The sleeper's side is fenced by the kernel, before FUTEX_WAIT reads the word.
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (anyone_sleeping()) futex_wake(w_.step(rank_));
    }
    wait_for(step);
  }

  // the other ranks whose word is behind this rank's step (python_path.py's monitored_barrier names them)
  std::vector<int> behind_ranks() const {
    std::vector<int> late;
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && behind(load(w_.step(r)), step)) late.push_back(r);
    }
    return late;
  }

  int first_missing(int32_t s) const {
    for (int r = 0; r < size_; ++r) {
      if (behind(load(w_.step(r)), s)) return r;
    }
    return -1;
  }

  void wait_for(int32_t s) {
    int missing = first_missing(s);
    if (missing < 0) return;
    // a few reads first (a few microseconds): a peer that is already on its way arrives within them
    for (int i = 0; i < 64 && missing >= 0; ++i) {
      SHM_PAUSE();
      missing = first_missing(s);
    }
    if (missing < 0) return;
    const double start = now_s();
    double next_check = start + FAULT_CHECK_S;
    const bool waited_on = callers_waiting && callers_waiting->load(std::memory_order_relaxed) > 0;
    const bool may_spin = strategy_ == SPIN || spin_s > 0 || waited_on;
    double spin_until = start + (strategy_ == FUTEX && may_spin ? std::max(spin_s, waited_on ? spin_s_idle : 0.0) : 0.0);
    double next_load = start + LOAD_CHECK_S;
    int watched = -1;
    int64_t delay0 = -1;
    int full = 0;  // checks in a row that found more runnable threads than cores
    if (strategy_ == FUTEX && may_spin && read_machine) {
      watched = missing;
      delay0 = peers_.run_delay(w_.pid(missing));
      full = load_.oversubscribed() ? 1 : 0;
    }
    if (strategy_ == FUTEX && spin_until > start) spun.fetch_add(1, std::memory_order_relaxed);
    bool cut = false;
    while (true) {
      missing = first_missing(s);
      if (missing < 0) return;
      const double now = now_s();
      if (now >= next_check) {
        check_peers(missing, now - start);
        next_check = now + FAULT_CHECK_S;
      }
      switch (strategy_) {
        case SPIN:
          SHM_PAUSE();
          continue;
        case YIELD:
          sched_yield();
          continue;
        case SLEEP: {
          struct timespec ts{0, 50000};
          nanosleep(&ts, nullptr);
          continue;
        }
        case FUTEX:
          break;
      }
      if (now < spin_until) {
        if (read_machine && now >= next_load) {
          next_load = now + LOAD_CHECK_S;
          full = load_.oversubscribed() ? full + 1 : 0;
          if (missing != watched) {  // waiting for another rank now: watch that one
            watched = missing;
            delay0 = peers_.run_delay(w_.pid(missing));
          } else if (delay0 >= 0 && peers_.run_delay(w_.pid(missing)) > delay0) {
            spin_until = now;  // the peer waited for a core (counted once it got one again)
          }
          if (full >= FULL_CHECKS) spin_until = now;  // threads have waited for cores for 3 checks in a row
          if (spin_until == now && !cut) {
            cut = true;
            spins_cut.fetch_add(1, std::memory_order_relaxed);
          }
        }
        SHM_PAUSE();
        continue;
      }
      if (now < spin_until + YIELD_S) {
        sched_yield();
        continue;
      }
      const int32_t seen = load(w_.step(missing));
      if (behind(seen, s)) {
        // say so first: the rank that writes the word wakes sleepers only
        store(w_.sleeping(rank_), 1);
        ++slept;
        if (futex_wait(w_.step(missing), seen, FAULT_CHECK_S)) ++woken;
        store(w_.sleeping(rank_), 0);
      }
    }
  }

  int machine_cores() const { return load_.cores(); }  // what /proc/loadavg's runnable count is held against

  bool anyone_sleeping() const {
    for (int r = 0; r < size_; ++r) {
      if (load(w_.sleeping(r))) return true;
    }
    return false;
  }

  void check_peers(int missing, double waited) {
    check_abort();
    if (std::string died = dead_peer(what); !died.empty()) throw NativeError(ErrorKind::Peer, died);
    if (waited > timeout_s) {
      abort(missing, LATE);
      char t[32];
      std::snprintf(t, sizeof t, "%g", timeout_s);
      throw NativeError(ErrorKind::Peer, what + " on rank " + std::to_string(rank_) + ": rank " + std::to_string(missing) +
                                             " did not reach step " + std::to_string(step) + " within the " + t +
                                             " s timeout (is it in another collective, or stuck?)");
    }
  }

  void check_abort() {
    if (std::string why = broken(what); !why.empty()) throw NativeError(ErrorKind::Peer, why);
  }

  // The first other rank whose process is gone, said for `what` ("" if none); it breaks the group
  // (the abort word). Safe from any thread, as broken() and abort() are: they touch shared words only.
  std::string dead_peer(const std::string& what) {
    for (int r = 0; r < size_; ++r) {
      const int32_t pid = w_.pid(r);
      if (r != rank_ && pid && !process_alive(pid)) {
        abort(r, DIED);
        return what + " on rank " + std::to_string(rank_) + ": rank " + std::to_string(r) + " (pid " +
               std::to_string(pid) + ") died while this rank waited for it";
      }
    }
    return "";
  }

  // Why `what` cannot run on a group that the abort word says is broken, or "".
  std::string broken(const std::string& what) const {
    const int culprit = load(w_.control + w_.abort_word) - 1;
    if (culprit < 0) return "";
    const int seen_by = load(w_.control + w_.abort_seen_by) - 1;
    const int why = load(w_.control + w_.abort_why);
    std::string how;
    if (why == LATE) {
      how = "did not reach a collective within rank " + std::to_string(seen_by) +
            "'s timeout, which gave up on it (a late rank breaks the group, as on Gloo)";
    } else if (why == FAILED || seen_by == culprit) {
      how = "failed (its error is on that rank)";
    } else {
      how = "died (rank " + std::to_string(seen_by) + " saw it)";
    }
    return what + " on rank " + std::to_string(rank_) + ": rank " + std::to_string(culprit) + " " + how +
           ", so this call cannot run: the group is broken, make a new one";
  }

  // Tell every other rank to stop waiting (culprit -1: this rank, whose own call failed).
  void abort(int culprit = -1, int why = FAILED) {
    if (!load(w_.control + w_.abort_word)) {
      store(w_.control + w_.abort_seen_by, rank_ + 1);
      store(w_.control + w_.abort_why, why);
      store(w_.control + w_.abort_word, (culprit < 0 ? rank_ : culprit) + 1);
    }
    for (int r = 0; r < size_; ++r) futex_wake(w_.step(r));
  }

  static constexpr double FAULT_CHECK_S = 0.05;
  static constexpr double YIELD_S = 2e-3;
  static constexpr double LOAD_CHECK_S = 2e-5;
  static constexpr int FULL_CHECKS = 3;

 private:
  Words w_;
  int rank_, size_;
  Strategy strategy_;
  MachineLoad load_;
  PeerDelay peers_;
};

}  // namespace shm_native
