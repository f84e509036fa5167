// What a group's engine is made from: native_setup.py's setup() in C++, the dict process_group.py
// hands forward.cpp's make_engine (the segment's words, the settings, the rank's place and the
// tables that say which dtypes and ops the native path takes).

#pragma once

#include <cstdint>
#include <string>

#include "native_p2p.h"
#include "native_collectives.h"

namespace shm_native {

struct Setup {  // what process_group.py hands the engine (native_setup.setup)
  Words words;
  Config config;
  int rank = 0, size = 1;
  Strategy strategy = FUTEX;
  double timeout_s = 600, spin_s_idle = 0;
  int cores = 0;               // the CPUs the ranks may run on together (layout.agree; 0: every core online)
  std::string loadavg = "/proc/loadavg";  // where the wait reads the machine's runnable threads (native_wait.h)
  std::string proc = "/proc";             // where it reads a peer's run delay, <proc>/<pid>/schedstat
  int64_t inline_bytes = 64 << 10;
  int worker_nice = 19;        // the worker thread's nice value (ShmConfig.worker_nice)
  int64_t cma_min_bytes = -1;  // all_reduces this large go by cross-memory attach (Python); -1: never
  int64_t round = 0, calls = 0;
  int step = 0;
  int dtype_codes[64];         // ScalarType -> ops.DTYPE_CODES (-1: not known)
  uint8_t reducible[8][64];    // [op][ScalarType]: the native path sums it (check_op_dtype's rule, no widening)
  int kind_codes[16];          // native kinds below -> ops.KINDS index + 1
  int64_t recorder_entries = 0;  // the flight record's size (0: off)
  Mailboxes mail;                // the pair mailboxes (none past 64 ranks: messages take the Python path)
};

}  // namespace shm_native
