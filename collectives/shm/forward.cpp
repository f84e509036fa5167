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
// Built on first import by torch.utils.cpp_extension (collectives/shm/native.py).

#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: the whole C++ API, a third of the build time
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace py = pybind11;
using c10::intrusive_ptr;
using c10d::Work;

namespace {

// A Python exception carried as a C++ one: C++ callers see what(); a pybind boundary (a Python
// caller of Work.wait) raises the original exception object again, its type included.
class PythonError : public std::runtime_error {
 public:
  PythonError(PyObject* error, const std::string& text)
      : std::runtime_error(text), error_(error, [](PyObject* e) {
          if (Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            Py_DECREF(e);
          }
        }) {
    Py_INCREF(error);
  }
  PyObject* error() const { return error_.get(); }

 private:
  std::shared_ptr<PyObject> error_;
};

// A Work on a Future: wait() rethrows the Future's error (torch's own future-wrapping Work
// returns true when the future failed).
class FutureWork : public Work {
 public:
  FutureWork(intrusive_ptr<c10::ivalue::Future> fut, c10d::OpType type)
      : Work(-1, type), fut_(std::move(fut)) {}

  bool isCompleted() override { return fut_->completed(); }
  bool isSuccess() const override { return fut_->completed() && !fut_->hasError(); }
  std::exception_ptr exception() const override {
    return fut_->completed() && fut_->hasError() ? fut_->exception_ptr() : nullptr;
  }
  bool wait(std::chrono::milliseconds /* timeout: the backend's own */) override {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;  // the worker thread that completes it needs the GIL
      fut_->wait();
    } else {
      fut_->wait();
    }
    if (fut_->hasError()) {
      std::rethrow_exception(fut_->exception_ptr());
    }
    return true;
  }
  intrusive_ptr<c10::ivalue::Future> getFuture() override { return fut_; }
  // recv from any source: the Future's value is the rank the message came from
  int sourceRank() const override {
    const auto& value = fut_->value();
    if (value.isInt()) {
      return static_cast<int>(value.toInt());
    }
    py::gil_scoped_acquire gil;
    return py::cast<int>(torch::jit::toPyObject(value));
  }

 private:
  intrusive_ptr<c10::ivalue::Future> fut_;
};

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
    return call("broadcast", c10d::OpType::BROADCAST, t, o);
  }
  intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call("allreduce", c10d::OpType::ALLREDUCE, t, o);
  }
  intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                          const c10d::AllreduceCoalescedOptions& o) override {
    return call("allreduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, t, o);
  }
  intrusive_ptr<Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return call("reduce", c10d::OpType::REDUCE, t, o);
  }
  intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                const c10d::AllgatherOptions& o) override {
    return call("allgather", c10d::OpType::ALLGATHER, out, in, o);
  }
  intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    return call("all_gather_single", c10d::OpType::_ALLGATHER_BASE, out, in, o);
  }
  intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllgatherOptions& o) override {
    return call("allgather_coalesced", c10d::OpType::ALLGATHER_COALESCED, out, in, o);
  }
  intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                      const c10d::AllgatherOptions& o) override {
    return call("allgather_into_tensor_coalesced", c10d::OpType::COALESCED, out, in, o);
  }
  intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                             const c10d::GatherOptions& o) override {
    return call("gather", c10d::OpType::GATHER, out, in, o);
  }
  intrusive_ptr<Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                              const c10d::ScatterOptions& o) override {
    return call("scatter", c10d::OpType::SCATTER, out, in, o);
  }
  intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                     const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter", c10d::OpType::REDUCE_SCATTER, out, in, o);
  }
  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_single", c10d::OpType::_REDUCE_SCATTER_BASE, out, in, o);
  }
  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, out, in, o);
  }
  intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                    std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return call("all_to_all_single", c10d::OpType::ALLTOALL_BASE, out, in, out_splits, in_splits, o);
  }
  intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                               const c10d::AllToAllOptions& o) override {
    return call("alltoall", c10d::OpType::ALLTOALL, out, in, o);
  }
  intrusive_ptr<Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return call("send", c10d::OpType::SEND, t, dst, tag);
  }
  intrusive_ptr<Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return call("recv", c10d::OpType::RECV, t, src, tag);
  }
  intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return call("recv_anysource", c10d::OpType::RECVANYSOURCE, t, tag);
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override {
    return call("barrier", c10d::OpType::BARRIER, o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    call("monitored_barrier", c10d::OpType::BARRIER, o, wait_all_ranks)->wait(std::chrono::milliseconds(0));
  }

 private:
  py::object impl_;
  std::string name_;
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
      .def_property_readonly("impl", &ForwardBackend::impl);
}
