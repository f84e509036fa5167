// A c10d Backend whose every call goes to a Python object: the shm backend's collectives.
//
// torch names a group, finds it by name (DeviceMesh, DTensor, the functional collectives) and
// sends its C++ callers (DDP's reducer, fully_shard) through the C++ Backend registered for the
// device. A Python subclass of ProcessGroup only catches the eight calls torch's trampoline
// forwards, and a Python subclass of Backend cannot be made (it has no constructor), so this
// Backend is the bridge: each call takes the GIL, calls the Python method of the same name with
// torch's own arguments (tensors, torch's option objects) and wraps the torch Future it returns
// in a Work whose wait() raises the collective's error.
//
// With the native path on (COLLECTIVES_SHM_PATH=native, the default), the calls it takes run in
// C++ with no GIL (native_engine.h, native_collectives.h, native_wait.h), and the others go to Python
// through the same engine's queue, so both keep one order.
//
// This file is the call table (ForwardBackend: each c10d call, to the engine or to Python) and the
// module's bindings; forward_work.h holds the Work types its calls return, forward_engine.h what
// makes a group's engine from Python and hands Python jobs to it.
//
// Built on first import by torch.utils.cpp_extension (collectives/shm/native.py).

#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: the whole C++ API, a third of the build time
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "forward_work.h"
#include "forward_engine.h"

namespace {

class ForwardBackend : public c10d::Backend {
 public:
  ForwardBackend(py::object impl, int rank, int size, std::string name)
      : Backend(rank, size), impl_(std::move(impl)), name_(std::move(name)) {}

  ~ForwardBackend() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      impl_ = py::object();
    } else {
      impl_.release();  // the interpreter is gone: nothing left to free it with
    }
  }

  const std::string getBackendName() const override { return name_; }
  py::object impl() const { return impl_; }
  void set_engine(std::shared_ptr<Engine> engine) { engine_ = std::move(engine); }

  // A native call (no GIL: released if the caller holds it), else null for the Python path.
  template <typename F>
  intrusive_ptr<Work> native(c10d::OpType type, F&& f) {
    if (!engine_) {
      return nullptr;
    }
    shm_native::FuturePtr fut;
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      fut = f(*engine_);
    } else {
      fut = f(*engine_);
    }
    return fut ? c10::make_intrusive<FutureWork>(fut, type, engine_) : nullptr;
  }

  // The coalesced forms on the native path: each pair its own native call, in order, when the
  // engine takes every pair (else null: the Python path, which does the same); one Work for them
  // all, done when all are, failed with the first error in order, as call_queue.py's _coalesced.
  template <typename Takes, typename Issue>
  intrusive_ptr<Work> native_coalesced(c10d::OpType type, std::vector<at::Tensor>& outs, size_t n, Takes takes,
                                       Issue issue) {
    if (!engine_) {
      return nullptr;
    }
    for (size_t i = 0; i < n; ++i) {
      if (!takes(*engine_, i)) return nullptr;
    }
    std::vector<shm_native::FuturePtr> futs;
    auto issue_all = [&] {
      for (size_t i = 0; i < n; ++i) futs.push_back(issue(*engine_, i));
    };
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      issue_all();
    } else {
      issue_all();
    }
    auto outer = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    std::vector<at::Tensor> value = outs;
    if (futs.empty()) {
      outer->markCompleted(c10::IValue(value));
      return c10::make_intrusive<FutureWork>(outer, type);
    }
    auto left = std::make_shared<std::atomic<size_t>>(futs.size());
    for (auto& f : futs) {
      // each callback holds the others' Futures until the last one runs (a Future drops its
      // callbacks once they have run)
      f->addCallback([outer, left, futs, value](c10::ivalue::Future&) {
        if (left->fetch_sub(1) != 1) return;
        for (const auto& g : futs) {
          if (g->hasError()) {
            outer->setError(g->exception_ptr());
            return;
          }
        }
        outer->markCompleted(c10::IValue(value));
      });
    }
    return c10::make_intrusive<FutureWork>(outer, type, engine_, futs.back().get());
  }

  // A point-to-point message on the native path (native_p2p.h), or null: the Python path then
  // checks the arguments and names what is wrong (one tensor, contiguous, a rank of the group)
  intrusive_ptr<Work> message(c10d::OpType type, int kind, std::vector<at::Tensor>& t, int peer) {
    if (!engine_ || t.size() != 1) return nullptr;
    auto fut = engine_->message(kind, t[0], peer);
    return fut ? c10::make_intrusive<MessageWork>(fut, type, engine_) : nullptr;
  }

  // The error a finished Python Future carries as its value (set_exception), or none. Needs the GIL.
  static std::exception_ptr python_error(c10::ivalue::Future& done) {
    if (!done.value().isPyObject()) {
      return nullptr;
    }
    py::object value = torch::jit::toPyObject(done.value());
    if (!PyExceptionInstance_Check(value.ptr())) {
      return nullptr;
    }
    std::string text =
        py::str(py::type::of(value).attr("__name__")).cast<std::string>() + ": " + py::str(value).cast<std::string>();
    return std::make_exception_ptr(PythonError(value.ptr(), text));
  }

  template <typename... Args>
  intrusive_ptr<Work> call(const char* method, c10d::OpType type, Args&&... args) {
    intrusive_ptr<c10::ivalue::Future> inner;
    std::exception_ptr error;
    bool done = false;
    {
      py::gil_scoped_acquire gil;
      py::object fut = impl_.attr(method)(std::forward<Args>(args)...);
      inner = py::cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>(fut)->fut;
      if (inner->completed()) {  // ran in the calling thread (small calls): settle it now, GIL in hand
        done = true;
        error = inner->hasError() ? inner->exception_ptr() : python_error(*inner);
      }
    }
    if (done && !error) {
      return c10::make_intrusive<FutureWork>(inner, type);
    }
    // A Python Future's set_exception stores the exception as its value (torch.futures): here it
    // becomes the error of a C++ Future, which every caller (Python, DDP's reducer) sees as one.
    auto outer = c10::make_intrusive<c10::ivalue::Future>(inner->elementType());
    if (done) {
      outer->setError(error);
      return c10::make_intrusive<FutureWork>(outer, type);
    }
    inner->addCallback([outer](c10::ivalue::Future& finished) {
      std::exception_ptr failed;
      if (finished.hasError()) {
        failed = finished.exception_ptr();
      } else {
        py::gil_scoped_acquire gil;
        failed = python_error(finished);
      }
      if (failed) {
        outer->setError(failed);
      } else {
        outer->markCompleted(finished.value());
      }
    });
    return c10::make_intrusive<FutureWork>(outer, type);
  }

  intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    if (auto w = native(c10d::OpType::BROADCAST, [&](Engine& e) { return e.broadcast(t, static_cast<int>(o.rootRank), caller_waits(o)); }))
      return w;
    return call("broadcast", c10d::OpType::BROADCAST, t, o);
  }
  intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    if (auto w = native(c10d::OpType::ALLREDUCE, [&](Engine& e) { return e.all_reduce(t, o.reduceOp, caller_waits(o)); }))
      return w;
    return call("allreduce", c10d::OpType::ALLREDUCE, t, o);
  }
  intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                          const c10d::AllreduceCoalescedOptions& o) override {
    if (auto w = native(c10d::OpType::ALLREDUCE_COALESCED,
                        [&](Engine& e) { return e.all_reduce_coalesced(t, o.reduceOp, caller_waits(o)); }))
      return w;
    return call("allreduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, t, o);
  }
  intrusive_ptr<Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    if (auto w = native(c10d::OpType::REDUCE,
                        [&](Engine& e) { return e.reduce(t, o.reduceOp, static_cast<int>(o.rootRank), caller_waits(o)); }))
      return w;
    return call("reduce", c10d::OpType::REDUCE, t, o);
  }
  intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                const c10d::AllgatherOptions& o) override {
    if (out.size() == 1 && in.size() == 1)
      if (auto w = native(c10d::OpType::ALLGATHER, [&](Engine& e) { return e.all_gather_list(out[0], in[0], caller_waits(o)); }))
        return w;
    return call("allgather", c10d::OpType::ALLGATHER, out, in, o);
  }
  intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    if (auto w = native(c10d::OpType::_ALLGATHER_BASE, [&](Engine& e) { return e.all_gather(out, in, caller_waits(o)); }))
      return w;
    return call("all_gather_single", c10d::OpType::_ALLGATHER_BASE, out, in, o);
  }
  intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllgatherOptions& o) override {
    // out[q][i]: rank q's in[i]; the engine takes them per input, as the Python path does
    bool fits = static_cast<int>(out.size()) == getSize();
    for (const auto& outs : out) fits = fits && outs.size() == in.size();
    if (fits) {
      std::vector<std::vector<at::Tensor>> per_input(in.size());
      for (size_t i = 0; i < in.size(); ++i)
        for (auto& outs : out) per_input[i].push_back(outs[i]);
      if (auto w = native(c10d::OpType::ALLGATHER_COALESCED,
                          [&](Engine& e) { return e.all_gather_coalesced(per_input, in, caller_waits(o)); }))
        return w;
    }
    return call("allgather_coalesced", c10d::OpType::ALLGATHER_COALESCED, out, in, o);
  }
  intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                      const c10d::AllgatherOptions& o) override {
    if (out.size() == in.size())
      if (auto w = native_coalesced(
              c10d::OpType::COALESCED, out, out.size(), [&](Engine& e, size_t i) { return e.takes_all_gather(out[i], in[i]); },
              [&](Engine& e, size_t i) { return e.all_gather(out[i], in[i], false); }))
        return w;
    return call("allgather_into_tensor_coalesced", c10d::OpType::COALESCED, out, in, o);
  }
  intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                             const c10d::GatherOptions& o) override {
    if (auto w = native(c10d::OpType::GATHER,
                        [&](Engine& e) { return e.gather(out, in, static_cast<int>(o.rootRank), caller_waits(o)); }))
      return w;
    return call("gather", c10d::OpType::GATHER, out, in, o);
  }
  intrusive_ptr<Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                              const c10d::ScatterOptions& o) override {
    if (auto w = native(c10d::OpType::SCATTER,
                        [&](Engine& e) { return e.scatter(out, in, static_cast<int>(o.rootRank), caller_waits(o)); }))
      return w;
    return call("scatter", c10d::OpType::SCATTER, out, in, o);
  }
  intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                     const c10d::ReduceScatterOptions& o) override {
    if (out.size() == 1 && in.size() == 1)
      if (auto w = native(c10d::OpType::REDUCE_SCATTER,
                          [&](Engine& e) { return e.reduce_scatter_list(out[0], in[0], o.reduceOp, caller_waits(o)); }))
        return w;
    return call("reduce_scatter", c10d::OpType::REDUCE_SCATTER, out, in, o);
  }
  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::ReduceScatterOptions& o) override {
    if (auto w = native(c10d::OpType::_REDUCE_SCATTER_BASE,
                        [&](Engine& e) { return e.reduce_scatter(out, in, o.reduceOp, caller_waits(o)); }))
      return w;
    return call("reduce_scatter_single", c10d::OpType::_REDUCE_SCATTER_BASE, out, in, o);
  }
  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    if (out.size() == in.size())
      if (auto w = native_coalesced(
              c10d::OpType::COALESCED, out, out.size(),
              [&](Engine& e, size_t i) { return e.takes_reduce_scatter(out[i], in[i], o.reduceOp); },
              [&](Engine& e, size_t i) { return e.reduce_scatter(out[i], in[i], o.reduceOp, false); }))
        return w;
    return call("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, out, in, o);
  }
  intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                    std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    if (auto w = native(c10d::OpType::ALLTOALL_BASE,
                        [&](Engine& e) { return e.all_to_all_single(out, in, out_splits, in_splits, caller_waits(o)); }))
      return w;
    return call("all_to_all_single", c10d::OpType::ALLTOALL_BASE, out, in, out_splits, in_splits, o);
  }
  intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                               const c10d::AllToAllOptions& o) override {
    if (auto w = native(c10d::OpType::ALLTOALL, [&](Engine& e) { return e.all_to_all_list(out, in, caller_waits(o)); }))
      return w;
    return call("alltoall", c10d::OpType::ALLTOALL, out, in, o);
  }
  intrusive_ptr<Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    if (auto w = message(c10d::OpType::SEND, shm_native::Messages::SEND, t, dst)) return w;
    return call("send", c10d::OpType::SEND, t, dst, tag);
  }
  intrusive_ptr<Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    if (auto w = message(c10d::OpType::RECV, shm_native::Messages::RECV, t, src)) return w;
    return call("recv", c10d::OpType::RECV, t, src, tag);
  }
  intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    if (auto w = message(c10d::OpType::RECVANYSOURCE, shm_native::Messages::RECV_ANY, t, -1)) return w;
    return call("recv_anysource", c10d::OpType::RECVANYSOURCE, t, tag);
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override {
    if (auto w = native(c10d::OpType::BARRIER, [&](Engine& e) { return e.barrier(); }))
      return w;
    return call("barrier", c10d::OpType::BARRIER, o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    const double timeout_s = o.timeout.count() > 0 ? o.timeout.count() / 1000.0 : -1.0;  // else the group's
    if (auto w = native(c10d::OpType::BARRIER, [&](Engine& e) { return e.monitored_barrier(timeout_s, wait_all_ranks); })) {
      w->wait(std::chrono::milliseconds(0));
      return;
    }
    call("monitored_barrier", c10d::OpType::BARRIER, o, wait_all_ranks)->wait(std::chrono::milliseconds(0));
  }

 private:
  py::object impl_;
  std::string name_;
  std::shared_ptr<Engine> engine_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_::import("torch.distributed");  // torch's Backend and option types, registered first
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const PythonError& e) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.error())), e.error());
    }
  });
  py::class_<ForwardBackend, c10d::Backend, intrusive_ptr<ForwardBackend>>(m, "ForwardBackend")
      .def(py::init<py::object, int, int, std::string>(), py::arg("impl"), py::arg("rank"), py::arg("size"),
           py::arg("name"))
      .def_property_readonly("impl", &ForwardBackend::impl)
      .def("set_engine", &ForwardBackend::set_engine);
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def("submit_python", &submit_python, py::arg("run"), py::arg("nbytes"))
      .def("drain", &Engine::drain, py::call_guard<py::gil_scoped_release>())
      .def("drain_messages", &Engine::drain_messages, py::call_guard<py::gil_scoped_release>())
      .def("all_reduce", &direct_all_reduce, py::arg("tensor"), py::arg("op"))
      .def("takes_all_reduce", &direct_takes, py::arg("tensor"), py::arg("op"))
      .def_readwrite("moves_nothing", &Engine::moves_nothing)
      .def("next_ids", [](Engine& e, bool p2p) {  // (record id, collective seq, p2p seq, op id)
        int64_t r, c, p, o;
        e.recorder().next_ids(p2p, &r, &c, &p, &o);
        return py::make_tuple(r, c, p, o);
      })
      .def("recorded", [](Engine& e) {  // the native calls' entries, oldest first (recorder.py reads them)
        py::list out;
        for (const auto& x : e.recorder().entries()) {
          if (x.record_id < 0) continue;
          py::list in_sizes, out_sizes;
          for (int i = 0; i < x.in_dims; ++i) in_sizes.append(x.in_sizes[i]);
          for (int i = 0; i < x.out_dims; ++i) out_sizes.append(x.out_sizes[i]);
          // a message: torchfrtrace's "send 0->1", "recv 1<-0" (group ranks; from any source: -1)
          const std::string rank = std::to_string(e.waiter_rank());
          const std::string name = x.kind == shm_native::Recorder::P2P_SEND   ? "send " + rank + "->" + std::to_string(x.peer)
                                   : x.kind == shm_native::Recorder::P2P_RECV ? "recv " + rank + "<-" + std::to_string(x.peer)
                                                                              : std::string(shm_native::kind_name(x.kind));
          out.append(py::make_tuple(x.record_id, x.collective_seq_id, x.p2p_seq_id, x.op_id, name,
                                    x.created, x.started, x.completed, x.state,
                                    x.dtype < 0 ? py::object(py::none())
                                                : py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(
                                                      torch::getTHPDtype(static_cast<at::ScalarType>(x.dtype)))),
                                    x.in_dims < 0 ? py::object(py::none()) : py::object(in_sizes),
                                    x.out_dims < 0 ? py::object(py::none()) : py::object(out_sizes), x.thread));
        }
        return out;
      })
      .def("recorder_status", [](Engine& e) {
        auto& r = e.recorder();
        return py::make_tuple(r.last_enqueued, r.last_started, r.last_completed);
      })
      .def_property_readonly("round", [](Engine& e) { return e.ops().round; })
      .def_property_readonly("calls", [](Engine& e) { return e.ops().calls; })
      .def_property_readonly("step", [](Engine& e) { return e.waiter().step; })
      .def_property_readonly("slept", [](Engine& e) { return e.waiter().slept.load(); })
      .def_property_readonly("woken", [](Engine& e) { return e.waiter().woken.load(); })
      // the cores a waiting rank holds the machine's runnable threads against (native_wait.h)
      .def_property_readonly("machine_cores", [](Engine& e) { return e.waiter().machine_cores(); })
      // (waits that spun, those whose spin the machine reading cut short): native_wait.h
      .def_property_readonly("spins", [](Engine& e) {
        return py::make_tuple(e.waiter().spun.load(), e.waiter().spins_cut.load());
      });
  m.def("make_engine", &make_engine, py::arg("setup"), py::arg("make_error"));
}
