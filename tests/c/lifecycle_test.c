/*
 * lifecycle_test.c: how gpu-arena's C API starts up (ffi/include/gpu_arena.h,
 * libgpu_arena.so), on the sim backend: calls before init, the lazy init by the first call,
 * threads racing it, the log level, and inits that fail.
 *
 * Built and run by ffi/tests/c_api.rs (`cargo test`), like api_test.c:
 *   cc -std=c11 -Wall -Wextra -Werror -pedantic -pthread -I ffi/include \
 *      tests/c/lifecycle_test.c -L <target dir> -lgpu_arena -Wl,-rpath,<target dir>
 *   GPU_ARENA_BACKEND=sim ./lifecycle_test <mode>
 *
 * Each mode runs in its own process, because gpu-arena initializes once per process:
 *   before-init  before anything initialized: the calls that take back a pointer (free,
 *                record_stream, close) fail with NOT_INITIALIZED and initialize nothing,
 *                nor do the queries or a refused argument; configure still works, then the
 *                first malloc initializes lazily with its settings (no gpu_arena_init).
 *   lazy-stats   the first call is stats: it initializes from the environment.
 *   lazy-stats-auto  the same on whatever GPU_ARENA_BACKEND picks (the log test: auto).
 *   lazy-race    8 threads race the first malloc: one pool, initialized once.
 *   bad-env      a malformed GPU_ARENA_CONF: configure, the lazy init by malloc and init fail,
 *                every call after reports NOT_INITIALIZED with the reason, nothing crashes.
 *   bad-backend  configure("backend=hip") on a build without HIP: the lazy init by stats and
 *                init fail cleanly.
 *
 * One line per check on stdout ("ok ..."). The first failed check prints "FAIL ..." with the
 * line, the value and gpu_arena_last_error(), and exits 1.
 *
 * Mode before-init: init_status, free, free_checked, record_stream(_checked), close,
 * imports_live, stats(NULL), malloc(0) before init; then configure + the lazy malloc.
 */
#define _GNU_SOURCE /* setenv */
#define PROGRAM "lifecycle_test"

#include "gpu_arena.h"

#include "check.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ mode before-init */

/* Before anything initialized gpu-arena: the calls that take back a pointer fail with
 * NOT_INITIALIZED and initialize nothing, as do the queries and a refused bad argument;
 * configure still works; then the first malloc initializes lazily with its settings. */
static void mode_before_init(void) {
    int x = 0;
    gpu_arena_stats_t s;
    CHECK(strcmp(gpu_arena_backend_name(), "") == 0, "backend_name() is \"\" before init");
    CHECK_CODE(gpu_arena_init_status(), GPU_ARENA_ERR_NOT_INITIALIZED, "init_status() before init");
    CHECK_ERROR_NAMES("gpu_arena_init_status", "not initialized yet");
    CHECK_CODE(gpu_arena_free_checked(&x, 4096, 0), GPU_ARENA_ERR_NOT_INITIALIZED,
               "free_checked before init");
    CHECK_ERROR_NAMES("gpu_arena_free", "not initialized yet", "nothing is its");
    gpu_arena_configure(NULL); /* overwrite the last error */
    gpu_arena_free(&x, 4096, 0, NULL);
    CHECK_ERROR_NAMES("gpu_arena_free", "not initialized yet");
    CHECK_CODE(gpu_arena_record_stream_checked(&x, NULL), GPU_ARENA_ERR_NOT_INITIALIZED,
               "record_stream_checked before init");
    CHECK_ERROR_NAMES("gpu_arena_record_stream", "not initialized yet");
    gpu_arena_record_stream(&x, NULL);
    CHECK(1, "record_stream (void) before init returns");
    CHECK_CODE(gpu_arena_close(&x), GPU_ARENA_ERR_NOT_INITIALIZED, "close before init");
    CHECK_ERROR_NAMES("gpu_arena_close", "not initialized yet");
    CHECK(gpu_arena_imports_live() == 0, "imports_live() before init is 0");
    CHECK_CODE(gpu_arena_close_dlpack(1), GPU_ARENA_ERR_NOT_INITIALIZED, "close_dlpack before init");
    CHECK_ERROR_NAMES("gpu_arena_close_dlpack", "not initialized yet");
    CHECK(gpu_arena_dlpack_imports(NULL, 0) == 0, "dlpack_imports() before init is 0");
    memset(&s, 0xAB, sizeof s);
    CHECK_CODE(gpu_arena_stats(0, NULL), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "stats(0, NULL) before init");
    CHECK_ERROR_NAMES("gpu_arena_stats", "out is NULL");
    char *before = xstrdup(gpu_arena_last_error());
    CHECK(gpu_arena_malloc(0, 0, NULL) == NULL, "malloc(0) before init is NULL");
    CHECK(strcmp(gpu_arena_last_error(), before) == 0, "malloc(0) is not an error, even now");
    free(before);
    CHECK_CODE(gpu_arena_init_status(), GPU_ARENA_ERR_NOT_INITIALIZED,
               "none of the calls above initialized gpu-arena");

    /* Still before first use: configure works, and the first malloc initializes with it. */
    CHECK_CODE(gpu_arena_configure("backend=sim,arena_size=4MiB,grow_arenas=0"), GPU_ARENA_OK,
               "configure after the refused calls (still before first use)");
    void *p = gpu_arena_malloc(2 * MiB, 0, NULL); /* large: from an arena_size arena */
    CHECK(p != NULL, "malloc(2 MiB) before init initializes lazily: %p", p);
    CHECK_CODE(gpu_arena_init_status(), GPU_ARENA_OK, "init_status() after the lazy init");
    CHECK(strcmp(gpu_arena_backend_name(), "sim") == 0, "backend is sim");
    memset(p, 0x5A, 4096);
    CHECK(((unsigned char *)p)[4095] == 0x5A, "the block is writable");
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats(0)");
    CHECK(s.reserved_bytes == 4 * MiB && s.alloc_count == 1 && s.free_count == 0 &&
              s.requested_bytes == 2 * MiB,
          "one 4 MiB arena (arena_size=4MiB applied), one alloc, the refused calls left no trace");
    CHECK_CODE(gpu_arena_configure("arena_size=8MiB"), GPU_ARENA_ERR_INVALID_STATE,
               "configure after the lazy init");
    CHECK_ERROR_NAMES("gpu_arena_configure", "after first use", "initialized by gpu_arena_malloc");
    gpu_arena_init(1);
    CHECK_CODE(gpu_arena_init_status(), GPU_ARENA_OK, "init(1) after the lazy init: no change");
    CHECK_CODE(gpu_arena_free_checked(p, 2 * MiB, 0), GPU_ARENA_OK, "free it");
    CHECK_CODE(gpu_arena_validate(0), GPU_ARENA_OK, "validate(0)");
}

/* ------------------------------------------------------------------ mode lazy-stats */

/* The first call is stats: it initializes from the environment (GPU_ARENA_BACKEND=sim; with
 * any_backend, whatever GPU_ARENA_BACKEND picks, e.g. auto). */
static void mode_lazy_stats(int any_backend) {
    gpu_arena_stats_t s;
    memset(&s, 0xAB, sizeof s);
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats(0) as the first call");
    CHECK(s.reserved_bytes == 0 && s.alloc_count == 0 && s.requested_bytes == 0,
          "an empty pool");
    if (!any_backend) {
        CHECK(strcmp(gpu_arena_backend_name(), "sim") == 0, "backend is sim (GPU_ARENA_BACKEND)");
        CHECK(gpu_arena_device_count() == 1, "one sim device");
    }
    CHECK_CODE(gpu_arena_configure("arena_size=8MiB"), GPU_ARENA_ERR_INVALID_STATE,
               "configure after the lazy init");
    CHECK_ERROR_NAMES("initialized by gpu_arena_stats");
}

/* ------------------------------------------------------------------ mode lazy-race */

/* Threads race the first malloc: every one gets memory from the one pool, initialized once
 * (ffi/tests/c_api.rs counts the "gpu-arena initialized" log lines at GPU_ARENA_LOG=info). */
#define RACERS 8
static void *racer(void *arg) {
    void **out = arg;
    *out = gpu_arena_malloc(64 * KiB, 0, NULL);
    return NULL;
}

static void mode_lazy_race(void) {
    pthread_t t[RACERS];
    void *p[RACERS];
    for (int i = 0; i < RACERS; i++) {
        CHECK(pthread_create(&t[i], NULL, racer, &p[i]) == 0, "start racer %d", i);
    }
    for (int i = 0; i < RACERS; i++) {
        pthread_join(t[i], NULL);
        CHECK(p[i] != NULL, "racer %d got memory: %p", i, p[i]);
    }
    gpu_arena_stats_t s;
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_OK, "stats(0)");
    CHECK(s.allocations == RACERS && s.requested_bytes == RACERS * 64 * KiB,
          "one pool holds all %d allocations (%" PRIu64 ")", RACERS, s.allocations);
    for (int i = 0; i < RACERS; i++) {
        CHECK_CODE(gpu_arena_free_checked(p[i], 64 * KiB, 0), GPU_ARENA_OK, "free racer's block");
    }
    CHECK_CODE(gpu_arena_set_log_level("warn"), GPU_ARENA_OK, "set_log_level(\"warn\")");
    CHECK_CODE(gpu_arena_set_log_level("loud"), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "set_log_level(\"loud\")");
    CHECK_ERROR_NAMES("gpu_arena_set_log_level", "loud", "debug");
    CHECK_CODE(gpu_arena_validate(0), GPU_ARENA_OK, "validate(0)");
}

/* ------------------------------------------------------------------ mode bad-env */

/* init_status reports the failed init's own code (the reason); every other call says
 * NOT_INITIALIZED. */
static void expect_dead_pool(const char *why, int init_code) {
    gpu_arena_stats_t s;
    CHECK_CODE(gpu_arena_init_status(), init_code, "init_status() after failed init");
    CHECK_ERROR_NAMES("gpu_arena_init_status", "failed to initialize", why);
    CHECK(gpu_arena_malloc(4096, 0, NULL) == NULL, "malloc(4096) after failed init is NULL");
    CHECK_ERROR_NAMES("gpu_arena_malloc", "failed to initialize", why);
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_ERR_NOT_INITIALIZED, "stats(0) after failed init");
    CHECK_ERROR_NAMES("gpu_arena_stats", "failed to initialize");
    CHECK_CODE(gpu_arena_empty_cache(-1), GPU_ARENA_ERR_NOT_INITIALIZED,
               "empty_cache(-1) after failed init");
    CHECK_CODE(gpu_arena_free_checked(&s, 64, 0), GPU_ARENA_ERR_NOT_INITIALIZED,
               "free_checked after failed init");
    CHECK_CODE(gpu_arena_device_count(), GPU_ARENA_ERR_NOT_INITIALIZED,
               "device_count() after failed init");
    CHECK(gpu_arena_snapshot_json() == NULL, "snapshot_json() after failed init is NULL");
    CHECK(strcmp(gpu_arena_backend_name(), "") == 0, "backend_name() is \"\"");
    gpu_arena_reset();
    CHECK(1, "reset() after failed init returns");
    CHECK_CODE(gpu_arena_configure("backend=sim"), GPU_ARENA_ERR_INVALID_STATE,
               "configure after a failed init");
    CHECK_ERROR_NAMES("gpu_arena_configure", "after first use");
    gpu_arena_init(1);
    CHECK_CODE(gpu_arena_init_status(), init_code, "init again: the failure stays");
}

static void mode_bad_env(void) {
    CHECK(setenv("GPU_ARENA_CONF", "backend=sim,arena_size=banana", 1) == 0,
          "GPU_ARENA_CONF=backend=sim,arena_size=banana");
    CHECK_CODE(gpu_arena_configure("validate=1"), GPU_ARENA_ERR_INVALID_ARGUMENT,
               "configure(\"validate=1\") over a malformed GPU_ARENA_CONF");
    CHECK_ERROR_NAMES("gpu_arena_configure", "GPU_ARENA_CONF", "banana");
    CHECK(gpu_arena_malloc(4096, 0, NULL) == NULL, "malloc before init: the lazy init fails");
    CHECK_CODE(gpu_arena_last_error_code(), GPU_ARENA_ERR_NOT_INITIALIZED, "its code");
    CHECK_ERROR_NAMES("gpu_arena_malloc", "failed to initialize", "GPU_ARENA_CONF", "banana");
    gpu_arena_init(1);
    CHECK(1, "init(1) with a malformed GPU_ARENA_CONF returns");
    expect_dead_pool("banana", GPU_ARENA_ERR_INVALID_ARGUMENT);
}

/* ------------------------------------------------------------------ mode bad-backend */

static void mode_bad_backend(void) {
    CHECK_CODE(gpu_arena_configure("backend=hip"), GPU_ARENA_OK,
               "configure(\"backend=hip\"): well-formed");
    gpu_arena_stats_t s;
    CHECK_CODE(gpu_arena_stats(0, &s), GPU_ARENA_ERR_NOT_INITIALIZED,
               "stats before init: the lazy init fails");
    CHECK_ERROR_NAMES("gpu_arena_stats", "failed to initialize", "hip");
    gpu_arena_init(1);
    CHECK(1, "init(1) with backend=hip on a build without HIP returns");
    expect_dead_pool("hip", GPU_ARENA_ERR_UNAVAILABLE);
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: %s [before-init|lazy-stats|lazy-stats-auto|lazy-race|bad-env|bad-backend]\n", argv[0]);
        return 2;
    }
    g_mode = argv[1];
    printf(PROGRAM " %s: gpu-arena C API on GPU_ARENA_BACKEND=%s\n", g_mode,
           getenv("GPU_ARENA_BACKEND") ? getenv("GPU_ARENA_BACKEND") : "(unset)");
    if (strcmp(g_mode, "before-init") == 0) {
        mode_before_init();
    } else if (strcmp(g_mode, "lazy-stats") == 0) {
        mode_lazy_stats(0);
    } else if (strcmp(g_mode, "lazy-stats-auto") == 0) {
        mode_lazy_stats(1);
    } else if (strcmp(g_mode, "lazy-race") == 0) {
        mode_lazy_race();
    } else if (strcmp(g_mode, "bad-env") == 0) {
        mode_bad_env();
    } else if (strcmp(g_mode, "bad-backend") == 0) {
        mode_bad_backend();
    } else {
        fprintf(stderr, "usage: %s [before-init|lazy-stats|lazy-stats-auto|lazy-race|bad-env|bad-backend]\n", argv[0]);
        return 2;
    }
    printf(PROGRAM " %s: all %d checks passed\n", g_mode, g_checks);
    return 0;
}
