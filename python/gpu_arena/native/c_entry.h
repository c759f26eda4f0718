// c_entry.h: the C entry points of the native torch allocator, found with dlsym by
// python/gpu_arena/torch_native.py (install) and torch_ipc.py (shares). Included at the end
// of allocator.cpp, whose Allocator and g_self they use; nothing crosses them as a C++
// exception (c_call).
#pragma once

namespace gpu_arena_native {
namespace {

void set_error(char* err, size_t err_len, const std::string& msg) {
  if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", msg.c_str());
}

// A C entry point's body: its result, or -1 with the exception's message in `err` (nothing
// crosses the C boundary as an exception).
template <typename Body>
int c_call(char* err, size_t err_len, Body body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    set_error(err, err_len, e.what_without_backtrace());
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
  } catch (...) {
    set_error(err, err_len, "unknown C++ exception");
  }
  return -1;
}

}  // namespace
}  // namespace gpu_arena_native

// Install gpu-arena as torch's CUDA allocator: bind the functions of the libgpu_arena at
// `libgpu_arena_path` (the instance already loaded), then changeCurrentAllocator. Returns 0
// (also when already installed from the same library), or -1 with the reason in `err`
// (NUL-terminated, cut to err_len): a missing symbol, a different library already bound,
// or torch refusing (CUDA already initialized with its own allocator). Call it before
// torch initializes CUDA; it throws nothing.
#define GA_EXPORT extern "C" __attribute__((visibility("default")))
GA_EXPORT int gpu_arena_torch_install_native(const char* libgpu_arena_path, char* err,
                                             size_t err_len) {
  using namespace gpu_arena_native;
  return c_call(err, err_len, [&] {
    static std::mutex mu;
    std::lock_guard<std::mutex> g(mu);
    if (libgpu_arena_path == nullptr) {
      set_error(err, err_len, "libgpu_arena_path is NULL");
      return -1;
    }
    if (g_self != nullptr) {
      if (g_api.path != libgpu_arena_path) {
        set_error(err, err_len, "already installed over " + g_api.path + ", not " +
                                    libgpu_arena_path);
        return -1;
      }
      if (cca::get() != g_self) {
        set_error(err, err_len, "installed before, but torch's current allocator is now " +
                                    cca::get()->name());
        return -1;
      }
      return 0;
    }
    std::string why = bind_api(g_api, libgpu_arena_path);
    if (!why.empty()) {
      set_error(err, err_len, why);
      return -1;
    }
    // Never destroyed: DataPtrs made by it may be freed during interpreter teardown.
    auto* keep = new std::shared_ptr<Allocator>(std::make_shared<Allocator>());
    try {
      torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(*keep);
    } catch (...) {
      delete keep;
      throw;
    }
    g_self = keep->get();
    g_self->bind_history(g_api.path);
    return 0;
  });
}

// The shares of the allocations holding ptrs[0..n) (python/gpu_arena/torch_ipc.py): for each,
// the 128 share bytes at out + 128 * i and the pointer's offset in its allocation at
// offsets[i]. Each allocation is shared once, on its first send, and unshared at its free
// (ipc_shares.h). Returns 0, or -1 with the reason in `err`: not installed, or a pointer
// that is not inside a live allocation of this allocator (the shares made before it stay,
// each unshared at its allocation's free).
GA_EXPORT int gpu_arena_torch_share_blocks(const uint64_t* ptrs, size_t n, uint8_t* out,
                                           uint64_t* offsets, char* err, size_t err_len) {
  using namespace gpu_arena_native;
  return c_call(err, err_len, [&] {
    if (g_self == nullptr) {
      set_error(err, err_len, "gpu-arena's native torch allocator is not installed");
      return -1;
    }
    if (n > 0 && (ptrs == nullptr || out == nullptr || offsets == nullptr)) {
      set_error(err, err_len, "ptrs, out or offsets is NULL");
      return -1;
    }
    for (size_t i = 0; i < n; ++i) {
      const Share s = g_self->share_block(reinterpret_cast<const void*>(ptrs[i]), &offsets[i]);
      std::memcpy(out + i * kShareBytes, s.bytes, kShareBytes);
    }
    return 0;
  });
}
