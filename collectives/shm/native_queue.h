// An engine's queue and its worker thread: call_queue.py in C++. A call runs at once in the
// thread that issues it when nothing is queued and it is small or its caller waits for it at once,
// or when the worker thread itself issues it (a Future's callback); every other call is queued
// for the worker thread, which runs them in order at nice 19. A caller about to wait on a queued
// call runs the queue up to it itself (help).

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "native_p2p.h"
#include "native_collectives.h"
#include "native_recorder.h"
#include "native_setup.h"

namespace shm_native {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
using Task = std::function<void()>;

struct Core {  // an engine's state, its queue and its worker thread
  explicit Core(const Setup& s)
      : rank(s.rank), worker_nice(s.worker_nice), inline_bytes(s.inline_bytes),
        waiter(s.words, s.rank, s.size, s.strategy, s.timeout_s, s.spin_s_idle, s.cores, s.loadavg, s.proc),
        ops(s.words, s.rank, s.size, s.config, &waiter), recorder(s.recorder_entries) {
    waiter.step = s.step;
    waiter.callers_waiting = &callers_waiting;
    ops.round = s.round;
    ops.calls = s.calls;
    messages = std::make_unique<Messages>(&waiter, s.mail, s.rank, s.size, s.timeout_s, &recorder);
  }
  int rank;
  int worker_nice;
  int64_t inline_bytes;
  std::atomic<int> callers_waiting{0};
  Waiter waiter;
  Collectives ops;
  Recorder recorder;
  std::mutex m;
  std::condition_variable cv, idle_cv;
  struct Queued {
    Task task;
    const void* tag = nullptr;  // the call's Future (help); null for a Python job
    int threads = 0;            // the issuing thread's intra-op threads (at::get_num_threads)
  };
  int threads = 0;  // the worker's intra-op threads, as last set

  // A queued call runs as the thread that issued it would: with its intra-op thread count. A
  // thread made here starts with OpenMP's default (every core), not the rank's
  // torch.set_num_threads; a Future's callback run here (torch's PowerSGD hook multiplies its
  // matrices there) then split its products over 2 threads where the rank asked for 1, and
  // left other bits than the same product in the rank's own thread.
  void as_issuer(const Queued& q) {
    if (q.threads > 0 && q.threads != threads) {
      at::set_num_threads(q.threads);
      threads = q.threads;
    }
  }
  std::deque<Queued> queue;
  int pending = 0;       // queued or running
  bool running = false;  // a queued call is running (in the worker or a helping caller)
  std::atomic<std::thread::id> runner{};  // the thread running it: its own calls run at once (nested)
  bool stop = false;
  std::thread worker;
  std::unique_ptr<Messages> messages;  // last: its thread stops before the rest goes

  bool idle() {
    std::lock_guard<std::mutex> lock(m);
    return pending == 0;
  }

  bool submit(Task task, int64_t nbytes, const void* tag = nullptr, bool caller_waits = false) {
    const bool nested = std::this_thread::get_id() == runner.load(std::memory_order_relaxed);
    {
      std::unique_lock<std::mutex> lock(m);
      // A call its caller waits for at once, behind only a call that another thread is running
      // (often one that has just completed its Future, its thread not yet back here): wait
      // for that one, then run this one here instead of queueing it for the worker.
      if (caller_waits && !nested && running && queue.empty())
        idle_cv.wait(lock, [this] { return !running || !queue.empty(); });
      if (!(nested || (pending == 0 && (caller_waits || nbytes <= inline_bytes)))) {
        ++pending;
        queue.push_back({std::move(task), tag, at::get_num_threads()});
        cv.notify_one();
        return false;
      }
    }
    waiter.spin_s = waiter.spin_s_idle;  // the caller waits anyway: spin a little first
    task();
    return true;
  }

  // Whether the call tagged `tag` is still waiting in the queue. Called with m held.
  bool queued(const void* tag) const {
    for (const auto& q : queue)
      if (q.tag == tag) return true;
    return false;
  }

  // The task at the head of the queue, when none is running: marked running in this thread.
  // Called with m held.
  bool take(Queued& out) {
    if (running || queue.empty()) return false;
    out = std::move(queue.front());
    queue.pop_front();
    running = true;
    runner.store(std::this_thread::get_id(), std::memory_order_relaxed);
    return true;
  }

  void finished() {
    bool more;
    {
      std::lock_guard<std::mutex> lock(m);
      running = false;
      runner.store(std::thread::id(), std::memory_order_relaxed);
      --pending;
      more = !queue.empty();
    }
    if (more) cv.notify_one();  // the worker may take the next; woken for nothing, it would take a core
    idle_cv.notify_all();
  }

  void serve(std::promise<void>& started) {
    // Below the threads that compute: a queued call (DDP's bucket during the backward) takes a
    // core that is free, not one a rank computes on. A caller that waits for it runs it itself
    // (help), at its own priority. Linux sets a thread's nice value by its thread id.
    if (worker_nice) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), worker_nice);
    started.set_value();
    while (true) {
      Queued q;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [this] { return stop || (!queue.empty() && !running); });
        if (!take(q)) return;  // stopped
      }
      waiter.spin_s = 0;  // the calling thread is computing (DDP's backward): do not take its core
      as_issuer(q);
      q.task();
      finished();
    }
  }

  // A caller about to block on the call tagged `tag`: it runs the queued calls up to and
  // including that one itself, so a blocking call skips the two thread hand-offs (wake the
  // worker, wake the caller). While another thread runs a call, it waits for that call to
  // finish, then goes on; it returns once `tag`'s call is no longer queued (it has run, or
  // another thread took it: then the caller waits on its Future). The thread running a call
  // (a Future's callback waiting) does not wait for itself.
  void help(const void* tag) {
    while (true) {
      Queued q;
      {
        std::unique_lock<std::mutex> lock(m);
        if (runner.load(std::memory_order_relaxed) != std::this_thread::get_id())
          idle_cv.wait(lock, [&] { return !running || !queued(tag); });
        if (!queued(tag) || !take(q)) return;
      }
      waiter.spin_s = waiter.spin_s_idle;  // the caller waits anyway
      q.task();
      finished();
      if (q.tag == tag) return;
    }
  }

  void drain() {
    std::unique_lock<std::mutex> lock(m);
    idle_cv.wait(lock, [this] { return pending == 0; });
  }
};

}  // namespace shm_native
