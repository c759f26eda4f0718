/*
 * graph_pool_test.c: what gpu-arena's PyTorch allocator (python/gpu_arena/native/) calls, from
 * C: graph pools (PyTorch's private pools for CUDA graphs), checkpoints, the segments view,
 * the allocation containing a pointer, a free by pointer, the memory fraction and the stats
 * resets, on the sim backend.
 *
 * Built and run by ffi/tests/c_api.rs (`cargo test`), like api_test.c:
 *   cc -std=c11 -Wall -Wextra -Werror -pedantic -pthread -I ffi/include \
 *      tests/c/graph_pool_test.c -L <target dir> -lgpu_arena -Wl,-rpath,<target dir>
 *   GPU_ARENA_BACKEND=sim ./graph_pool_test graph-pools
 *
 * One line per check on stdout ("ok ..."). The first failed check prints "FAIL ..." with the
 * line, the value and gpu_arena_last_error(), and exits 1.
 */
#define _GNU_SOURCE /* dladdr, realpath, strdup in check.h */
#define PROGRAM "graph_pool_test"

#include "gpu_arena.h"

#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CAPTURE ((void *)0xC0)
#define OTHER ((void *)0x1000)

static int overlaps(uintptr_t a, size_t alen, uintptr_t b, size_t blen) {
    return a < b + blen && b < a + alen;
}

int main(int argc, char **argv) {
    g_mode = argc > 1 ? argv[1] : "graph-pools";
    CHECK_CODE(gpu_arena_configure("backend=sim,sim_devices=1,sim_capacity=2GiB,sim_granularity=2MiB,arena_size=64MiB,validate=1"), GPU_ARENA_OK, "configure");
    gpu_arena_init(1);
    CHECK_CODE(gpu_arena_init_status(), GPU_ARENA_OK, "init");

    /* A capture: begin, allocations routed to the pool, a temporary freed, end. */
    CHECK(gpu_arena_graph_pool_begin(0, 0, 1) == 1, "begin creates the pool (use count 1)");
    void *out = gpu_arena_graph_pool_malloc(0, 0, 1, 4 * MiB, CAPTURE);
    void *tmp = gpu_arena_graph_pool_malloc(0, 0, 1, 8 * MiB, CAPTURE);
    CHECK(out && tmp, "pool allocations");
    gpu_arena_free(tmp, 8 * MiB, 0, CAPTURE);
    CHECK_CODE(gpu_arena_last_error_code(), GPU_ARENA_OK, "free of a pool block");
    CHECK_CODE(gpu_arena_empty_cache(0), GPU_ARENA_ERR_INVALID_STATE, "empty_cache while routing");
    CHECK_ERROR_NAMES("capture", "nothing was done");
    CHECK_CODE(gpu_arena_graph_pool_end(0, 0, 1), GPU_ARENA_OK, "end");

    /* After the capture: ordinary allocations never land on the graph's memory. */
    void *general = NULL;
    for (int i = 0; i < 16; i++) {
        void *p = gpu_arena_malloc(8 * MiB, 0, CAPTURE);
        general = p;
        CHECK(p && !overlaps((uintptr_t)p, 8 * MiB, (uintptr_t)tmp, 8 * MiB) &&
                  !overlaps((uintptr_t)p, 8 * MiB, (uintptr_t)out, 4 * MiB),
              "general allocation %d stays off the pool", i);
    }

    /* Checkpoint: the live blocks, then restored after a change. */
    gpu_arena_pool_block_t blocks[8];
    CHECK(gpu_arena_graph_pool_blocks(0, 0, 1, blocks, 8) == 1, "one live block");
    CHECK(blocks[0].ptr == (uintptr_t)out && blocks[0].bytes == (uint64_t)(4 * MiB) &&
              blocks[0].stream == CAPTURE,
          "the block as allocated");
    CHECK(gpu_arena_graph_pool_blocks(0, 0, 1, NULL, 0) == 1, "count only");
    gpu_arena_free(out, 4 * MiB, 0, CAPTURE);
    CHECK(gpu_arena_graph_pool_blocks(0, 0, 1, NULL, 0) == 0, "freed");
    CHECK_CODE(gpu_arena_graph_pool_restore(0, 0, 1, blocks, 1), GPU_ARENA_OK, "restore");
    gpu_arena_pool_block_t again[2];
    CHECK(gpu_arena_graph_pool_blocks(0, 0, 1, again, 2) == 1 && again[0].ptr == blocks[0].ptr,
          "restored at its own address");
    gpu_arena_pool_block_t bad[2] = {blocks[0], {(uintptr_t)general, 8 * MiB, 0, CAPTURE}};
    CHECK_CODE(gpu_arena_graph_pool_restore(0, 0, 1, bad, 2), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "restore of a block outside the pool");
    CHECK_ERROR_NAMES("not in an arena of the pool");
    CHECK(gpu_arena_graph_pool_blocks(0, 0, 1, again, 2) == 1 && again[0].ptr == blocks[0].ptr,
          "a refused restore changed nothing");

    /* Segments: the pool's arenas carry its id. */
    gpu_arena_segment_t segs[64];
    gpu_arena_segment_block_t sblocks[256];
    size_t nb = 0;
    ssize_t ns = gpu_arena_segments(0, segs, 64, sblocks, 256, &nb);
    CHECK(ns > 0 && ns <= 64 && nb <= 256, "segments: %zd, blocks %zu", ns, nb);
    int pool_segs = 0;
    for (ssize_t i = 0; i < ns; i++) {
        if (segs[i].in_graph_pool) {
            pool_segs++;
            CHECK(segs[i].pool_id0 == 0 && segs[i].pool_id1 == 1, "segment's pool id");
        }
    }
    CHECK(pool_segs >= 1, "the pool's segments are listed");

    /* Uses and release; bad calls. */
    CHECK(gpu_arena_graph_pool_use_count(0, 0, 1) == 1, "use count 1");
    CHECK(gpu_arena_graph_pool_retain(0, 0, 1) == 2, "retain");
    CHECK(gpu_arena_graph_pool_release(0, 0, 1) == 1, "release");
    CHECK(gpu_arena_graph_pool_release(0, 0, 1) == 0, "last release");
    CHECK_CODE(gpu_arena_graph_pool_release(0, 0, 1), GPU_ARENA_ERR_INVALID_STATE, "one release too many");
    CHECK_CODE(gpu_arena_graph_pool_begin(0, 0, 0), GPU_ARENA_ERR_INVALID_ARGUMENT, "torch's default pool");
    CHECK_CODE(gpu_arena_graph_pool_end(0, 9, 9), GPU_ARENA_ERR_INVALID_ARGUMENT, "end of an unknown pool");
    CHECK(gpu_arena_graph_pool_malloc(0, 9, 9, 512, CAPTURE) == NULL, "malloc in an unknown pool");
    CHECK_CODE(gpu_arena_last_error_code(), GPU_ARENA_ERR_INVALID_ARGUMENT, "its code");
    CHECK(gpu_arena_graph_pool_malloc(3, 0, 1, 512, CAPTURE) == NULL, "bad device");
    CHECK_CODE(gpu_arena_graph_pool_restore(0, 0, 1, NULL, 1), GPU_ARENA_ERR_INVALID_ARGUMENT, "NULL blocks");

    /* The last block freed after the last release: empty_cache releases the pool. */
    gpu_arena_free((void *)(uintptr_t)blocks[0].ptr, 4 * MiB, 0, CAPTURE);
    CHECK_CODE(gpu_arena_empty_cache(0), GPU_ARENA_OK, "empty_cache");
    CHECK(gpu_arena_graph_pool_use_count(0, 0, 1) == 0, "forgotten");
    CHECK(gpu_arena_graph_pool_blocks(0, 0, 1, NULL, 0) == GPU_ARENA_ERR_INVALID_ARGUMENT,
          "blocks of a forgotten pool");

    /* The allocation containing a pointer; a free without the size. */
    char *q = gpu_arena_malloc(3 * MiB, 0, OTHER);
    void *base = NULL;
    size_t req = 0;
    int dev = -1;
    CHECK_CODE(gpu_arena_allocation_of(q + 12345, &base, &req, &dev), GPU_ARENA_OK, "allocation_of");
    CHECK(base == q && req == (size_t)(3 * MiB) && dev == 0, "its start, size and device");
    CHECK_CODE(gpu_arena_allocation_of(q, NULL, NULL, NULL), GPU_ARENA_OK, "NULL outs");
    CHECK_CODE(gpu_arena_free_unsized(q), GPU_ARENA_OK, "free_unsized");
    CHECK_CODE(gpu_arena_free_unsized(q), GPU_ARENA_ERR_UNKNOWN_POINTER, "double free");
    CHECK_CODE(gpu_arena_allocation_of(q, &base, &req, &dev), GPU_ARENA_ERR_UNKNOWN_POINTER,
               "allocation_of a freed block");
    CHECK_CODE(gpu_arena_free_unsized(NULL), GPU_ARENA_OK, "free_unsized(NULL)");

    /* The memory fraction (a 2 GiB sim device): a growth past it fails, 1 lifts it. */
    CHECK_CODE(gpu_arena_set_memory_fraction(0, 0.25), GPU_ARENA_OK, "fraction 0.25");
    CHECK(gpu_arena_malloc(1 * GiB, 0, OTHER) == NULL, "1 GiB past a 512 MiB cap");
    CHECK_CODE(gpu_arena_last_error_code(), GPU_ARENA_ERR_OUT_OF_MEMORY, "as out of memory");
    CHECK_ERROR_NAMES("max_reserved=0.25");
    CHECK_CODE(gpu_arena_set_memory_fraction(0, 1.5), GPU_ARENA_ERR_INVALID_ARGUMENT, "fraction 1.5");
    CHECK_CODE(gpu_arena_set_memory_fraction(0, 1.0), GPU_ARENA_OK, "fraction 1");
    void *big = gpu_arena_malloc(1 * GiB, 0, OTHER);
    CHECK(big != NULL, "1 GiB once the cap is lifted");
    gpu_arena_free(big, 1 * GiB, 0, OTHER);

    /* Stats resets. */
    gpu_arena_stats_t s;
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats");
    CHECK(s.alloc_count > 0 && s.peak_reserved_bytes >= s.reserved_bytes, "counts before");
    CHECK_CODE(gpu_arena_reset_accumulated_stats(0), GPU_ARENA_OK, "reset accumulated");
    CHECK_CODE(gpu_arena_reset_peak_stats(0), GPU_ARENA_OK, "reset peaks");
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats");
    CHECK(s.alloc_count == 0 && s.free_count == 0 && s.backend_creates == 0,
          "accumulated counts zeroed");
    CHECK(s.peak_reserved_bytes == s.reserved_bytes && s.peak_allocated_bytes == s.allocated_bytes,
          "peaks at current values");
    void *p = gpu_arena_malloc(512, 0, OTHER);
    gpu_arena_free(p, 512, 0, OTHER);
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats");
    CHECK(s.alloc_count == 1 && s.free_count == 1, "counting from zero: %llu %llu",
          (unsigned long long)s.alloc_count, (unsigned long long)s.free_count);
    printf("graph_pool_test: %d checks passed\n", g_checks);
    return 0;
}
