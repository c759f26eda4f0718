// device_util.h: small helpers of the native torch allocator (allocator.cpp) that need
// only c10 and CUDA: PyTorch's size formatting for OOM messages, cudaMemGetInfo on a device.
#pragma once

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

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

}  // namespace gpu_arena_native
