/* What it costs to hand data from one core to another through shared memory, by how soon the
 * writer reuses the lines the reader last read: the effect behind COLLECTIVES_SHM_REGIONS.
 *
 * A writer pinned to CPU A copies BYTES into a shared buffer and raises a flag; a reader pinned to
 * CPU B copies them out and answers. The writer goes round RING such buffers, so it writes a
 * buffer again RING handoffs after the reader last read it (RING 1: at once, while the reader's
 * cache still holds those lines; the shm backend's default of two regions is RING 2). Then a
 * ping-pong of one word gives the round trip between the two cores.
 *
 *     cc -O2 -o /tmp/line_handoff benchmarks/studies/line_handoff.c
 *     /tmp/line_handoff 1048576 300 2          # BYTES ITERATIONS RING [CPU_A CPU_B] (default 0 1)
 *
 * It prints the best and mean microseconds per handoff (write plus the peer's read).
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set)) perror("sched_setaffinity");
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s BYTES ITERATIONS RING [CPU_A CPU_B]\n", argv[0]);
    return 2;
  }
  const size_t n = strtoul(argv[1], NULL, 10), ring = strtoul(argv[3], NULL, 10);
  const int iters = atoi(argv[2]), a = argc > 5 ? atoi(argv[4]) : 0, b = argc > 5 ? atoi(argv[5]) : 1;
  if (!n || !iters || !ring) {
    fprintf(stderr, "BYTES, ITERATIONS and RING must be positive\n");
    return 2;
  }
  char* shm = mmap(NULL, ring * n + 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  atomic_int* flag = (atomic_int*)(shm + ring * n);
  char* src = malloc(n);
  memset(src, 1, n);
  memset(shm, 0, ring * n);
  atomic_store(flag, 0);
  if (fork() == 0) {
    pin(b);
    char* dst = malloc(n);
    memset(dst, 0, n);
    for (int i = 0; i < iters; i++) {
      while (atomic_load(flag) != 2 * i + 1) {}
      memcpy(dst, shm + (i % ring) * n, n);
      atomic_store(flag, 2 * i + 2);
    }
    _exit(0);
  }
  pin(a);
  double best = 1e18, sum = 0;
  for (int i = 0; i < iters; i++) {
    double t = now_us();
    memcpy(shm + (i % ring) * n, src, n);
    atomic_store(flag, 2 * i + 1);
    while (atomic_load(flag) != 2 * i + 2) {}
    t = now_us() - t;
    best = t < best ? t : best;
    sum += t;
  }
  wait(NULL);
  printf("CPUs %d -> %d, %zu bytes, ring %zu: best %.1f us, mean %.1f us per handoff\n", a, b, n, ring, best,
         sum / iters);
  atomic_store(flag, 0);
  const int trips = 100000;
  if (fork() == 0) {
    pin(b);
    for (int i = 0; i < trips; i++) {
      while (atomic_load(flag) != 2 * i + 1) {}
      atomic_store(flag, 2 * i + 2);
    }
    _exit(0);
  }
  double t = now_us();
  for (int i = 0; i < trips; i++) {
    atomic_store(flag, 2 * i + 1);
    while (atomic_load(flag) != 2 * i + 2) {}
  }
  t = now_us() - t;
  wait(NULL);
  printf("ping-pong round trip between CPUs %d and %d: %.3f us\n", a, b, t / trips);
  return 0;
}
