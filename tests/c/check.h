/*
 * check.h: the checks of the C test programs (api_test.c, lifecycle_test.c,
 * observers_test.c). One line per check on stdout ("ok ..."); the first failed check prints
 * "FAIL ..." with the line, the value and gpu_arena_last_error(), and exits 1.
 *
 * Also: the first stats field that differs (stats_diff), and a check that the library loaded
 * is the one the test built (check_loaded_library).
 *
 * Define PROGRAM (the program's name, "api_test") before including; set g_mode (the mode
 * the program runs) in main. Include after gpu_arena.h, with _GNU_SOURCE
 * defined (dladdr, realpath, strdup).
 */
#ifndef GPU_ARENA_TESTS_CHECK_H
#define GPU_ARENA_TESTS_CHECK_H

#ifndef PROGRAM
#error "define PROGRAM (the test program's name) before including check.h"
#endif

#include <dlfcn.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KiB ((ssize_t)1 << 10)
#define MiB ((ssize_t)1 << 20)
#define GiB ((ssize_t)1 << 30)

static const char *g_mode = "";
static int g_checks;

static inline const char *code_name(int code) {
    switch (code) {
    case GPU_ARENA_OK: return "GPU_ARENA_OK";
    case GPU_ARENA_ERR_INVALID_ARGUMENT: return "GPU_ARENA_ERR_INVALID_ARGUMENT";
    case GPU_ARENA_ERR_OUT_OF_MEMORY: return "GPU_ARENA_ERR_OUT_OF_MEMORY";
    case GPU_ARENA_ERR_UNKNOWN_POINTER: return "GPU_ARENA_ERR_UNKNOWN_POINTER";
    case GPU_ARENA_ERR_BACKEND: return "GPU_ARENA_ERR_BACKEND";
    case GPU_ARENA_ERR_INVALID_DEVICE: return "GPU_ARENA_ERR_INVALID_DEVICE";
    case GPU_ARENA_ERR_NOT_INITIALIZED: return "GPU_ARENA_ERR_NOT_INITIALIZED";
    case GPU_ARENA_ERR_INVALID_STATE: return "GPU_ARENA_ERR_INVALID_STATE";
    case GPU_ARENA_ERR_UNAVAILABLE: return "GPU_ARENA_ERR_UNAVAILABLE";
    case GPU_ARENA_ERR_IPC: return "GPU_ARENA_ERR_IPC";
    case GPU_ARENA_ERR_INTERNAL: return "GPU_ARENA_ERR_INTERNAL";
    default: return "<unknown code>";
    }
}

static inline const char *last_error(void) {
    const char *e = gpu_arena_last_error();
    return e ? e : "<NULL: gpu_arena_last_error must never return NULL>";
}

/* Print "ok <what>" or fail the whole program with the reason and the last error. */
static inline void check_at(int line, int cond, const char *fmt, ...) {
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    g_checks++;
    if (cond) {
        printf("ok   [%s %3d] %s\n", g_mode, g_checks, what);
        return;
    }
    printf("FAIL [%s %3d] %s\n", g_mode, g_checks, what);
    printf("     at tests/c/" PROGRAM ".c:%d\n", line);
    printf("     gpu_arena_last_error(): \"%s\"\n", last_error());
    fflush(stdout);
    fprintf(stderr, PROGRAM " %s: check %d failed at tests/c/" PROGRAM ".c:%d: %s\n", g_mode,
            g_checks, line, what);
    exit(1);
}
#define CHECK(cond, ...) check_at(__LINE__, (cond), __VA_ARGS__)

#define CHECK_CODE(got, want, what)                                                         \
    do {                                                                                    \
        int got_ = (got);                                                                   \
        CHECK(got_ == (want), "%s -> %s (%d), want %s", (what), code_name(got_), got_,      \
              code_name(want));                                                             \
    } while (0)

/* last_error contains every non-NULL needle. */
#define CHECK_ERROR_NAMES(...) check_error_names(__LINE__, __VA_ARGS__, (const char *)NULL)
static inline void check_error_names(int line, const char *first, ...) {
    const char *err = last_error();
    char wanted[512] = "", missing[512] = "";
    va_list ap;
    va_start(ap, first);
    for (const char *n = first; n; n = va_arg(ap, const char *)) {
        char *list = strstr(err, n) ? wanted : missing;
        size_t used = strlen(list);
        snprintf(list + used, sizeof wanted - used, "%s\"%s\"", used ? ", " : "", n);
    }
    va_end(ap);
    if (missing[0]) {
        check_at(line, 0, "last_error \"%s\" lacks %s", err, missing);
    }
    check_at(line, 1, "last_error \"%s\" names %s", err, wanted);
}

static inline char *xstrdup(const char *s) {
    char *d = strdup(s ? s : "");
    if (!d) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    return d;
}

/* ------------------------------------------------------------------ stats */

/* The first field of gpu_arena_stats_t that differs between a and b ("name a -> b"), or
 * NULL. The fields' names and offsets are the library's (gpu_arena_stats_fields). */
static inline const char *stats_diff(const gpu_arena_stats_t *a, const gpu_arena_stats_t *b,
                              char *buf, size_t len) {
    gpu_arena_stats_field_t fields[sizeof(gpu_arena_stats_t) / sizeof(uint64_t)];
    int n = gpu_arena_stats_fields(fields, sizeof fields / sizeof *fields);
    if (n != (int)(sizeof fields / sizeof *fields)) {
        check_at(__LINE__, 0, "gpu_arena_stats_fields serves %d fields, one per uint64_t of "
                 "gpu_arena_stats_t", n);
    }
    for (int i = 0; i < n; i++) {
        uint64_t x, y;
        memcpy(&x, (const char *)a + fields[i].offset, sizeof x);
        memcpy(&y, (const char *)b + fields[i].offset, sizeof y);
        if (x != y) {
            snprintf(buf, len, "%s %" PRIu64 " -> %" PRIu64, fields[i].name, x, y);
            return buf;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ the library */

/* The library that was loaded is the one the test built (GPU_ARENA_EXPECT_LIB). */
static inline void check_loaded_library(void) {
    const char *want = getenv("GPU_ARENA_EXPECT_LIB");
    if (!want) {
        return;
    }
    void *(*fn)(ssize_t, int, void *) = gpu_arena_malloc;
    void *addr;
    memcpy(&addr, &fn, sizeof addr);
    Dl_info info;
    memset(&info, 0, sizeof info);
    CHECK(dladdr(addr, &info) != 0 && info.dli_fname, "dladdr finds gpu_arena_malloc");
    char got_real[PATH_MAX], want_real[PATH_MAX];
    int same = realpath(info.dli_fname, got_real) && realpath(want, want_real) &&
               strcmp(got_real, want_real) == 0;
    CHECK(same, "gpu_arena_malloc comes from %s (want %s)", info.dli_fname, want);
}

#endif /* GPU_ARENA_TESTS_CHECK_H */
