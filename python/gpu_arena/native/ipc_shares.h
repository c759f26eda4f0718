// ipc_shares.h: the shares the native torch allocator (allocator.cpp) makes of its
// allocations for other processes, and the imports it holds of theirs.
//
// Producer side (BlockShares): one gpu-arena share per allocation, made on its first send
// and reused by every later send (identical handle bytes for the same block, as torch's
// reductions cache expects), unshared when the allocation is freed. Both ways of sending a
// tensor use it: torch's own CUDA IPC (shareIpcHandle) and gpu-arena's reductions and weight
// sync (gpu_arena_torch_share_blocks, python/gpu_arena/torch_ipc.py), which hand the handle
// over without torch's reference-counting files and limbo. The unshare at the free ends the
// producer's hold; each consumer's lease holds the memory until it closes (or its process
// dies), and gpu-arena defers the free until then.
//
// Consumer side (ImportCache): getIpcDevPtr's imports, one per handle in this process,
// shared by every storage torch rebuilds from it and closed when the last one dies.
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "gpu_arena_api.h"

namespace gpu_arena_native {

class BlockShares {
 public:
  // The share of the allocation [base, base + len) (len: its requested size), made now if
  // it has none. `share` is gpu_arena_share; throws its error.
  template <typename ShareFn, typename ErrorFn>
  Share get_or_make(void* base, size_t len, ShareFn share, ErrorFn last_error) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = shares_.find(base);
    if (it == shares_.end()) {
      Share s{};
      TORCH_CHECK(share(base, len > 0 ? len : 1, &s) >= 0, "gpu-arena: gpu_arena_share failed: ",
                  last_error());
      it = shares_.emplace(base, s).first;
      live_.fetch_add(1, std::memory_order_release);
    }
    return it->second;
  }

  // At the free of the allocation starting at `base`: its share, taken out of the table
  // (the caller unshares it), or false when it had none. One atomic load when nothing is
  // shared (the allocator's free path).
  bool take(void* base, Share* out) {
    if (live_.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard<std::mutex> g(mu_);
    auto it = shares_.find(base);
    if (it == shares_.end()) return false;
    *out = it->second;
    shares_.erase(it);
    live_.fetch_sub(1, std::memory_order_release);
    return true;
  }

 private:
  std::atomic<int64_t> live_{0};
  std::mutex mu_;
  std::unordered_map<void*, Share> shares_;  // allocation start -> its share
};

class ImportCache {
 public:
  // The live import of `handle`'s share (kHandleMagicLen bytes of prefix, then the share),
  // or a new one made with `import_fn` and closed with `close_fn` when its last user dies.
  template <typename ImportFn, typename CloseFn>
  std::shared_ptr<void> get_or_import(const std::string& handle, size_t prefix,
                                      ImportFn import_fn, CloseFn close_fn) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = imports_.find(handle);
    if (it != imports_.end()) {
      if (auto live = it->second.lock()) return live;
    }
    Share s{};
    std::memcpy(s.bytes, handle.data() + prefix, kShareBytes);
    void* p = import_fn(s);
    std::shared_ptr<void> sp(p, [this, handle, close_fn](void* q) {
      close_fn(q);
      forget(handle);
    });
    imports_[handle] = sp;
    return sp;
  }

 private:
  void forget(const std::string& handle) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = imports_.find(handle);
    if (it != imports_.end() && it->second.expired()) imports_.erase(it);
  }

  std::mutex mu_;
  std::unordered_map<std::string, std::weak_ptr<void>> imports_;
};

}  // namespace gpu_arena_native
