// oom_shim_test.cpp: gpu_arena_torch_malloc (ffi/src/oom_shim.cpp through the Rust
// "C-unwind" trampoline) throws a catchable std::runtime_error instead of returning NULL,
// and the library keeps working afterwards. Sim backend (host memory), no GPU, no torch.
//
// Built and run by tests/python/test_torch_oom_sim.py:
//   g++ -std=c++17 -Wall -Wextra -Werror -I ffi/include tests/c/oom_shim_test.cpp
//       -L <dir> -lgpu_arena -Wl,-rpath,<dir> -o oom_shim_test && ./oom_shim_test
// Prints "ok ..." per check and "checks passed" at the end; "FAIL ..." and exit 1 otherwise:
// the exit status is the verdict (stdout is a log, shared with the library).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "gpu_arena.h"

static int checks = 0;

#define CHECK(cond, ...)                                                               \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::printf("FAIL line %d: %s: ", __LINE__, #cond);                             \
      std::printf(__VA_ARGS__);                                                        \
      std::printf(" (last error: %s)\n", gpu_arena_last_error());                      \
      std::exit(1);                                                                    \
    }                                                                                  \
    ++checks;                                                                          \
    std::printf("ok %s\n", #cond);                                                     \
  } while (0)

static bool contains(const std::string& s, const char* part) {
  return s.find(part) != std::string::npos;
}

// Calls gpu_arena_torch_malloc and returns the exception's message ("" when none thrown).
static std::string throws(ssize_t size, void** out) {
  *out = nullptr;
  try {
    *out = gpu_arena_torch_malloc(size, 0, nullptr);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

int main() {
  // 64 MiB arenas, at most 256 MiB reserved on the one sim device.
  CHECK(gpu_arena_configure("backend=sim,arena_size=64MiB,grow_arenas=0,max_reserved=256MiB") == GPU_ARENA_OK,
        "configure");
  gpu_arena_init(-1);
  CHECK(gpu_arena_init_status() == GPU_ARENA_OK, "init");

  void* live = gpu_arena_torch_malloc(32 << 20, 0, nullptr);
  CHECK(live != nullptr, "a normal allocation works");

  // Too much: a std::runtime_error naming the size, the device, gpu-arena's pool, the cause.
  void* p = nullptr;
  std::string msg = throws(ssize_t(1) << 30, &p);
  std::printf("message: %s\n", msg.c_str());
  CHECK(p == nullptr, "nothing returned");
  CHECK(msg.rfind("CUDA out of memory. Tried to allocate 1 GiB", 0) == 0,
        "starts with 'CUDA out of memory. Tried to allocate 1 GiB': %s", msg.c_str());
  CHECK(contains(msg, "out of memory"), "vLLM's substring");
  CHECK(contains(msg, "1 GiB (1073741824 bytes)"), "names the size: %s", msg.c_str());
  CHECK(contains(msg, "device 0"), "names the device");
  CHECK(contains(msg, "reserved by gpu-arena: 64 MiB"), "names reserved bytes: %s",
        msg.c_str());
  CHECK(contains(msg, "allocated: 32 MiB"), "names allocated bytes: %s", msg.c_str());
  CHECK(contains(msg, "Cause: gpu_arena_malloc(size=1073741824, device=0)"),
        "names the cause: %s", msg.c_str());
  CHECK(gpu_arena_last_error_code() == GPU_ARENA_ERR_OUT_OF_MEMORY, "the code stays OOM");

  // Not an OOM: its own message.
  msg = throws(-1, &p);
  CHECK(msg.rfind("gpu-arena: allocation of -1 bytes on device 0 failed:", 0) == 0, "%s",
        msg.c_str());
  CHECK(!contains(msg, "out of memory"), "a bad size is no OOM: %s", msg.c_str());
  try {
    gpu_arena_torch_malloc(4096, 9, nullptr);
    CHECK(false, "device 9 must throw");
  } catch (const std::runtime_error& e) {
    CHECK(contains(e.what(), "device 9"), "%s", e.what());
  }

  // Size 0: NULL, no exception.
  msg = throws(0, &p);
  CHECK(msg.empty() && p == nullptr, "size 0 gives NULL without throwing");

  // The plain function still returns NULL.
  CHECK(gpu_arena_malloc(ssize_t(1) << 30, 0, nullptr) == nullptr, "gpu_arena_malloc: NULL");

  // Still usable: allocate, write, read, free.
  void* q = gpu_arena_torch_malloc(1 << 20, 0, nullptr);
  CHECK(q != nullptr, "allocation after the exception");
  std::memset(q, 0xab, 1 << 20);
  CHECK(static_cast<unsigned char*>(q)[12345] == 0xab, "memory usable");
  gpu_arena_free(q, 1 << 20, 0, nullptr);
  gpu_arena_free(live, 32 << 20, 0, nullptr);
  gpu_arena_stats_t s{};
  CHECK(gpu_arena_stats(0, &s) == GPU_ARENA_OK && s.allocations == 0, "all freed");
  CHECK(s.oom_count == 2, "two OOMs counted (torch_malloc + malloc): %llu",
        static_cast<unsigned long long>(s.oom_count));
  CHECK(gpu_arena_validate(0) == GPU_ARENA_OK, "valid");
  std::printf("%d checks passed\n", checks);
  return 0;
}
