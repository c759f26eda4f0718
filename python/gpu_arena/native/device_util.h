// device_util.h: small helpers of the native torch allocator (allocator.cpp) that need
// only c10 and CUDA: PyTorch's size formatting for OOM messages, cudaMemGetInfo on a device,
// and the GIL let go around a call that may wait for another thread.
#pragma once

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

namespace gpu_arena_native {

// PyTorch's format_size (CUDACachingAllocator.cpp), for OOM messages shaped like its own.
inline std::string format_size(uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", size / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", size / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", size / 1073741824.0);
  }
  return buf;
}

// cudaMemGetInfo on `dev`, the caller's current device restored.
inline std::pair<size_t, size_t> mem_info(c10::DeviceIndex dev) {
  c10::cuda::CUDAGuard guard(dev);
  size_t free_bytes = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return {free_bytes, total};
}

// Lets go of Python's GIL for its scope when this thread holds it, as pybind11's
// gil_scoped_release does (the object links no Python: the three functions are looked up in
// the process). For a call that may wait for another thread which may need the GIL meanwhile:
// gpu_arena_graph_pool_begin waits for a call that synchronizes the device (empty_cache,
// sleep, wake, trim, run from Python through ctypes without the GIL), whose observers'
// callbacks may be Python functions.
class GilReleased {
 public:
  GilReleased() {
    static const Fns fns = load();
    if (fns.check != nullptr && fns.check() != 0) {
      fns_ = &fns;
      state_ = fns.save();
    }
  }
  ~GilReleased() {
    if (fns_ != nullptr) fns_->restore(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  struct Fns {
    int (*check)() = nullptr;          // PyGILState_Check
    void* (*save)() = nullptr;         // PyEval_SaveThread
    void (*restore)(void*) = nullptr;  // PyEval_RestoreThread
  };
  static Fns load() {
    Fns f;
    f.check = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "PyGILState_Check"));
    f.save = reinterpret_cast<void* (*)()>(dlsym(RTLD_DEFAULT, "PyEval_SaveThread"));
    f.restore = reinterpret_cast<void (*)(void*)>(dlsym(RTLD_DEFAULT, "PyEval_RestoreThread"));
    if (f.check == nullptr || f.save == nullptr || f.restore == nullptr) return Fns{};
    return f;
  }
  const Fns* fns_ = nullptr;
  void* state_ = nullptr;
};

}  // namespace gpu_arena_native
