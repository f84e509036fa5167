// The native path's engine: one per shm group and rank. It runs the group's calls one after
// another in the order they were issued (the same order on every rank), as call_queue.py's
// worker does: a small call, or one its caller waits for at once (async_op=False), with nothing
// queued before it runs at once in the calling thread, a
// call issued by the worker thread itself (a Future's callback, e.g. the PowerSGD hook) runs at
// once before those queued behind it, and every other call is queued for the worker thread, so
// DDP's reducer overlaps it with backward. A call's Work waits on a torch Future.
//
// The queue and its worker thread are native_queue.h's Core, and which calls the native path takes
// is native_takes.h's answer; the calls it takes (native_collectives.h) run here with no GIL; every other call
// (allreduce_coalesced, the coalesced list all_gather, a list form with several inputs,
// monitored_barrier, non-contiguous tensors, the large all_reduces that go by cross-memory
// attach, a refused call) is a task that runs the Python method's job with the GIL, in the same
// queue, with the engine's counters handed to the Python objects and back (forward.cpp builds
// those tasks), so both kinds keep one order and one state.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

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

#include "native_queue.h"
#include "native_takes.h"

namespace shm_native {

// K_ALL_REDUCE_COALESCED names a flight-record entry only: on the wire it is one all_reduce
// K_MONITORED_BARRIER names the call words only: its entry is a barrier's, as on the Python path
enum Kind { K_BROADCAST = 0, K_ALL_REDUCE, K_REDUCE, K_ALL_GATHER, K_REDUCE_SCATTER, K_BARRIER, K_GATHER, K_SCATTER, K_ALL_TO_ALL,
            K_MONITORED_BARRIER, K_ALL_REDUCE_COALESCED };
inline const char* kind_name(int k) {
  static const char* names[] = {"broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter", "barrier",
                                "gather", "scatter", "all_to_all", "monitored_barrier", "allreduce_coalesced"};
  return names[k];
}

class Engine : public Takes {
 public:

  explicit Engine(const Setup& s)
      : Takes(s),
        core_(std::make_shared<Core>(s)) {
    std::promise<void> started;
    auto ready = started.get_future();
    core_->worker = std::thread([core = core_, started = std::move(started)]() mutable { core->serve(started); });
    ready.wait();  // its nice value is set before any call: the group's calls all see the same worker
  }

  ~Engine() {
    {
      std::lock_guard<std::mutex> lock(core_->m);
      core_->stop = true;
    }
    core_->cv.notify_all();
    // joined when idle; a worker still in a call (a group destroyed mid-call) is left to finish it
    if (core_->idle()) core_->worker.join(); else core_->worker.detach();
  }

  // A floor for benchmarks (benchmarks.shm_native): all_reduce returns a finished Future at once and
  // moves nothing, so a call costs torch's dispatch, this Backend and its Future, no more.
  bool moves_nothing = false;

  // the error a failed native call's Future carries (forward.cpp: the Python exception of the same kind)
  std::function<std::exception_ptr(const NativeError&)> to_error;

  Waiter& waiter() { return core_->waiter; }
  int waiter_rank() const { return setup_.rank; }
  Recorder& recorder() { return core_->recorder; }
  // callers blocked in a Work's wait on this group: the worker thread may spin for them
  std::atomic<int>& callers_waiting() { return core_->callers_waiting; }
  Collectives& ops() { return core_->ops; }

  // Run `task` now or queue it (see the top of this file); returns whether it ran now.
  bool submit(Task task, int64_t nbytes) { return core_->submit(std::move(task), nbytes); }

  // a caller about to wait for `fut`: runs the calls queued up to it in this thread (Core::help)
  void help(const void* fut) { core_->help(fut); }

  // until every call issued so far has finished
  void drain() { core_->drain(); }

  // -- point-to-point messages (native_p2p.h): a Future of the peer, or null for the Python path ---
  FuturePtr message(int kind, const at::Tensor& t, int peer) {
    if (!core_->messages->available() || !plain(t)) return nullptr;
    if (kind != Messages::RECV_ANY && (peer < 0 || peer >= setup_.size || peer == setup_.rank)) return nullptr;
    return core_->messages->post(kind, t, peer);
  }
  // until every message posted so far is through
  void drain_messages() { core_->messages->drain(); }

  // -- the native calls: a Future, or null when the Python path must take the call ----------------
  // caller_waits: the caller waits for the call at once (async_op=False, collectives.shm.all_reduce).
  // With nothing queued it then runs now in the caller, whatever its size: queued, it would wake the
  // worker thread only for the caller to run it (help) or sleep until the worker has.
  FuturePtr all_reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOp& rop, bool caller_waits = false) {
    auto [op, avg] = op_of(rop);
    if (ts.size() != 1) return nullptr;
    if (moves_nothing && reduces(rop, ts[0])) {
      auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
      fut->markCompleted(c10::IValue(ts));
      return fut;
    }
    if (!takes_all_reduce(ts[0], rop)) return nullptr;
    const int64_t nbytes = ts[0].nbytes();
    at::Tensor t = ts[0];
    return run(K_ALL_REDUCE, ts, ts, nbytes, caller_waits, [this, t, op = op, avg = avg](Collectives& c) {
      c.begin(setup_.kind_codes[K_ALL_REDUCE], "all_reduce", dtype_code(t), t.numel(), op);
      c.reduce(static_cast<char*>(t.data_ptr()), t.numel(), t.scalar_type(), t.element_size(), op, true);
      if (avg) t.div_(setup_.size);
    });
  }

  // allreduce_coalesced (dist.all_reduce_coalesced, all_reduce in torch's coalescing manager): the
  // tensors, of one dtype, flattened into one and reduced as one all_reduce (its call words), then
  // copied back: process_group.py's job, so a rank on either path meets the other at the same call.
  FuturePtr all_reduce_coalesced(std::vector<at::Tensor>& ts, const c10d::ReduceOp& rop, bool caller_waits = false) {
    auto [op, avg] = op_of(rop);
    if (ts.empty()) return nullptr;
    int64_t numel = 0;
    for (const auto& t : ts) {
      if (t.scalar_type() != ts[0].scalar_type() || !reduces(rop, t)) return nullptr;
      numel += t.numel();
    }
    const int64_t nbytes = numel * ts[0].element_size();
    if (setup_.cma_min_bytes >= 0 && nbytes >= setup_.cma_min_bytes) return nullptr;
    if (moves_nothing) {
      auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
      fut->markCompleted(c10::IValue(ts));
      return fut;
    }
    std::vector<at::Tensor> flat_views;
    for (const auto& t : ts) flat_views.push_back(t.view(-1));
    at::Tensor flat = at::cat(flat_views);
    std::vector<at::Tensor> keep = ts;
    return run(K_ALL_REDUCE_COALESCED, ts, ts, nbytes, caller_waits, [this, flat, keep, op = op, avg = avg](Collectives& c) {
      c.begin(setup_.kind_codes[K_ALL_REDUCE], "all_reduce", dtype_code(flat), flat.numel(), op);
      c.reduce(static_cast<char*>(flat.data_ptr()), flat.numel(), flat.scalar_type(), flat.element_size(), op, true);
      if (avg) flat.div_(setup_.size);
      int64_t at = 0;
      for (const auto& t : keep) {
        t.view(-1).copy_(flat.narrow(0, at, t.numel()));
        at += t.numel();
      }
    });
  }

  FuturePtr reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOp& rop, int root, bool caller_waits = false) {
    auto [op, avg] = op_of(rop);
    if (ts.size() != 1 || !reduces(rop, ts[0]) || root < 0 || root >= setup_.size) return nullptr;
    at::Tensor t = ts[0];
    return run(K_REDUCE, ts, ts, t.nbytes(), caller_waits, [this, t, op = op, avg = avg, root](Collectives& c) {
      const bool mine = setup_.rank == root;
      c.begin(setup_.kind_codes[K_REDUCE], "reduce", dtype_code(t), t.numel(), op, root);
      c.reduce(static_cast<char*>(t.data_ptr()), t.numel(), t.scalar_type(), t.element_size(), op, mine);
      if (avg && mine) t.div_(setup_.size);
    });
  }

  FuturePtr broadcast(std::vector<at::Tensor>& ts, int root, bool caller_waits = false) {
    if (ts.size() != 1 || !plain(ts[0]) || dtype_code(ts[0]) < 0 || root < 0 || root >= setup_.size) return nullptr;
    at::Tensor t = ts[0];
    return run(K_BROADCAST, ts, ts, t.nbytes(), caller_waits, [this, t, root](Collectives& c) {
      c.begin(setup_.kind_codes[K_BROADCAST], "broadcast", dtype_code(t), t.numel(), OP_NONE, root);
      c.broadcast(static_cast<char*>(t.data_ptr()), t.numel(), t.element_size(), root);
    });
  }

  FuturePtr all_gather(at::Tensor& out, at::Tensor& in, bool caller_waits = false) {
    if (!takes_all_gather(out, in)) return nullptr;
    std::vector<at::Tensor> outs{out}, ins{in};
    return run(K_ALL_GATHER, ins, outs, out.nbytes(), caller_waits, [this, out, in](Collectives& c) {
      c.begin(setup_.kind_codes[K_ALL_GATHER], "all_gather", dtype_code(in), in.numel());
      c.all_gather(static_cast<char*>(out.data_ptr()), static_cast<const char*>(in.data_ptr()), in.numel(),
                   in.element_size());
    });
  }

  FuturePtr reduce_scatter(at::Tensor& out, at::Tensor& in, const c10d::ReduceOp& rop, bool caller_waits = false) {
    if (!takes_reduce_scatter(out, in, rop)) return nullptr;
    auto [op, avg] = op_of(rop);
    std::vector<at::Tensor> outs{out}, ins{in};
    return run(K_REDUCE_SCATTER, ins, outs, out.nbytes(), caller_waits, [this, out, in, op = op, avg = avg](Collectives& c) {
      c.begin(setup_.kind_codes[K_REDUCE_SCATTER], "reduce_scatter", dtype_code(in), in.numel(), op);
      c.reduce_scatter(static_cast<char*>(out.data_ptr()), static_cast<const char*>(in.data_ptr()), in.numel(),
                       in.scalar_type(), in.element_size(), op);
      if (avg) out.div_(setup_.size);
    });
  }

  // The list forms (dist.all_gather, dist.reduce_scatter), as the Python path runs them: the
  // tensor form on one joined buffer, copied out of it (or into it) in rank order.
  FuturePtr all_gather_list(std::vector<at::Tensor>& outs, at::Tensor& in, bool caller_waits = false) {
    if (!takes_all_gather_list(outs, in)) return nullptr;
    std::vector<at::Tensor> ins{in};
    return run(K_ALL_GATHER, ins, outs, setup_.size * in.nbytes(), caller_waits,
               [this, outs, in](Collectives& c) { gather_into_list(c, outs, in); });
  }

  // dist.all_gather_coalesced: per input i, the list form into outs[i] (one tensor a rank), one
  // call and one record for them all, as the Python path's job runs them (inputs may differ in
  // size; any input or output the engine does not take sends the whole call there)
  FuturePtr all_gather_coalesced(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                 bool caller_waits = false) {
    if (ins.empty() || outs.size() != ins.size()) return nullptr;
    int64_t nbytes = 0;
    std::vector<at::Tensor> flat_outs;
    for (size_t i = 0; i < ins.size(); ++i) {
      if (!takes_all_gather_list(outs[i], ins[i])) return nullptr;
      flat_outs.insert(flat_outs.end(), outs[i].begin(), outs[i].end());
      nbytes += setup_.size * ins[i].nbytes();
    }
    return run(K_ALL_GATHER, ins, flat_outs, nbytes, caller_waits, [this, outs, ins](Collectives& c) {
      for (size_t i = 0; i < ins.size(); ++i) gather_into_list(c, outs[i], ins[i]);
    });
  }

  FuturePtr reduce_scatter_list(at::Tensor& out, std::vector<at::Tensor>& ins, const c10d::ReduceOp& rop,
                                bool caller_waits = false) {
    if (!reduces(rop, out) || static_cast<int>(ins.size()) != setup_.size || !alike(ins, out)) return nullptr;
    auto [op, avg] = op_of(rop);
    std::vector<at::Tensor> outs{out};
    return run(K_REDUCE_SCATTER, ins, outs, out.nbytes(), caller_waits, [this, out, ins, op = op, avg = avg](Collectives& c) {
      const int64_t n = out.numel();
      at::Tensor joined = at::empty({setup_.size * n}, out.options());
      for (size_t q = 0; q < ins.size(); ++q) joined.narrow(0, static_cast<int64_t>(q) * n, n).copy_(ins[q].view(-1));
      c.begin(setup_.kind_codes[K_REDUCE_SCATTER], "reduce_scatter", dtype_code(out), joined.numel(), op);
      c.reduce_scatter(static_cast<char*>(out.data_ptr()), static_cast<const char*>(joined.data_ptr()), joined.numel(),
                       out.scalar_type(), out.element_size(), op);
      if (avg) out.div_(setup_.size);
    });
  }

  FuturePtr gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, int root, bool caller_waits = false) {
    std::vector<at::Tensor> outs;
    if (!rooted(in, out, root, &outs)) return nullptr;
    at::Tensor t = in[0];
    return run(K_GATHER, in, outs, t.nbytes(), caller_waits, [this, t, outs, root](Collectives& c) {
      c.begin(setup_.kind_codes[K_GATHER], "gather", dtype_code(t), t.numel(), OP_NONE, root);
      std::vector<char*> to;
      for (const auto& o : outs) to.push_back(static_cast<char*>(o.data_ptr()));
      c.gather(to, static_cast<const char*>(t.data_ptr()), t.nbytes(), root);
    });
  }

  FuturePtr scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in, int root, bool caller_waits = false) {
    std::vector<at::Tensor> ins;
    if (!rooted(out, in, root, &ins)) return nullptr;
    at::Tensor t = out[0];
    return run(K_SCATTER, ins, out, t.nbytes(), caller_waits, [this, t, ins, root](Collectives& c) {
      c.begin(setup_.kind_codes[K_SCATTER], "scatter", dtype_code(t), t.numel(), OP_NONE, root);
      std::vector<const char*> from;
      for (const auto& i : ins) from.push_back(static_cast<const char*>(i.data_ptr()));
      c.scatter(static_cast<char*>(t.data_ptr()), from, t.nbytes(), root);
    });
  }

  // all_to_all_single: rows of `in` go to the ranks by in_splits (empty: evenly), rows of `out`
  // come from them by out_splits
  FuturePtr all_to_all_single(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& out_splits,
                              const std::vector<int64_t>& in_splits, bool caller_waits = false) {
    const int p = setup_.size;
    if (!plain(out) || !plain(in) || out.scalar_type() != in.scalar_type() || dtype_code(in) < 0 || out.dim() == 0 ||
        in.dim() == 0 || out.sizes().slice(1) != in.sizes().slice(1))
      return nullptr;
    std::vector<int64_t> expects, sends;
    for (auto [t, splits, bytes] : {std::tuple<const at::Tensor*, const std::vector<int64_t>*, std::vector<int64_t>*>{
                                        &out, &out_splits, &expects}, {&in, &in_splits, &sends}}) {
      const int64_t rows = t->size(0), row_bytes = rows ? t->nbytes() / rows : 0;
      if (splits->empty()) {
        if (rows % p) return nullptr;
        bytes->assign(p, rows / p * row_bytes);
      } else {
        if (static_cast<int>(splits->size()) != p) return nullptr;
        int64_t sum = 0;
        for (int64_t n : *splits) {
          if (n < 0) return nullptr;
          sum += n;
          bytes->push_back(n * row_bytes);
        }
        if (sum != rows) return nullptr;
      }
    }
    std::vector<at::Tensor> outs{out}, ins{in};
    return run(K_ALL_TO_ALL, ins, outs, out.nbytes(), caller_waits, [this, out, in, expects, sends](Collectives& c) {
      c.begin(setup_.kind_codes[K_ALL_TO_ALL], "all_to_all", -1, 0);
      c.all_to_all(static_cast<char*>(out.data_ptr()), static_cast<const char*>(in.data_ptr()), expects, sends);
    });
  }

  // all_to_all of tensor lists: through one joined buffer each way, as the Python path does
  FuturePtr all_to_all_list(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins, bool caller_waits = false) {
    const int p = setup_.size;
    if (static_cast<int>(outs.size()) != p || static_cast<int>(ins.size()) != p || dtype_code(ins[0]) < 0 ||
        !alike(outs, ins[0], false) || !alike(ins, ins[0], false))
      return nullptr;
    std::vector<int64_t> expects, sends;
    for (int q = 0; q < p; ++q) expects.push_back(outs[q].nbytes()), sends.push_back(ins[q].nbytes());
    return run(K_ALL_TO_ALL, ins, outs, 0, caller_waits, [this, outs, ins, expects, sends](Collectives& c) {
      std::vector<at::Tensor> flat_ins;
      for (const auto& i : ins) flat_ins.push_back(i.view(-1).view(at::kByte));
      at::Tensor joined_in = at::cat(flat_ins);
      int64_t total = 0;
      for (int64_t n : expects) total += n;
      at::Tensor joined_out = at::empty({total}, joined_in.options());
      c.begin(setup_.kind_codes[K_ALL_TO_ALL], "all_to_all", -1, 0);
      c.all_to_all(static_cast<char*>(joined_out.data_ptr()), static_cast<const char*>(joined_in.data_ptr()), expects, sends);
      int64_t at = 0;
      for (size_t q = 0; q < outs.size(); ++q) {
        outs[q].view(-1).view(at::kByte).copy_(joined_out.narrow(0, at, expects[q]));
        at += expects[q];
      }
    });
  }

  FuturePtr barrier() {
    std::vector<at::Tensor> none;
    return run(K_BARRIER, none, none, 0, false, [this](Collectives& c) { c.barrier(setup_.kind_codes[K_BARRIER]); });
  }
  // timeout_s < 0: the group's
  FuturePtr monitored_barrier(double timeout_s, bool wait_all) {
    std::vector<at::Tensor> none;
    return run(K_BARRIER, none, none, 0, false, [this, timeout_s, wait_all](Collectives& c) {
      c.monitored_barrier(setup_.kind_codes[K_MONITORED_BARRIER], timeout_s, wait_all);
    });
  }

 private:
  // the list form of all_gather, as the Python path runs it: the tensor form on one joined
  // buffer, copied out of it in rank order
  void gather_into_list(Collectives& c, const std::vector<at::Tensor>& outs, const at::Tensor& in) {
    const int64_t n = in.numel();
    at::Tensor joined = at::empty({setup_.size * n}, in.options());
    c.begin(setup_.kind_codes[K_ALL_GATHER], "all_gather", dtype_code(in), n);
    c.all_gather(static_cast<char*>(joined.data_ptr()), static_cast<const char*>(in.data_ptr()), n, in.element_size());
    for (size_t q = 0; q < outs.size(); ++q) outs[q].view(-1).copy_(joined.narrow(0, static_cast<int64_t>(q) * n, n));
  }

  template <typename Body>
  FuturePtr run(int kind, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                int64_t nbytes, bool caller_waits, Body body) {
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    std::vector<at::Tensor> value = outputs;
    Core* core = core_.get();
    const int64_t slot = core_->recorder.scheduled(kind, inputs, outputs);
    const void* tag = fut.get();
    core_->submit(
        [core, fut, value, slot, body = std::move(body), to_error = &to_error]() mutable {
          // at once: run in the thread that issued it (not queued)
          if (slot >= 0) core->recorder.started(slot, core->runner.load(std::memory_order_relaxed) != std::this_thread::get_id());
          try {
            body(core->ops);
          } catch (const NativeError& e) {
            if (e.kind == ErrorKind::Peer) core->waiter.abort();
            fut->setError((*to_error)(e));
            return;
          } catch (const std::exception& e) {
            core->waiter.abort();
            fut->setError((*to_error)(NativeError(ErrorKind::Peer, core->waiter.what + " on rank " +
                                                                   std::to_string(core->rank) + ": " + e.what())));
            return;
          }
          core->recorder.completed(slot);
          fut->markCompleted(c10::IValue(value));
        },
        nbytes, tag, caller_waits);
    return fut;
  }

  std::shared_ptr<Core> core_;
};

}  // namespace shm_native
