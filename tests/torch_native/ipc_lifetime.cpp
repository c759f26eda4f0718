// The lifetime of memory the native torch allocator sends to another process, on the sim
// backend with a real second process (this program again, as a consumer): both ways a
// tensor leaves (torch's own CUDA IPC, shareIpcHandle / getIpcDevPtr, and gpu-arena's
// reductions and weight sync, gpu_arena_torch_share_blocks / gpu_arena_import), the
// sender dropping first, the consumer SIGKILLed, and a fresh-generation churn. After each:
// nothing allocated, no share, no export, no import, and empty_cache gives every byte back.
//
// torch's CUDA IPC reference counting (torch/csrc/CudaIPCTypes.cpp, libtorch_python) is not
// linked here; `Sent` and `Limbo` model what it does with a sent storage (our own code, its
// semantics): the sent storage's memory is kept in a record whose counter each receiver
// decrements when it drops its copy; the sender's drop frees the record when the counter is
// 0, else parks it in the limbo, which a collection (torch.cuda.ipc_collect(), the next
// drop of a sent storage, and the free-memory callbacks an allocator runs) frees once its
// counter is 0. Here the parent decrements the counter when the consumer says it dropped.
#include <c10/cuda/CUDACachingAllocator.h>
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu_arena_api.h"
#include "harness.h"

extern "C" int gpu_arena_torch_install_native(const char*, char*, size_t);

namespace cca = c10::cuda::CUDACachingAllocator;
using gpu_arena_native::kShareBytes;
using gpu_arena_native::Share;
using gpu_arena_native::StatsBuffer;

namespace {

constexpr size_t kBlock = 4u << 20;  // 4 MiB blocks: several per 64 MiB arena

// ---- the model of torch's sent-storage records and limbo --------------------------------
struct Sent {
  c10::DataPtr original;  // the sender's memory, freed with the record
  int counter = 1;        // receivers that have not dropped their copy
};
std::vector<std::unique_ptr<Sent>> g_limbo;
// What torch does when the sender drops a sent storage.
void sender_drops(std::unique_ptr<Sent> s) {
  if (s->counter > 0) g_limbo.push_back(std::move(s));
}
bool collect_limbo() {
  bool freed = false;
  for (auto it = g_limbo.begin(); it != g_limbo.end();) {
    if ((*it)->counter == 0) {
      it = g_limbo.erase(it);
      freed = true;
    } else {
      ++it;
    }
  }
  return freed;
}
// Registered as torch registers its collector: allocators run it before giving up on an
// allocation (and gpu-arena's emptyCache runs it first).
struct LimboCollector : c10::FreeMemoryCallback {
  bool Execute() override { return collect_limbo(); }
};

// ---- the library's C API ----------------------------------------------------------------
struct Lib {
  int (*stats)(int, StatsBuffer*);
  int (*import)(const Share*, void**);
  int (*close)(void*);
  int (*imports_live)();
  int (*empty_cache)(int);
  const char* (*last_error)();
};
Lib bind(void* h) {
  Lib l{};
  l.stats = reinterpret_cast<decltype(l.stats)>(dlsym(h, "gpu_arena_stats"));
  l.import = reinterpret_cast<decltype(l.import)>(dlsym(h, "gpu_arena_import"));
  l.close = reinterpret_cast<decltype(l.close)>(dlsym(h, "gpu_arena_close"));
  l.imports_live = reinterpret_cast<decltype(l.imports_live)>(dlsym(h, "gpu_arena_imports_live"));
  l.empty_cache = reinterpret_cast<decltype(l.empty_cache)>(dlsym(h, "gpu_arena_empty_cache"));
  l.last_error = reinterpret_cast<decltype(l.last_error)>(dlsym(h, "gpu_arena_last_error"));
  return l;
}

std::string hex(const void* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const auto b = static_cast<const unsigned char*>(p)[i];
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}
std::string unhex(const std::string& s) {
  std::string out;
  for (size_t i = 0; i + 1 < s.size(); i += 2) {
    out += static_cast<char>(std::stoi(s.substr(i, 2), nullptr, 16));
  }
  return out;
}

// ---- the consumer, from the parent's side -----------------------------------------------
class Consumer {
 public:
  Consumer(const char* exe, const char* lib, const char* conf) {
    int cmd[2], reply[2];
    if (pipe(cmd) != 0 || pipe(reply) != 0) std::abort();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(cmd[0], 0);
      dup2(reply[1], 3);
      for (int fd : {cmd[0], cmd[1], reply[0], reply[1]}) {
        if (fd > 3) ::close(fd);
      }
      setenv("GA_HARNESS_CONSUMER", "1", 1);
      execl(exe, exe, lib, conf, static_cast<char*>(nullptr));
      _exit(127);
    }
    ::close(cmd[0]);
    ::close(reply[1]);
    to_ = cmd[1];
    from_ = reply[0];
  }
  ~Consumer() {
    if (pid_ > 0) {
      kill9();
    }
    ::close(to_);
    ::close(from_);
  }
  // Send one command line; its answer line ("" after 20 s or a closed pipe).
  std::string ask(const std::string& line) {
    const std::string l = line + "\n";
    if (write(to_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) return "";
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{from_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char c;
      if (read(from_, &c, 1) != 1) return "";
      if (c == '\n') return out;
      out += c;
    }
    return "";
  }
  void kill9() {
    ::kill(pid_, SIGKILL);
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
  }
  bool exit_cleanly() {
    const bool said = ask("exit") == "bye";
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
    return said && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

gpu_arena_native::Stats stats(const Lib& l) {
  StatsBuffer b{};
  l.stats(0, &b);
  return b.s;
}
// Whether `cond` held within 10 s (the broker ends a lease when its message, or the news of
// a dead peer, arrives: not at once).
template <typename Cond>
bool eventually(Cond cond) {
  for (int i = 0; i < 1000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}
// Nothing left: no allocation, share, export or deferred free; empty_cache gives every byte
// back (torch's emptyCache: the limbo collected first).
void expect_all_back(cca::CUDAAllocator* a, const Lib& l, const char* what) {
  a->emptyCache({0, 0});  // collects the limbo (its records free their memory)
  const bool settled = eventually([&] {
    auto s = stats(l);
    return s.deferred_free_bytes == 0 && s.shares_live == 0 && s.exports_live == 0;
  });
  a->emptyCache({0, 0});
  const auto s = stats(l);
  std::printf("%s: allocated=%lu reserved=%lu shares=%lu exports=%lu deferred=%lu limbo=%zu\n",
              what, (unsigned long)s.allocated_bytes, (unsigned long)s.reserved_bytes,
              (unsigned long)s.shares_live, (unsigned long)s.exports_live,
              (unsigned long)s.deferred_free_bytes, g_limbo.size());
  EXPECT(settled);
  EXPECT(s.allocated_bytes == 0 && s.reserved_bytes == 0 && s.shares_live == 0);
  EXPECT(s.exports_live == 0 && s.deferred_free_bytes == 0 && g_limbo.empty());
}

c10::DataPtr filled(cca::CUDAAllocator* a, unsigned char byte) {
  c10::DataPtr p = a->allocate(kBlock);
  std::memset(p.get(), byte, kBlock);  // sim memory is host memory
  return p;
}

using ShareBlocks = int (*)(const uint64_t*, size_t, uint8_t*, uint64_t*, char*, size_t);

Share share_block(ShareBlocks fn, const void* ptr) {
  uint64_t p = reinterpret_cast<uint64_t>(ptr), off = 99;
  Share s{};
  char err[512] = {0};
  const int rc = fn(&p, 1, s.bytes, &off, err, sizeof err);
  if (rc != 0) std::printf("share_blocks: %s\n", err);
  EXPECT(rc == 0 && off == 0);
  return s;
}

}  // namespace

namespace c10 {
REGISTER_FREE_MEMORY_CALLBACK(ipc_limbo_model, LimboCollector);
}

void ipc_lifetime_checks(const char* exe, const char* lib, const char* conf, void* h) {
  auto* a = cca::get();
  const Lib l = bind(h);
  auto share_blocks = reinterpret_cast<ShareBlocks>(dlsym(RTLD_DEFAULT, "gpu_arena_torch_share_blocks"));
  EXPECT(share_blocks != nullptr);
  a->emptyCache({0, 0});

  // 1. torch's own path, the sender dropping first: the record waits in the limbo until the
  //    consumer drops its copy; empty_cache (no ipc_collect) then frees it and gives it back.
  {
    Consumer c(exe, lib, conf);
    c10::DataPtr p = filled(a, 0x5a);
    auto h1 = a->shareIpcHandle(p.get());
    auto sent = std::make_unique<Sent>();
    sent->original = std::move(p);
    EXPECT(c.ask("torch_import " + hex(h1.handle.data(), h1.handle.size()) + " 90") == "ok 0");
    sender_drops(std::move(sent));
    EXPECT(g_limbo.size() == 1 && stats(l).shares_live == 1);
    EXPECT(c.ask("drop 0") == "dropped");
    g_limbo.back()->counter -= 1;  // what the consumer's drop does to torch's counter
    EXPECT(stats(l).allocated_bytes >= kBlock);  // torch's limbo still holds it: no collection yet
    expect_all_back(a, l, "torch path, sender first");
    EXPECT(c.ask("imports") == "0");
    EXPECT(c.exit_cleanly());
  }
  // 2. gpu-arena's path, the sender dropping first: its free waits for the consumer's
  //    lease, not for a collection.
  {
    Consumer c(exe, lib, conf);
    c10::DataPtr p = filled(a, 0x33);
    Share s = share_block(share_blocks, p.get());
    EXPECT(c.ask("import " + hex(s.bytes, kShareBytes) + " 51") == "ok 0");
    p.clear();
    EXPECT(stats(l).deferred_free_bytes >= kBlock && stats(l).shares_live == 0);
    EXPECT(c.ask("drop 0") == "dropped");
    expect_all_back(a, l, "gpu-arena path, sender first");
    EXPECT(c.exit_cleanly());
  }
  // 3. The consumer SIGKILLed mid-sync (two of three blocks imported): the sender's drops
  //    complete when the broker sees it die.
  {
    Consumer c(exe, lib, conf);
    std::vector<c10::DataPtr> blocks;
    for (int i = 0; i < 3; ++i) blocks.push_back(filled(a, static_cast<unsigned char>(0x10 + i)));
    for (int i = 0; i < 2; ++i) {
      Share s = share_block(share_blocks, blocks[i].get());
      EXPECT(c.ask("import " + hex(s.bytes, kShareBytes) + " " + std::to_string(0x10 + i)) ==
             "ok " + std::to_string(i));
    }
    share_block(share_blocks, blocks[2].get());  // sent, never imported
    c.kill9();
    blocks.clear();
    expect_all_back(a, l, "consumer SIGKILLed");
  }
  // 4. Fresh generations (FSDP-gathered weights): each round sends 4 new blocks, the consumer
  //    imports and drops them, the sender drops the round before; reserved stays bounded by
  //    two rounds, and everything comes back at the end.
  {
    Consumer c(exe, lib, conf);
    std::vector<c10::DataPtr> prev;
    uint64_t peak_reserved = 0;
    bool data_ok = true;
    for (int round = 0; round < 20; ++round) {
      std::vector<c10::DataPtr> cur;
      for (int i = 0; i < 4; ++i) cur.push_back(filled(a, static_cast<unsigned char>(round * 4 + i)));
      std::string slots;
      for (int i = 0; i < 4; ++i) {
        Share s = share_block(share_blocks, cur[i].get());
        data_ok &= c.ask("import " + hex(s.bytes, kShareBytes) + " " +
                         std::to_string(round * 4 + i)).rfind("ok ", 0) == 0;
      }
      data_ok &= c.ask("drop_all") == "dropped";
      prev = std::move(cur);  // the round before is dropped here
      a->emptyCache({0, 0});
      peak_reserved = std::max<uint64_t>(peak_reserved, stats(l).reserved_bytes);
    }
    EXPECT(data_ok);
    std::printf("fresh generations: peak reserved after empty_cache %lu (live %zu)\n",
                (unsigned long)peak_reserved, 4 * kBlock);
    EXPECT(peak_reserved <= 2 * 4 * kBlock + (64u << 20));
    prev.clear();
    EXPECT(c.ask("imports") == "0");
    expect_all_back(a, l, "fresh generations");
    EXPECT(c.exit_cleanly());
  }
}

// ---- the consumer's own side ------------------------------------------------------------
int ipc_consumer_main(const char* lib, const char* conf, void* h) {
  auto configure = reinterpret_cast<int (*)(const char*)>(dlsym(h, "gpu_arena_configure"));
  char err[1024] = {0};
  if (configure(conf) != 0 || gpu_arena_torch_install_native(lib, err, sizeof err) != 0) return 2;
  auto* a = cca::get();
  a->init(1);
  const Lib l = bind(h);
  FILE* out = fdopen(3, "w");
  setvbuf(out, nullptr, _IOLBF, 0);
  struct Slot {
    std::shared_ptr<void> torch_import;
    void* ptr = nullptr;
  };
  std::vector<Slot> slots;
  char line[4096];
  while (std::fgets(line, sizeof line, stdin) != nullptr) {
    std::string cmd(line);
    if (!cmd.empty() && cmd.back() == '\n') cmd.pop_back();
    const auto sp = cmd.find(' ');
    const std::string op = cmd.substr(0, sp);
    std::string arg = sp == std::string::npos ? "" : cmd.substr(sp + 1);
    if (op == "torch_import" || op == "import") {
      const auto sp2 = arg.find(' ');
      const std::string handle = unhex(arg.substr(0, sp2));
      const int want = std::atoi(arg.substr(sp2 + 1).c_str());
      Slot s;
      try {
        if (op == "torch_import") {
          s.torch_import = a->getIpcDevPtr(handle);
          s.ptr = s.torch_import.get();
        } else {
          Share sh{};
          std::memcpy(sh.bytes, handle.data(), kShareBytes);
          if (l.import(&sh, &s.ptr) != 0) s.ptr = nullptr;
        }
      } catch (const c10::Error& e) {
        std::fprintf(stderr, "consumer: %s\n", e.what_without_backtrace());
      }
      const auto* b = static_cast<const unsigned char*>(s.ptr);
      const bool ok = b != nullptr && b[0] == want && b[kBlock - 1] == want;
      if (ok) slots.push_back(std::move(s));
      std::fprintf(out, ok ? "ok %zu\n" : "bad\n", slots.size() - 1);
    } else if (op == "drop" || op == "drop_all") {
      const size_t from = op == "drop" ? std::stoul(arg) : 0;
      const size_t to = op == "drop" ? from + 1 : slots.size();
      bool ok = true;
      for (size_t i = from; i < to && i < slots.size(); ++i) {
        if (slots[i].torch_import) {
          slots[i].torch_import.reset();
        } else if (slots[i].ptr != nullptr) {
          ok &= l.close(slots[i].ptr) == 0;
        }
        slots[i].ptr = nullptr;
      }
      if (op == "drop_all") slots.clear();
      std::fprintf(out, ok ? "dropped\n" : "close failed\n");
    } else if (op == "imports") {
      std::fprintf(out, "%d\n", l.imports_live());
    } else if (op == "exit") {
      std::fprintf(out, "bye\n");
      return 0;
    }
  }
  return 0;
}
