/*
 * blocks.h: the memory of api_test.c's blocks: a pattern written over a block (all of it
 * when small, its head, middle and tail when large) and read back, and the size the pool
 * gives a request (pool::block_len).
 */
#ifndef GPU_ARENA_TESTS_BLOCKS_H
#define GPU_ARENA_TESTS_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

static inline void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        p[i] = (unsigned char)(seed * 131u + i * 7u + (i >> 9));
    }
}

static inline size_t mismatch(const unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != (unsigned char)(seed * 131u + i * 7u + (i >> 9))) {
            return i;
        }
    }
    return (size_t)-1;
}

/* Write a pattern over the whole block when small, over its head, middle and tail when large
 * (sim memory is touched only when written). */
#define SPOT ((size_t)64 * 1024)
static inline void write_block(void *ptr, size_t size, unsigned seed) {
    unsigned char *p = ptr;
    if (size <= 3 * SPOT) {
        fill(p, size, seed);
        return;
    }
    fill(p, SPOT, seed);
    fill(p + size / 2 - SPOT / 2, SPOT, seed + 1);
    fill(p + size - SPOT, SPOT, seed + 2);
}

static inline int read_block(const void *ptr, size_t size, unsigned seed) {
    const unsigned char *p = ptr;
    if (size <= 3 * SPOT) {
        return mismatch(p, size, seed) == (size_t)-1;
    }
    return mismatch(p, SPOT, seed) == (size_t)-1 &&
           mismatch(p + size / 2 - SPOT / 2, SPOT, seed + 1) == (size_t)-1 &&
           mismatch(p + size - SPOT, SPOT, seed + 2) == (size_t)-1;
}

static inline uint64_t round512(uint64_t n) { return (n + 511) & ~(uint64_t)511; }
/* The pool's block size (pool::block_len): 512-byte rounding up to 4 KiB, quarter-octave
 * classes up to 1 MiB, 2 MiB multiples above (as PyTorch's large pool). */
static inline uint64_t block_len(uint64_t n) {
    const uint64_t mib = 1u << 20;
    uint64_t len = round512(n);
    if (len > mib) return (len + 2 * mib - 1) & ~(2 * mib - 1);
    if (len > 4096) { /* quarter-octave size classes */
        uint64_t p = 1;
        while (p * 2 <= len) p *= 2;
        uint64_t step = p / 4;
        return (len + step - 1) / step * step;
    }
    return len;
}

#endif /* GPU_ARENA_TESTS_BLOCKS_H */
