// kv_common.h: kv_bench's helpers, used by kv_bench.cpp and each of its headers: the clock
// (Clock, secs), the progress log on stderr (logf), formatting (strf, fmt_bytes, fmt_ns) and
// fatal errors (die, cu_err, CU_CHECK). Everything of kv_bench lives in one translation unit,
// in the anonymous namespace.
#pragma once

#include <cuda.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void logf(const char* fmt, ...) {
  static const Clock::time_point start = Clock::now();
  std::fprintf(stderr, "[kv_bench %8.2fs] ", secs(Clock::now() - start));
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

std::string strf(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "kv_bench: %s\n", msg.c_str());
  std::exit(2);
}

std::string cu_err(CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  return strf("%s (%d): %s", name ? name : "?", static_cast<int>(r), text ? text : "?");
}

#define CU_CHECK(call)                                                              \
  do {                                                                              \
    CUresult cu_check_r_ = (call);                                                  \
    if (cu_check_r_ != CUDA_SUCCESS)                                                \
      die(strf("%s:%d: %s failed: %s", __FILE__, __LINE__, #call,                   \
               cu_err(cu_check_r_).c_str()));                                       \
  } while (0)

std::string fmt_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = b < 0 ? -b : b;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (b < 0) v = -v;
  return u == 0 ? strf("%.0f B", v) : strf("%.2f %s", v, units[u]);
}

std::string fmt_ns(double ns) {
  if (ns >= 100000.0) return strf("%.1f µs", ns / 1000.0);
  if (ns >= 100.0) return strf("%.0f ns", ns);
  return strf("%.1f ns", ns);
}

}  // namespace
