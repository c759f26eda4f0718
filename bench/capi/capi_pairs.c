/* Warm alloc/free pairs through the C API (gpu_arena_malloc / gpu_arena_free, as
 * bench/gpu/kv_bench.cpp calls them), for callgrind: the C layer's share of a pair is this
 * target's instructions per pair minus pair_cost's (Pool::alloc / Pool::free).
 *
 *   cargo build --release -p gpu-arena-ffi
 *   cc -O2 -Iffi/include bench/capi/capi_pairs.c -Ltarget/release -lgpu_arena \
 *       -Wl,-rpath,$PWD/target/release -o target/release/capi_pairs
 *   GPU_ARENA_BACKEND=sim valgrind --tool=callgrind --collect-atstart=no \
 *       --toggle-collect='capi_pairs' target/release/capi_pairs 100000
 *
 * Pairs of 2 MiB on one stream (the thread cache's hit path after the first pair). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "gpu_arena.h"

#define BLOCK ((ssize_t)2 << 20)

__attribute__((noinline)) long capi_pairs(long n, void *stream) {
  long bad = 0;
  for (long i = 0; i < n; i++) {
    void *p = gpu_arena_malloc(BLOCK, 0, stream);
    if (!p) bad++;
    gpu_arena_free(p, BLOCK, 0, stream);
  }
  return bad;
}

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 2000000;
  void *stream = (void *)7;
  gpu_arena_init(1);
  if (capi_pairs(1, stream)) {
    fprintf(stderr, "gpu_arena_malloc: %s\n", gpu_arena_last_error());
    return 1;
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long bad = capi_pairs(n, stream);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (bad) {
    fprintf(stderr, "%ld allocations failed: %s\n", bad, gpu_arena_last_error());
    return 1;
  }
  double ns = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / (double)n;
  printf("capi pairs: %ld, %.1f ns per pair\n", n, ns);
  return 0;
}
