// A group's engine made from Python, and Python's jobs handed to it: native_setup.py's dict
// turned into the engine's Setup, collectives.shm.all_reduce's call into the engine (direct.py),
// and a Python-path call run in the engine's queue with its counters (call_queue.py).

#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>

#include "forward_work.h"

namespace {

// A Python object kept by C++ code that may drop it in a thread without the GIL.
struct PyHolder {
  explicit PyHolder(py::object o) : obj(std::move(o)) {}
  ~PyHolder() {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      obj = py::object();
    } else {
      obj.release();
    }
  }
  py::object obj;
};

// The engine of a group, from native_setup.setup()'s dict; make_error(kind,
// text, what, bank) is the Python exception a failed native call raises.
std::shared_ptr<Engine> make_engine(py::dict d, py::object make_error) {
  shm_native::Setup s;
  s.words.control = reinterpret_cast<volatile int32_t*>(d["control"].cast<uintptr_t>());
  s.words.step0 = d["step0"].cast<int>();
  s.words.pid0 = d["pid0"].cast<int>();
  s.words.sleep0 = d["sleep0"].cast<int>();
  s.words.call0 = d["call0"].cast<int>();
  s.words.call_words = d["call_words"].cast<int>();
  s.words.abort_word = d["abort"].cast<int>();
  s.words.abort_seen_by = d["abort_seen_by"].cast<int>();
  s.words.abort_why = d["abort_why"].cast<int>();
  s.config.control_bytes = d["control_bytes"].cast<int64_t>();
  s.config.slot_bytes = d["slot_bytes"].cast<int64_t>();
  s.config.half_bytes = d["half_bytes"].cast<int64_t>();
  s.config.regions = d["regions"].cast<int64_t>();
  s.config.piece_bytes = d["piece_bytes"].cast<int64_t>();
  s.config.small_bytes = d["small_bytes"].cast<int64_t>();
  s.rank = d["rank"].cast<int>();
  s.size = d["size"].cast<int>();
  s.strategy = static_cast<shm_native::Strategy>(d["strategy"].cast<int>());
  s.timeout_s = d["timeout_s"].cast<double>();
  s.spin_s_idle = d["spin_s_idle"].cast<double>();
  if (auto mail = d["mail"].cast<uintptr_t>()) {
    s.mail.boxes = reinterpret_cast<uint8_t*>(mail);
    s.mail.box_bytes = d["mailbox_bytes"].cast<int64_t>();
    s.mail.sent = s.words.control + d["mail_sent0"].cast<int>();
    s.mail.taken = s.words.control + d["mail_taken0"].cast<int>();
  }
  s.cores = d["cores"].cast<int>();
  if (d.contains("loadavg")) s.loadavg = d["loadavg"].cast<std::string>();
  if (d.contains("proc")) s.proc = d["proc"].cast<std::string>();
  s.inline_bytes = d["inline_bytes"].cast<int64_t>();
  s.worker_nice = d["worker_nice"].cast<int>();
  s.cma_min_bytes = d["cma_min_bytes"].cast<int64_t>();
  s.round = d["round"].cast<int64_t>();
  s.calls = d["calls"].cast<int64_t>();
  s.step = d["step"].cast<int>();
  for (auto& c : s.dtype_codes) c = -1;
  auto scalar_type = [](py::handle dtype) {  // a torch.dtype's ScalarType number
    if (!THPDtype_Check(dtype.ptr())) throw std::invalid_argument("make_engine: expected a torch.dtype");
    return static_cast<int>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
  };
  for (auto pair : d["dtype_codes"].cast<py::list>()) {  // [(torch.dtype, ops.DTYPE_CODES code)]
    auto t = pair.cast<py::tuple>();
    const int st = scalar_type(t[0]);
    if (st >= 0 && st < 64) s.dtype_codes[st] = t[1].cast<int>();
  }
  std::memset(s.reducible, 0, sizeof s.reducible);
  for (auto pair : d["reducible"].cast<py::list>()) {  // [(ops.OPS index, torch.dtype)]
    auto t = pair.cast<py::tuple>();
    const int op = t[0].cast<int>(), st = scalar_type(t[1]);
    if (op > 0 && op < 8 && st >= 0 && st < 64) s.reducible[op][st] = 1;
  }
  s.recorder_entries = d["recorder_entries"].cast<int64_t>();
  auto kinds = d["kind_codes"].cast<py::list>();  // in native_engine.h's Kind order
  for (size_t k = 0; k < kinds.size() && k < 16; ++k) s.kind_codes[k] = kinds[k].cast<int>();
  auto engine = std::make_shared<Engine>(s);
  auto maker = std::make_shared<PyHolder>(std::move(make_error));
  engine->to_error = [maker](const shm_native::NativeError& e) -> std::exception_ptr {
    py::gil_scoped_acquire gil;
    py::object bank = py::none();
    std::string what;
    if (auto m = dynamic_cast<const shm_native::Mismatch*>(&e)) {
      bank = py::cast(m->bank);
      what = m->what;
    }
    py::object error = maker->obj(static_cast<int>(e.kind), std::string(e.what()), what, bank);
    std::string text =
        py::str(py::type::of(error).attr("__name__")).cast<std::string>() + ": " + py::str(error).cast<std::string>();
    return std::make_exception_ptr(PythonError(error.ptr(), text));
  };
  return engine;
}

// collectives.shm.all_reduce (direct.py): the native all_reduce called from Python without torch's
// dispatch, as DeepSpeed's inference_all_reduce is called. The same engine call a dist.all_reduce
// on the group makes, waited for as its Work waits. False when the native path does not take the
// call (the caller then goes through dist.all_reduce); op is a c10d RedOpType number.
bool direct_takes(const std::shared_ptr<Engine>& engine, const at::Tensor& tensor, int op) {
  // dist.all_reduce views a complex tensor as real pairs before the backend sees it; this call does not
  return !tensor.is_complex() && engine->takes_all_reduce(tensor, op);
}

bool direct_all_reduce(const std::shared_ptr<Engine>& engine, const at::Tensor& tensor, int op) {
  if (!direct_takes(engine, tensor, op)) {
    return false;
  }
  std::vector<at::Tensor> ts{tensor};
  const c10d::ReduceOp rop(static_cast<c10d::ReduceOp::RedOpType>(op));
  shm_native::FuturePtr fut;
  {
    py::gil_scoped_release no_gil;
    fut = engine->all_reduce(ts, rop, /*caller_waits=*/true);
  }
  if (!fut) {
    return false;
  }
  FutureWork::wait_for(fut, engine.get());
  return true;
}

// A call the Python path runs, in the engine's order: run(round, calls, step, spin_s) runs the
// job with the engine's counters and returns the counters it left and what settles its Future
// (call_queue.py: _submit), called once the counters are back.
void submit_python(Engine& engine, py::object run, int64_t nbytes) {
  auto holder = std::make_shared<PyHolder>(std::move(run));
  Engine* e = &engine;
  engine.submit(
      [e, holder] {
        py::gil_scoped_acquire gil;
        auto& ops = e->ops();
        auto& waiter = e->waiter();
        try {
          py::tuple left = holder->obj(ops.round, ops.calls, waiter.step, waiter.spin_s);
          ops.round = left[0].cast<int64_t>();
          ops.calls = left[1].cast<int64_t>();
          waiter.step = left[2].cast<int>();
          left[3]();  // settle the Future: its callbacks' collectives run on the counters just handed back
        } catch (py::error_already_set& err) {  // _run catches the job's errors: this is a bug
          err.restore();
          PyErr_Print();
          waiter.abort();
        }
      },
      nbytes);
}

}  // namespace
