/*
 * share_bench: share / import latency of the gpu-arena C API itself (issue #14), measured
 * in C with clock_gettime(CLOCK_MONOTONIC) around each call (no ctypes in the way).
 *
 *   cc -O2 -std=c11 -pthread -I ffi/include bench/gpu/share_bench.c -o share_bench \
 *      -L DIR -lgpu_arena -Wl,-rpath,DIR          (DIR holds libgpu_arena.so)
 *   ./share_bench [--sim] [--n N] [--out FILE.md]
 *
 * The process forks before touching the library: the parent is the producer, the child
 * the consumer; share handles (plain bytes) travel over a socketpair. The producer makes
 * N (default 2048) 2 MiB allocations and an anchor share of each (so every arena is
 * exported); the consumer imports the anchors (so it maps every arena) and keeps them to
 * the end. Then, timed per call: gpu_arena_share x N (producer), gpu_arena_import x N and
 * gpu_arena_close x N (consumer), gpu_arena_share_many / import_many / close_many (batch
 * time / N), gpu_arena_unshare x 2N. On sim (device memory is host memory) the producer
 * writes a pattern into each block and the consumer checks it through its imports.
 *
 * Prints a markdown table (median and p90 in us, targets share <= 2 us, import <= 5 us,
 * PASS/FAIL). Exit 0: all targets met; 1: a target failed (--no-targets: never); 2: an
 * API call or the consumer failed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu_arena.h"

#define BLOCK ((size_t)2 << 20)
#define SHARE_TARGET_US 2.0
#define IMPORT_TARGET_US 5.0

/* Operations the producer asks of the consumer. */
enum op { OP_ANCHORS = 1, OP_SINGLE = 2, OP_BATCH = 3, OP_EXIT = 4 };

/* What the consumer sends back for one operation. */
typedef struct reply {
    int32_t rc;          /* 0, or the failing call's return code */
    int32_t bad_bytes;   /* blocks whose pattern did not match (sim only) */
    double import_med_us, import_p90_us;
    double close_med_us, close_p90_us;
    double import_many_us, close_many_us; /* per share */
    char err[160];
} reply_t;

static int g_sim;
static size_t g_n = 2048;

static void die(const char *what) {
    fprintf(stderr, "share_bench: %s failed: %s (last error: %s)\n", what, strerror(errno),
            gpu_arena_last_error() ? gpu_arena_last_error() : "");
    exit(2);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("write to the peer");
        p += w;
        len -= (size_t)w;
    }
}

static int read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Median and p90 of ns[0..n) in us (sorts ns). */
static void quantiles(uint64_t *ns, size_t n, double *med, double *p90) {
    qsort(ns, n, sizeof *ns, cmp_u64);
    *med = n ? (n % 2 ? ns[n / 2] : (ns[n / 2 - 1] + ns[n / 2]) / 2.0) / 1e3 : 0.0;
    *p90 = n ? ns[(n * 9) / 10 < n ? (n * 9) / 10 : n - 1] / 1e3 : 0.0;
}

static void setup(void) {
    if (g_sim) {
        char conf[160];
        size_t cap_gib = (3 * g_n * BLOCK) >> 30;
        snprintf(conf, sizeof conf, "backend=sim,arena_size=1GiB,sim_capacity=%zuGiB",
                 cap_gib < 4 ? (size_t)4 : cap_gib);
        if (gpu_arena_configure(conf) != 0) die("gpu_arena_configure");
    }
    (void)gpu_arena_device_count(); /* initializes lazily */
    if (gpu_arena_init_status() != 0) die("gpu_arena_init");
}

/* The byte pattern of block i (sim: written by the producer, checked by the consumer). */
static uint8_t pattern(size_t i, size_t at) { return (uint8_t)(i * 131u + at * 7u + 1u); }

static int check_block(const void *p, size_t i) {
    const uint8_t *b = p;
    static const size_t at[] = {0, 1, 4096, BLOCK / 2, BLOCK - 1};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++)
        if (b[at[k]] != pattern(i, at[k])) return 1;
    return 0;
}

/* ------------------------------------------------------------------------ consumer */

static void reply_err(reply_t *r, int rc, const char *what) {
    r->rc = rc ? rc : -1;
    snprintf(r->err, sizeof r->err, "%s: %d (%s)", what, rc,
             gpu_arena_last_error() ? gpu_arena_last_error() : "");
}

static int consumer(int fd) {
    setup();
    gpu_arena_share_t *h = calloc(g_n, sizeof *h);
    void **anchors = calloc(g_n, sizeof *anchors);
    void **ptrs = calloc(g_n, sizeof *ptrs);
    uint64_t *imp = calloc(g_n, sizeof *imp), *cls = calloc(g_n, sizeof *cls);
    if (!h || !anchors || !ptrs || !imp || !cls) die("calloc");
    size_t n_anchors = 0;
    for (;;) {
        uint32_t op;
        if (read_all(fd, &op, sizeof op) != 0) return 2;
        reply_t r;
        memset(&r, 0, sizeof r);
        if (op == OP_EXIT) {
            for (size_t i = 0; i < n_anchors; i++) gpu_arena_close(anchors[i]);
            write_all(fd, &r, sizeof r);
            return 0;
        }
        if (read_all(fd, h, g_n * sizeof *h) != 0) return 2;
        if (op == OP_ANCHORS) {
            for (size_t i = 0; i < g_n && !r.rc; i++) {
                int rc = gpu_arena_import(&h[i], &anchors[i]);
                if (rc) reply_err(&r, rc, "gpu_arena_import (anchor)");
                else n_anchors++;
            }
            if (!r.rc && g_sim)
                for (size_t i = 0; i < g_n; i++) r.bad_bytes += check_block(anchors[i], i);
        } else if (op == OP_SINGLE) {
            for (size_t i = 0; i < g_n && !r.rc; i++) {
                uint64_t t = now_ns();
                int rc = gpu_arena_import(&h[i], &ptrs[i]);
                imp[i] = now_ns() - t;
                if (rc) reply_err(&r, rc, "gpu_arena_import");
            }
            if (!r.rc && g_sim)
                for (size_t i = 0; i < g_n; i++) r.bad_bytes += check_block(ptrs[i], i);
            for (size_t i = 0; i < g_n && !r.rc; i++) {
                uint64_t t = now_ns();
                int rc = gpu_arena_close(ptrs[i]);
                cls[i] = now_ns() - t;
                if (rc) reply_err(&r, rc, "gpu_arena_close");
            }
            if (!r.rc) {
                quantiles(imp, g_n, &r.import_med_us, &r.import_p90_us);
                quantiles(cls, g_n, &r.close_med_us, &r.close_p90_us);
            }
        } else if (op == OP_BATCH) {
            uint64_t t = now_ns();
            int rc = gpu_arena_import_many(h, g_n, ptrs);
            r.import_many_us = (now_ns() - t) / 1e3 / (double)g_n;
            if (rc) {
                reply_err(&r, rc, "gpu_arena_import_many");
            } else {
                if (g_sim)
                    for (size_t i = 0; i < g_n; i++) r.bad_bytes += check_block(ptrs[i], i);
                t = now_ns();
                rc = gpu_arena_close_many(ptrs, g_n);
                r.close_many_us = (now_ns() - t) / 1e3 / (double)g_n;
                if (rc) reply_err(&r, rc, "gpu_arena_close_many");
            }
        } else {
            return 2;
        }
        write_all(fd, &r, sizeof r);
    }
}

/* ------------------------------------------------------------------------ producer */

static reply_t ask(int fd, uint32_t op, const gpu_arena_share_t *h) {
    reply_t r;
    write_all(fd, &op, sizeof op);
    if (h) write_all(fd, h, g_n * sizeof *h);
    if (read_all(fd, &r, sizeof r) != 0) {
        fprintf(stderr, "share_bench: the consumer died\n");
        exit(2);
    }
    if (r.rc) {
        fprintf(stderr, "share_bench: consumer: %s\n", r.err);
        exit(2);
    }
    if (r.bad_bytes) {
        fprintf(stderr, "share_bench: consumer saw wrong bytes in %d blocks\n", r.bad_bytes);
        exit(2);
    }
    return r;
}

static const char *verdict(double v, double target) { return v <= target ? "PASS" : "FAIL"; }

int main(int argc, char **argv) {
    const char *out_path = NULL;
    int targets = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sim")) g_sim = 1;
        else if (!strcmp(argv[i], "--no-targets")) targets = 0;
        else if (!strcmp(argv[i], "--n") && i + 1 < argc) g_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--sim] [--n N] [--out FILE.md] [--no-targets]\n", argv[0]);
            return 2;
        }
    }
    if (g_n == 0 || g_n > GPU_ARENA_BATCH_MAX) {
        fprintf(stderr, "share_bench: --n must be 1..%d\n", GPU_ARENA_BATCH_MAX);
        return 2;
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) die("socketpair");
    fflush(NULL);
    pid_t child = fork(); /* before the library is touched: each side initializes its own */
    if (child < 0) die("fork");
    if (child == 0) {
        close(sv[0]);
        _exit(consumer(sv[1]));
    }
    close(sv[1]);
    int fd = sv[0];
    setup();

    void **ptrs = calloc(g_n, sizeof *ptrs);
    size_t *lens = calloc(g_n, sizeof *lens);
    gpu_arena_share_t *anchors = calloc(g_n, sizeof *anchors);
    gpu_arena_share_t *h = calloc(g_n, sizeof *h), *hb = calloc(g_n, sizeof *hb);
    uint64_t *share_ns = calloc(g_n, sizeof *share_ns), *unshare_ns = calloc(2 * g_n, sizeof *unshare_ns);
    if (!ptrs || !lens || !anchors || !h || !hb || !share_ns || !unshare_ns) die("calloc");
    for (size_t i = 0; i < g_n; i++) {
        ptrs[i] = gpu_arena_malloc((ssize_t)BLOCK, 0, NULL);
        if (!ptrs[i]) die("gpu_arena_malloc");
        lens[i] = BLOCK;
        if (g_sim) {
            uint8_t *b = ptrs[i];
            static const size_t at[] = {0, 1, 4096, BLOCK / 2, BLOCK - 1};
            for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) b[at[k]] = pattern(i, at[k]);
        }
        if (gpu_arena_share(ptrs[i], BLOCK, &anchors[i]) != 0) die("gpu_arena_share (anchor)");
    }
    ask(fd, OP_ANCHORS, anchors);

    for (size_t i = 0; i < g_n; i++) {
        uint64_t t = now_ns();
        int rc = gpu_arena_share(ptrs[i], BLOCK, &h[i]);
        share_ns[i] = now_ns() - t;
        if (rc) die("gpu_arena_share");
    }
    reply_t single = ask(fd, OP_SINGLE, h);

    uint64_t t = now_ns();
    if (gpu_arena_share_many((const void *const *)ptrs, lens, g_n, hb) != 0) die("gpu_arena_share_many");
    double share_many_us = (now_ns() - t) / 1e3 / (double)g_n;
    reply_t batch = ask(fd, OP_BATCH, hb);

    for (size_t i = 0; i < 2 * g_n; i++) {
        const gpu_arena_share_t *s = i < g_n ? &h[i] : &hb[i - g_n];
        uint64_t t0 = now_ns();
        int rc = gpu_arena_unshare(s);
        unshare_ns[i] = now_ns() - t0;
        if (rc) die("gpu_arena_unshare");
    }
    ask(fd, OP_EXIT, NULL);
    int status = 0;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "share_bench: the consumer exited badly (status %d)\n", status);
        return 2;
    }
    for (size_t i = 0; i < g_n; i++) {
        if (gpu_arena_unshare(&anchors[i]) != 0) die("gpu_arena_unshare (anchor)");
        gpu_arena_free(ptrs[i], (ssize_t)BLOCK, 0, NULL);
    }

    double share_med, share_p90, unshare_med, unshare_p90;
    quantiles(share_ns, g_n, &share_med, &share_p90);
    quantiles(unshare_ns, 2 * g_n, &unshare_med, &unshare_p90);
    int fail = share_med > SHARE_TARGET_US || single.import_med_us > IMPORT_TARGET_US ||
               share_many_us > SHARE_TARGET_US || batch.import_many_us > IMPORT_TARGET_US;

    char table[4096];
    int len = snprintf(
        table, sizeof table,
        "# gpu-arena share latency, C API in C (%s backend, N=%zu blocks of 2 MiB)\n\n"
        "Every arena exported and mapped by the consumer before timing. Per call, us.\n\n"
        "| call | median | p90 | target | result |\n|---|---|---|---|---|\n"
        "| gpu_arena_share (exported arena) | %.3f | %.3f | <= %.0f | %s |\n"
        "| gpu_arena_import (mapped arena) | %.3f | %.3f | <= %.0f | %s |\n"
        "| gpu_arena_close | %.3f | %.3f | | |\n"
        "| gpu_arena_unshare | %.3f | %.3f | | |\n"
        "| gpu_arena_share_many, per share | %.3f | | <= %.0f | %s |\n"
        "| gpu_arena_import_many, per share | %.3f | | <= %.0f | %s |\n"
        "| gpu_arena_close_many, per share | %.3f | | | |\n",
        gpu_arena_backend_name(), g_n, share_med, share_p90, SHARE_TARGET_US,
        verdict(share_med, SHARE_TARGET_US), single.import_med_us, single.import_p90_us,
        IMPORT_TARGET_US, verdict(single.import_med_us, IMPORT_TARGET_US), single.close_med_us,
        single.close_p90_us, unshare_med, unshare_p90, share_many_us, SHARE_TARGET_US,
        verdict(share_many_us, SHARE_TARGET_US), batch.import_many_us, IMPORT_TARGET_US,
        verdict(batch.import_many_us, IMPORT_TARGET_US), batch.close_many_us);
    fputs(table, stdout);
    if (out_path) {
        FILE *f = fopen(out_path, "w");
        if (!f || fwrite(table, 1, (size_t)len, f) != (size_t)len || fclose(f) != 0) die("writing --out");
    }
    return targets && fail ? 1 : 0;
}
