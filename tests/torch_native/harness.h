// What the native torch allocator's harness (harness.cpp) shares with its parts
// (ipc_lifetime.cpp): the check counters and EXPECT.
#pragma once

#include <cstdio>

extern int failures, passes;

#define EXPECT(c)                                     \
  do {                                                \
    if (c) {                                          \
      ++passes;                                       \
    } else {                                          \
      ++failures;                                     \
      std::printf("FAIL line %d: %s\n", __LINE__, #c); \
    }                                                 \
  } while (0)

// ipc_lifetime.cpp: the lifetime of tensors sent to another process (a consumer: this
// program again, started by `ipc_lifetime_checks`), torch's limbo included.
void ipc_lifetime_checks(const char* self_exe, const char* lib, const char* conf, void* lib_handle);
// The consumer's loop, when this program runs as one (GA_HARNESS_CONSUMER set): commands on
// stdin, answers on fd 3. Returns the exit status.
int ipc_consumer_main(const char* lib, const char* conf, void* lib_handle);
