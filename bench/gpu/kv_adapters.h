// kv_adapters.h: kv_bench's trace file, device state and the allocators as replay adapters
// (gpu-arena through its C API loaded at run time, cuMemAlloc, cuMemAllocAsync, PyTorch's
// caching allocator unless KV_BENCH_NO_TORCH). Helpers from kv_common.h.
#pragma once

#include <cuda.h>
#include <dlfcn.h>

#include "gpu_arena.h"

#ifndef KV_BENCH_NO_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "kv_common.h"

namespace {

// ---------------------------------------------------------------------------------------
// The trace file.

struct Op {
  uint8_t kind;  // 0 alloc, 1 free
  uint32_t id;
  uint64_t bytes;
  uint32_t stream;
};

struct Trace {
  std::string path;
  uint64_t op_count = 0, peak_live_bytes = 0, peak_live_allocs = 0, allocs = 0, streams = 0,
           seed = 0, requests = 0;
  std::vector<Op> ops;
  size_t peak_index = 0;  // the op after which live bytes first reach the peak
};

uint64_t le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint32_t le32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

Trace load_trace(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) die(strf("cannot open trace %s: %s", path.c_str(), std::strerror(errno)));
  std::vector<unsigned char> buf;
  unsigned char chunk[1 << 16];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) buf.insert(buf.end(), chunk, chunk + n);
  std::fclose(f);
  const size_t kHeader = 64, kOp = 24;
  if (buf.size() < kHeader || std::memcmp(buf.data(), "KVTRACE1", 8) != 0)
    die(strf("%s: not a KVTRACE1 file", path.c_str()));
  Trace t;
  t.path = path;
  t.op_count = le64(&buf[8]);
  t.peak_live_bytes = le64(&buf[16]);
  t.peak_live_allocs = le64(&buf[24]);
  t.allocs = le64(&buf[32]);
  t.streams = le64(&buf[40]);
  t.seed = le64(&buf[48]);
  t.requests = le64(&buf[56]);
  if (buf.size() != kHeader + t.op_count * kOp)
    die(strf("%s: %zu bytes, header says %" PRIu64 " ops", path.c_str(), buf.size(), t.op_count));
  if (t.streams == 0 || t.streams > 64) die(strf("%s: %" PRIu64 " streams", path.c_str(), t.streams));
  t.ops.resize(t.op_count);
  std::vector<uint64_t> size(t.allocs, 0);
  std::vector<char> live(t.allocs, 0);
  uint64_t cur = 0, peak = 0, next_id = 0;
  for (uint64_t i = 0; i < t.op_count; ++i) {
    const unsigned char* r = &buf[kHeader + i * kOp];
    Op op{r[0], le32(r + 4), le64(r + 8), static_cast<uint32_t>(le64(r + 16))};
    if (op.kind > 1 || op.id >= t.allocs || le64(r + 16) >= t.streams || op.bytes == 0)
      die(strf("%s: op %" PRIu64 " is malformed", path.c_str(), i));
    if (op.kind == 0) {
      if (op.id != next_id || live[op.id]) die(strf("%s: op %" PRIu64 ": bad alloc id", path.c_str(), i));
      ++next_id;
      live[op.id] = 1;
      size[op.id] = op.bytes;
      cur += op.bytes;
      if (cur > peak) {
        peak = cur;
        t.peak_index = i;
      }
    } else {
      if (!live[op.id] || size[op.id] != op.bytes)
        die(strf("%s: op %" PRIu64 ": free of a dead id or with another size", path.c_str(), i));
      live[op.id] = 0;
      cur -= op.bytes;
    }
    t.ops[i] = op;
  }
  if (cur != 0 || next_id != t.allocs) die(strf("%s: allocations left live at the end", path.c_str()));
  if (peak != t.peak_live_bytes)
    die(strf("%s: peak live %" PRIu64 " but header says %" PRIu64, path.c_str(), peak, t.peak_live_bytes));
  return t;
}

// ---------------------------------------------------------------------------------------
// Device state.

struct Device {
  int ordinal = 0;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  std::string name;
  size_t total = 0;
  int driver_version = 0;
};

Device g_dev;

void make_current() { CU_CHECK(cuCtxSetCurrent(g_dev.ctx)); }

size_t mem_free() {
  CU_CHECK(cuCtxSynchronize());
  size_t fr = 0, tot = 0;
  CU_CHECK(cuMemGetInfo(&fr, &tot));
  return fr;
}

std::vector<CUstream> make_streams(size_t n) {
  std::vector<CUstream> s(n);
  for (auto& x : s) CU_CHECK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING));
  return s;
}

// ---------------------------------------------------------------------------------------
// gpu-arena through its C API, loaded at run time.

struct GpuArenaApi {
  void* handle = nullptr;
  std::string path;
  decltype(&gpu_arena_configure) configure = nullptr;
  decltype(&gpu_arena_init) init = nullptr;
  decltype(&gpu_arena_init_status) init_status = nullptr;
  decltype(&gpu_arena_malloc) malloc = nullptr;
  decltype(&gpu_arena_free) free = nullptr;
  decltype(&gpu_arena_empty_cache) empty_cache = nullptr;
  decltype(&gpu_arena_stats) stats = nullptr;
  decltype(&gpu_arena_validate) validate = nullptr;
  decltype(&gpu_arena_backend_name) backend_name = nullptr;
  decltype(&gpu_arena_last_error) last_error = nullptr;
  std::string error;  // why it is unusable, "" when usable

  bool ok() const { return error.empty(); }
};

template <class F>
bool load_sym(void* h, const char* name, F& out, std::string& err) {
  out = reinterpret_cast<F>(dlsym(h, name));
  if (!out) err += strf("missing symbol %s; ", name);
  return out != nullptr;
}

GpuArenaApi load_gpu_arena(int device_count, const std::string& conf) {
  GpuArenaApi a;
  const char* env = std::getenv("GPU_ARENA_LIB");
  a.path = env && *env ? env : "libgpu_arena.so";
  a.handle = dlopen(a.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!a.handle) {
    const char* e = dlerror();
    a.error = strf("dlopen(%s): %s", a.path.c_str(), e ? e : "?");
    return a;
  }
  std::string err;
  load_sym(a.handle, "gpu_arena_configure", a.configure, err);
  load_sym(a.handle, "gpu_arena_init", a.init, err);
  load_sym(a.handle, "gpu_arena_init_status", a.init_status, err);
  load_sym(a.handle, "gpu_arena_malloc", a.malloc, err);
  load_sym(a.handle, "gpu_arena_free", a.free, err);
  load_sym(a.handle, "gpu_arena_empty_cache", a.empty_cache, err);
  load_sym(a.handle, "gpu_arena_stats", a.stats, err);
  load_sym(a.handle, "gpu_arena_validate", a.validate, err);
  load_sym(a.handle, "gpu_arena_backend_name", a.backend_name, err);
  load_sym(a.handle, "gpu_arena_last_error", a.last_error, err);
  if (!err.empty()) {
    a.error = a.path + ": " + err;
    return a;
  }
  if (a.configure(conf.c_str()) != GPU_ARENA_OK) {
    a.error = strf("gpu_arena_configure(\"%s\"): %s", conf.c_str(), a.last_error());
    return a;
  }
  a.init(device_count);
  if (a.init_status() != GPU_ARENA_OK) {
    a.error = strf("gpu_arena_init: %s", a.last_error());
    return a;
  }
  if (conf.find("backend=cuda") != std::string::npos && std::strcmp(a.backend_name(), "cuda") != 0) {
    a.error = strf("backend is \"%s\", not cuda", a.backend_name());
    return a;
  }
  return a;
}

GpuArenaApi g_ga;

gpu_arena_stats_t ga_stats() {
  gpu_arena_stats_t s;
  std::memset(&s, 0, sizeof s);
  if (g_ga.stats(g_dev.ordinal, &s) != GPU_ARENA_OK) logf("gpu_arena_stats: %s", g_ga.last_error());
  return s;
}

// ---------------------------------------------------------------------------------------
// The allocators as replay adapters: alloc(bytes, stream index) -> pointer or NULL,
// free(pointer, bytes, stream index). Each keeps its own failure counts.

struct GpuArenaAdapter {
  std::vector<void*> streams;
  uint64_t free_failures = 0;
  void* alloc(uint64_t bytes, uint32_t s) {
    return g_ga.malloc(static_cast<ssize_t>(bytes), g_dev.ordinal, streams[s]);
  }
  void free(void* p, uint64_t bytes, uint32_t s) {
    g_ga.free(p, static_cast<ssize_t>(bytes), g_dev.ordinal, streams[s]);
  }
};

struct CuMemAllocAdapter {
  uint64_t free_failures = 0;
  void* alloc(uint64_t bytes, uint32_t) {
    CUdeviceptr d = 0;
    if (cuMemAlloc(&d, bytes) != CUDA_SUCCESS) return nullptr;
    return reinterpret_cast<void*>(d);
  }
  void free(void* p, uint64_t, uint32_t) {
    if (cuMemFree(reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) ++free_failures;
  }
};

struct CuAsyncAdapter {
  std::vector<CUstream> streams;
  uint64_t free_failures = 0;
  void* alloc(uint64_t bytes, uint32_t s) {
    CUdeviceptr d = 0;
    if (cuMemAllocAsync(&d, bytes, streams[s]) != CUDA_SUCCESS) return nullptr;
    return reinterpret_cast<void*>(d);
  }
  void free(void* p, uint64_t, uint32_t s) {
    if (cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), streams[s]) != CUDA_SUCCESS) ++free_failures;
  }
};

#ifndef KV_BENCH_NO_TORCH
namespace tca = c10::cuda::CUDACachingAllocator;

std::string g_torch_last_error;

struct TorchAdapter {
  std::vector<cudaStream_t> streams;
  uint64_t free_failures = 0;
  void* alloc(uint64_t bytes, uint32_t s) {
    try {
      return tca::raw_alloc_with_stream(static_cast<size_t>(bytes), streams[s]);
    } catch (const std::exception& e) {
      g_torch_last_error = e.what();
      return nullptr;
    }
  }
  void free(void* p, uint64_t, uint32_t) {
    try {
      tca::raw_delete(p);
    } catch (const std::exception& e) {
      g_torch_last_error = e.what();
      ++free_failures;
    }
  }
};

c10::DeviceIndex torch_dev() { return static_cast<c10::DeviceIndex>(g_dev.ordinal); }

int64_t torch_peak_reserved() {
  return tca::getDeviceStats(torch_dev()).reserved_bytes[0].peak;
}
int64_t torch_reserved() {
  return tca::getDeviceStats(torch_dev()).reserved_bytes[0].current;
}
#endif

}  // namespace
