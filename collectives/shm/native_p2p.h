// send, recv and recv from any source on the native path: point_to_point.py and transport.py's
// Transfer in C++, on the same mailboxes of the same segment, so either path reads the other's
// messages.
//
// Every ordered pair (src, dst) has a mailbox of two halves and two int32 counters: sent (written
// by src only) and taken (by dst only). A message goes in pieces of half a mailbox, led by its
// length (int64): src puts piece i in half i % 2 while sent - taken < 2, dst takes it while
// sent > taken, and each wakes the futex on the counter it moved. Messages between a pair arrive
// in the order they were posted; tags are not matched. A receive into a tensor of another size
// takes the whole message out, writes none of it, and fails naming both sizes. A receive from any
// source takes the first rank with a message begun towards this one that no posted receive takes.
//
// A message the caller can move whole at once, with nothing else in flight, it moves itself.
// Otherwise one thread per group moves every posted message along (a ring posts a send and a receive before
// waiting for either; moving one message at a time could leave both ranks inside sends larger than
// a mailbox), then sleeps on the counter the first stuck message waits for (0.2 ms at most; a new
// post wakes it). A new message first checks the abort word; after 50 ms without progress, and
// every 50 ms after, the thread also checks that every peer's process runs and the group's timeout
// (the group's Waiter says each as wait.py does), and fails every posted message naming the rank. Errors are NativeErrors: the Work's wait makes them the Python path's
// exceptions (forward.cpp), so this thread never takes the GIL.

#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include "native_recorder.h"
#include "native_wait.h"

namespace shm_native {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

struct Mailboxes {  // segment.py's mail: pair k = src * size + dst
  volatile int32_t* sent = nullptr;
  volatile int32_t* taken = nullptr;
  uint8_t* boxes = nullptr;
  int64_t box_bytes = 0;
};

class Messages {
 public:
  enum Kind { SEND = 0, RECV = 1, RECV_ANY = 2 };
  static constexpr int64_t HEADER_BYTES = 8;  // transport.py's: the message's length, ahead of its bytes
  static constexpr double FAULT_CHECK_S = 0.05, SLEEP_S = 2e-4;

  // waiter: the group's (its abort word and peer checks, which any thread may use)
  Messages(Waiter* waiter, Mailboxes mail, int rank, int size, double timeout_s, Recorder* recorder)
      : waiter_(waiter), mail_(mail), rank_(rank), size_(size), timeout_s_(timeout_s), rec_(recorder) {}
  ~Messages() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    wake_mover();
    if (thread_.joinable()) thread_.join();  // messages still posted are dropped, as the Python thread's are
  }

  // whether the segment has mailboxes (up to 64 ranks) with room for a length and a byte a half
  bool available() const { return mail_.boxes != nullptr && mail_.box_bytes >= 2 * (HEADER_BYTES + 8); }

  // Post a message of the contiguous CPU tensor `t`: a Future completed with the peer (for
  // RECV_ANY, the rank it came from) once it is through, or failed with a NativeError.
  FuturePtr post(int kind, const at::Tensor& t, int peer) {
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    const int64_t slot = rec_ ? rec_->scheduled_p2p(kind == SEND, kind == RECV_ANY ? -1 : peer, t) : -1;
    if (slot >= 0) rec_->started(slot, true);
    {
      std::lock_guard<std::mutex> lock(m_);
      // Nothing else in flight, the group whole, and the whole message moves now (a send with room
      // for it, a receive whose message is all there): the caller moves it, and no thread wakes.
      if (posted_ == 0 && kind != RECV_ANY && waiter_->broken("").empty()) {
        Transfer x = make(Posted{kind, t, peer, fut, slot}, kind, peer);
        if (moves_whole(x)) {
          progress(x);
          if (x.done < x.total && x.error.empty())  // never: moves_whole said it all moves (a loud failure, not a short message)
            x.error = "send/recv on rank " + std::to_string(rank_) + ": the message moved only in part at once";
          if (x.error.empty()) {
            if (rec_) rec_->completed(slot);
            fut->markCompleted(c10::IValue(static_cast<int64_t>(peer)));
          } else {
            fut->setError(std::make_exception_ptr(NativeError(ErrorKind::Disagree, x.error)));
          }
          return fut;
        }
      }
      inbox_.push_back(Posted{kind, t, peer, fut, slot});
      ++posted_;
      if (!thread_.joinable()) thread_ = std::thread([this] { serve(); });
    }
    cv_.notify_one();
    wake_mover();
    return fut;
  }

  // until every posted message is through or failed
  void drain() {
    std::unique_lock<std::mutex> lock(m_);
    idle_cv_.wait(lock, [&] { return posted_ == 0; });
  }

 private:
  struct Posted {
    int kind;
    at::Tensor t;
    int peer;
    FuturePtr fut;
    int64_t slot;
  };
  struct Transfer {
    Posted p;
    int kind, peer, pair;
    uint8_t* data;
    int64_t nbytes, total, done = 0;
    std::string error;
    volatile int32_t* block_word = nullptr;  // the counter that must change for it to move, and its value
    int32_t block_value = 0;
  };

  Transfer make(Posted p, int kind, int peer) {
    Transfer x{std::move(p), kind, peer, kind == SEND ? rank_ * size_ + peer : peer * size_ + rank_, nullptr, 0, 0};
    x.data = static_cast<uint8_t*>(x.p.t.data_ptr());
    x.nbytes = static_cast<int64_t>(x.p.t.nbytes());
    x.total = x.nbytes + HEADER_BYTES;
    return x;
  }

  // Move as many pieces as the mailbox allows now; whether any moved.
  bool progress(Transfer& x) {
    const int64_t half = mail_.box_bytes / 2;
    uint8_t* box = mail_.boxes + static_cast<int64_t>(x.pair) * mail_.box_bytes;
    volatile int32_t* sent = mail_.sent + x.pair;
    volatile int32_t* taken = mail_.taken + x.pair;
    bool moved = false;
    while (x.done < x.total) {
      const int32_t s = load(sent), tk = load(taken);
      const int32_t ahead = static_cast<int32_t>(static_cast<uint32_t>(s) - static_cast<uint32_t>(tk));
      int64_t n = 0;
      if (x.kind == SEND) {
        if (ahead >= 2) {
          x.block_word = taken, x.block_value = tk;
          break;
        }
        n = std::min(half, x.total - x.done);
        uint8_t* piece = box + (static_cast<uint32_t>(s) & 1u) * half;
        int64_t start = x.done - HEADER_BYTES, len = n;
        if (start < 0) {  // the first piece: the length first
          std::memcpy(piece, &x.nbytes, HEADER_BYTES);
          piece += HEADER_BYTES, len -= HEADER_BYTES, start = 0;
        }
        if (len > 0) std::memcpy(piece, x.data + start, static_cast<size_t>(len));
        store(sent, after(s));
        futex_wake(sent);
      } else {
        if (ahead <= 0) {
          x.block_word = sent, x.block_value = s;
          break;
        }
        const uint8_t* piece = box + (static_cast<uint32_t>(tk) & 1u) * half;
        if (x.done == 0) {  // the sender's length decides the pieces
          int64_t theirs = 0;
          std::memcpy(&theirs, piece, HEADER_BYTES);
          if (theirs != x.nbytes) {
            x.error = "recv on rank " + std::to_string(rank_) + " of the shm group: rank " + std::to_string(x.peer) +
                      " sent " + std::to_string(theirs) + " bytes, and this rank's tensor holds " +
                      std::to_string(x.nbytes) + " bytes; nothing was written into it (the message was taken out, " +
                      "so the next one arrives in order)";
            x.total = HEADER_BYTES + theirs;
          }
        }
        n = std::min(half, x.total - x.done);
        int64_t start = x.done - HEADER_BYTES, len = n;
        if (start < 0) piece += HEADER_BYTES, len -= HEADER_BYTES, start = 0;
        if (x.error.empty() && len > 0) std::memcpy(x.data + start, piece, static_cast<size_t>(len));
        store(taken, after(tk));
        futex_wake(taken);
      }
      x.done += n;
      moved = true;
    }
    return moved;
  }

  // Whether all of `x` moves at once: a send the mailbox has room for, a receive whose message is
  // all in it. Room only grows (the receiver frees halves), and so do the pieces put in.
  bool moves_whole(const Transfer& x) const {
    const int64_t half = mail_.box_bytes / 2;
    const int32_t s = load(mail_.sent + x.pair), tk = load(mail_.taken + x.pair);
    const int32_t ahead = static_cast<int32_t>(static_cast<uint32_t>(s) - static_cast<uint32_t>(tk));
    if (x.kind == SEND) return ahead >= 0 && ahead < 2 && x.total <= (2 - ahead) * half;
    if (ahead <= 0) return false;
    int64_t theirs = 0;
    std::memcpy(&theirs, mail_.boxes + static_cast<int64_t>(x.pair) * mail_.box_bytes +
                             (static_cast<uint32_t>(tk) & 1u) * half, HEADER_BYTES);
    return theirs >= 0 && HEADER_BYTES + theirs <= ahead * half;
  }

  // A rank with a message begun towards this one that no posted receive takes, or -1.
  int any_source(const std::map<int, std::deque<Transfer>>& queues) const {
    for (int q = 0; q < size_; ++q) {
      const int k = q * size_ + rank_;
      const int32_t ahead = static_cast<int32_t>(static_cast<uint32_t>(load(mail_.sent + k)) -
                                                 static_cast<uint32_t>(load(mail_.taken + k)));
      if (q != rank_ && ahead > 0 && !queues.count(k)) return q;
    }
    return -1;
  }

  void finish(Posted& p, const std::string& error, ErrorKind kind, int peer) {
    if (error.empty()) {
      if (rec_) rec_->completed(p.slot);
      p.fut->markCompleted(c10::IValue(static_cast<int64_t>(peer)));
    } else {
      p.fut->setError(std::make_exception_ptr(NativeError(kind, error)));
    }
    std::lock_guard<std::mutex> lock(m_);
    if (--posted_ == 0) idle_cv_.notify_all();
  }

  // Why the posted messages fail, or "": the abort word; with `peers`, also a peer's process gone
  // and the group's timeout (wait.py's _check_peers, through the group's Waiter).
  std::string fault(const char* what, int peer, double waited, bool peers) {
    if (std::string why = waiter_->broken(what); !why.empty() || !peers) return why;
    if (std::string died = waiter_->dead_peer(what); !died.empty()) return died;
    if (waited > timeout_s_) {
      waiter_->abort(peer, LATE);
      char t[32];
      std::snprintf(t, sizeof t, "%g", timeout_s_);
      return std::string(what) + " on rank " + std::to_string(rank_) + ": rank " + std::to_string(peer) +
             " did not complete it within the " + t + " s timeout (is it in another collective, or stuck?)";
    }
    return "";
  }

  void wake_mover() {
    if (volatile int32_t* w = sleeping_on_.load(std::memory_order_acquire)) futex_wake(w);
  }

  void serve() {
    std::map<int, std::deque<Transfer>> queues;  // pair -> its messages in posting order
    std::deque<Posted> any;                       // receives from any source, in posting order
    double last = now_s(), next_check = last + FAULT_CHECK_S;
    while (true) {
      std::deque<Posted> fresh;
      {
        std::unique_lock<std::mutex> lock(m_);
        if (queues.empty() && any.empty()) cv_.wait(lock, [&] { return stop_ || !inbox_.empty(); });
        if (stop_) return;
        fresh.swap(inbox_);
      }
      for (auto& p : fresh) {
        last = now_s(), next_check = last + FAULT_CHECK_S;
        const char* what = p.kind == SEND ? "send" : "recv";
        std::string broken = fault(what, p.peer, 0.0, false);  // the abort word only, as point_to_point.py
        if (!broken.empty()) {
          finish(p, broken, ErrorKind::Peer, p.peer);
        } else if (p.kind == RECV_ANY) {
          any.push_back(std::move(p));
        } else {
          const int kind = p.kind, peer = p.peer;
          Transfer x = make(std::move(p), kind, peer);
          queues[x.pair].push_back(std::move(x));
        }
      }
      for (int q; !any.empty() && (q = any_source(queues)) >= 0;) {
        Transfer x = make(std::move(any.front()), RECV, q);
        any.pop_front();
        queues[x.pair].push_back(std::move(x));
      }
      bool moved = false;
      for (auto it = queues.begin(); it != queues.end();) {
        auto& line = it->second;
        while (!line.empty()) {
          Transfer& x = line.front();
          moved |= progress(x);
          if (x.done < x.total) break;
          finish(x.p, x.error, ErrorKind::Disagree, x.peer);
          line.pop_front();
        }
        it = line.empty() ? queues.erase(it) : std::next(it);
      }
      if (moved) {
        last = now_s(), next_check = last + FAULT_CHECK_S;
        continue;
      }
      if (queues.empty() && any.empty()) continue;
      const double now = now_s();
      if (now >= next_check) {
        next_check = now + FAULT_CHECK_S;
        const int peer = !queues.empty() ? queues.begin()->second.front().peer : rank_;
        std::string broken = fault("a point-to-point message", peer, now - last, true);
        if (!broken.empty()) {
          for (auto& [pair, line] : queues)
            for (auto& x : line) finish(x.p, broken, ErrorKind::Peer, x.peer);
          for (auto& p : any) finish(p, broken, ErrorKind::Peer, -1);
          queues.clear(), any.clear();
          continue;
        }
      }
      volatile int32_t* word = !queues.empty() ? queues.begin()->second.front().block_word : nullptr;
      if (word) {
        sleeping_on_.store(word, std::memory_order_release);
        {
          std::lock_guard<std::mutex> lock(m_);
          if (!inbox_.empty() || stop_) {  // posted meanwhile: look at it first
            sleeping_on_.store(nullptr, std::memory_order_release);
            continue;
          }
        }
        futex_wait(word, queues.begin()->second.front().block_value, SLEEP_S);
        sleeping_on_.store(nullptr, std::memory_order_release);
      } else {
        struct timespec ts{0, static_cast<long>(SLEEP_S * 1e9)};  // a receive from any source: look again
        nanosleep(&ts, nullptr);
      }
    }
  }

  Waiter* waiter_;
  Mailboxes mail_;
  int rank_, size_;
  double timeout_s_;
  Recorder* rec_;
  std::mutex m_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Posted> inbox_;
  int64_t posted_ = 0;  // posted and not finished (guarded by m_)
  bool stop_ = false;
  std::atomic<volatile int32_t*> sleeping_on_{nullptr};
  std::thread thread_;
};

}  // namespace shm_native
