/* Whether a futex wake-up is lost when the waker reads the sleepers' flags right after storing its
 * word, with no fence between the store and the read: the barrier of native_wait.h without its fence.
 *
 * A waker process stores step i into a shared word and, if the sleeper's flag is up, wakes it
 * (FUTEX_WAKE). The sleeper raises its flag and sleeps on the word while it is below i
 * (FUTEX_WAIT, 20 ms timeout), then answers. x86 lets the waker's read of the flag pass its
 * store, so the waker can see no flag while the sleeper, having raised it, reads the old word in
 * the kernel and sleeps: that sleep ends only at its timeout. FENCE 1 puts a full fence between
 * the store and the read, as native_wait.h does. The waker waits a random 0 to SPREAD loop turns
 * before each store, so the two sides meet at every offset.
 *
 *     cc -O2 -o /tmp/lost_wake benchmarks/studies/lost_wake.c
 *     /tmp/lost_wake 300000 0 3000        # ITERATIONS FENCE SPREAD
 *
 * It prints how many sleeps there were and how many ended at the timeout (a wake-up lost, or the
 * waker kept off its core for 20 ms).
 */
#include <errno.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  _Alignas(64) _Atomic int32_t step;
  _Alignas(64) _Atomic int32_t sleeping;
  _Alignas(64) _Atomic int32_t ack;
} Words;

static long futex(void* word, int op, int value, const struct timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s ITERATIONS FENCE(0|1) SPREAD\n", argv[0]);
    return 2;
  }
  const int n = atoi(argv[1]), fence = atoi(argv[2]);
  const unsigned spread = (unsigned)atoi(argv[3]) + 1;
  Words* w = mmap(NULL, sizeof(Words), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (w == MAP_FAILED) return 1;
  const pid_t waker = fork();
  if (waker == 0) {
    unsigned x = 12345;
    for (int i = 1; i <= n; ++i) {
      x = x * 1103515245u + 12345u;
      for (volatile unsigned k = 0, turns = (x >> 16) % spread; k < turns; ++k) {
      }
      atomic_store_explicit(&w->step, i, memory_order_release);
      if (fence) atomic_thread_fence(memory_order_seq_cst);
      if (atomic_load_explicit(&w->sleeping, memory_order_acquire)) futex(&w->step, FUTEX_WAKE, 1 << 30, NULL);
      while (atomic_load_explicit(&w->ack, memory_order_acquire) < i) {
      }
    }
    _exit(0);
  }
  long sleeps = 0, timeouts = 0;
  const struct timespec timeout = {0, 20 * 1000 * 1000};
  for (int i = 1; i <= n; ++i) {
    int32_t seen;
    while ((seen = atomic_load_explicit(&w->step, memory_order_acquire)) < i) {
      atomic_store_explicit(&w->sleeping, 1, memory_order_release);
      ++sleeps;
      if (futex(&w->step, FUTEX_WAIT, seen, &timeout) == -1 && errno == ETIMEDOUT) ++timeouts;
      atomic_store_explicit(&w->sleeping, 0, memory_order_release);
    }
    atomic_store_explicit(&w->ack, i, memory_order_release);
  }
  waitpid(waker, NULL, 0);
  printf("fence %d: %d iterations, %ld sleeps, %ld ended at the 20 ms timeout\n", fence, n, sleeps, timeouts);
  return 0;
}
