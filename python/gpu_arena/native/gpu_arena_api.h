// gpu_arena_api.h: gpu-arena's C API as the native PyTorch allocator (allocator.cpp) binds it
// at run time. Shipped in the gpu_arena wheel beside allocator.cpp and compiled with it by
// gpu_arena/torch_native.py; it does not include ffi/include/gpu_arena.h (not in the wheel).
//
// The functions are found with dlopen(path, RTLD_NOW | RTLD_NOLOAD) + dlsym in the library
// Python already loaded (RTLD_NOW alone if it is not loaded yet): the allocator never links
// libgpu_arena, so it uses the same instance, with the same pools, as the rest of the process.
//
// The structs repeat the layouts of ffi/include/gpu_arena.h. Stats holds only the leading
// fields of gpu_arena_stats_t, up to the last one the allocator reads: the struct grows at its
// end (its doc says new fields go last; the full list is served by gpu_arena_stats_fields), so
// a new counter changes nothing here, and the allocator hands gpu_arena_stats a StatsBuffer
// with room to spare. torch_native.check_headers(gpu_arena_header=...) compiles allocator.cpp
// with -DGPU_ARENA_CHECK_LAYOUT and the real header to check these layouts against it (every
// field of Stats by name and offset).
#pragma once

#include <dlfcn.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpu_arena_native {

constexpr int kErrOutOfMemory = -2;  // GPU_ARENA_ERR_OUT_OF_MEMORY
constexpr size_t kShareBytes = 128;  // GPU_ARENA_SHARE_BYTES

// The leading fields of gpu_arena_stats_t, in its order.
struct Stats {
  uint64_t reserved_bytes, allocated_bytes, peak_reserved_bytes, peak_allocated_bytes;
  uint64_t arenas, backend_creates, backend_destroys, exports_live, exports_total;
  uint64_t shares_live, imports_live, pinned_bytes, allocations, alloc_count, free_count;
  uint64_t oom_count, deferred_free_bytes, pending_free_bytes, requested_bytes;
  uint64_t peak_requested_bytes;
};
// What gpu_arena_stats writes into: Stats plus room for the fields a newer library adds.
struct StatsBuffer {
  Stats s;
  uint64_t spare[256];
};
// gpu_arena_share_t: a share handle, plain bytes.
struct Share {
  uint8_t bytes[kShareBytes];
};
// gpu_arena_pool_block_t: one live block of a graph pool.
struct PoolBlock {
  uint64_t ptr, requested, bytes;
  void* stream;
};

// gpu_arena_segment_t: one arena as a segment of torch's snapshot.
struct Segment {
  uint64_t address, bytes, pool_id0, pool_id1, first_block, block_count;
  uint8_t small, in_graph_pool;
};
// gpu_arena_segment_block_t: a range of a segment.
struct SegmentBlock {
  uint64_t address, bytes, requested;
  uint8_t allocated;
};

// X(name, return type, parameter types...): gpu_arena_<name>. Install fails, naming each
// one missing, when the library lacks any.
#define GPU_ARENA_FNS(X)                                                               \
  X(init, void, int)                                                             \
  X(malloc, void*, ssize_t, int, void*)                                          \
  X(record_stream_checked, int, void*, void*)                                    \
  X(empty_cache, int, int)                                                       \
  X(stats, int, int, StatsBuffer*)                                               \
  X(device_count, int)                                                           \
  X(last_error_code, int)                                                        \
  X(last_error, const char*)                                                     \
  X(alloc_error_message, char*, ssize_t, int)                                    \
  X(string_free, void, char*)                                                    \
  X(share, int, const void*, size_t, Share*)                                     \
  X(unshare, int, const Share*)                                                  \
  X(import, int, const Share*, void**)                                           \
  X(close, int, void*)                                                           \
  X(record_history, int, int, size_t)                                            \
  X(graph_pool_retain, int, int, uint64_t, uint64_t)                             \
  X(graph_pool_release, int, int, uint64_t, uint64_t)                            \
  X(graph_pool_use_count, int, int, uint64_t, uint64_t)                          \
  X(graph_pool_begin, int, int, uint64_t, uint64_t)                              \
  X(graph_pool_end, int, int, uint64_t, uint64_t)                                \
  X(graph_pool_malloc, void*, int, uint64_t, uint64_t, size_t, void*)            \
  X(graph_pool_blocks, ssize_t, int, uint64_t, uint64_t, PoolBlock*, size_t)     \
  X(graph_pool_restore, int, int, uint64_t, uint64_t, const PoolBlock*, size_t)  \
  X(graph_pool_empty_cache, int, int, uint64_t, uint64_t)                        \
  X(reset_peak_stats, int, int)                                                  \
  X(reset_accumulated_stats, int, int)                                           \
  X(set_memory_fraction, int, int, double)                                       \
  X(free_unsized, int, void*)                                                    \
  X(allocation_of, int, const void*, void**, size_t*, int*)                      \
  X(segments, ssize_t, int, Segment*, size_t, SegmentBlock*, size_t, size_t*)

#define GPU_ARENA_FIELD(name, ret, ...) ret (*name)(__VA_ARGS__) = nullptr;
struct Api {
  GPU_ARENA_FNS(GPU_ARENA_FIELD)
  bool bound = false;
  std::string path;
};
#undef GPU_ARENA_FIELD

// Fill `api` from the library at `path`; "" on success, else why not (nothing is kept).
inline std::string bind_api(Api& api, const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) h = dlopen(path, RTLD_NOW);
  if (h == nullptr) {
    const char* why = dlerror();
    return std::string("dlopen(") + path + ") failed: " + (why ? why : "unknown error");
  }
  Api out;
  std::string missing;
#define GPU_ARENA_BIND(name, ret, ...)                                            \
  out.name = reinterpret_cast<ret (*)(__VA_ARGS__)>(dlsym(h, "gpu_arena_" #name)); \
  if (out.name == nullptr) missing += " gpu_arena_" #name;
  GPU_ARENA_FNS(GPU_ARENA_BIND)
#undef GPU_ARENA_BIND
  if (!missing.empty()) {
    return std::string(path) + " lacks" + missing +
           " (a libgpu_arena older than gpu_arena's native torch allocator)";
  }
  out.bound = true;
  out.path = path;
  api = out;
  return "";
}

}  // namespace gpu_arena_native
