// The cross-core probe of benchmarks/crosscore.py: how fast data moves between CPU 0 and CPU 1.
//  * round trip: one cache line bounced CPU 0 -> CPU 1 -> CPU 0 (median of 5000, ns);
//  * split: CPU 0 and CPU 1 each write half of a 4 MiB buffer, then CPU 0 reads all
//    of it, 16 times (median over rounds, us): what each K-chunk of an XLA:CPU decode
//    does (a fusion split over two threads, then a dot on one);
//  * one core: the same writes and reads on CPU 0 alone (us).
// Usage: crosscore [rounds]; prints one JSON line. Linux only (thread affinity); exits 2
// where it may not run threads on CPUs 0 and 1.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}
static void pin(int c) {  // exits where CPU c is not this process's (taskset, a cpuset)
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(c, &s);
  if (pthread_setaffinity_np(pthread_self(), sizeof s, &s) != 0) {
    fprintf(stderr, "crosscore: cannot run a thread on CPU %d (needs CPUs 0 and 1)\n", c);
    exit(2);
  }
}
static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

enum { PINGS = 5000 };
#define WORDS ((4u << 20) / sizeof(unsigned))
static _Alignas(64) atomic_int flag;
static unsigned *buf;
static atomic_int go, done;

static void *pong(void *unused) {
  pin(1);
  for (int i = 0; i < PINGS; i++) {
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {}
    atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
  }
  return unused;
}
static void fill(unsigned *p, size_t n, unsigned v) { for (size_t i = 0; i < n; i++) p[i] = v + (unsigned)i; }
static unsigned sum(const unsigned *p, size_t n) { unsigned s = 0; for (size_t i = 0; i < n; i++) s += p[i]; return s; }
static void *writer(void *unused) {  // CPU 1: the second half of the buffer, once per `go`
  pin(1);
  for (int it = 1;; it++) {
    int g;
    while ((g = atomic_load(&go)) < it && g >= 0) {}
    if (g < 0) return unused;
    fill(buf + WORDS / 2, WORDS / 2, (unsigned)it);
    atomic_store(&done, it);
  }
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 20;
  if (rounds < 1) rounds = 1;
  pin(0);
  pthread_t t;
  double *rt = malloc(sizeof(double) * PINGS), *split = malloc(sizeof(double) * rounds),
         *one = malloc(sizeof(double) * rounds);
  pthread_create(&t, 0, pong, 0);
  for (int i = 0; i < PINGS; i++) {
    double s = now();
    atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {}
    rt[i] = now() - s;
  }
  pthread_join(t, 0);
  buf = aligned_alloc(64, WORDS * sizeof(unsigned));
  memset(buf, 0, WORDS * sizeof(unsigned));
  pthread_create(&t, 0, writer, 0);
  volatile unsigned acc = 0;
  int it = 0;
  for (int r = 0; r < rounds; r++) {
    double s = now();
    for (int k = 0; k < 16; k++) {
      atomic_store(&go, ++it);
      fill(buf, WORDS / 2, (unsigned)it);
      while (atomic_load(&done) < it) {}
      acc += sum(buf, WORDS);
    }
    split[r] = (now() - s) / 1e3;
    s = now();
    for (int k = 0; k < 16; k++) {
      fill(buf, WORDS, (unsigned)k);
      acc += sum(buf, WORDS);
    }
    one[r] = (now() - s) / 1e3;
  }
  atomic_store(&go, -1);
  pthread_join(t, 0);
  qsort(rt, PINGS, sizeof(double), cmp);
  qsort(split, rounds, sizeof(double), cmp);
  qsort(one, rounds, sizeof(double), cmp);
  printf("{\"roundtrip_ns\": %.0f, \"split_us\": %.0f, \"one_core_us\": %.0f}\n", rt[PINGS / 2],
         split[rounds / 2], one[rounds / 2]);
  return acc == 12345u;  // keeps the sums
}
