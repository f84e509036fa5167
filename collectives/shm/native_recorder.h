// The native path's flight record: a ring buffer of the last N calls the engine ran in C++, in
// the fields of torch's flight-recorder entries, read only when a record is dumped
// (recorder.py turns them into torch's entry dicts, merged with the calls the Python path
// recorded, by record id).
//
// A call costs two reads of the CPU's time-stamp counter (created, completed; a queued call a
// third, started), a few stores and two atomic increments: no lock, no allocation, no system
// clock. The counter is turned into wall-clock nanoseconds when the record is read, from two
// (counter, wall clock) pairs: one taken when the recorder was made, one at the reading. The ids come from counters the
// Python recorder draws from too (next_ids), so the group has one sequence of record ids and of
// collective sequence numbers whichever path ran a call. Native entries carry no stack frames
// (torch's C++ callers have no Python ones; a Python caller's would need the GIL).

#pragma once

#include <ATen/ATen.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define SHM_TICKS() static_cast<uint64_t>(__rdtsc())
#else  // elsewhere the system clock, in nanoseconds (the conversion at reading is then 1:1)
#define SHM_TICKS() static_cast<uint64_t>(shm_native::wall_ns())
#endif

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace shm_native {

inline int64_t wall_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

struct RecEntry {
  static constexpr int MAX_DIMS = 8;
  int64_t record_id = -1, collective_seq_id = 0, p2p_seq_id = 0, op_id = 0;
  int32_t peer = -2;  // a message's other rank (-1: any source); -2: a collective
  int64_t created = 0, started = 0, completed = 0;
  int32_t state = 0;  // 0 scheduled, 1 started, 2 completed
  int32_t kind = 0;   // native_engine.h's Kind
  int32_t dtype = -1; // ScalarType of the input (-1: no tensor)
  int32_t in_dims = -1, out_dims = -1;  // -1: no tensor
  int64_t in_sizes[MAX_DIMS], out_sizes[MAX_DIMS];
  uint64_t thread = 0;
};

class Recorder {
 public:
  explicit Recorder(int64_t capacity)
      : ring_(static_cast<size_t>(capacity > 0 ? capacity : 0)), tsc0_(SHM_TICKS()), ns0_(wall_ns()) {}

  // ids for a call of either path: (record id, collective seq id or 0, p2p seq id or 0, op id)
  void next_ids(bool p2p, int64_t* record_id, int64_t* coll, int64_t* p2p_id, int64_t* op_id) {
    *record_id = next_record_.fetch_add(1, std::memory_order_relaxed);
    if (p2p) {
      *coll = 0;
      *p2p_id = *op_id = p2p_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    } else {
      *p2p_id = 0;
      *coll = *op_id = coll_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    }
  }

  // A new entry for a native call; returns its slot, or -1 when recording is off. Its shapes
  // follow recorder.py's rule: a tensor's own, a list's stack [len, *shape of the first], none for
  // no tensor.
  int64_t scheduled(int kind, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out) {
    if (ring_.empty()) return -1;
    const int64_t slot = written_.fetch_add(1, std::memory_order_relaxed);
    RecEntry& e = ring_[static_cast<size_t>(slot) % ring_.size()];
    next_ids(false, &e.record_id, &e.collective_seq_id, &e.p2p_seq_id, &e.op_id);
    e.peer = -2;
    e.created = static_cast<int64_t>(SHM_TICKS());
    e.started = e.completed = 0;
    e.state = 0;
    e.kind = kind;
    e.dtype = !in.empty() ? static_cast<int32_t>(in[0].scalar_type())
              : !out.empty() ? static_cast<int32_t>(out[0].scalar_type()) : -1;
    e.in_dims = shape(in, e.in_sizes);
    e.out_dims = shape(out, e.out_sizes);
    e.thread = static_cast<uint64_t>(pthread_self());
    last_enqueued = e.collective_seq_id;
    return slot;
  }

  // A new entry for a point-to-point message (native_p2p.h): send or recv, the other rank (-1 for
  // any source), the tensor's shape in and out, as recorder.py's p2p entries.
  int64_t scheduled_p2p(bool send, int peer, const at::Tensor& t) {
    if (ring_.empty()) return -1;
    const int64_t slot = written_.fetch_add(1, std::memory_order_relaxed);
    RecEntry& e = ring_[static_cast<size_t>(slot) % ring_.size()];
    next_ids(true, &e.record_id, &e.collective_seq_id, &e.p2p_seq_id, &e.op_id);
    e.created = static_cast<int64_t>(SHM_TICKS());
    e.started = e.completed = 0;
    e.state = 0;
    e.kind = send ? P2P_SEND : P2P_RECV;
    e.peer = peer;
    e.dtype = static_cast<int32_t>(t.scalar_type());
    std::vector<at::Tensor> one{t};
    e.in_dims = e.out_dims = shape(one, e.in_sizes);
    shape(one, e.out_sizes);
    e.thread = static_cast<uint64_t>(pthread_self());
    return slot;
  }
  static constexpr int P2P_SEND = 100, P2P_RECV = 101;  // RecEntry::kind of a message

  void started(int64_t slot, bool at_once) {
    if (slot < 0) return;
    RecEntry& e = ring_[static_cast<size_t>(slot) % ring_.size()];
    e.started = at_once ? e.created : static_cast<int64_t>(SHM_TICKS());
    e.state = 1;
    if (e.peer == -2) last_started = e.collective_seq_id;
  }

  void completed(int64_t slot) {
    if (slot < 0) return;
    RecEntry& e = ring_[static_cast<size_t>(slot) % ring_.size()];
    e.completed = static_cast<int64_t>(SHM_TICKS());
    e.state = 2;
    if (e.peer == -2) last_completed = e.collective_seq_id;
  }

  // the entries held now, oldest first, their times in wall-clock nanoseconds (read at dump time)
  std::vector<RecEntry> entries() const {
    std::vector<RecEntry> out;
    const int64_t n = written_.load(std::memory_order_relaxed);
    const int64_t cap = static_cast<int64_t>(ring_.size());
    const double tsc1 = static_cast<double>(SHM_TICKS());
    const double ns1 = static_cast<double>(wall_ns());
    const double per_tick = tsc1 > tsc0_ ? (ns1 - ns0_) / (tsc1 - tsc0_) : 0.0;
    auto ns = [&](int64_t t) { return t ? static_cast<int64_t>(ns0_ + (t - static_cast<double>(tsc0_)) * per_tick) : 0; };
    for (int64_t s = n > cap ? n - cap : 0; s < n; ++s) {
      RecEntry e = ring_[static_cast<size_t>(s % cap)];
      e.created = ns(e.created);
      e.started = ns(e.started);
      e.completed = ns(e.completed);
      out.push_back(e);
    }
    return out;
  }

  int64_t last_enqueued = -1, last_started = -1, last_completed = -1;

 private:
  static int32_t shape(const std::vector<at::Tensor>& ts, int64_t* sizes) {
    if (ts.empty()) return -1;
    const bool stacked = ts.size() > 1;
    if (stacked) sizes[0] = static_cast<int64_t>(ts.size());
    const int32_t d = static_cast<int32_t>(std::min<int64_t>(ts[0].dim() + stacked, RecEntry::MAX_DIMS));
    for (int32_t i = stacked; i < d; ++i) sizes[i] = ts[0].size(i - stacked);
    return d;
  }

  std::vector<RecEntry> ring_;
  uint64_t tsc0_;
  int64_t ns0_;
  std::atomic<int64_t> written_{0}, next_record_{0}, coll_seq_{0}, p2p_seq_{0};
};

}  // namespace shm_native
