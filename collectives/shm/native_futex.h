// The words ranks wait on: futex.py in C++. Acquire and release loads and stores of the segment's
// int32 words, their wrapping order, the futex's wait and wake, and a spinning core's pause.

#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHM_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define SHM_PAUSE() __asm__ __volatile__("yield")
#else
#define SHM_PAUSE() ((void)0)
#endif

#include <chrono>
#include <cstdint>

namespace shm_native {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The step counters are int32 words that wrap from INT32_MAX to INT32_MIN (a long job passes 2^31
// barriers: hours of small calls back to back). The ranks are never 2^31 steps apart, so a rank is
// behind a step when the 32-bit difference is negative (wait.py's after and behind).
inline int32_t after(int32_t step) { return static_cast<int32_t>(static_cast<uint32_t>(step) + 1u); }
inline bool behind(int32_t word, int32_t step) {
  return static_cast<int32_t>(static_cast<uint32_t>(word) - static_cast<uint32_t>(step)) < 0;
}

inline int32_t load(volatile int32_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
inline void store(volatile int32_t* w, int32_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

// true when another thread's FUTEX_WAKE ended the sleep (not the timeout, a changed word or a signal)
inline bool futex_wait(volatile int32_t* w, int32_t expected, double timeout_s) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_s);
  ts.tv_nsec = static_cast<long>((timeout_s - ts.tv_sec) * 1e9);
  return syscall(SYS_futex, const_cast<int32_t*>(w), FUTEX_WAIT, expected, &ts, nullptr, 0) == 0;
}

inline void futex_wake(volatile int32_t* w) {
  syscall(SYS_futex, const_cast<int32_t*>(w), FUTEX_WAKE, 1 << 30, nullptr, nullptr, 0);
}

}  // namespace shm_native
