// oom_shim.cpp: gpu_arena_malloc for PyTorch's change_current_allocator route, throwing a
// C++ exception instead of returning NULL. Built into libgpu_arena.so by ffi/build.rs (the
// cc crate; g++ and libstdc++ only, no PyTorch). Exported through the Rust "C-unwind"
// trampoline gpu_arena_torch_malloc (ffi/src/torch_api.rs explains why).
//
// Why the throw happens here: PyTorch's CUDAPluggableAllocator never checks the pointer it
// gets, so NULL becomes a tensor at address 0 and the GPU faults later
// (cudaErrorIllegalAddress). A C++ exception from the alloc function reaches Python as a
// RuntimeError (torch's HANDLE_TH_ERRORS turns any std::exception into one) and leaves the
// allocator usable. Rust cannot throw C++ exceptions (and a panic must not cross the C
// ABI), so Rust's gpu_arena_malloc returns NULL with a thread-local error, and this C++
// function turns that into the exception on its own side.
//
// std::runtime_error gives Python a plain RuntimeError whose message starts with
// "CUDA out of memory." (what vLLM and others match). torch.OutOfMemoryError needs
// c10::OutOfMemoryError, i.e. torch's headers and libc10: gpu_arena.torch builds that
// variant at install() when it can (python/gpu_arena/_oom_shim_c10.cpp).
#include <stdexcept>
#include <string>
#include <sys/types.h>

// The C API functions used (declared in include/gpu_arena.h, which is generated from the
// Rust sources by a test; declared here so that the build does not depend on it).
extern "C" {
void* gpu_arena_malloc(ssize_t size, int device, void* stream);
char* gpu_arena_alloc_error_message(ssize_t size, int device);
void gpu_arena_string_free(char* s);
}

namespace {

std::string take_message(ssize_t size, int device) {
  char* m = gpu_arena_alloc_error_message(size, device);
  std::string msg = m != nullptr ? m : "gpu-arena: allocation failed (no message)";
  gpu_arena_string_free(m);
  return msg;
}

}  // namespace

extern "C" void* gpu_arena_torch_malloc_cxx(ssize_t size, int device, void* stream) {
  void* p = gpu_arena_malloc(size, device, stream);
  // size 0 gives NULL and is not an error (PyTorch allocates 0 bytes for empty tensors).
  if (p != nullptr || size == 0) {
    return p;
  }
  throw std::runtime_error(take_message(size, device));
}
