// The native path's collectives: python_path.py in C++, step for step, on the same segment, so that every
// element is reduced by the same rank in the same order and the native path leaves the same bits
// as the Python one (tests/shm/test_native.py checks it over collectives, dtypes, ops, sizes,
// world sizes and roots). python_path.py's docstring explains the steps; the comments here name them.
//
// The arithmetic: a sum of float32, float64 or a signed or unsigned 8, 16, 32 or 64-bit integer
// (wrapping, as torch's) is a loop compiled for AVX-512, AVX2 and plain x86-64 and chosen at run
// time (GCC's target_clones); every other op and dtype goes through ATen's own kernel (torch.add,
// torch.minimum, ... on views of the slots), which is what the Python path calls. An elementwise
// a + b rounds once whatever the vector width, so every width gives the same bits.

#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "native_wait.h"

namespace shm_native {

enum Op { OP_NONE = 0, OP_SUM = 1, OP_PRODUCT = 2, OP_MIN = 3, OP_MAX = 4, OP_BAND = 5, OP_BOR = 6, OP_BXOR = 7 };

#if defined(__x86_64__)
#define SHM_VECTOR_WIDTHS __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SHM_VECTOR_WIDTHS
#endif
#define SHM_SUM_LOOP(NAME, T, U)                                                            \
  SHM_VECTOR_WIDTHS inline void NAME(                                                       \
      T* __restrict out, const T* a, const T* b, int64_t n) {                                \
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(static_cast<U>(a[i]) + static_cast<U>(b[i])); \
  }
SHM_SUM_LOOP(sum_f32, float, float)
SHM_SUM_LOOP(sum_f64, double, double)
SHM_SUM_LOOP(sum_i8, int8_t, uint8_t)
SHM_SUM_LOOP(sum_u8, uint8_t, uint8_t)
SHM_SUM_LOOP(sum_i16, int16_t, uint16_t)
SHM_SUM_LOOP(sum_i32, int32_t, uint32_t)
SHM_SUM_LOOP(sum_i64, int64_t, uint64_t)
#undef SHM_SUM_LOOP

// The same sum stored twice (the caller's tensor and the slot the others read it from): the sum is
// read back from neither. Each element is one addition either way, so the bits are the same.
#define SHM_SUM_TWICE_LOOP(NAME, T, U)                                                                   \
  SHM_VECTOR_WIDTHS inline void NAME(                                                                    \
      T* __restrict out, T* __restrict also, const T* a, const T* b, int64_t n) {                      \
    for (int64_t i = 0; i < n; ++i) {                                                                    \
      const T v = static_cast<T>(static_cast<U>(a[i]) + static_cast<U>(b[i]));                          \
      out[i] = v;                                                                                        \
      also[i] = v;                                                                                       \
    }                                                                                                    \
  }
SHM_SUM_TWICE_LOOP(sum_twice_f32, float, float)
SHM_SUM_TWICE_LOOP(sum_twice_f64, double, double)
SHM_SUM_TWICE_LOOP(sum_twice_i32, int32_t, uint32_t)
SHM_SUM_TWICE_LOOP(sum_twice_i64, int64_t, uint64_t)
#undef SHM_SUM_TWICE_LOOP

// out = a op b, elementwise (out may be a). __restrict above is honoured only where out != a
// partially overlaps: callers pass out == a or disjoint buffers.
inline void combine(void* out, const void* a, const void* b, int64_t n, at::ScalarType dtype, int op) {
  if (n == 0) return;
  if (op == OP_SUM) {
    switch (dtype) {
      case at::kFloat: return sum_f32((float*)out, (const float*)a, (const float*)b, n);
      case at::kDouble: return sum_f64((double*)out, (const double*)a, (const double*)b, n);
      case at::kChar: return sum_i8((int8_t*)out, (const int8_t*)a, (const int8_t*)b, n);
      case at::kByte: return sum_u8((uint8_t*)out, (const uint8_t*)a, (const uint8_t*)b, n);
      case at::kShort: return sum_i16((int16_t*)out, (const int16_t*)a, (const int16_t*)b, n);
      case at::kInt: return sum_i32((int32_t*)out, (const int32_t*)a, (const int32_t*)b, n);
      case at::kLong: return sum_i64((int64_t*)out, (const int64_t*)a, (const int64_t*)b, n);
      default: break;
    }
  }
  auto opts = at::TensorOptions().dtype(dtype).device(at::kCPU);
  at::Tensor to = at::from_blob(out, {n}, opts);
  at::Tensor ta = at::from_blob(const_cast<void*>(a), {n}, opts);
  at::Tensor tb = at::from_blob(const_cast<void*>(b), {n}, opts);
  switch (op) {
    case OP_SUM: at::add_out(to, ta, tb); break;
    case OP_PRODUCT: at::mul_out(to, ta, tb); break;
    case OP_MIN: at::minimum_out(to, ta, tb); break;
    case OP_MAX: at::maximum_out(to, ta, tb); break;
    case OP_BAND: at::bitwise_and_out(to, ta, tb); break;
    case OP_BOR: at::bitwise_or_out(to, ta, tb); break;
    case OP_BXOR: at::bitwise_xor_out(to, ta, tb); break;
    default: throw std::runtime_error("shm native path: unknown op " + std::to_string(op));
  }
}

// out = a op b and also = out, without reading out back where the dtype has a loop for it
inline void combine_twice(void* out, void* also, const void* a, const void* b, int64_t n, at::ScalarType dtype,
                          int op, int es) {
  if (n == 0) return;
  if (op == OP_SUM) {
    switch (dtype) {
      case at::kFloat: return sum_twice_f32((float*)out, (float*)also, (const float*)a, (const float*)b, n);
      case at::kDouble: return sum_twice_f64((double*)out, (double*)also, (const double*)a, (const double*)b, n);
      case at::kInt: return sum_twice_i32((int32_t*)out, (int32_t*)also, (const int32_t*)a, (const int32_t*)b, n);
      case at::kLong: return sum_twice_i64((int64_t*)out, (int64_t*)also, (const int64_t*)a, (const int64_t*)b, n);
      default: break;
    }
  }
  combine(out, a, b, n, dtype, op);
  std::memcpy(also, out, n * es);
}

// What a collective needs from the process group (set once, from Python: process_group.py).
struct Config {
  // half_bytes: what a round uses of a slot (python_path.py's ShmCollectives.half: half a slot, or less
  // with COLLECTIVES_SHM_ROUND_KB; the name is from when rounds alternated halves); regions: how
  // many such regions of a slot the rounds use in turn (ShmCollectives.regions); small_bytes: the
  // small path's largest all_reduce (ShmCollectives.small: ops.small_limit of the world size, at
  // most half_bytes)
  int64_t control_bytes = 0, slot_bytes = 0, half_bytes = 0, regions = 2, piece_bytes = 1 << 20,
          small_bytes = 16 << 10;
};

// One rank's call, as python_path.py packs it: kind | op | root, dtype code, numel (two words).
struct Call {
  int32_t words[4] = {0, 0, 0, 0};
};

// The words of a disagreement (every rank's, in rank order), for Python to describe (ops.disagreement).
struct Mismatch : NativeError {
  Mismatch(std::string what, std::vector<int32_t> bank)
      : NativeError(ErrorKind::Mismatch, "the ranks' calls disagree"), what(std::move(what)), bank(std::move(bank)) {}
  std::string what;
  std::vector<int32_t> bank;
};

class Collectives {
 public:
  Collectives(Words words, int rank, int size, Config config, Waiter* waiter)
      : w_(words), rank_(rank), size_(size), cfg_(config), waiter_(waiter),
        data_(reinterpret_cast<char*>(const_cast<int32_t*>(words.control)) + config.control_bytes),
        half_(config.half_bytes) {}

  int64_t round = 0;  // python_path.py's ShmCollectives.round: the half of every slot a round uses
  int64_t calls = 0;  // ShmCollectives.calls: collectives entered (the words' bank parity)

  // -- the call words (python_path.py: begin, meet) -------------------------------------------------------
  void begin(int kind_code, const char* kind, int dtype_code, int64_t numel, int op = OP_NONE, int root = -1) {
    waiter_->what = kind;
    pending_.words[0] = kind_code | op << 4 | (root + 1) << 8;
    pending_.words[1] = dtype_code;
    pending_.words[2] = static_cast<int32_t>(numel & 0x7FFFFFFF);
    pending_.words[3] = static_cast<int32_t>(numel >> 31);
    has_pending_ = true;
  }

  void meet() {
    if (!has_pending_) {
      waiter_->barrier();
      return;
    }
    has_pending_ = false;
    const int bank = static_cast<int>(calls & 1);
    ++calls;
    volatile int32_t* mine = bank_word(bank, rank_);
    for (int i = 0; i < 4; ++i) store(mine + i, pending_.words[i]);
    waiter_->barrier();
    // a rank whose peers are ahead never waits: look at the abort word here too
    waiter_->check_abort();
    for (int q = 0; q < size_; ++q) {
      volatile int32_t* theirs = bank_word(bank, q);
      for (int i = 0; i < 4; ++i) {
        if (load(theirs + i) != pending_.words[i]) {
          std::vector<int32_t> all(static_cast<size_t>(size_) * 4);
          for (int k = 0; k < size_; ++k)
            for (int j = 0; j < 4; ++j) all[k * 4 + j] = load(bank_word(bank, k) + j);
          throw Mismatch(waiter_->what, std::move(all));
        }
      }
    }
  }

  int next_round() { return static_cast<int>(++round % cfg_.regions); }  // python_path.py's next_round

  char* slot(int q, int half) const { return data_ + q * cfg_.slot_bytes + half * half_; }

  std::vector<std::pair<int64_t, int64_t>> rounds(int64_t numel, int64_t itemsize, int64_t parts = 1) const {
    const int64_t per = std::max<int64_t>(1, half_ / (itemsize * parts));
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t a = 0; a < numel; a += per) out.emplace_back(a, std::min(a + per, numel));
    if (out.empty()) out.emplace_back(0, 0);
    return out;
  }

  static std::pair<int64_t, int64_t> bounds(int64_t numel, int size, int r) {  // chunks.bounds
    const int64_t base = numel / size, extra = numel % size;
    const int64_t start = r * base + std::min<int64_t>(r, extra);
    return {start, start + base + (r < extra ? 1 : 0)};
  }

  // -- all_reduce and reduce (python_path.py: _reduce) ------------------------------------------------------
  void reduce(char* flat, int64_t numel, at::ScalarType dtype, int es, int op, bool copy_out) {
    const int p = size_, r = rank_;
    if (numel * es <= cfg_.small_bytes) {  // ShmCollectives.small: never more than a round
      const int h = next_round();
      std::memcpy(slot(r, h), flat, numel * es);
      meet();
      if (copy_out) {  // every rank adds every slot, in rank order
        if (p == 1) {
          std::memcpy(flat, slot(0, h), numel * es);
        } else {
          combine(flat, slot(0, h), slot(1, h), numel, dtype, op);
          for (int q = 2; q < p; ++q) combine(flat, flat, slot(q, h), numel, dtype, op);
        }
      }
      return;
    }
    for (auto [a, b] : rounds(numel, es)) {
      const int64_t m = b - a;
      const int h = next_round();
      auto [s, e] = bounds(m, p, r);
      char* mine_slot = slot(r, h);
      // 1. copy in what the others reduce
      if (s > 0) std::memcpy(mine_slot, flat + a * es, s * es);
      if (e < m) std::memcpy(mine_slot + e * es, flat + (a + e) * es, (m - e) * es);
      meet();
      // 3. this rank's slice: its own value first, then the others' in rank order
      if (e > s) {
        char* mine = flat + (a + s) * es;
        std::vector<const char*> others;
        for (int q = 0; q < p; ++q)
          if (q != r) others.push_back(slot(q, h) + s * es);
        if (copy_out) {
          sum_in_pieces(mine, mine, others, e - s, dtype, es, op, mine_slot + s * es);
        } else {
          sum_in_pieces(mine_slot + s * es, mine, others, e - s, dtype, es, op, nullptr);
        }
      }
      meet();
      if (copy_out) {  // 5. every other slice from the slot of the rank that reduced it
        for (int q = 0; q < p; ++q) {
          auto [qs, qe] = bounds(m, p, q);
          if (qe > qs && q != r) std::memcpy(flat + (a + qs) * es, slot(q, h) + qs * es, (qe - qs) * es);
        }
      }
    }
  }

  // into = first op others[0] op others[1] ..., a piece at a time, each piece also copied to `also`
  void sum_in_pieces(char* into, const char* first, const std::vector<const char*>& others, int64_t n,
                     at::ScalarType dtype, int es, int op, char* also) {
    if (others.empty()) {
      if (into != first) std::memcpy(into, first, n * es);
      if (also) std::memcpy(also, into, n * es);
      return;
    }
    const int64_t step = std::max<int64_t>(1, cfg_.piece_bytes / es);
    for (int64_t c = 0; c < n; c += step) {
      const int64_t k = std::min(step, n - c);
      char* piece = into + c * es;
      const size_t last = others.size() - 1;  // the last addition also stores into `also`
      const char* acc = first + c * es;
      for (size_t j = 0; j < last; ++j, acc = piece) combine(piece, acc, others[j] + c * es, k, dtype, op);
      if (also) {
        combine_twice(piece, also + c * es, acc, others[last] + c * es, k, dtype, op, es);
      } else {
        combine(piece, acc, others[last] + c * es, k, dtype, op);
      }
    }
  }

  void broadcast(char* flat, int64_t numel, int es, int src) {
    for (auto [a, b] : rounds(numel, es)) {
      const int h = next_round();
      if (rank_ == src) std::memcpy(slot(src, h), flat + a * es, (b - a) * es);
      meet();
      if (rank_ != src) std::memcpy(flat + a * es, slot(src, h), (b - a) * es);
    }
  }

  // out (size x numel) gets every rank's `in` in rank order
  void all_gather(char* out, const char* in, int64_t numel, int es) {
    for (auto [a, b] : rounds(numel, es)) {
      const int h = next_round();
      std::memcpy(slot(rank_, h), in + a * es, (b - a) * es);
      meet();
      for (int q = 0; q < size_; ++q) std::memcpy(out + (q * numel + a) * es, slot(q, h), (b - a) * es);
    }
  }

  // out (numel / size) gets chunk `rank` of the reduction of every rank's `in`
  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, int es, int op) {
    const int p = size_, r = rank_;
    const int64_t c = numel / p;
    for (auto [a, b] : rounds(c, es, p)) {
      const int64_t k = b - a;
      const int h = next_round();
      for (int q = 0; q < p; ++q) std::memcpy(slot(r, h) + q * k * es, in + (q * c + a) * es, k * es);
      meet();
      std::vector<const char*> others;
      for (int q = 0; q < p; ++q)
        if (q != r) others.push_back(slot(q, h) + r * k * es);
      sum_in_pieces(out + a * es, slot(r, h) + r * k * es, others, k, dtype, es, op, nullptr);
    }
  }

  // -- gather, scatter, all_to_all (routing.py), on bytes -----------------------------------------
  // outs (on dst: one per rank) get every rank's `in`, round by round through its slot
  void gather(const std::vector<char*>& outs, const char* in, int64_t nbytes, int dst) {
    for (auto [a, b] : rounds(nbytes, 1)) {
      const int h = next_round();
      std::memcpy(slot(rank_, h), in + a, b - a);
      meet();
      if (rank_ == dst)
        for (int q = 0; q < size_; ++q) std::memcpy(outs[q] + a, slot(q, h), b - a);
    }
  }

  // out gets src's ins[rank]: src lays chunk q of every input side by side in its slot
  void scatter(char* out, const std::vector<const char*>& ins, int64_t nbytes, int src) {
    for (auto [a, b] : rounds(nbytes, 1, size_)) {
      const int64_t k = b - a;
      const int h = next_round();
      if (rank_ == src)
        for (int q = 0; q < size_; ++q) std::memcpy(slot(src, h) + q * k, ins[q] + a, k);
      meet();
      std::memcpy(out + a, slot(src, h) + rank_ * k, k);
    }
  }

  // sends[q] bytes of `in` go to rank q, expects[q] bytes of `out` come from rank q (rank order).
  // First every rank's counts, in one round: a send its receiver does not expect is an error on
  // every rank before any data moves; then round by round, region q of this rank's slot carries
  // the next piece for rank q.
  void all_to_all(char* out, const char* in, const std::vector<int64_t>& expects, const std::vector<int64_t>& sends) {
    const int p = size_, r = rank_;
    int h = next_round();
    auto* mine = reinterpret_cast<int64_t*>(slot(r, h));
    for (int q = 0; q < p; ++q) mine[q] = sends[q], mine[p + q] = expects[q];
    meet();
    auto counts = [&](int q) { return reinterpret_cast<const int64_t*>(slot(q, h)); };
    std::string pairs;
    int wrong = 0;
    int64_t largest = 0;
    for (int q = 0; q < p; ++q) {
      for (int d = 0; d < p; ++d) {
        const int64_t sent = counts(q)[d], expected = counts(d)[p + q];
        largest = std::max(largest, sent);
        if (sent != expected && wrong++ < 4)
          pairs += (pairs.empty() ? "" : "; ") + std::string("rank ") + std::to_string(q) + " sends " + std::to_string(sent) +
                   " bytes to rank " + std::to_string(d) + ", which expects " + std::to_string(expected);
      }
    }
    if (wrong)
      throw NativeError(ErrorKind::Disagree, "all_to_all on rank " + std::to_string(r) +
                                                 " of the shm group: the ranks' splits disagree (" + pairs +
                                                 (wrong > 4 ? "; ..." : "") +
                                                 "); none of them moved data, and the group is still usable");
    std::vector<int64_t> in_at(p + 1, 0), out_at(p + 1, 0);
    for (int q = 0; q < p; ++q) in_at[q + 1] = in_at[q] + sends[q], out_at[q + 1] = out_at[q] + expects[q];
    const int64_t per = std::max<int64_t>(1, half_ / p);
    for (auto [a, b] : rounds(largest, 1, p)) {
      h = next_round();
      char* mine_slot = slot(r, h);
      for (int q = 0; q < p; ++q) {
        const int64_t s = std::min(a, sends[q]), e = std::min(b, sends[q]);
        if (e > s) std::memcpy(mine_slot + q * per, in + in_at[q] + s, e - s);
      }
      meet();
      for (int q = 0; q < p; ++q) {
        const int64_t s = std::min(a, expects[q]), e = std::min(b, expects[q]);
        if (e > s) std::memcpy(out + out_at[q] + s, slot(q, h) + r * per, e - s);
      }
    }
  }

  void barrier(int kind_code) {
    begin(kind_code, "barrier", -1, 0);
    next_round();
    meet();
  }

  // python_path.py's monitored_barrier: a barrier whose timeout (timeout_s, or the group's when negative)
  // names the ranks that did not reach it: the first of them, or all with wait_all (Gloo's
  // monitoredBarrier)
  void monitored_barrier(int kind_code, double timeout_s, bool wait_all) {
    begin(kind_code, "monitored_barrier", -1, 0);
    next_round();
    struct Restore {  // the group's timeout again, however this call ends
      Waiter* w;
      double saved;
      ~Restore() { w->timeout_s = saved; }
    } restore{waiter_, waiter_->timeout_s};
    if (timeout_s >= 0) waiter_->timeout_s = timeout_s;
    try {
      meet();
    } catch (const NativeError& e) {
      std::vector<int> late = waiter_->behind_ranks();
      if (e.kind != ErrorKind::Peer || late.empty()) throw;
      if (!wait_all) late.resize(1);
      std::string named = late.size() > 1 ? "ranks " : "rank ";
      for (size_t i = 0; i < late.size(); ++i) named += (i ? ", " : "") + std::to_string(late[i]);
      char t[32];
      std::snprintf(t, sizeof t, "%g", waiter_->timeout_s);
      throw NativeError(ErrorKind::Peer, "monitored_barrier on rank " + std::to_string(rank_) + ": " + named +
                                             " did not reach it within " + t + " s (" + e.what() + ")");
    }
  }

 private:
  volatile int32_t* bank_word(int bank, int q) const {
    return w_.control + w_.call0 + (static_cast<int64_t>(bank) * size_ + q) * w_.call_words;
  }

  Words w_;
  int rank_, size_;
  Config cfg_;
  Waiter* waiter_;
  char* data_;
  int64_t half_;
  Call pending_;
  bool has_pending_ = false;
};

}  // namespace shm_native
