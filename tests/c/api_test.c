/*
 * api_test.c: the C API of gpu-arena (ffi/include/gpu_arena.h, libgpu_arena.so), exercised
 * from C on the sim backend, where device pointers are host memory.
 *
 * Built and run by ffi/tests/c_api.rs (`cargo test`):
 *   cc -std=c11 -Wall -Wextra -Werror -pedantic -pthread -I ffi/include tests/c/api_test.c \
 *      -L <target dir> -lgpu_arena -Wl,-rpath,<target dir> -o api_test
 *   GPU_ARENA_BACKEND=sim ./api_test <mode>
 *
 * Each mode runs in its own process, because gpu-arena initializes once per process:
 *   api          (default) the whole API: configure, init, malloc/free of many sizes with
 *                reads and writes, record_stream, stats, snapshot_json, empty_cache, threads,
 *                then every bad input of BAD_CASES below.
 * The modes about startup (calls before init, the lazy init, failed inits) are in
 * lifecycle_test.c.
 *
 * One line per check on stdout ("ok ..."). The first failed check prints "FAIL ..." with the
 * line, the value and gpu_arena_last_error(), and exits 1.
 *
 * Bad inputs (mode api; table BAD_CASES, run against a fixture of live and freed blocks on
 * 2 sim devices). Each asserts the return code (or NULL), that gpu_arena_last_error() names
 * the call and the value, and that stats, snapshot_json and validate show nothing changed:
 *
 *   id                      input                                         expect
 *   free-unknown            free of a stack address                       UNKNOWN_POINTER
 *   free-unknown-heap       free of a libc malloc pointer (void free)     last_error set
 *   free-double             free of a block already freed                 UNKNOWN_POINTER
 *   free-double-void        the same through void gpu_arena_free          last_error set
 *   free-interior           free of live+512 (not a block start)          UNKNOWN_POINTER
 *   free-wrong-size         free with size+1                              INVALID_ARGUMENT
 *   free-wrong-size-small   free with size-1 (same 512 rounding)          INVALID_ARGUMENT
 *   free-wrong-device       free of a device-0 block as device 1          UNKNOWN_POINTER
 *   free-device-range       free with device 7 (2 devices)                INVALID_DEVICE
 *   free-device-negative    free with device -1                           INVALID_DEVICE
 *   free-negative-size      free with size -4096                          INVALID_ARGUMENT
 *   malloc-negative         malloc(-1)                                    NULL
 *   malloc-ssize-min        malloc(SSIZE_MIN)                             NULL
 *   malloc-absurd           malloc(1 << 60)                               NULL
 *   malloc-ssize-max        malloc(SSIZE_MAX)                             NULL
 *   malloc-device-range     malloc(4096, device 2)                        NULL
 *   malloc-device-negative  malloc(4096, device -1)                       NULL
 *   malloc-oom              malloc(2 GiB) with sim_capacity=1GiB          NULL, oom_count+1 only
 *   malloc-zero             malloc(0)                                     NULL, NOT an error
 *   free-null               free(NULL)                                    OK, not an error
 *   stats-device-range      stats(device 2)                               INVALID_DEVICE
 *   stats-device-negative   stats(device -1)                              INVALID_DEVICE
 *   stats-null-out          stats(0, NULL)                                INVALID_ARGUMENT
 *   empty-cache-range       empty_cache(device 5)                         INVALID_DEVICE
 *   empty-cache-negative    empty_cache(device -2)                        INVALID_DEVICE
 *   validate-device-range   validate(device 9)                            INVALID_DEVICE
 *   configure-after-init    configure("arena_size=2MiB") after init       INVALID_STATE
 *   configure-bad-after     configure("color=blue") after init            INVALID_STATE
 *   configure-null          configure(NULL)                               INVALID_ARGUMENT
 *   record-unknown          record_stream_checked(stack address)          UNKNOWN_POINTER
 *   record-freed            record_stream_checked(freed block)            UNKNOWN_POINTER
 *   record-null             record_stream_checked(NULL)                   UNKNOWN_POINTER
 *   record-unknown-void     record_stream(stack address) (void)           last_error set
 * Before first use (mode api, before init): configure("sim_devices=3,color=blue"),
 * configure("arena_size=banana"), configure(NULL) -> INVALID_ARGUMENT, and the later
 * device_count shows the rejected sim_devices=3 was not applied.
 */
#define _GNU_SOURCE /* dladdr, realpath, setenv, SSIZE_MAX */
#define PROGRAM "api_test"

#include "gpu_arena.h"

#include "blocks.h"
#include "check.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The fixed part of gpu_arena_stats_t: uint64_t fields, in this order. */
_Static_assert(offsetof(gpu_arena_stats_t, reserved_bytes) == 0, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, allocated_bytes) == 8, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, peak_reserved_bytes) == 16, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, peak_allocated_bytes) == 24, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, arenas) == 32, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, backend_creates) == 40, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, backend_destroys) == 48, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, exports_live) == 56, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, exports_total) == 64, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, shares_live) == 72, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, imports_live) == 80, "stats layout");
_Static_assert(offsetof(gpu_arena_stats_t, pinned_bytes) == 88, "stats layout");
_Static_assert(sizeof(gpu_arena_stats_t) % 8 == 0, "stats layout");
_Static_assert(sizeof(((gpu_arena_stats_t *)0)->pinned_bytes) == 8, "uint64_t fields");
_Static_assert(sizeof(ssize_t) == sizeof(void *), "ssize_t is pointer-sized");

#ifndef SSIZE_MIN
#define SSIZE_MIN (-SSIZE_MAX - 1)
#endif

/* Configuration of mode api: 2 simulated devices, 1 GiB each, fixed 64 MiB arenas. */
#define NDEV 2
#define ARENA_SIZE (64 * MiB)
#define API_CONF "backend=sim,sim_devices=2,sim_capacity=1GiB,sim_granularity=2MiB," \
                 "arena_size=64MiB,grow_arenas=0,validate=1"

/* "0x7f..." as Rust's {:p} and {:#x} print it. */
static const char *hex(const void *p, char buf[32]) {
    snprintf(buf, 32, "0x%" PRIxPTR, (uintptr_t)p);
    return buf;
}

/* ------------------------------------------------------------------ state snapshots */

typedef struct {
    gpu_arena_stats_t stats[NDEV];
    char *json;
} state_t;

static void state_take(state_t *s, int ndev) {
    memset(s, 0, sizeof *s);
    for (int d = 0; d < ndev; d++) {
        int rc = gpu_arena_stats(d, &s->stats[d]);
        if (rc != GPU_ARENA_OK) {
            printf("FAIL [%s] gpu_arena_stats(%d) -> %s: %s\n", g_mode, d, code_name(rc),
                   last_error());
            exit(1);
        }
    }
    char *json = gpu_arena_snapshot_json();
    s->json = xstrdup(json);
    gpu_arena_string_free(json);
}

static void state_free(state_t *s) {
    free(s->json);
    s->json = NULL;
}

/* Every device validates, and (unless oom_delta) stats and the JSON snapshot are identical. */
static void check_unchanged(const char *id, const state_t *before, int oom_device) {
    state_t after;
    state_take(&after, NDEV);
    for (int d = 0; d < NDEV; d++) {
        gpu_arena_stats_t want = before->stats[d];
        if (d == oom_device) {
            want.oom_count += 1;
        }
        char buf[160];
        const char *diff = stats_diff(&want, &after.stats[d], buf, sizeof buf);
        CHECK(diff == NULL, "%s: stats of device %d unchanged%s%s%s", id, d,
              oom_device == d ? " but oom_count+1" : "", diff ? ": " : "", diff ? diff : "");
        CHECK_CODE(gpu_arena_validate(d), GPU_ARENA_OK, "gpu_arena_validate after the case");
    }
    if (oom_device < 0) {
        CHECK(strcmp(before->json, after.json) == 0, "%s: snapshot_json unchanged", id);
    }
    state_free(&after);
}

/* ------------------------------------------------------------------ helpers */

static void *stream_handle(uintptr_t s) { return (void *)s; }

/* ------------------------------------------------------------------ mode api: the good path */

#define NSIZES 14
static const ssize_t SIZES[NSIZES] = {
    1, 7, 511, 512, 513, 4096, 65535, 100000, 1 * MiB, 3 * MiB + 17,
    ARENA_SIZE - 512, ARENA_SIZE, ARENA_SIZE + 1, 100 * MiB,
};

typedef struct {
    void *ptr;
    ssize_t size;
    int device;
    uintptr_t stream;
    unsigned seed;
} block_t;

static int overlaps(const block_t *a, const block_t *b) {
    uintptr_t a0 = (uintptr_t)a->ptr, a1 = a0 + (uintptr_t)a->size;
    uintptr_t b0 = (uintptr_t)b->ptr, b1 = b0 + (uintptr_t)b->size;
    return a0 < b1 && b0 < a1;
}

static void configure_before_init(void) {
    CHECK(strcmp(gpu_arena_backend_name(), "") == 0, "backend_name() is \"\" before init");
    CHECK(gpu_arena_last_error()[0] == '\0', "last_error is \"\" before any error");

    CHECK_CODE(gpu_arena_configure("sim_devices=3,color=blue"), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "configure(\"sim_devices=3,color=blue\") before init");
    CHECK_ERROR_NAMES("gpu_arena_configure", "color");
    CHECK_CODE(gpu_arena_configure("arena_size=banana"), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "configure(\"arena_size=banana\") before init");
    CHECK_ERROR_NAMES("gpu_arena_configure", "banana");
    CHECK_CODE(gpu_arena_configure("backend=tpu"), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "configure(\"backend=tpu\") before init");
    CHECK_ERROR_NAMES("gpu_arena_configure", "tpu");
    CHECK_CODE(gpu_arena_configure(NULL), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "configure(NULL) before init");
    CHECK_ERROR_NAMES("gpu_arena_configure", "NULL");

    CHECK_CODE(gpu_arena_configure(API_CONF), GPU_ARENA_OK, "configure(\"" API_CONF "\")");
    CHECK_CODE(gpu_arena_configure("validate=1"), GPU_ARENA_OK,
               "a second configure before init adds to the first");
}

static void init_and_check(void) {
    gpu_arena_init(NDEV);
    CHECK_CODE(gpu_arena_init_status(), GPU_ARENA_OK, "init(2); init_status()");
    gpu_arena_init(NDEV);
    CHECK_CODE(gpu_arena_init_status(), GPU_ARENA_OK, "init is safe to call twice");
    CHECK(strcmp(gpu_arena_backend_name(), "sim") == 0, "backend_name() is \"%s\", want sim",
          gpu_arena_backend_name());
    CHECK(gpu_arena_device_count() == NDEV,
          "device_count() is %d, want %d (the rejected sim_devices=3 was not applied)",
          gpu_arena_device_count(), NDEV);
    check_loaded_library();
    for (int d = 0; d < NDEV; d++) {
        gpu_arena_stats_t s;
        memset(&s, 0xAB, sizeof s);
        CHECK_CODE(gpu_arena_stats(d, &s), GPU_ARENA_OK, "stats(device) after init");
        CHECK(s.reserved_bytes == 0 && s.allocated_bytes == 0 && s.arenas == 0 &&
                  s.backend_creates == 0 && s.backend_destroys == 0 &&
                  s.peak_reserved_bytes == 0 && s.peak_allocated_bytes == 0 &&
                  s.allocations == 0 && s.alloc_count == 0 && s.free_count == 0,
              "device %d starts empty: every counter 0", d);
        CHECK_CODE(gpu_arena_validate(d), GPU_ARENA_OK, "validate(device) on an empty pool");
    }
}

static void good_path(void) {
    enum { N = NSIZES * NDEV };
    block_t b[N];
    uint64_t want_alloc[NDEV] = {0, 0};
    int n = 0;
    /* last_error is only ever set by a failure: it must stay as it is through this path. */
    char *err0 = xstrdup(gpu_arena_last_error());

    for (int d = 0; d < NDEV; d++) {
        for (int i = 0; i < NSIZES; i++, n++) {
            block_t *x = &b[n];
            x->size = SIZES[i];
            x->device = d;
            x->stream = (uintptr_t)(i % 3) * 0x1000; /* default stream 0 and two others */
            x->seed = (unsigned)n + 1;
            x->ptr = gpu_arena_malloc(x->size, d, stream_handle(x->stream));
            CHECK(x->ptr != NULL, "malloc(%zd, device %d, stream %#" PRIxPTR ") = %p", x->size,
                  d, x->stream, x->ptr);
            CHECK((uintptr_t)x->ptr % 512 == 0, "%p is 512-byte aligned", x->ptr);
            write_block(x->ptr, (size_t)x->size, x->seed);
            want_alloc[d] += block_len((uint64_t)x->size);
        }
    }
    int disjoint = 1;
    for (int i = 0; i < N; i++) {
        for (int j = i + 1; j < N; j++) {
            if (overlaps(&b[i], &b[j])) {
                disjoint = 0;
                printf("     %p+%zd overlaps %p+%zd\n", b[i].ptr, b[i].size, b[j].ptr, b[j].size);
            }
        }
    }
    CHECK(disjoint, "the %d blocks do not overlap", N);
    int intact = 1;
    for (int i = 0; i < N; i++) {
        intact &= read_block(b[i].ptr, (size_t)b[i].size, b[i].seed);
    }
    CHECK(intact, "every block reads back what was written to it");

    gpu_arena_stats_t s[NDEV];
    for (int d = 0; d < NDEV; d++) {
        CHECK_CODE(gpu_arena_stats(d, &s[d]), GPU_ARENA_OK, "stats after the allocations");
        CHECK(s[d].allocations == NSIZES && s[d].alloc_count == NSIZES,
              "device %d: allocations %" PRIu64 ", alloc_count %" PRIu64 ", want %d", d,
              s[d].allocations, s[d].alloc_count, NSIZES);
        CHECK(s[d].allocated_bytes == want_alloc[d],
              "device %d: allocated_bytes %" PRIu64 " = sum of block sizes (%" PRIu64 ")",
              d, s[d].allocated_bytes, want_alloc[d]);
        CHECK(s[d].reserved_bytes >= s[d].allocated_bytes && s[d].reserved_bytes % (2 * MiB) == 0,
              "device %d: reserved_bytes %" PRIu64 " >= allocated, granularity multiple", d,
              s[d].reserved_bytes);
        CHECK(s[d].arenas >= 2 && s[d].backend_creates == s[d].arenas &&
                  s[d].backend_destroys == 0,
              "device %d: %" PRIu64 " arenas = %" PRIu64 " creates, 0 destroys", d, s[d].arenas,
              s[d].backend_creates);
        CHECK(s[d].peak_allocated_bytes == s[d].allocated_bytes &&
                  s[d].peak_reserved_bytes == s[d].reserved_bytes,
              "device %d: peaks equal the current values while growing", d);
        CHECK(s[d].free_count == 0 && s[d].oom_count == 0, "device %d: no frees, no OOM yet", d);
        CHECK(s[d].exports_live == 0 && s[d].shares_live == 0 && s[d].imports_live == 0 &&
                  s[d].pinned_bytes == 0,
              "device %d: no IPC activity", d);
        CHECK_CODE(gpu_arena_validate(d), GPU_ARENA_OK, "validate with live blocks");
    }

    char *json = gpu_arena_snapshot_json();
    CHECK(json != NULL, "snapshot_json() returns a string");
    CHECK(json[0] == '{' && json[strlen(json) - 1] == '}', "snapshot_json is a JSON object");
    CHECK(strstr(json, "\"backend\":\"sim\"") != NULL, "snapshot_json names the sim backend");
    CHECK(strstr(json, "\"devices\"") && strstr(json, "\"arenas\"") &&
              strstr(json, "\"ranges\""),
          "snapshot_json lists devices, arenas and ranges (%zu bytes)", strlen(json));
    gpu_arena_string_free(json);
    gpu_arena_string_free(NULL);
    CHECK(1, "string_free(json) and string_free(NULL)");

    /* record_stream: blocks 0..5 of each device are also used on stream 0x7000. */
    int recorded[NDEV] = {0, 0};
    for (int i = 0; i < N; i++) {
        if (i % NSIZES < 6) {
            if (i % 2) {
                gpu_arena_record_stream(b[i].ptr, stream_handle(0x7000));
            } else {
                CHECK_CODE(gpu_arena_record_stream_checked(b[i].ptr, stream_handle(0x7000)),
                           GPU_ARENA_OK, "record_stream_checked(live block, stream 0x7000)");
            }
            recorded[b[i].device]++;
        }
    }
    CHECK(strcmp(gpu_arena_last_error(), err0) == 0, "record_stream on live blocks sets no error");
    intact = 1;
    for (int i = 0; i < N; i++) {
        intact &= read_block(b[i].ptr, (size_t)b[i].size, b[i].seed);
    }
    CHECK(intact, "every block still reads back its own pattern");

    for (int i = 0; i < N; i++) {
        if (i % 2) {
            gpu_arena_free(b[i].ptr, b[i].size, b[i].device, stream_handle(b[i].stream));
        } else {
            CHECK_CODE(gpu_arena_free_checked(b[i].ptr, b[i].size, b[i].device), GPU_ARENA_OK,
                       "free_checked(block, its size, its device)");
        }
    }
    CHECK(strcmp(gpu_arena_last_error(), err0) == 0, "the frees set no error");
    gpu_arena_stats_t f[NDEV];
    for (int d = 0; d < NDEV; d++) {
        CHECK_CODE(gpu_arena_stats(d, &f[d]), GPU_ARENA_OK, "stats after freeing everything");
        CHECK(f[d].free_count == NSIZES, "device %d: free_count %" PRIu64 ", want %d", d,
              f[d].free_count, NSIZES);
        /* Frees recorded on another stream may wait for it (counted until then). */
        CHECK(f[d].allocations <= (uint64_t)recorded[d],
              "device %d: %" PRIu64 " allocations left, at most the %d cross-stream frees", d,
              f[d].allocations, recorded[d]);
        CHECK(f[d].reserved_bytes == s[d].reserved_bytes && f[d].arenas == s[d].arenas,
              "device %d: the arenas stay cached (%" PRIu64 " bytes reserved)", d,
              f[d].reserved_bytes);
        CHECK(f[d].peak_allocated_bytes == s[d].peak_allocated_bytes &&
                  f[d].peak_reserved_bytes == s[d].peak_reserved_bytes,
              "device %d: peaks are kept after the frees", d);
        CHECK_CODE(gpu_arena_validate(d), GPU_ARENA_OK, "validate after the frees");
    }

    /* A cached range is reused: no driver call. */
    void *again = gpu_arena_malloc(4096, 0, stream_handle(0));
    CHECK(again != NULL, "malloc(4096) after the frees = %p", again);
    gpu_arena_stats_t r;
    CHECK_CODE(gpu_arena_stats(0, &r), GPU_ARENA_OK, "stats");
    CHECK(r.backend_creates == f[0].backend_creates, "served from the cache: creates stay %" PRIu64,
          r.backend_creates);
    write_block(again, 4096, 99);
    CHECK(read_block(again, 4096, 99), "the reused block is writable");
    CHECK_CODE(gpu_arena_free_checked(again, 4096, 0), GPU_ARENA_OK, "free it");

    /* empty_cache(0) releases device 0 only; empty_cache(-1) and reset() the rest. */
    CHECK_CODE(gpu_arena_empty_cache(0), GPU_ARENA_OK, "empty_cache(0)");
    gpu_arena_stats_t e0, e1;
    CHECK_CODE(gpu_arena_stats(0, &e0), GPU_ARENA_OK, "stats(0)");
    CHECK_CODE(gpu_arena_stats(1, &e1), GPU_ARENA_OK, "stats(1)");
    CHECK(e0.reserved_bytes == 0 && e0.arenas == 0 && e0.allocations == 0 &&
              e0.allocated_bytes == 0,
          "device 0 after empty_cache(0): nothing reserved, no arena, no allocation");
    CHECK(e0.backend_destroys == e0.backend_creates,
          "device 0: every created arena destroyed (%" PRIu64 " creates, %" PRIu64 " destroys)",
          e0.backend_creates, e0.backend_destroys);
    CHECK(e0.peak_reserved_bytes == s[0].peak_reserved_bytes, "device 0: peak_reserved kept");
    CHECK(e1.reserved_bytes == f[1].reserved_bytes && e1.backend_destroys == 0,
          "device 1 untouched by empty_cache(0)");
    CHECK_CODE(gpu_arena_empty_cache(-1), GPU_ARENA_OK, "empty_cache(-1)");
    gpu_arena_reset();
    for (int d = 0; d < NDEV; d++) {
        gpu_arena_stats_t z;
        CHECK_CODE(gpu_arena_stats(d, &z), GPU_ARENA_OK, "stats after empty_cache(-1), reset()");
        CHECK(z.reserved_bytes == 0 && z.arenas == 0 && z.allocations == 0 &&
                  z.allocated_bytes == 0 && z.backend_destroys == z.backend_creates,
              "device %d released everything", d);
        CHECK_CODE(gpu_arena_validate(d), GPU_ARENA_OK, "validate after empty_cache");
    }
    CHECK(strcmp(gpu_arena_last_error(), err0) == 0, "the good path set no error at all");
    free(err0);
}

/* ------------------------------------------------------------------ mode api: threads */

typedef struct {
    int index;
    int failures;
    char first_error[256];
    char initial_error[64];
} worker_t;

static void *worker(void *arg) {
    worker_t *w = arg;
    snprintf(w->initial_error, sizeof w->initial_error, "%s", gpu_arena_last_error());
    unsigned state = 12345u + (unsigned)w->index;
    for (int i = 0; i < 2000; i++) {
        state = state * 1103515245u + 12345u;
        ssize_t size = 1 + (ssize_t)((state >> 8) % (256 * 1024));
        int dev = (w->index + i) % NDEV;
        void *p = gpu_arena_malloc(size, dev, stream_handle((uintptr_t)(w->index + 1) << 12));
        if (!p) {
            if (!w->failures++) {
                snprintf(w->first_error, sizeof w->first_error, "malloc: %s", last_error());
            }
            continue;
        }
        unsigned char *c = p;
        c[0] = (unsigned char)i;
        c[size - 1] = (unsigned char)(i + 1);
        if (c[0] != (unsigned char)i || c[size - 1] != (unsigned char)(i + 1)) {
            w->failures++;
        }
        if (gpu_arena_free_checked(p, size, dev) != GPU_ARENA_OK && !w->failures++) {
            snprintf(w->first_error, sizeof w->first_error, "free: %s", last_error());
        }
    }
    /* An error on this thread is visible here only. */
    gpu_arena_validate(40 + w->index);
    char want[32];
    snprintf(want, sizeof want, "device=%d", 40 + w->index);
    if (!strstr(gpu_arena_last_error(), want) && !w->failures++) {
        snprintf(w->first_error, sizeof w->first_error, "thread-local error: %s", last_error());
    }
    return NULL;
}

static void threads(void) {
    CHECK_CODE(gpu_arena_validate(33), GPU_ARENA_ERR_INVALID_DEVICE,
               "validate(33) on the main thread");
    char *mine = xstrdup(gpu_arena_last_error());
    enum { T = 4 };
    pthread_t tid[T];
    worker_t w[T];
    for (int t = 0; t < T; t++) {
        memset(&w[t], 0, sizeof w[t]);
        w[t].index = t;
        CHECK(pthread_create(&tid[t], NULL, worker, &w[t]) == 0, "start thread %d", t);
    }
    for (int t = 0; t < T; t++) {
        pthread_join(tid[t], NULL);
        CHECK(w[t].initial_error[0] == '\0', "thread %d: last_error starts \"\" (got \"%s\")", t,
              w[t].initial_error);
        CHECK(w[t].failures == 0, "thread %d: 2000 malloc/write/free, own last_error: %s", t,
              w[t].failures ? w[t].first_error : "all fine");
    }
    CHECK(strcmp(gpu_arena_last_error(), mine) == 0,
          "the main thread's last_error is its own (\"%s\")", mine);
    free(mine);
    for (int d = 0; d < NDEV; d++) {
        gpu_arena_stats_t s;
        CHECK_CODE(gpu_arena_stats(d, &s), GPU_ARENA_OK, "stats after the threads");
        CHECK(s.allocations == 0 && s.allocated_bytes == 0 && s.free_count == s.alloc_count,
              "device %d: %" PRIu64 " allocs and frees, none live", d, s.alloc_count);
        CHECK_CODE(gpu_arena_validate(d), GPU_ARENA_OK, "validate after the threads");
    }
    CHECK_CODE(gpu_arena_empty_cache(-1), GPU_ARENA_OK, "empty_cache(-1)");
}

/* ------------------------------------------------------------------ mode api: bad inputs */

/* Return values of the table's calls that are not int codes. */
#define RET_NULL 1000 /* gpu_arena_malloc returned NULL */
#define RET_PTR 1001  /* gpu_arena_malloc returned a pointer (always wrong here) */
#define RET_VOID 1002 /* a void function (gpu_arena_free, gpu_arena_record_stream) */

typedef struct {
    void *live0;     /* live on device 0, size LIVE0 */
    void *live1;     /* live on device 1, size LIVE1 */
    void *freed0;    /* allocated then freed on device 0, size FREED0 */
    void *heap;      /* a libc malloc block: not gpu-arena's */
    int on_stack;    /* its address: not gpu-arena's */
} fixture_t;

#define LIVE0 ((ssize_t)10000)
#define LIVE1 ((ssize_t)20000)
#define FREED0 ((ssize_t)30000)

static fixture_t fx;

static int ret_of(void *p) {
    if (p) {
        printf("     unexpected pointer %p: freeing it\n", p);
        gpu_arena_free(p, 4096, 0, NULL);
        return RET_PTR;
    }
    return RET_NULL;
}

/* The calls. */
static int c_free_unknown(void) { return gpu_arena_free_checked(&fx.on_stack, 4096, 0); }
static int c_free_unknown_heap(void) { gpu_arena_free(fx.heap, 4096, 0, NULL); return RET_VOID; }
static int c_free_double(void) { return gpu_arena_free_checked(fx.freed0, FREED0, 0); }
static int c_free_double_void(void) { gpu_arena_free(fx.freed0, FREED0, 0, NULL); return RET_VOID; }
static int c_free_interior(void) {
    return gpu_arena_free_checked((char *)fx.live0 + 512, LIVE0 - 512, 0);
}
static int c_free_wrong_size(void) { return gpu_arena_free_checked(fx.live0, LIVE0 + 1, 0); }
static int c_free_wrong_size_small(void) { return gpu_arena_free_checked(fx.live0, LIVE0 - 1, 0); }
static int c_free_wrong_device(void) { return gpu_arena_free_checked(fx.live0, LIVE0, 1); }
static int c_free_device_range(void) { return gpu_arena_free_checked(fx.live0, LIVE0, 7); }
static int c_free_device_negative(void) { return gpu_arena_free_checked(fx.live0, LIVE0, -1); }
static int c_free_negative_size(void) { return gpu_arena_free_checked(fx.live0, -4096, 0); }
static int c_malloc_negative(void) { return ret_of(gpu_arena_malloc(-1, 0, NULL)); }
static int c_malloc_ssize_min(void) { return ret_of(gpu_arena_malloc(SSIZE_MIN, 0, NULL)); }
static int c_malloc_absurd(void) { return ret_of(gpu_arena_malloc((ssize_t)1 << 60, 0, NULL)); }
static int c_malloc_ssize_max(void) { return ret_of(gpu_arena_malloc(SSIZE_MAX, 0, NULL)); }
static int c_malloc_device_range(void) { return ret_of(gpu_arena_malloc(4096, NDEV, NULL)); }
static int c_malloc_device_negative(void) { return ret_of(gpu_arena_malloc(4096, -1, NULL)); }
static int c_malloc_oom(void) { return ret_of(gpu_arena_malloc(2 * GiB, 0, NULL)); }
static int c_malloc_zero(void) { return ret_of(gpu_arena_malloc(0, 0, NULL)); }
static int c_free_null(void) { return gpu_arena_free_checked(NULL, 4096, 0); }
static int c_stats_device_range(void) {
    gpu_arena_stats_t s;
    return gpu_arena_stats(NDEV, &s);
}
static int c_stats_device_negative(void) {
    gpu_arena_stats_t s;
    return gpu_arena_stats(-1, &s);
}
static int c_stats_null_out(void) { return gpu_arena_stats(0, NULL); }
static int c_empty_cache_range(void) { return gpu_arena_empty_cache(5); }
static int c_empty_cache_negative(void) { return gpu_arena_empty_cache(-2); }
static int c_validate_device_range(void) { return gpu_arena_validate(9); }
static int c_configure_after_init(void) { return gpu_arena_configure("arena_size=2MiB"); }
static int c_configure_bad_after(void) { return gpu_arena_configure("color=blue"); }
static int c_configure_null(void) { return gpu_arena_configure(NULL); }
static int c_record_unknown(void) {
    return gpu_arena_record_stream_checked(&fx.on_stack, stream_handle(0x1000));
}
static int c_record_freed(void) {
    return gpu_arena_record_stream_checked(fx.freed0, stream_handle(0x1000));
}
static int c_record_null(void) { return gpu_arena_record_stream_checked(NULL, stream_handle(1)); }
static int c_record_unknown_void(void) {
    gpu_arena_record_stream(&fx.on_stack, stream_handle(0x1000));
    return RET_VOID;
}

/* Which fixture pointer last_error must name (as 0x...). */
typedef enum { P_NONE, P_STACK, P_HEAP, P_FREED0, P_LIVE0, P_INTERIOR } ptr_t;

typedef struct {
    const char *id;
    const char *input;
    int (*call)(void);
    int want;             /* a GPU_ARENA_* code, or RET_NULL / RET_VOID */
    int is_error;         /* 0: must leave last_error as it was */
    const char *names[3]; /* substrings last_error must contain (the call, the value, why) */
    ptr_t names_ptr;
    int oom_device;       /* -1; else stats may differ by oom_count+1 on this device */
} bad_case_t;

/* The table: one row per bad input (see the list at the top of the file). */
static const bad_case_t BAD_CASES[] = {
    {"free-unknown", "free of a stack address", c_free_unknown, GPU_ARENA_ERR_UNKNOWN_POINTER, 1,
     {"gpu_arena_free", "not allocated", NULL}, P_STACK, -1},
    {"free-unknown-heap", "void free of a libc malloc pointer", c_free_unknown_heap, RET_VOID, 1,
     {"gpu_arena_free", "unknown pointer", NULL}, P_HEAP, -1},
    {"free-double", "free of a block already freed", c_free_double, GPU_ARENA_ERR_UNKNOWN_POINTER,
     1, {"gpu_arena_free", "size=30000", "double free"}, P_FREED0, -1},
    {"free-double-void", "void free of a block already freed", c_free_double_void, RET_VOID, 1,
     {"gpu_arena_free", "double free", NULL}, P_FREED0, -1},
    {"free-interior", "free of live+512", c_free_interior, GPU_ARENA_ERR_UNKNOWN_POINTER, 1,
     {"gpu_arena_free", "not the start", NULL}, P_INTERIOR, -1},
    {"free-wrong-size", "free with size+1", c_free_wrong_size, GPU_ARENA_ERR_INVALID_ARGUMENT, 1,
     {"gpu_arena_free", "size 10001", "allocated with size 10000"}, P_LIVE0, -1},
    {"free-wrong-size-small", "free with size-1", c_free_wrong_size_small,
     GPU_ARENA_ERR_INVALID_ARGUMENT, 1, {"gpu_arena_free", "size 9999", "allocated with size"},
     P_LIVE0, -1},
    {"free-wrong-device", "free of a device-0 block as device 1", c_free_wrong_device,
     GPU_ARENA_ERR_UNKNOWN_POINTER, 1, {"gpu_arena_free", "device=1", "device 1"}, P_LIVE0, -1},
    {"free-device-range", "free with device 7 of 2", c_free_device_range,
     GPU_ARENA_ERR_INVALID_DEVICE, 1, {"gpu_arena_free", "device=7", "out of range"}, P_LIVE0, -1},
    {"free-device-negative", "free with device -1", c_free_device_negative,
     GPU_ARENA_ERR_INVALID_DEVICE, 1, {"gpu_arena_free", "device=-1", "out of range"}, P_LIVE0, -1},
    {"free-negative-size", "free with size -4096", c_free_negative_size,
     GPU_ARENA_ERR_INVALID_ARGUMENT, 1, {"gpu_arena_free", "-4096", "negative"}, P_NONE, -1},
    {"malloc-negative", "malloc(-1)", c_malloc_negative, RET_NULL, 1,
     {"gpu_arena_malloc", "-1", "negative"}, P_NONE, -1},
    {"malloc-ssize-min", "malloc(SSIZE_MIN)", c_malloc_ssize_min, RET_NULL, 1,
     {"gpu_arena_malloc", "-9223372036854775808", "negative"}, P_NONE, -1},
    {"malloc-absurd", "malloc(1 << 60)", c_malloc_absurd, RET_NULL, 1,
     {"gpu_arena_malloc", "1152921504606846976", NULL}, P_NONE, -1},
    {"malloc-ssize-max", "malloc(SSIZE_MAX)", c_malloc_ssize_max, RET_NULL, 1,
     {"gpu_arena_malloc", "9223372036854775807", NULL}, P_NONE, -1},
    {"malloc-device-range", "malloc(4096) on device 2 of 2", c_malloc_device_range, RET_NULL, 1,
     {"gpu_arena_malloc", "device=2", "out of range"}, P_NONE, -1},
    {"malloc-device-negative", "malloc(4096) on device -1", c_malloc_device_negative, RET_NULL, 1,
     {"gpu_arena_malloc", "device=-1", "out of range"}, P_NONE, -1},
    {"malloc-oom", "malloc(2 GiB), 1 GiB simulated", c_malloc_oom, RET_NULL, 1,
     {"gpu_arena_malloc", "2147483648", "out of memory"}, P_NONE, 0},
    {"malloc-zero", "malloc(0): NULL and no error", c_malloc_zero, RET_NULL, 0, {NULL}, P_NONE,
     -1},
    {"free-null", "free(NULL): nothing, no error", c_free_null, GPU_ARENA_OK, 0, {NULL}, P_NONE,
     -1},
    {"stats-device-range", "stats(device 2 of 2)", c_stats_device_range,
     GPU_ARENA_ERR_INVALID_DEVICE, 1, {"gpu_arena_stats", "device=2", "out of range"}, P_NONE, -1},
    {"stats-device-negative", "stats(device -1)", c_stats_device_negative,
     GPU_ARENA_ERR_INVALID_DEVICE, 1, {"gpu_arena_stats", "device=-1", "out of range"}, P_NONE,
     -1},
    {"stats-null-out", "stats(0, NULL)", c_stats_null_out, GPU_ARENA_ERR_INVALID_ARGUMENT, 1,
     {"gpu_arena_stats", "out is NULL", NULL}, P_NONE, -1},
    {"empty-cache-range", "empty_cache(device 5 of 2)", c_empty_cache_range,
     GPU_ARENA_ERR_INVALID_DEVICE, 1, {"gpu_arena_empty_cache", "device=5", "out of range"},
     P_NONE, -1},
    {"empty-cache-negative", "empty_cache(device -2)", c_empty_cache_negative,
     GPU_ARENA_ERR_INVALID_DEVICE, 1, {"gpu_arena_empty_cache", "device=-2", "out of range"},
     P_NONE, -1},
    {"validate-device-range", "validate(device 9 of 2)", c_validate_device_range,
     GPU_ARENA_ERR_INVALID_DEVICE, 1, {"gpu_arena_validate", "device=9", "out of range"}, P_NONE,
     -1},
    {"configure-after-init", "configure(\"arena_size=2MiB\") after init", c_configure_after_init,
     GPU_ARENA_ERR_INVALID_STATE, 1, {"gpu_arena_configure", "after first use", NULL}, P_NONE,
     -1},
    {"configure-bad-after", "configure(\"color=blue\") after init", c_configure_bad_after,
     GPU_ARENA_ERR_INVALID_STATE, 1, {"gpu_arena_configure", "after first use", NULL}, P_NONE,
     -1},
    {"configure-null", "configure(NULL)", c_configure_null, GPU_ARENA_ERR_INVALID_ARGUMENT, 1,
     {"gpu_arena_configure", "NULL", NULL}, P_NONE, -1},
    {"record-unknown", "record_stream_checked(stack address)", c_record_unknown,
     GPU_ARENA_ERR_UNKNOWN_POINTER, 1, {"gpu_arena_record_stream", "unknown pointer", NULL},
     P_STACK, -1},
    {"record-freed", "record_stream_checked(freed block)", c_record_freed,
     GPU_ARENA_ERR_UNKNOWN_POINTER, 1, {"gpu_arena_record_stream", "not a live allocation", NULL},
     P_FREED0, -1},
    {"record-null", "record_stream_checked(NULL)", c_record_null, GPU_ARENA_ERR_UNKNOWN_POINTER, 1,
     {"gpu_arena_record_stream", "ptr=0x0", NULL}, P_NONE, -1},
    {"record-unknown-void", "void record_stream(stack address)", c_record_unknown_void, RET_VOID,
     1, {"gpu_arena_record_stream", "unknown pointer", NULL}, P_STACK, -1},
};

static const char *ret_name(int r) {
    switch (r) {
    case RET_NULL: return "NULL";
    case RET_PTR: return "a pointer";
    case RET_VOID: return "(void)";
    default: return code_name(r);
    }
}

static const void *fixture_ptr(ptr_t which) {
    switch (which) {
    case P_STACK: return &fx.on_stack;
    case P_HEAP: return fx.heap;
    case P_FREED0: return fx.freed0;
    case P_LIVE0: return fx.live0;
    case P_INTERIOR: return (char *)fx.live0 + 512;
    default: return NULL;
    }
}

static void bad_inputs(void) {
    /* The fixture: live blocks on both devices, then one freed block on device 0 (freed last,
     * so that no live block starts where it started). */
    fx.live0 = gpu_arena_malloc(LIVE0, 0, stream_handle(0x1000));
    fx.live1 = gpu_arena_malloc(LIVE1, 1, stream_handle(0x1000));
    fx.freed0 = gpu_arena_malloc(FREED0, 0, stream_handle(0x1000));
    fx.heap = malloc(4096);
    CHECK(fx.live0 && fx.live1 && fx.freed0 && fx.heap, "fixture: live0 %p, live1 %p, freed0 %p",
          fx.live0, fx.live1, fx.freed0);
    write_block(fx.live0, (size_t)LIVE0, 7);
    write_block(fx.live1, (size_t)LIVE1, 8);
    CHECK_CODE(gpu_arena_free_checked(fx.freed0, FREED0, 0), GPU_ARENA_OK, "fixture: free freed0");

    size_t ncases = sizeof BAD_CASES / sizeof *BAD_CASES;
    for (size_t i = 0; i < ncases; i++) {
        const bad_case_t *c = &BAD_CASES[i];
        /* A known error first: an error case must replace it, a non-error case keep it. */
        gpu_arena_validate(77);
        char *err_before = xstrdup(gpu_arena_last_error());
        state_t before;
        state_take(&before, NDEV);

        int got = c->call();

        char what[160];
        snprintf(what, sizeof what, "bad[%s] %s", c->id, c->input);
        CHECK(got == c->want, "%s -> %s, want %s", what, ret_name(got), ret_name(c->want));
        if (c->is_error) {
            CHECK(strcmp(gpu_arena_last_error(), err_before) != 0,
                  "%s: sets a new last_error", c->id);
            CHECK_ERROR_NAMES(c->names[0] ? c->names[0] : "", c->names[1], c->names[2]);
            if (c->names_ptr != P_NONE) {
                char buf[32];
                CHECK(strstr(gpu_arena_last_error(), hex(fixture_ptr(c->names_ptr), buf)) != NULL,
                      "%s: last_error names the pointer %s", c->id, buf);
            }
        } else {
            CHECK(strcmp(gpu_arena_last_error(), err_before) == 0,
                  "%s: not an error, last_error unchanged (\"%s\")", c->id, err_before);
        }
        check_unchanged(c->id, &before, c->oom_device);
        state_free(&before);
        free(err_before);
    }
    CHECK(read_block(fx.live0, (size_t)LIVE0, 7) && read_block(fx.live1, (size_t)LIVE1, 8),
          "the live blocks survived every bad input intact");

    CHECK_CODE(gpu_arena_free_checked(fx.live0, LIVE0, 0), GPU_ARENA_OK, "free live0");
    CHECK_CODE(gpu_arena_free_checked(fx.live1, LIVE1, 1), GPU_ARENA_OK, "free live1");
    CHECK_CODE(gpu_arena_empty_cache(-1), GPU_ARENA_OK, "empty_cache(-1)");
    for (int d = 0; d < NDEV; d++) {
        gpu_arena_stats_t s;
        CHECK_CODE(gpu_arena_stats(d, &s), GPU_ARENA_OK, "final stats");
        CHECK(s.allocations == 0 && s.allocated_bytes == 0 && s.reserved_bytes == 0 &&
                  s.arenas == 0 && s.backend_destroys == s.backend_creates,
              "device %d ends empty: %" PRIu64 " arenas created and destroyed, %" PRIu64
              " OOM", d, s.backend_creates, s.oom_count);
        CHECK_CODE(gpu_arena_validate(d), GPU_ARENA_OK, "final validate");
    }
    free(fx.heap);
    printf("api_test %s: %zu bad-input cases checked\n", g_mode, ncases);
}

/* Tags, sleep and wake on device 0: bad tag names and devices refused with nothing changed,
 * the offloaded tag identical at the same address after a wake, the memory given back while
 * asleep, allocations of a sleeping tag refused, double sleep / waking an awake tag refused,
 * one tag asleep (gpu_arena_sleep_tags) while another allocates, the offload's host buffer
 * kept after a wake and freed by gpu_arena_sleep_release_host. */
static void sleep_wake(void) {
    gpu_arena_stats_t s;
    char long_tag[65];
    memset(long_tag, 'a', 64);
    long_tag[64] = 0;
    CHECK_CODE(gpu_arena_set_tag(long_tag), GPU_ARENA_ERR_INVALID_ARGUMENT, "set_tag(64 bytes)");
    CHECK_CODE(gpu_arena_set_tag("kv cache"), GPU_ARENA_ERR_INVALID_ARGUMENT, "set_tag(space)");
    CHECK_ERROR_NAMES("gpu_arena_set_tag", "kv cache");
    CHECK_CODE(gpu_arena_sleep(NDEV, NULL), GPU_ARENA_ERR_INVALID_DEVICE, "sleep(bad device)");
    CHECK_CODE(gpu_arena_sleep(-2, NULL), GPU_ARENA_ERR_INVALID_DEVICE, "sleep(-2)");
    CHECK_CODE(gpu_arena_wake(NDEV, NULL), GPU_ARENA_ERR_INVALID_DEVICE, "wake(bad device)");
    CHECK_CODE(gpu_arena_sleep(0, "ok,bad/tag"), GPU_ARENA_ERR_INVALID_ARGUMENT, "sleep(bad list)");
    CHECK_CODE(gpu_arena_wake(0, NULL), GPU_ARENA_ERR_INVALID_STATE, "wake with nothing asleep");

    CHECK_CODE(gpu_arena_set_tag("c_weights"), GPU_ARENA_OK, "set_tag(c_weights)");
    void *w = gpu_arena_malloc(2 * MiB, 0, NULL);
    CHECK_CODE(gpu_arena_set_tag("c_kv"), GPU_ARENA_OK, "set_tag(c_kv)");
    void *kv = gpu_arena_malloc(2 * MiB, 0, NULL);
    CHECK(w != NULL && kv != NULL, "tagged mallocs");
    write_block(w, 2 * MiB, 41);
    CHECK_CODE(gpu_arena_sleep(0, "c_weights"), GPU_ARENA_OK, "sleep(0, c_weights)");
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats asleep");
    CHECK(s.reserved_bytes == 0 && s.sleeping_bytes == 2 * (uint64_t)ARENA_SIZE,
          "asleep: reserved %" PRIu64 ", sleeping %" PRIu64, s.reserved_bytes, s.sleeping_bytes);
    CHECK(gpu_arena_malloc(2 * MiB, 0, NULL) == NULL, "malloc of a sleeping tag fails");
    CHECK_CODE(gpu_arena_last_error_code(), GPU_ARENA_ERR_INVALID_STATE, "malloc while asleep");
    CHECK_ERROR_NAMES("asleep", "c_kv");
    CHECK_CODE(gpu_arena_sleep(0, "c_weights"), GPU_ARENA_ERR_INVALID_STATE, "sleep twice");
    CHECK_CODE(gpu_arena_wake(0, "c_weights"), GPU_ARENA_OK, "wake(0, c_weights)");
    CHECK(read_block(w, 2 * MiB, 41), "weights identical after wake");
    CHECK_CODE(gpu_arena_wake(0, "c_weights"), GPU_ARENA_ERR_INVALID_STATE, "wake an awake tag");
    CHECK_CODE(gpu_arena_wake(-1, NULL), GPU_ARENA_OK, "wake(-1, NULL)");
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats awake");
    CHECK(s.reserved_bytes == 2 * (uint64_t)ARENA_SIZE && s.sleeping_bytes == 0, "awake again");

    /* One tag sleeps while the other stays awake and allocates. */
    CHECK_CODE(gpu_arena_sleep_tags(0, "c_kv", "c_weights"), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "sleep_tags offloading a tag it does not put to sleep");
    CHECK_CODE(gpu_arena_sleep_tags(0, "c_kv", NULL), GPU_ARENA_OK, "sleep_tags(0, c_kv)");
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats, c_kv asleep");
    CHECK(s.reserved_bytes == (uint64_t)ARENA_SIZE && s.sleeping_bytes == (uint64_t)ARENA_SIZE,
          "c_kv asleep: reserved %" PRIu64 ", sleeping %" PRIu64, s.reserved_bytes,
          s.sleeping_bytes);
    CHECK_CODE(gpu_arena_sleep_tags(0, "c_kv", NULL), GPU_ARENA_ERR_INVALID_STATE,
               "sleep_tags twice");
    CHECK_CODE(gpu_arena_set_tag("c_weights"), GPU_ARENA_OK, "set_tag(c_weights) again");
    void *w2 = gpu_arena_malloc(2 * MiB, 0, NULL);
    CHECK(w2 != NULL, "the awake tag allocates while c_kv sleeps");
    CHECK(read_block(w, 2 * MiB, 41), "the awake tag's contents untouched");
    CHECK_CODE(gpu_arena_free_checked(w2, 2 * MiB, 0), GPU_ARENA_OK, "free w2");
    CHECK_CODE(gpu_arena_wake(0, "c_kv"), GPU_ARENA_OK, "wake(0, c_kv)");
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats after the wakes");
    CHECK(s.offload_host_bytes >= 2 * (uint64_t)MiB,
          "the offload's host buffer is kept for the next sleep: %" PRIu64, s.offload_host_bytes);
    CHECK_CODE(gpu_arena_sleep_release_host(-1), GPU_ARENA_OK, "sleep_release_host(-1)");
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats after sleep_release_host");
    CHECK(s.offload_host_bytes == 0, "kept host buffers freed");
    CHECK_CODE(gpu_arena_free_checked(w, 2 * MiB, 0), GPU_ARENA_OK, "free w");
    CHECK_CODE(gpu_arena_free_checked(kv, 2 * MiB, 0), GPU_ARENA_OK, "free kv");
    CHECK_CODE(gpu_arena_set_tag(NULL), GPU_ARENA_OK, "set_tag(NULL)");
    CHECK_CODE(gpu_arena_empty_cache(-1), GPU_ARENA_OK, "empty_cache after sleep/wake");
    CHECK_CODE(gpu_arena_validate(0), GPU_ARENA_OK, "validate after sleep/wake");
    printf("api_test %s: sleep/wake checked\n", g_mode);
}

static void mode_api(void) {
    configure_before_init();
    init_and_check();
    good_path();
    threads();
    bad_inputs();
    sleep_wake();
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_mode = argc > 1 ? argv[1] : "api";
    printf("api_test %s: gpu-arena C API on GPU_ARENA_BACKEND=%s\n", g_mode,
           getenv("GPU_ARENA_BACKEND") ? getenv("GPU_ARENA_BACKEND") : "(unset)");
    if (strcmp(g_mode, "api") == 0) {
        mode_api();
    } else {
        fprintf(stderr, "usage: %s [api] (the startup modes are lifecycle_test's)\n", argv[0]);
        return 2;
    }
    printf("api_test %s: all %d checks passed\n", g_mode, g_checks);
    return 0;
}
