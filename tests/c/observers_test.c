/*
 * observers_test.c: arena observers through the C API (gpu_arena_observe_arenas,
 * gpu_arena_unobserve_arenas) on the sim backend, where device pointers are host memory.
 *
 * Built and run by ffi/tests/c_api.rs (`cargo test`), like api_test.c:
 *   cc -std=c11 -Wall -Wextra -Werror -pedantic -pthread -I ffi/include \
 *      tests/c/observers_test.c -L <target dir> -lgpu_arena -Wl,-rpath,<target dir>
 *   GPU_ARENA_BACKEND=sim ./observers_test
 *
 * Checks, in one process:
 *   - before init: observe / unobserve report GPU_ARENA_ERR_NOT_INITIALIZED;
 *   - bad input: out_id NULL, both callbacks NULL, unobserve of 0 / an unknown id / an id
 *     already removed: GPU_ARENA_ERR_INVALID_ARGUMENT naming the reason, stats unchanged;
 *   - on_ready for the existing arena (from observe, with its base, size, flags), and for a
 *     new arena before any memory of it is handed out (stats called from inside on_ready
 *     see no allocation of it);
 *   - on_release from empty_cache with the arena still mapped (its first byte is read);
 *   - a nonzero on_ready is counted in observer_errors and gets no on_release;
 *   - a callback calls malloc, free, stats, and unobserves its own observer;
 *   - threads allocate and empty the cache while the main thread adds and removes
 *     observers: one release per ready, none after unobserve returned;
 *   - gpu_arena_trim cuts an arena down to its survivors' pages (bytes kept), with
 *     on_release for it and on_ready for each window; a bad device is refused.
 * One line per check ("ok ..."); the first failure prints "FAIL ..." and exits 1.
 */
#define _GNU_SOURCE
#define PROGRAM "observers_test"

#include "gpu_arena.h"

#include "check.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CONF "backend=sim,sim_capacity=1GiB,sim_granularity=2MiB,arena_size=8MiB,grow_arenas=0,validate=1"

static gpu_arena_stats_t stats(void) {
    gpu_arena_stats_t s;
    memset(&s, 0, sizeof s);
    int rc = gpu_arena_stats(0, &s);
    CHECK(rc == GPU_ARENA_OK, "stats");
    return s;
}

/* ------------------------------------------------------------------ a recording observer */

#define MAX_ARENAS 64

typedef struct recorder {
    pthread_mutex_t lock;
    int ready, released, refuse;
    int closed;          /* set once unobserve returned: any later call is a violation */
    int violations;
    uint64_t ids[MAX_ARENAS]; /* arenas taken, not yet released */
    gpu_arena_arena_info_t last_ready, last_release;
    int read_memory;     /* read the first byte of arena `watch` in on_release */
    uint64_t watch;
    int watch_byte;      /* what it read there */
    uint64_t allocations_seen; /* stats().allocations inside the last on_ready */
    int call_stats;
} recorder;

static void recorder_init(recorder *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->lock, NULL);
    r->watch_byte = -1;
}

static int on_ready(const gpu_arena_arena_info_t *a, void *user) {
    recorder *r = user;
    uint64_t allocations = 0;
    if (r->call_stats) {
        gpu_arena_stats_t s;
        if (gpu_arena_stats(a->device, &s) == GPU_ARENA_OK) { /* re-entrant call */
            allocations = s.allocations;
        }
    }
    pthread_mutex_lock(&r->lock);
    if (r->closed) {
        r->violations++;
    }
    r->ready++;
    r->last_ready = *a;
    r->allocations_seen = allocations;
    int refuse = r->refuse;
    if (!refuse) {
        for (int i = 0; i < MAX_ARENAS; i++) {
            if (r->ids[i] == a->arena_id) {
                r->violations++; /* a second on_ready */
            }
        }
        int stored = 0;
        for (int i = 0; i < MAX_ARENAS && !stored; i++) {
            if (r->ids[i] == 0) {
                r->ids[i] = a->arena_id;
                stored = 1;
            }
        }
        if (!stored) {
            r->violations++;
        }
    }
    pthread_mutex_unlock(&r->lock);
    return refuse ? 7 : 0;
}

static int on_release(const gpu_arena_arena_info_t *a, void *user) {
    recorder *r = user;
    int byte = r->read_memory && a->arena_id == r->watch
                   ? *(const volatile unsigned char *)a->base
                   : -1;
    pthread_mutex_lock(&r->lock);
    if (r->closed) {
        r->violations++;
    }
    int found = 0;
    for (int i = 0; i < MAX_ARENAS; i++) {
        if (r->ids[i] == a->arena_id) {
            r->ids[i] = 0;
            found = 1;
        }
    }
    if (!found) {
        r->violations++; /* release without a successful ready, or twice */
    }
    r->released++;
    r->last_release = *a;
    if (byte >= 0) {
        r->watch_byte = byte;
    }
    pthread_mutex_unlock(&r->lock);
    return 0;
}

static uint64_t observe(recorder *r) {
    uint64_t id = 0;
    int rc = gpu_arena_observe_arenas(on_ready, on_release, r, &id);
    CHECK(rc == GPU_ARENA_OK && id != 0, "observe_arenas -> id %" PRIu64, id);
    return id;
}

static void unobserve(recorder *r, uint64_t id) {
    int rc = gpu_arena_unobserve_arenas(id);
    CHECK(rc == GPU_ARENA_OK, "unobserve_arenas(%" PRIu64 ")", id);
    pthread_mutex_lock(&r->lock);
    r->closed = 1;
    pthread_mutex_unlock(&r->lock);
}

/* ------------------------------------------------------------------ the checks */

/* Unobserve does not initialize (before init there is no observer to remove); observe does,
 * lazily, as malloc does (not called here: the program configures first). */
static void before_init(void) {
    int rc = gpu_arena_unobserve_arenas(1);
    CHECK(rc == GPU_ARENA_ERR_NOT_INITIALIZED, "unobserve before init -> %d", rc);
    CHECK(gpu_arena_init_status() == GPU_ARENA_ERR_NOT_INITIALIZED, "still not initialized");
}

static void bad_input(void) {
    gpu_arena_stats_t before = stats();
    uint64_t id = 0;
    int rc = gpu_arena_observe_arenas(on_ready, on_release, NULL, NULL);
    CHECK(rc == GPU_ARENA_ERR_INVALID_ARGUMENT && strstr(gpu_arena_last_error(), "out_id"),
          "observe with out_id NULL -> %d", rc);
    rc = gpu_arena_observe_arenas(NULL, NULL, NULL, &id);
    CHECK(rc == GPU_ARENA_ERR_INVALID_ARGUMENT && strstr(gpu_arena_last_error(), "NULL"),
          "observe with both callbacks NULL -> %d", rc);
    uint64_t bad_ids[] = {0, 123456789};
    for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++) {
        rc = gpu_arena_unobserve_arenas(bad_ids[i]);
        CHECK(rc == GPU_ARENA_ERR_INVALID_ARGUMENT &&
                  strstr(gpu_arena_last_error(), "not registered") &&
                  strstr(gpu_arena_last_error(), "gpu_arena_unobserve_arenas"),
              "unobserve(%" PRIu64 ") -> %d: %s", bad_ids[i], rc, gpu_arena_last_error());
    }
    gpu_arena_stats_t after = stats();
    CHECK(memcmp(&before, &after, sizeof before) == 0, "bad input changed nothing");
}

static void ready_release_and_errors(void) {
    unsigned char *p = gpu_arena_malloc(2 * MiB, 0, NULL);
    CHECK(p != NULL, "malloc 2 MiB (a large block: an arena_size arena)");
    memset(p, 0x5A, MiB);

    recorder a;
    recorder_init(&a);
    a.read_memory = 1;
    a.call_stats = 1;
    uint64_t a_id = observe(&a);
    CHECK(a.ready == 1 && a.released == 0, "on_ready for the existing arena (%d)", a.ready);
    CHECK(a.last_ready.device == 0 && a.last_ready.size == (size_t)(8 * MiB) &&
              a.last_ready.flags == 0 && (unsigned char *)a.last_ready.base <= p &&
              p < (unsigned char *)a.last_ready.base + a.last_ready.size,
          "its info: device 0, 8 MiB, flags 0, contains the allocation");
    uint64_t first_id = a.last_ready.arena_id;
    a.watch = first_id;

    /* A request larger than an arena: a new arena, ready before it is handed out. */
    unsigned char *big = gpu_arena_malloc(20 * MiB, 0, NULL);
    CHECK(big != NULL, "malloc 20 MiB (a dedicated arena)");
    CHECK(a.ready == 2 && a.last_ready.arena_id != first_id &&
              (unsigned char *)a.last_ready.base <= big,
          "on_ready for the new arena");
    CHECK(a.allocations_seen == 1,
          "inside on_ready, stats saw %" PRIu64 " allocations (the new one not yet made)",
          a.allocations_seen);

    /* An observer that refuses every arena: counted, no release, arenas still usable. */
    recorder b;
    recorder_init(&b);
    b.refuse = 1;
    uint64_t errors = stats().observer_errors;
    uint64_t b_id = observe(&b);
    CHECK(b.ready == 2, "the refusing observer saw both arenas");
    CHECK(stats().observer_errors == errors + 2, "two refusals counted in observer_errors");
    memset(big, 1, 20 * MiB);

    gpu_arena_free(big, 20 * MiB, 0, NULL);
    gpu_arena_free(p, 2 * MiB, 0, NULL);
    CHECK(gpu_arena_empty_cache(-1) == GPU_ARENA_OK, "empty_cache");
    CHECK(a.released == 2, "on_release for both arenas (%d)", a.released);
    CHECK(a.watch_byte == 0x5A, "the arena was still mapped in on_release (read %#x at its base)",
          a.watch_byte);
    CHECK(b.released == 0, "no on_release after a refused on_ready");
    CHECK(stats().arenas == 0, "the arenas are gone");

    unobserve(&a, a_id);
    unobserve(&b, b_id);
    gpu_arena_stats_t before = stats();
    int rc = gpu_arena_unobserve_arenas(a_id);
    CHECK(rc == GPU_ARENA_ERR_INVALID_ARGUMENT && strstr(gpu_arena_last_error(), "not registered"),
          "a second unobserve is refused: %s", gpu_arena_last_error());
    gpu_arena_stats_t after = stats();
    CHECK(memcmp(&before, &after, sizeof before) == 0, "and changes nothing");
    CHECK(a.violations == 0 && b.violations == 0, "no rule broken");
}

/* An observer whose on_ready allocates, frees, and unobserves itself. */
static _Atomic uint64_t g_self_id;
static atomic_int g_self_ready, g_self_release, g_self_unobserve_rc = 1;

static int self_ready(const gpu_arena_arena_info_t *a, void *user) {
    (void)a;
    (void)user;
    atomic_fetch_add(&g_self_ready, 1);
    void *q = gpu_arena_malloc(4096, 0, NULL); /* from an existing arena: not this one */
    if (q != NULL) {
        gpu_arena_free(q, 4096, 0, NULL);
    }
    uint64_t id = atomic_exchange(&g_self_id, 0);
    if (id != 0) {
        atomic_store(&g_self_unobserve_rc, gpu_arena_unobserve_arenas(id));
    }
    return 0;
}

static int self_release(const gpu_arena_arena_info_t *a, void *user) {
    (void)a;
    (void)user;
    atomic_fetch_add(&g_self_release, 1);
    return 0;
}

static void reentrant(void) {
    void *keep = gpu_arena_malloc(MiB, 0, NULL); /* one arena that stays */
    CHECK(keep != NULL, "malloc");
    uint64_t id = 0;
    atomic_store(&g_self_id, 0);
    int rc = gpu_arena_observe_arenas(self_ready, self_release, NULL, &id);
    CHECK(rc == GPU_ARENA_OK, "observe (re-entrant observer)");
    atomic_store(&g_self_id, id);
    void *big = gpu_arena_malloc(20 * MiB, 0, NULL); /* a new arena: its on_ready runs */
    CHECK(big != NULL, "malloc from a new arena");
    CHECK(atomic_load(&g_self_unobserve_rc) == GPU_ARENA_OK,
          "the callback unobserved its own observer");
    CHECK(atomic_load(&g_self_ready) == 2 && atomic_load(&g_self_release) == 2,
          "each ready released (ready %d, release %d)", atomic_load(&g_self_ready),
          atomic_load(&g_self_release));
    gpu_arena_free(big, 20 * MiB, 0, NULL);
    gpu_arena_free(keep, MiB, 0, NULL);
    CHECK(gpu_arena_empty_cache(-1) == GPU_ARENA_OK, "empty_cache");
    CHECK(atomic_load(&g_self_release) == 2, "no call after unobserve");
    CHECK(gpu_arena_unobserve_arenas(id) == GPU_ARENA_ERR_INVALID_ARGUMENT,
          "already removed by its callback");
}

/* ------------------------------------------------------------------ threads */

static atomic_int g_running, g_iterations;

static void *allocator(void *arg) {
    size_t t = (size_t)arg;
    void *live[8] = {0};
    ssize_t sizes[8] = {0};
    for (int i = 0; i < 1500; i++) {
        atomic_fetch_add(&g_iterations, 1);
        int slot = i % 8;
        if (live[slot]) {
            gpu_arena_free(live[slot], sizes[slot], 0, NULL);
            live[slot] = NULL;
        }
        sizes[slot] = (i + (int)t) % 13 == 0 ? 10 * MiB : ((i % 5) + 1) * 256 * 1024;
        live[slot] = gpu_arena_malloc(sizes[slot], 0, (void *)(0x1000 * (t + 1)));
        if (!live[slot]) {
            printf("FAIL thread %zu: malloc: %s\n", t, gpu_arena_last_error());
            exit(1);
        }
        if (i % 40 == 39) {
            gpu_arena_empty_cache(0);
        }
    }
    for (int s = 0; s < 8; s++) {
        if (live[s]) {
            gpu_arena_free(live[s], sizes[s], 0, NULL);
        }
    }
    atomic_fetch_sub(&g_running, 1);
    return NULL;
}

static void threads(void) {
    pthread_t th[3];
    atomic_store(&g_running, 3);
    for (size_t t = 0; t < 3; t++) {
        CHECK(pthread_create(&th[t], NULL, allocator, (void *)t) == 0, "thread %zu", t);
    }
    while (atomic_load(&g_iterations) == 0) {
        sched_yield();
    }
    int rounds = 0, taken = 0;
    for (; rounds < 200 || atomic_load(&g_running) > 0; rounds++) {
        recorder r;
        recorder_init(&r);
        r.refuse = rounds % 7 == 3;
        uint64_t id = 0;
        if (gpu_arena_observe_arenas(on_ready, on_release, &r, &id) != GPU_ARENA_OK) {
            CHECK(0, "observe in round %d", rounds);
        }
        if (gpu_arena_unobserve_arenas(id) != GPU_ARENA_OK) {
            CHECK(0, "unobserve in round %d", rounds);
        }
        pthread_mutex_lock(&r.lock);
        r.closed = 1;
        int expect_release = r.refuse ? 0 : r.ready;
        if (r.violations || r.released != expect_release) {
            CHECK(0, "round %d: ready %d, release %d, violations %d", rounds, r.ready,
                  r.released, r.violations);
        }
        taken += r.ready;
        pthread_mutex_unlock(&r.lock);
        pthread_mutex_destroy(&r.lock);
    }
    for (size_t t = 0; t < 3; t++) {
        pthread_join(th[t], NULL);
    }
    CHECK(taken > 0, "%d observers added and removed while 3 threads allocated (%d arenas "
          "seen): one release per ready, none after unobserve", rounds, taken);
    CHECK(gpu_arena_empty_cache(-1) == GPU_ARENA_OK && gpu_arena_validate(0) == GPU_ARENA_OK,
          "pool valid");
}

/* -------------------------------------------------------------------------------- trim */

/* gpu_arena_trim: an 8 MiB arena of four 2 MiB blocks, the middle two freed, is cut down to
 * its two survivors' pages (same addresses and bytes), its observer gets on_release for it
 * and on_ready for each window; a bad device is refused. */
static void trim(void) {
    CHECK(gpu_arena_empty_cache(-1) == GPU_ARENA_OK && stats().reserved_bytes == 0,
          "trim: nothing reserved before");
    unsigned char *b[4];
    for (int i = 0; i < 4; i++) {
        b[i] = gpu_arena_malloc(2 * 1024 * 1024, 0, NULL);
        CHECK(b[i] != NULL, "trim: malloc of block %d", i);
    }
    CHECK(stats().reserved_bytes == 8u * 1024 * 1024, "trim: the four blocks fill one arena");
    memset(b[0], 0xA5, 2 * 1024 * 1024);
    memset(b[3], 0x5A, 2 * 1024 * 1024);
    gpu_arena_free(b[1], 2 * 1024 * 1024, 0, NULL);
    gpu_arena_free(b[2], 2 * 1024 * 1024, 0, NULL);
    CHECK(stats().allocations == 2, "trim: the middle blocks freed");
    recorder r;
    recorder_init(&r);
    uint64_t id = observe(&r);
    CHECK(r.ready == 1, "trim: the observer took the arena (ready %d)", r.ready);
    uint64_t released = 0;
    CHECK(gpu_arena_trim(0, &released) == GPU_ARENA_OK, "gpu_arena_trim(0) returns OK");
    gpu_arena_stats_t s = stats();
    CHECK(released == 4u * 1024 * 1024 && s.reserved_bytes == 4u * 1024 * 1024 && s.arenas == 2,
          "trim: released %" PRIu64 " bytes, %" PRIu64 " reserved in %" PRIu64 " arenas "
          "(want 4 MiB, 4 MiB, 2)", released, s.reserved_bytes, s.arenas);
    int intact = b[0][0] == 0xA5 && b[0][2 * 1024 * 1024 - 1] == 0xA5 && b[3][0] == 0x5A &&
                 b[3][2 * 1024 * 1024 - 1] == 0x5A;
    CHECK(intact, "trim: the survivors keep their addresses and bytes");
    pthread_mutex_lock(&r.lock);
    int ready = r.ready, rel = r.released, bad = r.violations;
    pthread_mutex_unlock(&r.lock);
    CHECK(rel == 1 && ready == 3 && bad == 0,
          "trim: on_release for the arena, on_ready for its 2 windows (release %d, ready %d, "
          "violations %d)", rel, ready, bad);
    CHECK(gpu_arena_trim(7, NULL) == GPU_ARENA_ERR_INVALID_DEVICE,
          "gpu_arena_trim(7) is GPU_ARENA_ERR_INVALID_DEVICE");
    CHECK(gpu_arena_trim(-1, NULL) == GPU_ARENA_OK, "gpu_arena_trim(-1, NULL) returns OK");
    gpu_arena_free(b[0], 2 * 1024 * 1024, 0, NULL);
    gpu_arena_free(b[3], 2 * 1024 * 1024, 0, NULL);
    CHECK(gpu_arena_empty_cache(-1) == GPU_ARENA_OK && stats().reserved_bytes == 0,
          "trim: the windows go back with their blocks");
    unobserve(&r, id);
    CHECK(r.released == 3 && r.violations == 0, "trim: one release per ready");
    CHECK(gpu_arena_validate(0) == GPU_ARENA_OK, "pool valid after trim");
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_mode = "observers";
    before_init();
    CHECK(gpu_arena_configure(CONF) == GPU_ARENA_OK, "configure %s", CONF);
    gpu_arena_init(1);
    CHECK(gpu_arena_init_status() == GPU_ARENA_OK, "init");
    bad_input();
    ready_release_and_errors();
    reentrant();
    threads();
    trim();
    printf("observers_test: all %d checks passed\n", g_checks);
    return 0;
}
