// The Works forward.cpp's calls return (process_group.py's Work and call_queue.py's waits, in
// C++): a Work on a torch Future whose wait() raises the collective's own error, a point-to-point
// message's Work, and whether torch's caller waits for a call at once.

#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "native_engine.h"

namespace py = pybind11;
using c10::intrusive_ptr;
using c10d::Work;
using shm_native::Engine;

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
  // help_tag: the queued call a waiter runs the queue up to (Engine::help); by default this Work's own
  FutureWork(intrusive_ptr<c10::ivalue::Future> fut, c10d::OpType type, std::shared_ptr<Engine> engine = nullptr,
             const void* help_tag = nullptr)
      : Work(-1, type), fut_(std::move(fut)), engine_(std::move(engine)), help_tag_(help_tag) {}

  bool isCompleted() override { return fut_->completed(); }
  bool isSuccess() const override { return fut_->completed() && !fut_->hasError(); }
  std::exception_ptr exception() const override {
    return fut_->completed() && fut_->hasError() ? fut_->exception_ptr() : nullptr;
  }
  bool wait(std::chrono::milliseconds /* timeout: the backend's own */) override {
    wait_for(fut_, engine_.get(), help_tag_);
    return true;
  }
  intrusive_ptr<c10::ivalue::Future> getFuture() override { return fut_; }

  // Until `fut` has finished; rethrows its error. A native call's waiter: the engine's worker may
  // spin while someone waits for it, and a call still queued runs here (Engine::help) rather than
  // on the worker thread.
  static void wait_for(const intrusive_ptr<c10::ivalue::Future>& fut, Engine* engine, const void* help_tag = nullptr) {
    struct Waiting {
      std::atomic<int>* n;
      explicit Waiting(std::atomic<int>* c) : n(c) { if (n) n->fetch_add(1); }
      ~Waiting() { if (n) n->fetch_sub(1); }
    } waiting(engine && !fut->completed() ? &engine->callers_waiting() : nullptr);
    auto finish = [&] {
      if (engine && !fut->completed()) engine->help(help_tag ? help_tag : fut.get());
      fut->wait();
    };
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;  // the worker thread that completes it needs the GIL
      finish();
    } else {
      finish();
    }
    if (fut->hasError()) {
      std::rethrow_exception(fut->exception_ptr());
    }
  }

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
  std::shared_ptr<Engine> engine_;
  const void* help_tag_;
};

// A point-to-point message's Work (native_p2p.h): its thread fails a Future with a NativeError, and
// wait() raises it as the Python path's exception of the same kind (which needs the GIL, so the
// message thread never makes one).
class MessageWork : public FutureWork {
 public:
  MessageWork(intrusive_ptr<c10::ivalue::Future> fut, c10d::OpType type, std::shared_ptr<Engine> engine)
      : FutureWork(std::move(fut), type), engine_(std::move(engine)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    try {
      return FutureWork::wait(timeout);
    } catch (const shm_native::NativeError& e) {
      std::rethrow_exception(engine_->to_error(e));
    }
  }

 private:
  std::shared_ptr<Engine> engine_;
};

// Whether torch's caller waits for the call at once (dist.all_reduce(..., async_op=False) sets
// opts.asyncOp = false); torch before asyncOp existed: no.
template <typename O, typename = void>
struct HasAsyncOp : std::false_type {};
template <typename O>
struct HasAsyncOp<O, std::void_t<decltype(std::declval<O>().asyncOp)>> : std::true_type {};
template <typename O>
bool caller_waits(const O& o) {
  if constexpr (HasAsyncOp<O>::value) {
    return !o.asyncOp;
  } else {
    return false;
  }
}

}  // namespace
